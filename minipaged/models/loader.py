"""Load a Hugging Face checkpoint directory (or a GGUF file) into one of our model classes.

The directory holds ``config.json`` and weights as ``*.safetensors`` (one
file, or shards listed in ``model.safetensors.index.json``) or
``pytorch_model*.bin``. The model is built on the meta device (no memory,
no random init), materialized on the target device directly in its final
dtype (``materialize``), and every parameter is filled from the checkpoint;
a parameter the checkpoint lacks is an error. Projections that the model
runs as one matmul (``MergedLinear``: q/k/v, gate/up) load each checkpoint
tensor into their own row range.

A tensor-parallel rank (``tp``) builds its slice of the model; each parallel
module names the part of a checkpoint tensor it holds
(``checkpoint_slices``), and only that part is read: a safetensors file is
sliced where it lies, without reading the rest (a ``.bin`` file can only be
loaded whole, then sliced).

A ``.gguf`` file takes the place of the whole directory: ``models.gguf``
builds the config from its metadata and yields its tensors under Hugging
Face's names, dequantized one at a time, so everything below treats it as
one more weight file.
"""

from __future__ import annotations

import ctypes
import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..quantization.linear import (
    QuantEmbedding,
    QuantLinear,
    finalize_quantized,
    quantize_shell,
)
from . import model_class
from .gguf import close_gguf_files, gguf_hf_config, gguf_weight_readers, is_gguf
from .layers import MergedLinear, unmerged_name


def load_hf_config(model_dir: str | Path) -> Any:
    """The checkpoint's ``transformers`` config, with clear errors for a bad directory
    (a GGUF file's is built from its metadata)."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if is_gguf(path):
        return gguf_hf_config(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    return AutoConfig.from_pretrained(str(path))


# generation_config.json keys that set sampling defaults, and SamplingParams' names for them.
_SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                      "min_p": "min_p", "max_new_tokens": "max_tokens"}


def load_generation_config(model_dir: str | Path) -> tuple[tuple[int, ...], dict[str, Any]]:
    """``(end-of-sequence token ids, default sampling settings)`` from the
    checkpoint's ``generation_config.json`` (empty when it has none).

    Chat models list several end tokens there (Llama 3: end of text and end
    of turn) and the sampling settings their authors recommend; an ``LLM``
    uses those when ``generate`` is called without ``sampling_params``, as
    vLLM does. A GGUF file has none: its one end token is in the config.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return (), {}
    data = json.loads(path.read_text())
    eos = data.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    defaults = {ours: data[theirs] for theirs, ours in _SAMPLING_DEFAULTS.items()
                if data.get(theirs) is not None}
    return eos, defaults


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, safetensors preferred; sharded ones by their index
    (a GGUF file is its own one weight file)."""
    if is_gguf(model_dir):
        return [model_dir]
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        index = model_dir / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [model_dir / s for s in shards]
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(f"model directory {str(model_dir)!r} has no *.safetensors or "
                            f"pytorch_model*.bin weights")


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every checkpoint tensor, whole."""
    for name, read in iter_weight_readers(files):
        yield name, read(None)


Index = tuple[slice, ...]


