"""Every end-to-end figure of the paper that this project reproduces, in one run.

    python scripts/reproduce.py            # about 15 minutes on 2 CPU cores
    python scripts/reproduce.py --quick    # a tiny run, to check it works

In order: ``minipaged.bench.serving`` on ShareGPT-like and Alpaca-like traces (figures
12 and 13), ``sweeps.py parallel`` (figure 14), and ``sweeps.py
block-size`` (figures 18b and 19b; at fixed rates just below paging's knee
with their bigger pool, ``sweeps.BLOCK_RATES``). Every step writes its JSON
and PNG to ``--out`` (default ``assets/``); a summary table is printed last.
"""

from __future__ import annotations

import argparse
import time

import sweeps
from minipaged.bench import serving


def summary(results: dict) -> list[str]:
    """Lines of the final table: each figure's headline, measured beside the paper's."""
    lines = []
    for dataset in ("sharegpt", "alpaca"):
        r = results.get(dataset)
        if not r:
            continue
        sus = ", ".join(f"{k} {v:.2f}x" for k, v in r["sustained_ratios"].items())
        bat = ", ".join(f"{k} {v:.2f}x" for k, v in r["batched_ratios"].items())
        lines.append(f"fig 12 {dataset:8s} sustained rate: {sus or '-'}")
        lines.append(f"fig 13 {dataset:8s} batched requests: {bat or '-'} "
                     "(paper, ShareGPT: " + ", ".join(
                         f"paged/{k} {v}x" for k, v in serving.PAPER_RATIOS.items()) + ")")
    par = results.get("parallel")
    if par:
        cells = ", ".join(f"{k} {serving._fmt(c['sustained_ratios'].get('paged/oracle'), '.2f')}x"
                          for k, c in par["configs"].items())
        lines.append(f"fig 14 paged/oracle sustained rate: {cells} "
                     "(paper: " + ", ".join(f"{v}x {k}" for k, v in sweeps.PAPER_FIG14.items())
                     + ")")
    blocks = results.get("block_size")
    if blocks:
        for name, s in blocks["series"].items():
            runs = [r for r in s["runs"].values() if r["mean_normalized_latency"] is not None]
            if runs:
                best = min(runs, key=lambda r: r["mean_normalized_latency"])
                lines.append(f"fig 18b/19b {name:14s} lowest latency at block size "
                             f"{best['block_size']} "
                             f"({best['mean_normalized_latency']:.4f} s/token)")
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="assets")
    args = p.parse_args(argv)
    quick = ["--quick"] if args.quick else []
    common = quick + ["--out", args.out]
    t0 = time.perf_counter()
    results = {}
    for dataset in ("sharegpt", "alpaca"):
        print(f"== figures 12 and 13, {dataset}-like ==", flush=True)
        results[dataset] = serving.main(common + ["--dataset", dataset])
    print("== figure 14 ==", flush=True)
    results["parallel"] = sweeps.main(["parallel"] + common)
    print("== figures 18b and 19b ==", flush=True)
    results["block_size"] = sweeps.main(["block-size"] + common)
    minutes = (time.perf_counter() - t0) / 60
    print(f"\n== summary ({minutes:.1f} minutes) ==")
    for line in summary(results):
        print(line)
    results["minutes"] = minutes
    return results


if __name__ == "__main__":
    main()
