"""The paper's other end-to-end figures, on the serving benchmark's engines.

    python scripts/sweeps.py parallel      # figure 14: parallel sampling and beam search
    python scripts/sweeps.py block-size    # figures 18b and 19b: block size, swap vs recompute
    python scripts/sweeps.py parallel --quick

``parallel`` (figure 14): the Alpaca-like trace with every request asking
for ``n`` samples (temperature 1, a seed per request) or a beam of width
``n`` (greedy beam search), n = 2, 4, 6; for paging (with
``admission_headroom``) and Oracle, the knee search of ``minipaged.bench.serving``
(its bound: 3x the lowest latency at the start rate; one trace per rate).
Paging shares a request's prompt blocks among its sequences (and a beam's
common prefix); the reserving policies reserve a span per sequence and copy
the parent's KV at every fork.

Both use a 4096-token KV pool and a 1024-token context (``SWEEP_SETTINGS``:
a request of 6 sequences, and blocks of 256 tokens, need room), bigger than
figures 12-13's 1536 tokens.

``block-size``: paging alone at one request rate per workload, the KV pool
fixed in tokens and the block size swept from 1
to 256 tokens (figure 18b, ShareGPT- and Alpaca-like), then the ShareGPT-like
runs again with preemption by swapping instead of recomputation (figure
19b). Each point is the mean over two traces (``--seed`` and the next). These
runs use the engine's default admission (``paged-no-headroom``: vLLM's 1 %
watermark), so that preemption happens often enough to compare its two
mechanisms. The rates (``BLOCK_RATES``) sit just below paging's knee, so
that the pool fills and sequences get preempted.

Each writes ``<name>_cpu.json`` and ``<name>_cpu.png`` to ``--out`` (default
``assets/``) and prints a table last.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from minipaged.bench.harness import (
    arguments,
    environment,
    plain_log_axes,
    pyplot,
    save_figure,
    save_record,
)
from minipaged.bench.serving import (
    SETTINGS,
    ServingBench,
    _fmt,
    engine_record,
    print_run,
    rate_sweep,
    workload_record,
)

WIDTHS = (2, 4, 6)
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Start rates for figure 14's knee search, per (kind, width): light loads on
# this model (a request of n sequences costs about n times one).
PARALLEL_START = {"cpu": 96.0, "quick": 32.0}
# Figures 14, 18b and 19b use a bigger pool than figures 12-13 (4096 tokens
# against 1536) and a longer context: requests of n sequences, and blocks up
# to 256 tokens, need room; one trace per rate for figure 14 (6 settings to search).
SWEEP_SETTINGS = {"cpu": dict(num_blocks=256, max_model_len=1024, num_requests=400)}
PARALLEL_SETTINGS = {"cpu": dict(num_requests=200, refine=2)}
# Figure 18b/19b rates when not given: near paging's knee with the sweeps'
# 4096-token pool on the development machine (2026-11-30), so that the pool
# fills and sequences get preempted; at 82 and 299 req/s there were too few
# preemptions to compare swap with recompute.
BLOCK_RATES = {"cpu": {"sharegpt": 100.0, "alpaca": 400.0}, "quick": {"sharegpt": 32.0,
                                                                     "alpaca": 64.0}}
QUICK_BLOCK_SIZES = (4, 16, 64)
# The paper's section 6.3 (OPT-13B, Alpaca): paging's advantage over Orca
# (Oracle) grows with sharing, from 1.3x in basic sampling to 2.3x for beam
# search of width 6.
PAPER_FIG14 = {"basic sampling": 1.3, "beam width 6": 2.3}


def sampling_params_for(kind: str, width: int):
    """``params_for(request)`` for ``serve_trace``: ``width`` samples or beams, EOS ignored."""
    from minipaged.sampling_params import RequestOutputKind, SamplingParams

    final = RequestOutputKind.FINAL_ONLY
    if kind == "parallel":
        return lambda r: SamplingParams(n=width, temperature=1.0, seed=int(r.request_id),
                                        ignore_eos=True, max_tokens=r.output_len,
                                        output_kind=final)
    if kind == "beam":
        return lambda r: SamplingParams(n=width, use_beam_search=True, temperature=0.0,
                                        ignore_eos=True, max_tokens=r.output_len,
                                        output_kind=final)
    raise ValueError(f"kind must be 'parallel' or 'beam', got {kind!r}")


def parallel(bench: ServingBench, policies: list[str], widths, start_rate: float,
             bound_factor: float) -> dict:
    """Figure 14: one knee search per (kind, width), every policy."""
    out = {}
    for kind in ("parallel", "beam"):
        for width in widths:
            label = f"{kind}{width} "
            bench.cfg["start_rate"] = start_rate / width
            out[f"{kind}-{width}"] = {"kind": kind, "width": width, **rate_sweep(
                bench, policies, "alpaca", None, bound_factor, sampling_params_for(kind, width),
                label=label)}
    return out


def block_size(bench: ServingBench, block_sizes, rates: dict[str, float],
               seeds=(0, 1)) -> dict:
    """Figures 18b (per workload) and 19b (swap vs recompute, ShareGPT-like): paging only.

    Near the knee one run's latency moves a lot with the timing of its
    preemptions, so each point is the mean over traces drawn with ``seeds``.
    """
    series = {}
    for name, dataset, mode in (("sharegpt", "sharegpt", "recompute"),
                                ("alpaca", "alpaca", "recompute"),
                                ("sharegpt-swap", "sharegpt", "swap")):
        runs = {}
        for bs in block_sizes:
            per_seed = []
            for seed in seeds:
                run = bench.run(rates[dataset], "paged-no-headroom", dataset, seed=seed,
                                block_size=bs, preemption_mode=mode)
                print_run(f"{name} block {bs} seed {seed}", run)
                per_seed.append(run)
            bench.engines.clear()  # one pool at a time
            latencies = [r["mean_normalized_latency"] for r in per_seed]
            runs[str(bs)] = {
                "block_size": bs, "seeds": list(seeds), "runs": per_seed,
                "finished_all": all(r["finished_all"] for r in per_seed),
                "mean_normalized_latency": (None if None in latencies
                                            else sum(latencies) / len(latencies)),
                "mean_batched_requests": sum(r["mean_batched_requests"] for r in per_seed)
                / len(per_seed),
                "preemptions": sum(r["preemptions"] for r in per_seed) / len(per_seed),
            }
        series[name] = {"dataset": dataset, "preemption_mode": mode, "rate": rates[dataset],
                        "runs": runs}
    return series


def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, out_help="folder for the .json and .png", out="assets",
                  quick="tiny model, a handful of requests", seed=True)
    p.add_argument("experiment", choices=("parallel", "block-size"))
    p.add_argument("--policies", default="paged,oracle", help="figure 14's policies")
    p.add_argument("--widths", default=None, help="figure 14's n / beam widths, e.g. 2,4,6")
    p.add_argument("--start-rate", type=float, help="figure 14: start rate x width (req/s)")
    p.add_argument("--block-sizes", default=None, help="e.g. 1,16,256")
    p.add_argument("--sharegpt-rate", type=float)
    p.add_argument("--alpaca-rate", type=float)
    p.add_argument("--num-requests", type=int, help="requests per run")
    p.add_argument("--bound-factor", type=float, default=3.0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    setting = "quick" if args.quick else "cpu"
    cfg = dict(SETTINGS[setting], **SWEEP_SETTINGS.get(setting, {}))
    if args.experiment == "parallel":
        cfg.update(PARALLEL_SETTINGS.get(setting, {}))
    if args.num_requests:
        cfg["num_requests"] = args.num_requests
    cfg["seeds"] = [args.seed] if args.experiment == "parallel" else [args.seed, args.seed + 1]
    t0 = time.perf_counter()
    bench = ServingBench(cfg, args.seed)
    record = {"environment": environment(), "setting": setting,
              "model": {"shape": bench.shape, "dtype": "float32"}}
    try:
        if args.experiment == "parallel":
            policies = [p for p in args.policies.split(",") if p]
            widths = ([int(w) for w in args.widths.split(",")] if args.widths
                      else (WIDTHS if setting == "cpu" else (2,)))
            start = args.start_rate or PARALLEL_START[setting]
            record.update(benchmark="parallel", workload=workload_record(bench, "alpaca"),
                          engine_config=engine_record(bench), start_rate_times_width=start,
                          configs=parallel(bench, policies, widths, start, args.bound_factor))
        else:
            sizes = ([int(b) for b in args.block_sizes.split(",")] if args.block_sizes
                     else (BLOCK_SIZES if setting == "cpu" else QUICK_BLOCK_SIZES))
            rates = dict(BLOCK_RATES[setting])
            rates["sharegpt"] = args.sharegpt_rate or rates["sharegpt"]
            rates["alpaca"] = args.alpaca_rate or rates["alpaca"]
            record.update(benchmark="block_size",
                          workload={"sharegpt": workload_record(bench, "sharegpt"),
                                    "alpaca": workload_record(bench, "alpaca")},
                          engine_config=engine_record(bench, block_size=list(sizes)),
                          seeds=[args.seed, args.seed + 1],
                          series=block_size(bench, sizes, rates, (args.seed, args.seed + 1)))
    finally:
        bench.close()
    record["total_seconds"] = time.perf_counter() - t0
    parallel_run = args.experiment == "parallel"
    name = "parallel_cpu" if parallel_run else "block_size_cpu"
    save_record(record, Path(args.out) / f"{name}.json",
                plot_parallel if parallel_run else plot_block_size)
    (print_parallel if parallel_run else print_block_size)(record)
    return record


# -- figures and tables ----------------------------------------------------------------

def plot_parallel(record: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    configs = record["configs"]
    widths = sorted({c["width"] for c in configs.values()})
    fig, axes = plt.subplots(2, len(widths), figsize=(3.6 * len(widths), 6.4), squeeze=False)
    for row, kind in enumerate(("parallel", "beam")):
        for col, width in enumerate(widths):
            ax = axes[row][col]
            c = configs.get(f"{kind}-{width}")
            if c is None:
                ax.axis("off")
                continue
            for p, res in c["policies"].items():
                runs = sorted(res["runs"].values(), key=lambda r: r["rate"])
                pts = [(r["rate"], r["mean_normalized_latency"]) for r in runs
                       if r["mean_normalized_latency"] is not None]
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=p)
            ax.axhline(c["search"]["bound_seconds_per_token"], color="grey", ls="--", lw=1)
            plain_log_axes(ax)
            ratio = c["sustained_ratios"].get("paged/oracle")
            title = "parallel sampling n" if kind == "parallel" else "beam width"
            ax.set_title(f"{title} = {width}" + (f"\npaged sustains {ratio:.2f}x Oracle"
                                                  if ratio else ""), fontsize=9)
            ax.set_xlabel("request rate (req/s)", fontsize=8)
            if col == 0:
                ax.set_ylabel("normalized latency (s/token)", fontsize=8)
            ax.legend(fontsize=7)
    fig.suptitle(f"Alpaca-like, {record['environment']['device']} (the paper's figure 14)",
                 fontsize=10)
    save_figure(fig, path, dpi=110)


def print_parallel(record: dict) -> None:
    print(f"\n{record['environment']['device']}; Alpaca-like, "
          f"{record['workload']['num_requests_per_rate']} requests per rate; KV pool "
          f"{record['engine_config']['kv_tokens']} tokens")
    print(f"{'config':12s} " + " ".join(f"{p:>10s}" for p in
                                        next(iter(record["configs"].values()))["policies"])
          + "   sustained req/s, paged/oracle")
    for key, c in record["configs"].items():
        rates = " ".join(f"{_fmt(r['sustained_rate'], '.3g'):>10s}" for r in c["policies"].values())
        ratio = c["sustained_ratios"].get("paged/oracle")
        print(f"{key:12s} {rates}   {_fmt(ratio, '.2f')}x")


def plot_block_size(record: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    series = record["series"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, ax in (("sharegpt", left), ("alpaca", left), ("sharegpt", right),
                     ("sharegpt-swap", right)):
        s = series.get(name)
        if s is None:
            continue
        runs = sorted(s["runs"].values(), key=lambda r: r["block_size"])
        pts = [(r["block_size"], r["mean_normalized_latency"]) for r in runs
               if r["mean_normalized_latency"] is not None]
        label = (f"{s['dataset']}-like, {s['rate']:g} req/s" if ax is left
                 else f"{s['preemption_mode']}")
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    for ax, title in ((left, "figure 18b: block size (recompute)"),
                      (right, "figure 19b: swap vs recompute, ShareGPT-like")):
        plain_log_axes(ax)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("mean normalized latency (s/token)")
        ax.set_title(f"{title}\n{record['environment']['device']}", fontsize=9)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def print_block_size(record: dict) -> None:
    series = record["series"]
    print(f"\n{record['environment']['device']}; KV pool {record['engine_config']['kv_tokens']} "
          "tokens; normalized latency s/token (preemptions), "
          f"mean of {len(record['seeds'])} traces")
    sizes = sorted({r["block_size"] for s in series.values() for r in s["runs"].values()})
    print(f"{'block':>6s} " + " ".join(f"{n:>22s}" for n in series))
    for bs in sizes:
        cells = []
        for s in series.values():
            r = s["runs"].get(str(bs))
            cells.append("-" if r is None else
                         f"{_fmt(r['mean_normalized_latency'])} ({r['preemptions']:.0f})")
        print(f"{bs:6d} " + " ".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
