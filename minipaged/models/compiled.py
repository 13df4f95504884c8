"""A model body compiled by Inductor, for CPUs (``LLM(..., enforce_eager=False)``).

Why: between its four GEMMs, a decoder layer runs about forty small ops in
eager PyTorch (RMSNorm's five, the residual adds, rotary's slices and
concatenations, SiLU-and-multiply, the views around attention), each a
dispatch of a few microseconds plus the Python of the module calls around
it. For one user's decode step that fixed cost is as large as reading the
weights of a 4-bit model. ``torch.compile`` turns each chain of element-wise
ops into one C++ loop and the Python of the whole body into one call.

What the compiler does not see, each an opaque op (``torch.library``):

- attention, ``minipaged::attention``: it writes the step's K/V into the
  paged cache and reads blocks through the step's plan, host-side objects
  that change every step. The compiled body passes a ``CompiledLayerCache``
  (the layer's number) where the eager one passes the layer's cache tensors,
  and the op finds the caches and metadata in ``current_step()``, set around
  each forward (vLLM passes its attention metadata the same way, as a
  "forward context");
- a packed oneDNN GEMM, ``minipaged::packed_linear`` (``cpu_linear``).

The token count is unbacked (``mark_unbacked``): prefill, decode, one user
and any batch share one graph, which ``ModelRunner.compile_model`` builds at
start-up; Inductor's on-disk cache makes the next start faster. The logits
head stays eager: it runs once per step on the rows that are sampled, and
its quantized forms refine their top logits.

A decode step of one sequence (one user, the step whose fixed costs weigh
most) runs a graph of its own, the decode graph, where attention is no opaque op:
the step's caches and metadata are inputs of the graph, and each layer's KV
store and attention are traced into it (``layers.traced_decode_attention``:
an in-place ``index_put_`` on the cache, then the scores, softmax and sum
over V with each key row loaded through the block table inside Inductor's
loops). That removes the op's per-layer cost (its dispatch and Python, the
gather into a new tensor, SDPA's fixed cost): on the 2-core Zen 4 VM, one
user of SmolLM2 gained 1.13x in float32 and 1.36x with 4-bit weights at chat
lengths, 1.28x and 1.09x after a 400-token prompt
(``scripts/decode_graph_bench.py``). The pool's
tensors are marked static (their shapes never change), so the graph's one
symbol is the table's width, at least two blocks (a one-block table is
widened). Where the model's big float layers are packed for oneDNN
(``decode_templates_pay``), the decode graph is traced frozen: those layers
show it their plain weights (``cpu_linear.plain_while_tracing``), which
become constants, and Inductor times its CPU GEMM template, the weight
re-blocked for its AVX-512 or AMX kernel, against ATen's product at each
shape. One user of SmolLM2 on the 2-core Xeon VM went from 44.2 to 62.9
tokens/s in bfloat16 and from 31.3 to 37.4 in float32, with the same
greedy tokens in float32 (``scripts/frozen_decode_bench.py``: two engines
in one process, medians of three alternating rounds). The cost: a copy of
each weight in the template's layout, and 45 to 55 s more at start-up,
every start, since Inductor's cache skips frozen graphs.

A step where several sequences each decode one token runs a second graph
of the same body, the batch decode graph (guarded, the batch
size a second symbol), when padding each sequence's keys to the longest
one's costs little (``batch_decode_pays``: at most twice
the real keys, at most ``BATCH_DECODE_MAX_BYTES`` of them); other batches
keep the op, whose parts pad only among similar lengths. On the 2-core
Xeon VM, SmolLM2's 32 chats at once in bfloat16 went from 457 to 514
tokens/s with it (medians of three alternating rounds); float32 was level
until its graph left Inductor's settings at their default
(``batch_decode_options``: 1.075x more). Frozen with the GEMM templates
too, it served them 1.03x faster (600 against 584), for 86 s more at
start-up: it stays unfrozen.

A model with 4-bit weights on a CPU with AMX (``quantization.gemm.CpuInt4Gemm``,
``wide_graph_pays``) gets a second graph for steps of ``WIDE_STEP_TOKENS``
tokens or more (prefill, a batch of users). ATen's int4 op is a GEMV at
heart: its cost grows with each row (at SmolLM2's gate/up shape, 576 -> 3072,
on the 2-core Sapphire Rapids VM: 52 us for one row, 720 us for 32, 1,430 us
for 64). Inductor has a GEMM template for the same op that widens the
nibbles to bf16 tiles for the CPU's AMX units (230 us for 32 rows, 270 us
for 64), but uses it only with ``max_autotune`` and only when the packed
weight is a constant of the graph, which ``freezing`` makes it; for one row
it is slower (166 us), so narrow steps keep the first graph. Autotuning
keeps, shape by shape, whichever of the two is faster. The wide graph costs
memory: Inductor re-blocks each weight its AMX kernel serves (32 output
columns a block instead of ATen's 64) into a copy of its own, and compiled
code and autotuning's leftovers stay (about 40 MB on SmolLM2's Q4_1 file
with the graph forced on a Zen 4 VM, where no weight was re-blocked).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config

from ..kernels.reference import is_fp8
from .cpu_linear import PackedLinear, plain_while_tracing
from .layers import (
    AttentionMetadata,
    CompiledLayerCache,
    DecodeLayerCache,
    KVCache,
    paged_attention_layer,
)


@dataclass
class StepContext:
    """The caches and metadata of the forward that is running."""

    kv_caches: list[KVCache]
    meta: AttentionMetadata


_STEP: StepContext | None = None


def current_step() -> StepContext:
    """The running compiled forward's caches and metadata."""
    if _STEP is None:
        raise RuntimeError("minipaged::attention runs only inside a compiled forward")
    return _STEP


