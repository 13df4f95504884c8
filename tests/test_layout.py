"""No test module imports another test module.

What two test modules share lives in a module that is not a test
(``helpers.py``, ``tiny_models.py``, ``scripted.py``, ``kernel_cases.py``) or,
for fixtures, in a ``conftest.py``. A test module that imports another one
runs (or silently skips) the other's module-level code and autouse fixtures,
and breaks as soon as the two sit in different folders: pytest puts only a
test module's own folder on ``sys.path``.

Every ``.py`` file under tests/ is read with ``ast`` (not imported): an
``import`` or ``from ... import`` of a module whose name, or any dotted part
of it, starts with ``test_`` is an offence, wherever in the file it sits.
"""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def imports_of_test_modules(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """``(line, module)`` for every import of a test module in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.module is not None and is_test_module(node.module):
                found.append((node.lineno, "." * node.level + node.module))
            elif node.module is None:   # from . import test_x
                found += [(node.lineno, "." * node.level + a.name) for a in node.names
                          if is_test_module(a.name)]
    return sorted(found)


def offences(root: Path = TESTS) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root.parent)
        for line, module in imports_of_test_modules(path.read_text(encoding="utf-8"), str(path)):
            out.append(f"{rel}:{line} imports the test module {module}")
    return out


def test_no_test_module_imports_another():
    found = offences()
    assert not found, ("move what they share into tests/helpers.py (or a fixture into a "
                       "conftest.py):\n" + "\n".join(found))


def test_the_check_reports_a_planted_import():
    planted = ("import os\n"
               "from helpers import drive\n"
               "from test_robustness import drive, engine_for\n"
               "\n"
               "def test_x():\n"
               "    import test_server as srv\n"
               "    from tests.engine.test_engine import run\n"
               "    from . import test_output_kinds\n"
               "    from .test_penalties import VOCAB\n")
    assert imports_of_test_modules(planted) == [
        (3, "test_robustness"), (6, "test_server"), (7, "tests.engine.test_engine"),
        (8, ".test_output_kinds"), (9, ".test_penalties")]
    assert imports_of_test_modules("import testing, contest_x\nfrom tests import helpers\n") == []


def test_the_walk_names_the_offending_file(tmp_path):
    root = tmp_path / "tests"
    (root / "engine").mkdir(parents=True)
    (root / "engine" / "test_a.py").write_text("def test_a():\n    pass\n")
    (root / "engine" / "test_b.py").write_text("import pytest\nfrom test_a import test_a\n")
    assert offences(root) == ["tests/engine/test_b.py:2 imports the test module test_a"]