def iter_weight_readers(files: list[Path]
                        ) -> Iterator[tuple[str, Callable[[Index | None], torch.Tensor]]]:
    """``(name, read)`` for every checkpoint tensor; ``read(index)`` returns
    ``tensor[index]`` (the whole tensor for None), reading only that slice
    from a safetensors file."""
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"weight shard {str(f)!r} is missing")
        if is_gguf(f):
            yield from gguf_weight_readers(f)
        elif f.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    yield name, (lambda index, name=name: handle.get_tensor(name) if index is None
                                 else handle.get_slice(name)[index])
        else:
            for name, tensor in torch.load(f, map_location="cpu", weights_only=True).items():
                yield name, lambda index, tensor=tensor: tensor if index is None else tensor[index]


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               hf_config: Any = None, tp: Any = None, layers: range | None = None,
               quantization: str = "none") -> nn.Module:
    """Build the model ``config.architectures[0]`` names and fill it from the checkpoint.

    ``tp`` (a ``distributed.TensorParallel``): build and load only this rank's slice.
    ``layers``: build and load only this pipeline stage's decoder layers
    (``distributed.pipeline``); the checkpoint's other tensors are skipped
    unread (a GGUF tensor is dequantized only when read).
    ``quantization``: a resolved mode of ``minipaged.quantization`` ("none",
    "gguf", "int8"): the linear layers and the embedding are built as
    quantized shells before anything is allocated, filled here, then packed
    once for the device's GEMMs (``quantization.linear.finalize_quantized``).
    """
    path = Path(model_dir)
    hf_config = hf_config if hf_config is not None else load_hf_config(path)
    cls = model_class((getattr(hf_config, "architectures", None) or [None])[0])
    files = weight_files(path)
    parts = {k: v for k, v in (("tp", tp), ("layers", layers)) if v is not None}
    with torch.device("meta"):
        model = cls(hf_config, **parts)
    if quantization != "none":
        quantize_shell(model, floats_to_int8=quantization == "int8",
                       linear_types=(nn.Linear, MergedLinear))
    materialize(model, device, dtype)   # a head tied at construction stays tied
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()

    params = dict(model.named_parameters())
    # Merged projections load one part per checkpoint tensor, into row ranges.
    merged = {f"{prefix}.{kind}": module for prefix, module in model.named_modules()
              if isinstance(module, MergedLinear) or getattr(module, "merged", False)
              for kind in ("weight", "bias")}
    expected = {(name, shard) for name in params
                for shard in (range(len(merged[name].out_sizes)) if name in merged else [None])}
    # The module that owns each parameter: a parallel one says which slice it loads.
    owners = {f"{prefix}.{pname}" if prefix else pname: module
              for prefix, module in model.named_modules()
              for pname, _ in module.named_parameters(recurse=False)}
    shells = quantized_shells(model)
    expected |= {(name, shard) for name, shell in shells.items()
                 for shard in (range(len(shell.out_sizes)) if getattr(shell, "merged", False)
                               else [None])}
    head_source = _tied_head_source(model, params)
    loaded: set[tuple[str, int | None]] = set()
    for ckpt_name, whole in iter_weight_readers(files):
        for target, read in checkpoint_targets(model, ckpt_name, whole):
            if head_source is not None and target == (head_source, None):
                target = ("lm_head.weight", None)
            if target is not None and target[0] in shells:
                name, shard = target
                keep = quantization == "gguf" and hasattr(read, "quantized")
                shells[name].load_weight(read.quantized() if keep else read(None), shard)
                loaded.add(target)
            elif target is not None and target[0] in params:
                name, shard = target
                dest = params[name]
                if shard is not None:
                    dest = dest[merged[name].shard_rows(shard)]
                _copy_weight(ckpt_name, read, owners[name], name, shard, dest, dtype)
                loaded.add(target)
            # else: e.g. a tied lm_head saved anyway, or buffers we recompute
    missing = sorted(expected - loaded, key=str)
    if missing:
        names = [unmerged_name(name, shard, cls.merges) for name, shard in missing]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ValueError(f"checkpoint in {str(path)!r} lacks weight(s): {shown}")
    if shells:
        finalize_quantized(model, device, dtype)
    release_load_memory()
    return model.eval()


def _copy_weight(ckpt_name: str, read, owner: nn.Module, name: str, shard: int | None,
                 dest: torch.Tensor, dtype: torch.dtype) -> None:
    """Read a checkpoint tensor (this rank's slice of it, if ``owner`` is a
    parallel layer) into ``dest``, checking its shape."""
    index = (owner.checkpoint_slices(name.rsplit(".", 1)[-1], shard)
             if hasattr(owner, "checkpoint_slices") else None)
    tensor = read(index)
    with torch.no_grad():
        if getattr(owner, "pads_rows", False) and tensor.shape[0] < dest.shape[0]:
            # The last rank's vocabulary slice is shorter than its table:
            # zero rows (no id maps to them; their logits are cut off).
            dest[tensor.shape[0]:].zero_()
            dest = dest[:tensor.shape[0]]
        if tuple(tensor.shape) != tuple(dest.shape):
            which = "" if index is None else " (this rank's slice)"
            raise ValueError(f"weight {ckpt_name!r} has shape {tuple(tensor.shape)}{which}, "
                             f"the model expects {tuple(dest.shape)}")
        dest.copy_(tensor.to(dtype))
    # The tensor goes before the next one is read (a dequantized GGUF tensor
    # is a float32 copy): the load peaks at the model plus one tensor.