@contextlib.contextmanager
def step_context(kv_caches: list[KVCache], meta: AttentionMetadata) -> Iterator[None]:
    global _STEP
    _STEP = StepContext(kv_caches, meta)
    try:
        yield
    finally:
        _STEP = None


_LIBRARY = torch.library.Library("minipaged", "FRAGMENT")   # see cpu_linear's
_LIBRARY.define("attention(Tensor q, Tensor k, Tensor v, int layer, float scale, "
                "int sliding_window, float logits_soft_cap) -> Tensor")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
              sliding_window: int, logits_soft_cap: float) -> torch.Tensor:
    """``paged_attention_layer`` of layer ``layer`` in the running step
    (q ``[T, Hq, D]``, k, v ``[T, Hkv, D]`` -> ``[T, Hq, D]``); a window of 0
    and a cap of 0.0 mean none. It writes the layer's KV cache, which the
    compiler does not see: nothing it compiled reads that cache."""
    step = current_step()
    return paged_attention_layer(q, k, v, step.kv_caches[layer], step.meta, scale,
                                 sliding_window or None, logits_soft_cap or None)


_LIBRARY.impl("attention", attention, "CPU")


@torch.library.register_fake("minipaged::attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
      sliding_window: int, logits_soft_cap: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


WIDE_STEP_TOKENS = 8
"""Steps of this many tokens or more run the wide graph (where there is one):
the int4 op and the AMX template cost about the same at 8 rows (185 and
161 us at the gate/up shape above)."""

# The decode graph's traced attention reads q's row once per key. Inductor
# inlines a pointwise expression into each of its reads unless it has more
# than this many ops (50 by default on a CPU), so q's rotary, cos and sin
# included, was computed again for every key of every layer. At 8, such
# chains are computed once into a buffer (on the 2-core Xeon VM, SmolLM2's
# Q4_1 file, bf16: the decode graph's speed over the op's went from 1.20x
# to 1.35x after a 400-token prompt, 1.43x to 1.52x on chats; benchmarks.md).
_DECODE_OPTIONS = {"realize_cpu_opcount_threshold": 8}


def batch_decode_options(kv_dtype: torch.dtype) -> dict:
    """Inductor's settings for the batch decode graph, by the cache's dtype.

    A float32 cache keeps Inductor's default: at 8 (``_DECODE_OPTIONS``) the
    batch's attention realized the products it sums, q times each key and
    each weight times each value, 576 floats a key for SmolLM2 (some 27 MB
    written and read again per layer and product at 32 sequences of 368
    keys), where the default sums them inside its loops and recomputes q's
    rotary per key instead. Other dtypes keep 8, which measured faster
    there (the recomputed rotary would be rounded to 16 bits at each op).
    SmolLM2's 32 chats on the 2-core Xeon VM, default against 8, medians of
    three alternating rounds (``scripts/batch_decode_options_bench.py``):
    float32 251.4 against 234.0 tokens/s (1.075x, the same greedy tokens),
    bfloat16 445.6 against 495.0 (0.90x)."""
    return {} if kv_dtype == torch.float32 else _DECODE_OPTIONS


# The most float32 K and V (keys padded to the batch's longest sequence) one
# layer of the batch decode graph gathers: past it, a batch takes the body
# graph, whose attention op reads the keys in cache-sized parts.
BATCH_DECODE_MAX_BYTES = 64 << 20

# Inductor settings of the graphs whose GEMMs may take Inductor's CPU GEMM
# templates (the wide graph, and the decode graph where
# ``decode_templates_pay``). max_autotune: time the template against ATen's
# op at each GEMM's shape and keep the faster, silently. freezing (the
# weights become constants, which the CPU GEMM templates require; they are
# only read while the engine serves) is not among them: Dynamo decides what
# is a constant while it traces, from the global setting, before these
# options reach Inductor, so the graph's calls are made inside it
# (``_freezing``, about 13 us a call).
_TEMPLATE_OPTIONS = {
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


def _freezing() -> contextlib.AbstractContextManager:
    import torch._inductor.config as inductor_config
    return inductor_config.patch(freezing=True)


def wide_graph_pays(model: nn.Module) -> bool:
    """Whether ``model`` runs CPU int4 GEMMs on a CPU with AMX tiles.

    Without AMX the wide graph only costs: on the 2-core Zen 4 VM (AVX-512,
    torch 2.13) Inductor offered no template for the int4 op at all, so every
    GEMM stayed ATen's and the graph added compile time and memory."""
    from ..quantization.gemm import CpuInt4Gemm
    # A private helper, but the one Inductor's own AMX checks rest on.
    return (torch.cpu._is_amx_tile_supported()
            and any(isinstance(m, CpuInt4Gemm) for m in model.modules()))


def decode_templates_pay(model: nn.Module) -> bool:
    """Whether one sequence's decode graph is frozen, its float GEMMs open to
    Inductor's templates: ``model`` has layers packed for oneDNN
    (``cpu_linear.PackedLinear``, the big float ones).

    oneDNN's packed product is made for many rows: at one row (a
    matrix-vector product, bound by reading the weight) it read SmolLM2's
    bfloat16 weights at 15 to 18 GB/s where Inductor's template, the weight
    re-blocked at compile time, read them at 22 (30 layers' GEMMs, 2-core
    Xeon VM, torch 2.13), and each call costs some 15 us before any
    arithmetic. The template's price: a copy of each weight it serves, in
    its own layout, and a longer compile (45 to 55 s more, two cores)."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


def batch_decode_pays(num_tokens: int, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether a step of ``num_tokens`` tokens runs the batch decode graph:
    every sequence decodes one token, and its attention, which pads each
    sequence's keys to the longest one's, reads at most twice the real keys
    and at most ``BATCH_DECODE_MAX_BYTES`` of float32 K and V a layer.
    ``k_cache``: a layer's ``[blocks, block_size, Hkv, D]``."""
    if num_tokens < 2 or meta.max_query_len != 1:
        return False
    padded = num_tokens * meta.max_seq_len
    kv_bytes = padded * 2 * k_cache.shape[2] * k_cache.shape[3] * 4
    return kv_bytes <= BATCH_DECODE_MAX_BYTES and padded <= 2 * int(meta.seq_lens.sum())


def can_compile(device: torch.device, attention_backend: str, world_size: int) -> bool:
    """Where the compiled body runs: a CPU, the torch attention path, one process
    (CUDA has its graphs; the Triton and reference backends are for tests)."""
    return device.type == "cpu" and attention_backend == "torch" and world_size == 1


class CompiledForward:
    """``model(input_ids, positions, kv_caches, meta)`` with the body compiled.

    input_ids, positions: ``[T]``; returns the hidden states ``[T, H]``, as
    the eager model does. ``wide``: whether steps of ``WIDE_STEP_TOKENS``
    or more run a graph of their own (default: ``wide_graph_pays``). A step
    of one sequence and one new token runs the decode graph (see the module
    doc), unless the cache is fp8. ``kv_dtype``: the cache's, which picks
    the batch decode graph's settings (``batch_decode_options``).
    """

    def __init__(self, model: nn.Module, num_layers: int, wide: bool | None = None,
                 decode_templates: bool | None = None, kv_dtype: torch.dtype = torch.float32):
        self.model = model
        self.layer_caches = [CompiledLayerCache(i) for i in range(num_layers)]
        self._compiled = self._compile(CompiledForward._body, {})
        if wide is None:
            wide = wide_graph_pays(model)
        self._wide = self._compile(CompiledForward._body, _TEMPLATE_OPTIONS) if wide else None
        # Decode steps (see the module doc): one sequence's graph, without
        # guards (frozen, with GEMM templates, where ``decode_templates_pay``),
        # and a batch's; None: those steps take the body graph.
        if decode_templates is None:
            decode_templates = decode_templates_pay(model)
        self.decode_templates = decode_templates
        self._decode = self._compile(
            CompiledForward._decode_body,
            {**_DECODE_OPTIONS, **(_TEMPLATE_OPTIONS if decode_templates else {})},
            guard_on_inputs=False)
        self._batch_decode = self._compile(CompiledForward._decode_body,
                                           batch_decode_options(kv_dtype))
        self._traced: set[str] = set()    # the decode graphs traced so far, by attribute
        self._static_caches: list[KVCache] | None = None

    @property
    def has_wide_graph(self) -> bool:
        """Whether steps of ``WIDE_STEP_TOKENS`` or more run a graph of their own."""
        return self._wide is not None

    def _compile(self, method: Callable, options: dict,
                 guard_on_inputs: bool = True) -> Callable[..., torch.Tensor]:
        """``method`` compiled for this instance, with ``options`` for Inductor.

        Without the guards on the modules: checking each of the model's
        parameters before every call took about 2.4 ms a step (SmolLM2's
        30 layers). That is safe only because this instance's graphs never
        serve another model: Dynamo keeps compiled code per code object,
        so each graph's body gets a code object of its own here (a second
        engine in the process, even of the same shapes, compiles its own),
        and this model's weights and settings do not change while it serves.
        ``guard_on_inputs=False`` drops the guards on the call's arguments
        too (the decode graph's: see ``_run_decode``).

        Without Inductor's size asserts: its generated code checks the size
        and stride of every input (the parameters among them) and of every
        opaque op's output on every call, about 620 checks a step for
        SmolLM2, some 0.6 ms of one user's step; the inputs are the ones
        Dynamo traced (guarded, or fixed for the engine's life), and the
        opaque ops' outputs are declared by their fake implementations.
        """
        body = types.FunctionType(method.__code__.replace(), globals(), method.__name__)
        guards = (torch.compiler.skip_guard_on_all_nn_modules_unsafe if guard_on_inputs
                  else torch.compiler.skip_all_guards_unsafe)
        return torch.compile(
            types.MethodType(body, self), dynamic=True, fullgraph=True,
            options={"guard_filter_fn": guards, "size_asserts": False, **options})

    def _body(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.layer_caches, None)

    def _decode_body(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                     slots: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor) -> torch.Tensor:
        caches = [DecodeLayerCache(k, v, slots, block_tables, seq_lens)
                  for k, v in zip(k_caches, v_caches)]
        return self.model(input_ids, positions, caches, None)

    def _run_decode(self, graph: str, input_ids: torch.Tensor, positions: torch.Tensor,
                    kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """A decode step (one new token per sequence) through the decode graph
        named ``graph``: ``"_decode"`` for one sequence, ``"_batch_decode"``
        for several.

        One sequence's graph runs with no guards at all
        (``guard_on_inputs=False``): checking its 60-odd arguments took about
        0.3 ms a step, and nothing they could differ in reaches it. The
        pool's tensors are the same objects for the engine's life (another
        pool is refused), and the step's tensors are built here, always of
        the same dtypes and ranks: one token, one sequence, a table at least
        two blocks wide (the graph's one symbol). The batch's graph keeps its
        guards: its sequence count is a second symbol, at least two."""
        if self._static_caches is not kv_caches:
            if self._traced:   # the guardless graph would not notice: refuse rather than misread
                raise RuntimeError("the decode graph was built for another KV cache pool")
            # The pool's tensors never change shape: constants of the graphs,
            # so the table's width (and a batch's size) are their symbols.
            for k_cache, v_cache in kv_caches:
                torch._dynamo.mark_static(k_cache)
                torch._dynamo.mark_static(v_cache)
            self._static_caches = kv_caches
        tables = meta.block_tables.long().clamp_min(0)   # blocks freed behind a window: masked
        if tables.shape[1] == 1:   # a one-block table would be a size-1 dimension of its own
            tables = torch.cat([tables, tables], dim=1)
        args = (input_ids, positions.clone(), [k for k, _ in kv_caches],
                [v for _, v in kv_caches], meta.slot_mapping.long(), tables,
                meta.seq_lens.long())
        run = getattr(self, graph)
        frozen = graph == "_decode" and self.decode_templates
        with _freezing() if frozen else contextlib.nullcontext():
            if graph in self._traced:
                return run(*args)
            # The table's width is a symbol. A size that happens to equal another
            # while tracing must not become the same symbol, or the graph would
            # guard on their equality and be traced again later. A frozen graph
            # sees the packed layers' plain weights, its constants.
            with (fx_config.patch(use_duck_shape=False),
                  plain_while_tracing() if frozen else contextlib.nullcontext()):
                out = run(*args)
        self._traced.add(graph)
        return out

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        # No slot is negative here: only CUDA graphs pad with NO_SLOT, and the
        # compiled body runs on a CPU (``can_compile``).
        k_cache = kv_caches[0][0]
        if not is_fp8(k_cache):
            if self._decode is not None and input_ids.shape[0] == 1:
                return self._run_decode("_decode", input_ids, positions, kv_caches, meta)
            if (self._batch_decode is not None
                    and batch_decode_pays(input_ids.shape[0], k_cache, meta)):
                return self._run_decode("_batch_decode", input_ids, positions, kv_caches, meta)
        # The body graph: one for every token count (an unbacked size is never
        # specialized to 1). positions is a view at offset T into the step's one
        # host-to-device copy; a copy of its own (T integers) keeps that
        # offset from being specialized instead.
        positions = positions.clone()
        for tensor in (input_ids, positions):
            torch._dynamo.decorators.mark_unbacked(tensor, 0)
        if self._wide is not None and input_ids.shape[0] >= WIDE_STEP_TOKENS:
            with step_context(kv_caches, meta), _freezing():
                return self._wide(input_ids, positions)
        with step_context(kv_caches, meta):
            return self._compiled(input_ids, positions)
