"""A draft model anyone can build from the target alone: its first layers.

A draft must share the target's vocabulary, and a family's smallest
checkpoint often does not exist or is not at hand. The target's own first
``n`` layers, followed by its final norm and its head, form a model of the
same vocabulary at ``n / L`` of the body's cost: the early-exit drafts of
self-speculative decoding (LayerSkip, Draft & Verify), without the
training those papers give the early layers. Untrained, the exit is a weak
guesser; how weak is what ``bench spec_decode --draft-layers`` measures.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from ..models.gguf import gguf_tokenizer, gguf_weight_readers, is_gguf
from ..models.hub import resolve_model
from ..models.loader import iter_weights, load_hf_config, weight_files

_LAYER = re.compile(r"\.layers\.(\d+)\.")
# Files of a checkpoint folder that the copy keeps as they are.
_KEPT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json", "chat_template.jinja", "tokenizer.model")


def truncated_draft(model: str | Path, num_layers: int, out_dir: str | Path,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write a Hugging Face folder in ``out_dir`` holding ``model``'s first
    ``num_layers`` decoder layers, embeddings, final norm and head (weights
    in ``dtype``, dequantized from a GGUF file), and its tokenizer; returns
    ``out_dir``. ``num_layers`` must be in ``[1, layers - 1]``."""
    model_dir = resolve_model(model)
    config = load_hf_config(model_dir)
    total = config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be in [1, {total - 1}] (the model has {total} "
                         f"layers), got {num_layers}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    config.save_pretrained(out)
    if is_gguf(model_dir):
        weights = ((name, read(None)) for name, read in gguf_weight_readers(model_dir))
        if (tokenizer := gguf_tokenizer(model_dir)) is not None:
            tokenizer.save_pretrained(out)
    else:
        weights = iter_weights(weight_files(Path(model_dir)))
        for name in _KEPT_FILES:
            if (Path(model_dir) / name).is_file():
                shutil.copy(Path(model_dir) / name, out / name)
    kept = {}
    for name, tensor in weights:
        layer = _LAYER.search(name)
        if layer is None or int(layer.group(1)) < num_layers:
            kept[name] = tensor.to(dtype).contiguous()
    from safetensors.torch import save_file

    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
