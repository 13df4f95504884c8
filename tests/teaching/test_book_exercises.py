"""The book's graded exercises: every check in ``book/checks/chNN.py`` fails on a stub.

For each ``check_exercise_N`` of a chapter's checks module:

* the chapter ``book/NN_*.ipynb`` has a cell that nbval compares and that grades the
  shipped stub with it (``grade(check_exercise_N, stub)``), whose saved output says the
  exercise is not done yet: the check reached the stub's ``NotImplementedError``;
* the solutions notebook ``book/solutions/NN_*_solutions.ipynb`` calls it in a cell that
  nbval compares, whose saved output says ``exercise N -> ok``;
* called on a stub that raises ``NotImplementedError``, it raises;
* called on a function that hands the work to a package function the check switches
  off (the module's ``ANSWERS[N]``), it fails with the message that says so.

And a chapter with a checks module keeps no solution cell of its own (``# Solution``).
The notebooks are read as JSON; nothing is executed but the checks on stubs, which call
the student's function before they build any engine.
"""

import ast
import importlib
import json
import re
import sys
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parents[2] / "book"
CHECKS = sorted(BOOK.glob("checks/ch[0-9][0-9]*.py"))
SKIPPED = ("NBVAL_IGNORE_OUTPUT", "PYTEST_VALIDATE_IGNORE_OUTPUT", "NBVAL_SKIP",
           "NBVAL_RAISES_EXCEPTION")
SKIPPED_TAGS = {"nbval-ignore-output", "pytest-validate-ignore-output", "nbval-skip",
                "raises-exception"}


def _source(cell):
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _code_cells(path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _one(pattern):
    found = sorted(BOOK.glob(pattern))
    assert len(found) == 1, f"expected one notebook {pattern}, found {[p.name for p in found]}"
    return found[0]


def _check_names(path):
    tree = ast.parse(path.read_text())
    return [node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and re.fullmatch(r"check_exercise_\d+", node.name)]


def _calls(cell, name):
    return re.search(rf"\b{name}\(", _source(cell)) is not None


def _compared(cell):
    lines = _source(cell).splitlines()
    first = lines[0].strip() if lines else ""
    tags = set(cell.get("metadata", {}).get("tags", []))
    marked = any(first.startswith(f"# {marker}") for marker in SKIPPED)
    return not marked and not tags & SKIPPED_TAGS


def _text_output(cell):
    return "".join(_source({"source": o.get("text", "")}) for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def test_there_are_checks():
    assert CHECKS, "no book/checks/chNN.py"


@pytest.mark.parametrize("module", CHECKS, ids=lambda p: p.stem)
def test_chapter_runs_every_check_on_its_stub(module):
    nn = module.stem[2:]
    cells = _code_cells(_one(f"{nn}_*.ipynb"))
    names = _check_names(module)
    assert names, f"{module.name} defines no check_exercise_N"
    for name in names:
        number = name.rsplit("_", 1)[1]
        graded = [c for c in cells if re.search(rf"\bgrade\({name}\b", _source(c)) and _compared(c)]
        assert graded, f"chapter {nn}: no compared cell grades a stub with {name}"
        assert any(f"exercise {number}: the stub still raises NotImplementedError -> not done yet"
                   in _text_output(c) for c in graded), (
            f"chapter {nn}: the saved output of grade({name}, ...) does not report the stub")
    stale = [_source(c).splitlines()[0] for c in cells
             if _source(c).lstrip().startswith("# Solution")]
    assert not stale, f"chapter {nn} still has solution cells: {stale}"


@pytest.mark.parametrize("module", CHECKS, ids=lambda p: p.stem)
def test_solutions_pass_every_check(module):
    nn = module.stem[2:]
    cells = _code_cells(_one(f"solutions/{nn}_*_solutions.ipynb"))
    for name in _check_names(module):
        number = name.rsplit("_", 1)[1]
        compared = [c for c in cells if _calls(c, name) and _compared(c)]
        assert compared, f"solutions {nn}: no compared cell calls {name}"
        assert any(f"exercise {number} -> ok" in _text_output(c) for c in compared), (
            f"solutions {nn}: the saved output of {name}'s cell does not say "
            f"'exercise {number} -> ok' (re-execute the notebook)")


def test_grade_reports_a_stub_and_lets_a_wrong_answer_fail(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BOOK))
    from checks import grade

    def check_exercise_7(fn):
        assert fn() == 42, "exercise 7: expected 42"
        print("exercise 7 -> ok")

    def stub():
        raise NotImplementedError("exercise 7: your code")

    grade(check_exercise_7, stub)
    assert "exercise 7: the stub still raises NotImplementedError" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="expected 42"):
        grade(check_exercise_7, lambda: 41)
    grade(check_exercise_7, lambda: 42)
    assert capsys.readouterr().out == "exercise 7 -> ok\n"
    del sys.modules["checks"]


