"""Files shipped inside the minipaged package (see ``[tool.setuptools.package-data]``).

``tiny-stdlib-llama/`` is a ~5M-parameter LLaMA and its byte-level BPE
tokenizer, trained on the Python standard library's source by
``scripts/train_tiny_model.py``: small enough to ship in the wheel, trained
enough that ``python -m minipaged demo`` prints Python-looking text.
"""

from __future__ import annotations

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
