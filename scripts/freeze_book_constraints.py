"""Write book/constraints.txt: the exact versions of everything ``minipaged[dev,book]``
pulls in, as installed in this environment (run it right after CI passed here).

A course's students install with ``-c book/constraints.txt`` and get the
versions the book's saved outputs were checked with. torch and triton are
left out: torch is installed first, as its own wheel (CPU or CUDA build), and
triton must stay free to match the GPU machine's.

    python scripts/freeze_book_constraints.py
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

LEFT_OUT = {"torch", "triton", "minipaged"}
OUT = Path(__file__).resolve().parent.parent / "book" / "constraints.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str, extras: set[str]) -> dict[str, str]:
    """``{canonical name: installed version}`` of ``root[extras]`` and everything it
    requires, following only requirements whose markers hold here."""
    found: dict[str, str] = {}
    todo = [(root, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue   # a requirement for another platform or Python
        key = canonical(dist.metadata["Name"])
        if key in found and not wanted:
            continue
        found[key] = dist.version
        for req in dist.requires or []:
            spec, _, marker = req.partition(";")
            env_ok = True
            if marker.strip():
                from packaging.markers import Marker
                m = Marker(marker.strip())
                env_ok = any(m.evaluate({"extra": e}) for e in wanted) or m.evaluate({"extra": ""})
            if not env_ok:
                continue
            dep = re.match(r"\s*([A-Za-z0-9_.-]+)(\[([^\]]*)\])?", spec)
            dep_extras = {e.strip() for e in (dep.group(3) or "").split(",") if e.strip()}
            if canonical(dep.group(1)) not in found or dep_extras:
                todo.append((dep.group(1), frozenset(dep_extras)))
    return found


def main() -> None:
    pins = closure("minipaged", {"dev", "book"})
    lines = [f"{name}=={version}" for name, version in sorted(pins.items())
             if name not in LEFT_OUT]
    header = (f"# The versions CI last passed the book with (Python "
              f"{sys.version_info.major}.{sys.version_info.minor}); written by "
              f"scripts/freeze_book_constraints.py.\n"
              f"# Use: pip install -e \".[dev,book]\" -c book/constraints.txt\n")
    OUT.write_text(header + "\n".join(lines) + "\n")
    print(f"{len(lines)} pins -> {OUT}")


if __name__ == "__main__":
    main()