@pytest.mark.parametrize("module", CHECKS, ids=lambda p: p.stem)
def test_checks_fail_on_stubs(module, monkeypatch):
    monkeypatch.syspath_prepend(str(BOOK))
    checks = importlib.import_module(f"checks.{module.stem}")
    try:
        for name in _check_names(module):
            def stub(*args, **kwargs):
                raise NotImplementedError(f"{name}: stub")

            with pytest.raises((NotImplementedError, AssertionError)):
                getattr(checks, name)(stub)
    finally:
        for key in [k for k in sys.modules if k == "checks" or k.startswith("checks.")]:
            del sys.modules[key]


@pytest.mark.parametrize("module", CHECKS, ids=lambda p: p.stem)
def test_a_function_calling_the_packages_answer_fails(module, monkeypatch):
    monkeypatch.syspath_prepend(str(BOOK))
    checks = importlib.import_module(f"checks.{module.stem}")
    try:
        from checks import _function

        numbers = {int(name.rsplit("_", 1)[1]): name for name in _check_names(module)}
        assert sorted(checks.ANSWERS) == sorted(numbers), (
            f"{module.stem}: ANSWERS must list the switched-off functions of every exercise")
        # An empty list: no package function computes that answer (a closed calculation
        # the check does itself). Every chapter has at least one exercise that switches off.
        assert any(checks.ANSWERS.values()), f"{module.stem}: no exercise switches anything off"
        for number, name in numbers.items():
            for target in checks.ANSWERS[number]:
                answer = _function(target)

                def student(*args, _answer=answer, **kwargs):
                    return _answer(*args, **kwargs)

                with pytest.raises(RuntimeError, match=f"exercise {number}: .* switched off"):
                    getattr(checks, name)(student)
                assert answer.__code__.co_name != "refused", f"{target} was not put back"
    finally:
        for key in [k for k in sys.modules if k == "checks" or k.startswith("checks.")]:
            del sys.modules[key]


def test_chapter_02_refuses_an_answer_without_a_triton_kernel(monkeypatch):
    # Zeros from torch: the check says the kernel is missing before it compares values.
    # The kernel exercises are chapter 02's 1 and 2 and chapter 02b's 1 (the window).
    monkeypatch.syspath_prepend(str(BOOK))
    try:
        import torch

        def torch_only(q, *args):
            return torch.zeros_like(q)

        def torch_only_with_parts(q, k_cache, v_cache, tables, seq_lens, splits):
            return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[1], splits)

        for module, number, student in (("ch02", 1, torch_only), ("ch02", 2, torch_only_with_parts),
                                        ("ch02b", 1, torch_only)):
            checks = importlib.import_module(f"checks.{module}")
            with pytest.raises(AssertionError, match=f"exercise {number}: .*no Triton kernel"):
                getattr(checks, f"check_exercise_{number}")(student)
    finally:
        for key in [k for k in sys.modules if k == "checks" or k.startswith("checks.")]:
            del sys.modules[key]


def test_grade_passes_a_teachers_seed_to_the_check(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BOOK))
    from checks import grade

    seen = []

    def check_exercise_8(fn, seed: int = 80):
        seen.append(seed)
        assert fn(seed) == seed + 1, f"exercise 8: expected {seed + 1}"
        print("exercise 8 -> ok")

    grade(check_exercise_8, lambda x: x + 1)
    grade(check_exercise_8, lambda x: x + 1, seed=12345)
    assert seen == [80, 12345]
    with pytest.raises(AssertionError, match="expected 12346"):
        grade(check_exercise_8, lambda x: 0, seed=12345)
    del sys.modules["checks"]


@pytest.mark.parametrize("module", CHECKS, ids=lambda p: p.stem)
def test_every_check_takes_a_seed(module):
    tree = ast.parse(module.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and re.fullmatch(r"check_exercise_\d+", node.name):
            names = [a.arg for a in node.args.args + node.args.kwonlyargs]
            assert "seed" in names, f"{module.stem}.{node.name} takes no seed"
