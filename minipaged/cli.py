"""The ``minipaged`` command (also ``python -m minipaged``), as ``vllm serve``
and ``vllm bench`` are:

    minipaged serve [MODEL] [--port 8000] [engine flags]   the OpenAI-compatible server
    minipaged demo [--model DIR_OR_GGUF] [--tiny]          the demo (minipaged.teaching.demo)
    minipaged bench NAME [ARGS]                            a benchmark (minipaged.bench.NAME)

Each subcommand's own ``--help`` lists its flags.
"""

from __future__ import annotations

import sys

USAGE = """usage: minipaged serve [MODEL] [--port 8000] [--help]
       minipaged demo [--model DIR_OR_GGUF] [--tiny] [--help]
       minipaged bench NAME [ARGS] (minipaged bench lists the benchmarks)"""


def _serve(argv: list[str]) -> int | None:
    from .server.cli import main
    return main(argv)


def _demo(argv: list[str]) -> int | None:
    from .teaching.demo import main
    return main(argv)


def _bench(argv: list[str]) -> int | None:
    from .bench import main
    return main(argv)


COMMANDS = {"serve": _serve, "demo": _demo, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; exit code 2 with the usage for a missing or unknown one."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr if argv else sys.stdout)
        return 2
    code = COMMANDS[argv[0]](argv[1:])
    return code if isinstance(code, int) else 0
