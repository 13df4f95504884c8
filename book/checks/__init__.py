"""Checks for the book's exercises: one module per chapter (``ch04`` for chapter 04).

Each ``check_exercise_N(student_fn)`` calls the student's function on fresh, seeded
inputs, computes the right answer by running the engine (or the package) on the same
inputs, and raises ``AssertionError`` saying what was expected and what came back; it
prints ``exercise N -> ok`` when every case agrees. The student's function is called
before the engine runs, so a stub fails at once. While it runs, the package functions
that would hand it the answer (the module's ``ANSWERS[N]``) are switched off
(``refusing``): calling one raises ``RuntimeError`` saying why. Nothing here imports
``minipaged`` at module level: a chapter's setup must set ``TRITON_INTERPRET`` first.
"""

import contextlib


def grade(check, student_fn, seed: int | None = None) -> None:
    """Run ``check`` (a ``check_exercise_N``) on ``student_fn``, as a chapter's check cell does.

    While ``student_fn`` is still the shipped stub, the check meets its
    ``NotImplementedError``: this reports the exercise as not done yet instead of
    stopping the notebook, so "Run All" goes on to the next exercise. A wrong answer
    raises the check's ``AssertionError``; a right one prints ``exercise N -> ok``.
    ``seed``: fresh inputs instead of the check's own (a teacher grading with a seed the
    students have not seen); every check draws its cases from it.
    """
    number = check.__name__.rsplit("_", 1)[-1]
    try:
        check(student_fn) if seed is None else check(student_fn, seed=seed)
    except NotImplementedError:
        print(f"exercise {number}: the stub still raises NotImplementedError -> not done yet")


def _function(target: str):
    """The function named ``"module:qualified.name"``."""
    import importlib

    module, _, name = target.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def refusing(exercise: int, answers: dict[int, list[str]]):
    """Switch off the package's answers to ``exercise`` for the block: each function
    in ``answers[exercise]`` (a check module's ``ANSWERS``; ``"module:qualified.name"``)
    has its code swapped for one that raises ``RuntimeError`` saying why (so a name
    imported earlier, ``from ... import``, is switched off too), and put back afterwards
    whatever happens."""
    saved = []
    try:
        for target in answers[exercise]:
            fn = _function(target)
            message = (f"exercise {exercise}: {target.replace(':', '.')} is switched off while "
                       f"your function runs; the exercise is to compute its answer yourself")
            namespace: dict = {}
            exec(f"def refused(*args, **kwargs):\n    raise RuntimeError({message!r})\n",
                 namespace)
            saved.append((fn, fn.__code__))
            fn.__code__ = namespace["refused"].__code__
        yield
    finally:
        for fn, original in saved:
            fn.__code__ = original
