"""GGUF checkpoints: llama.cpp's one-file format, read as a Hugging Face model.

A ``.gguf`` file holds the model's hyperparameters and tokenizer as metadata
(``llama.block_count``, ``tokenizer.ggml.tokens``, ...) and its weights as
tensors named the llama.cpp way (``blk.3.attn_q.weight``), most of them
quantized in blocks (Q4_1: 32 weights share one fp16 scale and minimum and
keep 4 bits each). This module turns the file into what the rest of the
loader already understands:

- ``gguf_hf_config``: a ``transformers`` config built from the metadata, with
  unsupported architectures and quantization types refused before anything
  is allocated;
- ``gguf_weight_readers``: ``(Hugging Face name, reader)`` pairs (LLaMA,
  Mistral, Qwen2/3 and Gemma 2/3 files, ``GGUF_ARCHITECTURES``); a
  ``GGUFTensor`` reader dequantizes one tensor when the loader asks for it
  (Q4_0, Q4_1, Q4_K and Q8_0 through ``quantization.gguf_blocks``, in torch;
  every other type with the ``gguf`` package, the GGML project's own reader),
  so loading never holds more than the model plus one tensor's temporaries,
  or keeps it quantized (``GGUFTensor.quantized``, ``quantization="gguf"``);
- ``gguf_tokenizer``: the tokenizer ``transformers`` builds from the metadata,
  kept on disk after the first build (``tokenizer_cache_dir``).

llama.cpp stores the rows of LLaMA's q and k projections in a different order
(each head's rotary pairs interleaved rather than split in halves); the
reader puts them back, so the rotary embedding of ``models.layers`` applies.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_SUFFIX = ".gguf"

# general.architecture -> (our registry's class name, whether q/k rows are
# permuted, the transformers model_type its config is).
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True, "llama"),
    "mistral": ("MistralForCausalLM", True, "mistral"),
    "qwen2": ("Qwen2ForCausalLM", False, "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", False, "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", False, "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", False, "gemma3_text"),
}
# llama.cpp's converter stores Gemma's norm weights as 1 + w (its RMSNorm
# multiplies by the weight); the reader takes the 1 back off.
_NORMS_PLUS_ONE = frozenset({"gemma2", "gemma3"})

# Per-layer tensor names: llama.cpp's on the left, Hugging Face's on the right.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP there.
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; the reader checks the magic)."""
    path = Path(path)
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


@functools.cache
def _fast_reader_class():
    """``gguf.GGUFReader`` reading its fields through a plain ndarray view of
    the memory map instead of the ``np.memmap`` itself.

    The reader slices the map once per value it parses, and a 262,144-token
    vocabulary (Gemma 3) has about two million of them: each ``np.memmap``
    slice pays for ``__array_finalize__``, a plain view does not. Measured on
    Gemma 3 270M's file (2-core Xeon): 19.9 s to parse with the reader as it
    is, 6.2 s so; the same fields and tensors (``tests/models/test_gguf.py``).
    The tensors' ``data`` are then ndarray views of the same mapped pages.
    """
    import numpy as np
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return PlainViewReader


@functools.lru_cache(maxsize=4)
def _open(path: str):
    try:
        # Memory-maps the file: tensors are read when touched.
        return _fast_reader_class()(path)
    except (ValueError, OSError) as err:
        raise ValueError(f"{path!r} is not a readable GGUF file: {err}") from err


def open_gguf(path: str | Path):
    """The file's ``gguf.GGUFReader`` (parsed once per process and path, until
    ``close_gguf_files``)."""
    return _open(str(Path(path).resolve()))


@contextlib.contextmanager
def transformers_reads_through_open_gguf() -> Iterator[None]:
    """While inside, ``gguf.GGUFReader(path)``, which ``transformers`` calls to
    read a GGUF file (its config, its tokenizer's tables, its tensors), returns
    ``open_gguf(path)``: minipaged's faster reader, parsed once per process and
    shared with minipaged's own loader. Measured on SmolLM2's file (2-core
    Xeon): ``transformers``' model load takes 30.2 s without it and 17.7 s
    with it, its tokenizer 10.1 s and 4.7 s. Not thread-safe: it swaps the
    module's attribute for the length of the block."""
    import gguf

    _fast_reader_class()      # subclasses the real class: make it before the swap
    real = gguf.GGUFReader
    gguf.GGUFReader = lambda path, *args, **kwargs: open_gguf(path)
    try:
        yield
    finally:
        gguf.GGUFReader = real