def checkpoint_targets(model: nn.Module, ckpt_name: str, read):
    """``(target, read)`` pairs for one checkpoint tensor: usually the one
    ``model.checkpoint_name`` gives, with the tensor's own reader. A tensor
    that holds several parts of a merged projection (Phi-3 stores q, k and v
    as one ``qkv_proj``) gives one pair per part (``model.fused_parts``:
    ``(part, rows of the tensor)``), each reading only its rows."""
    target = model.checkpoint_name(ckpt_name)
    parts = getattr(model, "fused_parts", lambda name: None)(ckpt_name)
    if target is None or not parts:
        return [(target, read)]
    return [((target[0], part), _rows_reader(read, rows)) for part, rows in parts]


def _rows_reader(read, rows: slice):
    """A reader of rows ``rows`` of the tensor ``read`` reads: ``index``
    (a parallel layer's slice of the part) counts from the part's first row."""
    def read_rows(index: Index | None) -> torch.Tensor:
        if index is None:
            return read((rows,))
        first = index[0]
        start = rows.start + (first.start or 0)
        stop = rows.stop if first.stop is None else rows.start + first.stop
        return read((slice(start, stop), *index[1:]))
    return read_rows


def release_load_memory() -> None:
    """Give back to the system what loading no longer needs: the GGUF files'
    memory maps (their pages read so far count as resident) and the heap
    pages the freed temporaries held, which glibc otherwise keeps for the
    process (``malloc_trim``; about 200 MB after SmolLM2's kept-quantized
    load on the 2-core VM). Nothing is lost: a file is mapped again if read."""
    close_gguf_files()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to trim this way
        pass


def quantized_shells(model: nn.Module) -> dict[str, QuantLinear | QuantEmbedding]:
    """Quantized layers by their weight's checkpoint name (``prefix.weight``);
    a head tied to the embedding loads nothing of its own and is left out."""
    return {f"{prefix}.weight": module for prefix, module in model.named_modules()
            if isinstance(module, QuantEmbedding)
            or isinstance(module, QuantLinear) and module.tied_to is None}


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace every parameter and buffer of a model built on the meta device
    by an uninitialized tensor on ``device``, a floating one directly in ``dtype``.

    Why not ``model.to_empty(device=device).to(dtype)``: ``to_empty`` allocates
    every floating tensor in the default dtype (float32) on the device and only
    then does ``.to(dtype)`` convert them, so a half-precision load would peak
    at the whole model in float32, twice its final size; a model whose bf16
    weights fit on a GPU could fail to load. Allocated here one tensor at a
    time in its final dtype, the load peaks at the model as it ends up plus
    the one checkpoint tensor being copied in.

    Dtypes end up as ``.to(dtype)`` leaves them: floating tensors in ``dtype``,
    others (integer buffers) in their own. Buffers that must stay float32 are
    recomputed afterwards by their module's ``reset_buffers`` (rotary
    ``inv_freq``). A tensor shared by several modules stays one tensor.
    """
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, new)

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, device=device,
                           dtype=dtype if t.is_floating_point() else t.dtype)

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in done:  # (the meta tensor is kept, so its id stays its own)
                    done[id(t)] = t, (nn.Parameter(empty(t), requires_grad=t.requires_grad)
                                      if isinstance(t, nn.Parameter) else empty(t))
                table[name] = done[id(t)][1]


def _tied_head_source(model: nn.Module, params: dict[str, Any]) -> str | None:
    """The embedding's checkpoint name when this model (a pipeline's last stage)
    holds a head tied to an embedding it does not hold: the head loads that
    tensor itself. None otherwise."""
    name = getattr(model, "embedding_weight", None)
    if (name is None or name in params or "lm_head.weight" not in params
            or not model.ties_embeddings()):
        return None
    return name
