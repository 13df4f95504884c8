"""Checks for the book's exercises: one module per chapter (``ch04`` for chapter 04).

Each ``check_exercise_N(student_fn)`` calls the student's function on fresh, seeded
inputs, computes the right answer by running the engine (or the package) on the same
inputs, and raises ``AssertionError`` saying what was expected and what came back; it
prints ``exercise N -> ok`` when every case agrees. The student's function is called
before the engine runs, so a stub fails at once. Nothing here imports ``minipaged`` at
module level: a chapter's setup must set ``TRITON_INTERPRET`` first.
"""
