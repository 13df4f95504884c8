"""Where a model's files are: a GGUF file, a local directory, or a Hugging Face Hub id.

``LLM(model=...)`` takes any of them. An id (``"Qwen/Qwen2.5-0.5B"``) resolves to
its snapshot in the Hugging Face cache, downloaded on first use by
``huggingface_hub``, which also decides where the cache is (``HF_HUB_CACHE``,
else ``HF_HOME/hub``) and whether the network may be used (``HF_HUB_OFFLINE=1``:
only what is cached already). Only the files the engine reads are fetched.
"""

from __future__ import annotations

import os
from pathlib import Path

from .gguf import GGUF_SUFFIX, is_gguf

# What the engine reads from a checkpoint: the configs, safetensors weights
# (their shard index too) and the tokenizer. Repositories that also hold
# PyTorch .bin, TensorFlow or Flax copies of the weights skip those.
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
             "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
             "merges.txt", "chat_template.jinja"]

# Mistral's repositories add the same weights in Mistral's own format and names
# (consolidated.safetensors), which the loader cannot use: not worth the download.
HUB_SKIPPED = ["consolidated*"]

# Older repositories (OPT's, for one) have no safetensors: their .bin weights then.
HUB_BIN_WEIGHTS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def local_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` stands for: ``path`` itself when it is one, or a
    directory's only ``.gguf`` file when the directory has no ``config.json``
    (a folder as llama.cpp and Ollama users keep one). None for anything else;
    a ``ValueError`` when such a directory holds several GGUF files."""
    if is_gguf(path):
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if is_gguf(p))
    if len(found) > 1:
        raise ValueError(f"model directory {str(path)!r} holds {len(found)} GGUF files "
                         f"({', '.join(p.name for p in found)}); pass the one to load")
    return found[0] if found else None


def resolve_model(model: str | os.PathLike) -> Path:
    """Where ``model``'s files are: a GGUF file (``model`` itself, or the one
    ``.gguf`` in the directory ``model``), the directory ``model``, else the
    Hub cache's snapshot of the id ``model``.

    A ``ValueError`` naming ``model``, the path tried and the Hub's error says
    why neither worked (no such directory, and an invalid id, an id not on the
    Hub, or one not cached while offline).
    """
    path = Path(model).expanduser()
    if (gguf := local_gguf(path)) is not None:
        return gguf
    if path.is_dir():
        return path
    if path.suffix.lower() == GGUF_SUFFIX:
        raise ValueError(f"model {str(model)!r} names a GGUF file, and there is no file at "
                         f"{str(path.absolute())!r}")
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(str(model), allow_patterns=HUB_FILES,
                                          ignore_patterns=HUB_SKIPPED))
        if not any(snapshot.glob("*.safetensors")):
            snapshot = Path(snapshot_download(str(model), allow_patterns=HUB_BIN_WEIGHTS))
    except (ValueError, OSError) as err:  # what huggingface_hub raises: both families
        hub_error = " ".join(f"{type(err).__name__}: {err}".split())  # one line
        raise ValueError(f"model {str(model)!r} is neither a local directory (no directory at "
                         f"{str(path.absolute())!r}) nor a Hugging Face Hub id that resolves "
                         f"({hub_error})") from err
    return snapshot
