"""``python -m minipaged demo [...]`` (``minipaged.teaching.demo``) or ``serve [...]``
(``minipaged.server.cli``)."""

import sys


def _demo(argv):
    from .teaching.demo import main
    main(argv)


def _serve(argv):
    from .server.cli import main
    main(argv)


COMMANDS = {"demo": _demo, "serve": _serve}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print("usage: python -m minipaged demo [--model DIR_OR_GGUF] [--tiny] [--help]\n"
              "       python -m minipaged serve [MODEL] [--port 8000] [--help]")
        sys.exit(2)
    COMMANDS[sys.argv[1]](sys.argv[2:])
