"""Workloads and the benchmarks of minipaged's own parts: ``minipaged bench NAME [ARGS...]``.

Each benchmark (``BENCHMARKS``) also runs as ``python -m minipaged.bench.NAME``
(``MODULES`` names the one whose module is named otherwise: ``serve``, the
HTTP load client, is ``serve_client``), with ``--help``: its options, exposes
``main(argv=None)`` and writes its JSON (and a PNG when matplotlib is
installed) under ``assets/`` by default; ``serve`` writes one where
``--result-file`` says.
``harness`` is what they share: timing, the machine, records, figures,
arguments and random-weight models.

What stays in the package, and why: the book, the demo or the tests import
it, or it measures this package through its own API in this interpreter.
Beside the benchmarks: ``workloads`` and ``chat_prompts``, the synthetic
traces and real chat requests they and several chapters serve;
``stand_ins``, a Llama-style tokenizer and a model that costs nothing;
``timing``, the harness's names that chapter 05 imports.

What reaches outside the package lives in the repository's ``scripts/``
(see ``scripts/README.md``): the throughput comparison against transformers
and vLLM (every engine in a process of its own), the GPU check
(``gpu_check`` here only runs it) with its GPU-only steps, the kernel
resource report, the paper's sweeps, and the records of one-off measurements.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "memory_waste": "KV memory holding real tokens, reservation against paging, simulated "
                    "(the paper's figure 2, chapter 00)",
    "serving": "normalized latency against request rate per KV policy (the paper's figures "
               "12 and 13, chapter 08)",
    "prefix": "prefix caching off and on: prompt tokens computed, time to first token",
    "host_overhead": "host milliseconds per engine step, phase by phase, the model stood in",
    "structured": "what structured output's constrained rows cost per decode step",
    "kernels": "paged decode bandwidth and prefill TFLOP/s against SDPA (CUDA)",
    "gpu_check": "every GPU check in one command, within 8 minutes (from a checkout)",
    "spec_decode": "speculative decoding (n-gram drafts) against plain decoding: tokens/s, "
                   "acceptance, on quoting and open-chat requests",
    "serve": "load any OpenAI-compatible server over HTTP: throughput, TTFT, TPOT, ITL "
             "(vllm bench serve's measures)",
}

MODULES = {"serve": "serve_client"}
"""A benchmark whose module is named otherwise: ``serve`` is the HTTP client
(``python -m minipaged.bench.serve_client``), not the in-process ``serving``."""


def module_name(name: str) -> str:
    """The module under ``minipaged.bench`` that runs benchmark ``name``."""
    return MODULES.get(name, name)


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    return "\n".join(["usage: minipaged bench NAME [ARGS...]   (NAME --help: its options)",
                      "", "benchmarks:"]
                     + [f"  {name:<{width}}  {what}" for name, what in BENCHMARKS.items()]
                     + ["", "A checkout's scripts/ has more: throughput.py (against transformers "
                            "and vLLM), reproduce.py (the paper's figures)."])


def main(argv: list[str] | None = None) -> int:
    """``minipaged bench NAME [ARGS...]``: run ``minipaged.bench.NAME``'s
    ``main`` with ``ARGS``. Without a name, the list of benchmarks (exit 0);
    with an unknown one, the list on stderr and exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name = argv[0].replace("-", "_")
    if name not in BENCHMARKS:
        print(f"minipaged bench: unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    result = importlib.import_module(f"{__name__}.{module_name(name)}").main(argv[1:])
    return result if isinstance(result, int) else 0
