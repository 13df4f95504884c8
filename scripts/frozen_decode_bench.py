"""One user's decode graph frozen with Inductor's GEMM templates against it unfrozen.

    python scripts/frozen_decode_bench.py --dtype bfloat16      # SmolLM2's GGUF as float weights
    python scripts/frozen_decode_bench.py --dtype float32 --rounds 4

Two compiled engines (``enforce_eager=False``) of the same file are loaded
here, with float weights (``--modes none``: the GGUF dequantized): one whose
decode graph is frozen, its GEMMs timed against Inductor's CPU templates
(``models.compiled.decode_templates_pay``, the default where the model has
packed float layers), and one where that check is switched off, so its
GEMMs stay oneDNN's packed product (``minipaged::packed_linear``); each
start-up is timed. Then, ``--rounds`` times, each engine in turn
(alternating, so that a machine that drifts weighs on both alike) serves
``--single`` chat requests one at a time, greedy, ``--tokens`` output
tokens each. Records every round's tokens/s, the medians, the greedy
tokens' first divergence between the two, and the memory bandwidth before
and after; writes ``frozen_decode_cpu_<dtype>.json`` to ``--out``. A
repository script: not part of the package.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from compiled_body_bench import chat_prompt_ids, run_modes, side_by_side_parser, tokens_per_second

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.bench.harness import save_record  # noqa: E402
from minipaged.bench.spec_decode import first_divergence  # noqa: E402
from minipaged.models import compiled as compiled_body  # noqa: E402

ENGINES = ("unfrozen", "frozen")


def load(model: str, mode: str, args: argparse.Namespace, frozen: bool) -> tuple[LLM, float]:
    """A compiled engine whose one-user decode graph is frozen or not, and its
    start-up seconds."""
    pays = compiled_body.decode_templates_pay
    if not frozen:
        compiled_body.decode_templates_pay = lambda model: False
    try:
        start = time.perf_counter()
        llm = LLM(model, quantization=mode, dtype=args.dtype, enforce_eager=False,
                  enable_prefix_caching=False, max_num_seqs=1)
        seconds = time.perf_counter() - start
    finally:
        compiled_body.decode_templates_pay = pays
    if llm.engine.executor.runner.compiled.decode_templates != frozen:
        raise SystemExit(f"the {'frozen' if frozen else 'unfrozen'} engine did not build that "
                         f"graph (no packed float layers in {model}?)")
    return llm, seconds


def run_mode(model: str, mode: str, args: argparse.Namespace) -> dict:
    engines, ready = {}, {}
    for name in ENGINES:
        engines[name], seconds = load(model, mode, args, frozen=name == "frozen")
        ready[name] = round(seconds, 1)
    chats = chat_prompt_ids(engines["frozen"], args.single)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for llm in engines.values():   # warm-up: first-call costs out of the timed rounds
        tokens_per_second(llm, chats[:1], SamplingParams(max_tokens=4, ignore_eos=True), False)
    rounds = {name: [] for name in ENGINES}
    outputs = {}
    for r in range(args.rounds):
        for name, llm in engines.items():
            speed, outputs[name] = tokens_per_second(llm, chats, params, False)
            rounds[name].append(round(speed, 2))
            print(f"{mode} {args.dtype} round {r + 1}: {name:8s} one user {speed:6.1f} tok/s",
                  flush=True)
    medians = {name: statistics.median(v) for name, v in rounds.items()}
    return {
        "mode": mode,
        "ready_seconds": ready,
        "rounds": rounds,
        "median_tokens_per_s": medians,
        "speedup": round(medians["frozen"] / medians["unfrozen"], 3),
        "first_divergence": [first_divergence(a, b)
                             for a, b in zip(outputs["unfrozen"], outputs["frozen"])],
    }


def main() -> None:
    parser = side_by_side_parser(__doc__)
    parser.set_defaults(modes="none", single=6, rounds=3)
    args = parser.parse_args()
    workload = {"description": f"{args.single} chat requests (bench.chat_prompts), one at a "
                               f"time, two compiled engines alternating"}
    record = run_modes(args, run_mode, "frozen_decode_graph", workload)
    save_record(record, Path(args.out) / f"frozen_decode_cpu_{args.dtype}.json")
    for result in record["results"]:
        print(f"{result['mode']}: {result['median_tokens_per_s']} tok/s (medians), "
              f"{result['speedup']}x, ready {result['ready_seconds']} s")


if __name__ == "__main__":
    main()
