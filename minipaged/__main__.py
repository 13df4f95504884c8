"""``python -m minipaged demo [...]``: see ``minipaged.demo``."""

import sys

from .demo import main as demo_main

COMMANDS = {"demo": demo_main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print("usage: python -m minipaged demo [--model DIR] [--help]")
        sys.exit(2)
    COMMANDS[sys.argv[1]](sys.argv[2:])
