"""One user's GEMMs on a CPU: the plain product for one row against oneDNN's packed call.

    python scripts/plain_gemv_bench.py                  # float32, compiled
    python scripts/plain_gemv_bench.py --eager

One user's decode step multiplies one row by every weight, which is bound by
reading the weight; ``models.cpu_linear.PLAIN_MAX_ROWS`` sends such rows to
a plain product on the row-major weight (``F.linear``) instead of the packed
oneDNN call: up to two float32 rows, no bfloat16 row (``torch.mv`` for one
bf16 row, tried at commit ba96df6, served one user no faster; both are in
``assets/plain_gemv_cpu.json``; a dtype with no plain rows compares the
packed call with itself). For each dtype
(``--dtypes``) one engine of SmolLM2 (float weights, ``quantization="none"``,
compiled unless ``--eager``, ``max_num_seqs=1``) serves ``--single`` chat
requests one at a time, greedy, ``--tokens`` output tokens each, ``--rounds``
times with each setting in turn (packed for every row count, then the
default), alternating so that a machine that slows down weighs on both.
Records every round's tokens/s, the medians, the greedy tokens of the two
settings compared and the memory bandwidth; writes ``plain_gemv_cpu.json``
to ``--out``. A repository script: not part of the package.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bandwidth import memory_read_gbs
from compiled_body_bench import chat_prompt_ids, tokens_per_second

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.assets import smollm2_path  # noqa: E402
from minipaged.bench.harness import environment, save_record  # noqa: E402
from minipaged.bench.spec_decode import first_divergence  # noqa: E402
from minipaged.models import cpu_linear  # noqa: E402

SETTINGS = {"packed": {}, "plain": dict(cpu_linear.PLAIN_MAX_ROWS)}


def run_dtype(dtype: str, args: argparse.Namespace) -> dict:
    """One engine in ``dtype``, each setting in turn (see the module doc)."""
    llm = LLM(str(smollm2_path()), dtype=dtype, quantization="none", max_num_seqs=1,
              enforce_eager=args.eager, enable_prefix_caching=False)
    prompts = chat_prompt_ids(llm, args.single)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    tokens_per_second(llm, prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), False)
    rounds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    outputs = {}
    try:
        for r in range(args.rounds):
            for name, rows in SETTINGS.items():
                cpu_linear.PLAIN_MAX_ROWS = rows
                rate, outputs[name] = tokens_per_second(llm, prompts, params, False)
                rounds[name].append(round(rate, 2))
                print(f"{dtype} round {r + 1}: {name:6s} {rate:6.1f} tok/s", flush=True)
    finally:
        cpu_linear.PLAIN_MAX_ROWS = SETTINGS["plain"]
    medians = {name: statistics.median(v) for name, v in rounds.items()}
    return {"dtype": dtype, "rounds": rounds, "median_tokens_per_s": medians,
            "gain": round(medians["plain"] / medians["packed"], 3),
            "first_divergence": [first_divergence(a, b)
                                 for a, b in zip(outputs["packed"], outputs["plain"])]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32", help="comma-separated")
    parser.add_argument("--eager", action="store_true", help="the eager body (default compiled)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single", type=int, default=6, help="chats served one at a time")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--out", default=str(HERE.parent / "assets"))
    args = parser.parse_args(argv)
    before = memory_read_gbs()
    results = [run_dtype(dtype, args) for dtype in args.dtypes.split(",")]
    record = {"benchmark": "plain_gemv", "model": "SmolLM2-135M-Instruct",
              "environment": environment(),
              "workload": {"single": args.single, "tokens": args.tokens, "rounds": args.rounds,
                           "body": "eager" if args.eager else "compiled", "greedy": True},
              "settings": {name: {str(k): v for k, v in rows.items()}
                           for name, rows in SETTINGS.items()},
              "bandwidth_gbs": {"before": round(before, 1), "after": round(memory_read_gbs(), 1)},
              "results": results}
    print("\n| dtype | packed | plain | gain | first divergences |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        m = r["median_tokens_per_s"]
        print(f"| {r['dtype']} | {m['packed']:.1f} | {m['plain']:.1f} | {r['gain']:.2f} | "
              f"{r['first_divergence']} |")
    print(f"memory bandwidth {record['bandwidth_gbs']} GB/s")
    save_record(record, Path(args.out) / "plain_gemv_cpu.json")


if __name__ == "__main__":
    main()