def close_gguf_files() -> None:
    """Forget the parsed files, so their memory maps close once nothing else holds them."""
    _open.cache_clear()


def metadata(reader) -> dict[str, Any]:
    """The metadata fields as Python values, without the tokenizer's big tables."""
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores")
    return {name: field.contents() for name, field in reader.fields.items()
            if name not in skip and not name.startswith("GGUF.")}


@functools.cache
def dequantizable_types() -> frozenset[str]:
    """Names of the tensor types the installed ``gguf`` package can turn into floats.

    Found by asking it to dequantize one zero block of each type, so a newer
    ``gguf`` with more types is picked up without a change here.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    names = set()
    for qtype in GGMLQuantizationType:
        if qtype.name.startswith("I") and not qtype.name.startswith("IQ"):
            continue   # I8..I64: integer tensors, not weights
        if qtype not in GGML_QUANT_SIZES:
            continue
        block, nbytes = GGML_QUANT_SIZES[qtype]
        raw_dtype = {"F32": np.float32, "F16": np.float16, "F64": np.float64}.get(qtype.name)
        raw = (np.zeros(block, dtype=raw_dtype) if raw_dtype is not None
               else np.zeros(nbytes, dtype=np.uint8))
        try:
            dequantize(raw, qtype)
        except (NotImplementedError, ValueError, KeyError):
            continue
        names.add(qtype.name)
    return frozenset(names)


def _architecture(meta: dict[str, Any], path: str) -> str:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r} holds architecture {arch!r}, which minipaged "
                         f"does not serve; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")
    return arch


def _check_tensor_types(reader, path: str) -> None:
    supported = dequantizable_types()
    found = sorted({t.tensor_type.name for t in reader.tensors} - supported)
    if found:
        raise ValueError(f"GGUF file {path!r} has tensors of type {', '.join(found)}, which the "
                         f"installed gguf package cannot dequantize; supported: "
                         f"{', '.join(sorted(supported))}")


def _embedding_rows(reader) -> int:
    """The vocabulary size read off the embedding table (``ne`` lists columns first)."""
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ValueError("GGUF file has neither a vocab_size key nor a token_embd.weight tensor")


def gguf_hf_config(path: str | Path) -> Any:
    """The ``transformers`` config the file's metadata describes.

    A ``ValueError`` names an unsupported architecture or tensor type (and
    lists the supported ones) before any weight is read.
    """
    from transformers import AutoConfig

    reader = open_gguf(path)
    meta = metadata(reader)
    arch = _architecture(meta, str(path))
    _check_tensor_types(reader, str(path))
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF file {str(path)!r} uses rope scaling {scaling!r}, which the GGUF "
                         f"loader does not read; supported: none")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = key("vocab_size") or _embedding_rows(reader)
    kwargs = {
        "architectures": [GGUF_ARCHITECTURES[arch][0]],
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        # llama.cpp leaves out output.weight when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if arch in ("mistral", "gemma2", "gemma3"):
        kwargs["sliding_window"] = key("attention.sliding_window")
    if arch in _NORMS_PLUS_ONE:
        # The file names the padding token; Gemma's configs keep it at 0.
        kwargs["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id", 0)
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            kwargs[cap] = key(cap)      # Gemma 2 (Gemma 3: none)
    return AutoConfig.for_model(GGUF_ARCHITECTURES[arch][2], **kwargs)


def _hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (None: not a weight we load)."""
    layer_names = _GEMMA_LAYER_NAMES if arch in _NORMS_PLUS_ONE else _LAYER_NAMES
    if m := _LAYER_RE.match(name):
        layer, part, kind = m.groups()
        return (f"model.layers.{layer}.{layer_names[part]}.{kind}"
                if part in layer_names else None)
    stem, _, kind = name.rpartition(".")
    return f"{_TOP_NAMES[stem]}.{kind}" if stem in _TOP_NAMES else None


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of a q or k projection's rows (or bias).

    Within each head, llama.cpp interleaves the two halves that rotary
    embedding pairs up (rows 0, d/2, 1, d/2+1, ...); Hugging Face keeps them
    as two halves. ``w``: ``[num_heads * d, ...]``; the result has the same shape.
    """
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def _dequantize_array(data: np.ndarray, type_name: str, qtype, shape: tuple[int, ...]
                      ) -> np.ndarray | torch.Tensor:
    """The tensor's values; the types ``quantization.gguf_blocks`` unpacks (Q4_0,
    Q4_1, Q4_K, Q8_0) for the whole tensor at once in torch, bit for bit the
    numbers of ``gguf.quants`` (which works row group by row group in numpy,
    several times slower), every other type by it."""
    from ..quantization.gguf_blocks import KEPT_TYPES, unpack

    if type_name in KEPT_TYPES and len(shape) == 2:
        return unpack(data, type_name, shape).dequantize()
    from gguf.quants import dequantize
    array = dequantize(data, qtype)
    # Float tensors come back as views of the read-only memory map: copy those.
    return np.array(array, dtype=np.float32, copy=not array.flags.writeable, order="C")


def dequantize_tensor(tensor) -> torch.Tensor:
    """One GGUF tensor as float32 ``[rows, cols]`` (or ``[n]``), in PyTorch's order.

    GGUF lists dimensions fastest-first (``ne``); dequantized, the values are
    already row-major, as PyTorch holds them.
    """
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    values = _dequantize_array(tensor.data, tensor.tensor_type.name, tensor.tensor_type, shape)
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    return values.reshape(shape)


Index = tuple[slice, ...]


FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def kept_type_policy(type_name: str) -> str:
    """What ``quantization="gguf"`` does with a linear weight of this GGUF type:
    ``"kept"`` (unpacked exactly into a layout a GEMM reads:
    ``quantization.gguf_blocks.KEPT_TYPES``), ``"float"`` (stored as floats,
    kept so), ``"converted"`` (another block type the gguf package
    dequantizes: requantized at load to per-channel int8, one more rounding),
    or ``"refused"`` (the IQ family and anything not dequantizable: no GEMM
    here reads their codebooks, and converting them would hide that)."""
    from ..quantization.gguf_blocks import KEPT_TYPES

    if type_name in KEPT_TYPES:
        return "kept"
    if type_name in FLOAT_TYPES:
        return "float"
    if type_name.startswith("IQ") or type_name not in dequantizable_types():
        return "refused"
    return "converted"


def check_kept_types(path: str | Path) -> None:
    """Refuse a file ``quantization="gguf"`` cannot serve, naming the types
    (``quantization="none"`` dequantizes any type the gguf package reads)."""
    refused = sorted({t.tensor_type.name for t in open_gguf(path).tensors
                      if len(t.shape) == 2 and kept_type_policy(t.tensor_type.name) == "refused"})
    if refused:
        raise ValueError(f"GGUF file {str(path)!r} has weights of type {', '.join(refused)}, "
                         f"which quantization='gguf' does not keep or convert; pass "
                         f"quantization='none' to dequantize them at load")


class GGUFTensor:
    """One weight of the file, read on demand.

    ``tensor(index)``: the values dequantized to float32, ``[index]`` of them;
    ``quantized()``: the weight as ``quantization="gguf"`` keeps it (a
    canonical ``Int4Weight`` / ``Int8Weight``, float32 values for a float
    type, or per-channel int8 for a converted type; ``kept_type_policy``).
    Both put LLaMA's q/k rows back in Hugging Face's order; ``offset`` is
    added to the values (-1 for Gemma's norms, stored as 1 + w).
    """

    def __init__(self, tensor, unpermute_heads: int | None, offset: float = 0.0):
        self.tensor = tensor
        self.unpermute_heads = unpermute_heads
        self.offset = offset
        self.type_name = tensor.tensor_type.name

    def __call__(self, index: Index | None) -> torch.Tensor:
        w = dequantize_tensor(self.tensor)
        if self.unpermute_heads is not None:
            w = unpermute_rotary_rows(w, self.unpermute_heads)
        if self.offset:
            w = w + self.offset
        return w if index is None else w[index]

    def quantized(self):
        from ..quantization.formats import quantize_int8
        from ..quantization.gguf_blocks import unpack

        policy = kept_type_policy(self.type_name)
        if policy != "kept":
            if policy == "refused":
                raise ValueError(f"GGUF tensor {self.tensor.name!r} has type {self.type_name}, "
                                 f"which quantization='gguf' does not keep or convert")
            values = self(None)
            return values if policy == "float" else quantize_int8(values)
        shape = tuple(int(n) for n in reversed(self.tensor.shape.tolist()))
        weight = unpack(self.tensor.data, self.type_name, shape)
        if self.unpermute_heads is not None:
            order = unpermute_rotary_rows(torch.arange(shape[0]), self.unpermute_heads)
            weight = weight.rows(order)
        return weight


def gguf_weight_readers(path: str | Path) -> Iterator[tuple[str, GGUFTensor]]:
    """``(Hugging Face name, reader)`` for every weight in the file; calling
    ``reader(index)`` dequantizes the tensor (to float32) and returns
    ``tensor[index]``; ``reader.quantized()`` keeps it quantized."""
    reader = open_gguf(path)
    meta = metadata(reader)
    arch = _architecture(meta, str(path))
    permuted = GGUF_ARCHITECTURES[arch][1]
    heads = {"q_proj": meta[f"{arch}.attention.head_count"],
             "k_proj": meta.get(f"{arch}.attention.head_count_kv",
                                meta[f"{arch}.attention.head_count"])}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, arch)
        if name is None:
            continue
        proj = name.split(".")[-2]
        offset = -1.0 if arch in _NORMS_PLUS_ONE and "norm" in proj else 0.0
        yield name, GGUFTensor(tensor, heads[proj] if permuted and proj in heads else None,
                               offset)


def tokenizer_cache_dir() -> Path:
    """Where built GGUF tokenizers are kept between processes:
    ``$MINIPAGED_CACHE/gguf-tokenizers``, by default under ``~/.cache/minipaged``
    (``$XDG_CACHE_HOME`` if set)."""
    root = os.environ.get("MINIPAGED_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minipaged"
    return Path(root) / "gguf-tokenizers"


def _tokenizer_cache_key(path: Path) -> str:
    """Names one file's tokenizer as one transformers version builds it: the file
    (path, size, modification time) and the version, so an edited file or an
    upgrade builds it again."""
    import transformers

    stat = path.stat()
    ident = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def build_gguf_tokenizer(path: str | Path):
    """The tokenizer transformers builds from the file's metadata
    (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``), with no cache.
    It reads the whole file's metadata, 49,152-token tables included, through
    ``open_gguf`` (``transformers_reads_through_open_gguf``)."""
    from transformers import AutoTokenizer

    path = Path(path)
    with transformers_reads_through_open_gguf():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str):
    """Built once per file and transformers version, then read back from
    ``tokenizer_cache_dir()`` (a tokenizer folder, under a second to load). A
    cache that cannot be read or written is skipped, never an error."""
    from transformers import AutoTokenizer

    folder = tokenizer_cache_dir() / _tokenizer_cache_key(Path(path))
    if (folder / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError):
            pass   # a damaged entry: build again and overwrite it
    tokenizer = build_gguf_tokenizer(path)
    try:
        # Written beside, then renamed: a concurrent reader never sees half a folder.
        partial = Path(tempfile.mkdtemp(prefix=folder.name, dir=_made(folder.parent)))
        tokenizer.save_pretrained(str(partial))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    except OSError:
        pass
    return tokenizer


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def gguf_tokenizer(path: str | Path):
    """The tokenizer ``transformers`` builds from the file's metadata (with its
    chat template), or None for a file without one (prompts as token ids then,
    as for a checkpoint folder without tokenizer files).

    Building it takes seconds, so it is made once per process and file
    (tokenizers are not changed by encoding, so engines share it), and kept
    on disk for later processes (``tokenizer_cache_dir``; a test checks the
    copy read back encodes, decodes and renders chat as the fresh one)."""
    if "tokenizer.ggml.model" not in open_gguf(path).fields:
        return None
    return _tokenizer(str(Path(path).resolve()))


def save_dequantized(path: str | Path, out_dir: str | Path,
                     dtype: torch.dtype = torch.float32) -> Path:
    """Write the GGUF file as a Hugging Face checkpoint folder in ``out_dir``:
    ``config.json``, one ``model.safetensors`` of the dequantized weights (in
    ``dtype``) and the tokenizer. Peers that cannot read GGUF (vLLM's CPU
    build, in the benchmarks) then load exactly the weights minipaged serves.
    Holds the whole dequantized model in memory while writing."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gguf_hf_config(path).save_pretrained(out)
    if (tokenizer := gguf_tokenizer(path)) is not None:
        tokenizer.save_pretrained(out)
    tensors = {name: read(None).to(dtype).contiguous() for name, read in gguf_weight_readers(path)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
