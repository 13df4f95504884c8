"""Teaching helpers: what the book and ``minipaged demo`` use to show the
engine at work; nothing in serving depends on them.

Owns: the demo (``minipaged demo``), step traces (``trace``: the scheduler's
decisions, step by step) and the block-table pictures (``viz``).

May import: anything in the package below the server.
"""
