"""Serving two classes of requests under FCFS and under priority scheduling (issue 26).

    python scripts/serving_classes.py            # assets/serving_classes_cpu.json and .png
    python scripts/serving_classes.py --rate 6 --repeats 3 --num-requests 120
    python scripts/serving_classes.py --quick    # a tiny run, to check it works

Why: operators put interactive traffic ahead of batch jobs with vLLM's
``--scheduling-policy priority``. This measures what that buys each class on
one workload: "interactive" chats (short prompts, short answers) and "batch"
jobs (long prompts, long outputs) arrive mixed as one Poisson trace, at a
rate where the engine is loaded (the KV pool holds only a few batch jobs, so
requests queue). The same trace is served in real time (``serving.serve_trace``)
by one engine with ``scheduling_policy="fcfs"`` and one with ``"priority"``
(interactive priority 0, batch 1: lower is served first), alternating the two
per trace seed so a shared CPU's drift hits both alike.

Per class and policy it reports how many requests finished, the end-to-end
latency, time to first token (TTFT) and time per output token after the
first (TPOT), each as mean and 99th percentile over the requests of every
trace seed. Writes ``serving_classes_cpu.json`` (every run's per-request
records too) and ``serving_classes_cpu.png`` (grouped bars: the mean, with
the p99 marked, per class and policy) to ``--out`` (default ``assets/``) and
prints a table. The model and engine are ``bench.serving``'s (a tiny
random-weight LLaMA, a small KV pool, prefix caching off, recompute).

The record of one measurement (the README's figures for priority
scheduling), kept as a repository script; ``minipaged.bench.serving``'s
``serve_trace`` and ``ServingBench`` do the serving.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from minipaged.bench import serving
from minipaged.bench.harness import arguments, environment, parse, pyplot, save_figure, save_record
from minipaged.bench.workloads import TraceRequest, poisson_arrivals, random_prompt_ids

# Per class: its share of the requests, prompt and output lengths (uniform,
# inclusive) and its priority under scheduling_policy="priority".
CLASSES = {
    "interactive": dict(share=0.75, prompt=(16, 64), output=(16, 48), priority=0),
    "batch": dict(share=0.25, prompt=(256, 448), output=(128, 256), priority=1),
}
SCHEDULING_POLICIES = ("fcfs", "priority")
SETTINGS = {
    "cpu": dict(model="tiny", num_requests=120, rate=6.0, repeats=3, num_blocks=96,
                max_model_len=1024, trace_max_len=1024, max_seconds=120.0),
    "quick": dict(model="quick", num_requests=12, rate=40.0, repeats=1, num_blocks=24,
                  max_model_len=256, trace_max_len=256, max_seconds=30.0),
}
QUICK_CLASSES = {
    "interactive": dict(share=0.75, prompt=(4, 12), output=(4, 8), priority=0),
    "batch": dict(share=0.25, prompt=(64, 96), output=(48, 64), priority=1),
}


def class_trace(num_requests: int, rate: float, classes: dict, seed: int
                ) -> tuple[list[TraceRequest], dict[str, str]]:
    """A seeded Poisson trace whose requests are drawn from ``classes``, and
    each request id's class. The class of each request is drawn by share, so
    both classes arrive interleaved, as one stream."""
    rng = np.random.default_rng(seed)
    names = list(classes)
    shares = np.array([classes[c]["share"] for c in names], dtype=float)
    kinds = rng.choice(len(names), size=num_requests, p=shares / shares.sum())
    arrivals = poisson_arrivals(rng, num_requests, rate)
    trace, class_of = [], {}
    for i, (k, t) in enumerate(zip(kinds, arrivals)):
        spec = classes[names[k]]
        prompt = int(rng.integers(spec["prompt"][0], spec["prompt"][1] + 1))
        output = int(rng.integers(spec["output"][0], spec["output"][1] + 1))
        trace.append(TraceRequest(str(i), float(t), prompt, output))
        class_of[str(i)] = names[k]
    return trace, class_of


def serve_classes(bench: serving.ServingBench, trace: list[TraceRequest],
                  prompts: list[list[int]], class_of: dict[str, str], classes: dict,
                  policy: str, tag: str) -> dict:
    """Serve ``trace`` with ``scheduling_policy=policy``; under ``"priority"``
    each request gets its class's priority (FCFS refuses any but 0)."""
    engine = bench.engine("paged-no-headroom", scheduling_policy=policy)
    priority_for = (None if policy == "fcfs"
                    else lambda r: classes[class_of[r.request_id]]["priority"])
    run = serving.serve_trace(engine, trace, prompts, tag, bench.cfg["max_seconds"],
                              priority_for=priority_for, keep_requests=True)
    for req in run["requests"]:
        req["class"] = class_of[req["request_id"]]
    return run


def _stat(values: list, fn) -> float | None:
    return float(fn(values)) if values else None


def class_summary(requests: list[dict], name: str) -> dict:
    """One class's count, finished count, and mean and p99 of end-to-end
    latency, TTFT and TPOT (seconds) over its finished requests."""
    mine = [r for r in requests if r["class"] == name]
    done = [r for r in mine if r["latency"] is not None]
    out = {"requests": len(mine), "finished": len(done)}
    for key in ("latency", "ttft", "tpot"):
        values = [r[key] for r in done]
        out[f"mean_{key}"] = _stat(values, np.mean)
        out[f"p99_{key}"] = _stat(values, lambda v: np.percentile(v, 99))
    return out


def summarize(runs: dict[str, list[dict]], classes: dict) -> dict:
    """Per policy and class: the summary over the requests of all its runs."""
    return {policy: {name: class_summary([r for run in rs for r in run["requests"]], name)
                     for name in classes}
            for policy, rs in runs.items()}


def summarize_by_seed(runs: dict[str, list[dict]], classes: dict) -> dict:
    """Per policy, trace seed and class: the summary of that one run, to show
    how far single traces spread around the pooled numbers."""
    return {policy: {str(run["seed"]): {name: class_summary(run["requests"], name)
                                        for name in classes} for run in rs}
            for policy, rs in runs.items()}


def run_classes(bench: serving.ServingBench, classes: dict, num_requests: int, rate: float,
                repeats: int, seed: int) -> dict[str, list[dict]]:
    """Each trace seed served under every policy, alternating (fcfs, priority,
    fcfs, ...), so drift in the machine's speed falls on both alike."""
    runs: dict[str, list[dict]] = {p: [] for p in SCHEDULING_POLICIES}
    for i in range(repeats):
        trace, class_of = class_trace(num_requests, rate, classes, seed + i)
        prompts = random_prompt_ids(trace, bench.shape["vocab_size"], seed + i)
        for policy in SCHEDULING_POLICIES:
            run = serve_classes(bench, trace, prompts, class_of, classes, policy,
                                f"{policy}{i}-")
            run["seed"] = seed + i
            runs[policy].append(run)
            print(f"  {policy:8s} seed {seed + i}: finished {run['finished_requests']}/"
                  f"{run['num_requests']}, preempted {run['preemptions']}, batched "
                  f"{run['mean_batched_requests']:.1f}, {run['wall_seconds']:.1f} s", flush=True)
    return runs


# -- output ---------------------------------------------------------------------------

METRICS = (("latency", "end-to-end latency"), ("ttft", "time to first token"),
           ("tpot", "time per output token"))


def plot(record: dict, path: Path) -> None:
    """Grouped bars per metric: per class, one bar per policy (the mean), with
    the 99th percentile marked above it; log scale, since classes differ by
    orders of magnitude."""
    plt = pyplot(path)
    if plt is None:
        return
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 0.2, not 2 x 10^-1
    summary, classes = record["summary"], list(record["classes"])
    fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 5.2))
    width = 0.38
    for ax, (key, title) in zip(axes, METRICS):
        for j, policy in enumerate(summary):
            xs = np.arange(len(classes)) + (j - 0.5) * width
            means = [summary[policy][c][f"mean_{key}"] or np.nan for c in classes]
            p99s = [summary[policy][c][f"p99_{key}"] or np.nan for c in classes]
            ax.bar(xs, means, width, color=f"C{j}", label=f"{policy}: mean")
            ax.scatter(xs, p99s, marker="_", s=900, linewidths=3, color="black",
                       label="p99" if j == 0 else None, zorder=3)
            for x, m in zip(xs, means):
                ax.text(x, m, f"{m:.3g}", ha="center", va="bottom", fontsize=11)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(np.arange(len(classes)), classes, fontsize=14)
        ax.set_title(title, fontsize=15)
        ax.set_ylabel("seconds", fontsize=13)
        ax.tick_params(axis="y", labelsize=12)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=13)
    cpu = record["environment"].get("cpu", {})
    fig.suptitle(f"{record['workload']['rate']:g} req/s, {record['workload']['num_requests']} "
                 f"requests x {record['workload']['repeats']} traces; {cpu.get('model', '')}",
                 fontsize=13)
    save_figure(fig, path, dpi=110, rect=(0, 0.07, 1, 1))  # room for the legend below


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:9.1f}"


def print_table(record: dict) -> None:
    print(f"\n{record['environment']['cpu']['model']}, {record['environment']['torch_threads']}"
          f" threads; {record['workload']['rate']:g} req/s; times in ms")
    head = " ".join(f"{m + '_' + k:>11s}" for k, _ in METRICS for m in ("mean", "p99"))
    print(f"{'policy':8s} {'class':11s} {'finished':>9s} {head}")
    for policy, per_class in record["summary"].items():
        for name, s in per_class.items():
            cells = " ".join(f"{_ms(s[m + '_' + k]):>11s}" for k, _ in METRICS
                             for m in ("mean", "p99"))
            print(f"{policy:8s} {name:11s} {s['finished']:>4d}/{s['requests']:<4d} {cells}")


def parse_args(argv=None):
    p = arguments(__doc__, out_help="folder for the .json and .png", out="assets",
                  quick="tiny model and trace", seed=True, threads=True)
    p.add_argument("--rate", type=float, help="requests/s of the mixed trace")
    p.add_argument("--num-requests", type=int, help="requests per trace")
    p.add_argument("--repeats", type=int, help="traces (seeds), each under both policies")
    p.add_argument("--num-blocks", type=int, help="KV pool blocks (16 tokens each)")
    p.add_argument("--note", action="append", default=[],
                   help="a remark stored in the record, e.g. what else ran (repeatable)")
    return parse(p, argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    setting = "quick" if args.quick else "cpu"
    cfg = dict(SETTINGS[setting])
    for key in ("rate", "num_requests", "repeats", "num_blocks"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    classes = QUICK_CLASSES if args.quick else CLASSES
    t_start = time.perf_counter()
    bench = serving.ServingBench(cfg, args.seed)
    try:
        runs = run_classes(bench, classes, cfg["num_requests"], cfg["rate"], cfg["repeats"],
                           args.seed)
    finally:
        bench.close()
    record = {
        "benchmark": "serving_classes", "environment": environment(),
        "setting": setting, "model": {"shape": bench.shape, "dtype": "float32"},
        "classes": classes,
        "workload": {"rate": cfg["rate"], "num_requests": cfg["num_requests"],
                     "repeats": cfg["repeats"], "seeds": [args.seed + i
                                                          for i in range(cfg["repeats"])],
                     "arrivals": "Poisson, classes interleaved by share",
                     "max_tokens": "the class's drawn output length, ignore_eos, greedy"},
        "engine_config": serving.engine_record(bench, kv_policy="paged",
                                               admission_headroom=False),
        "summary": summarize(runs, classes),
        "summary_by_seed": summarize_by_seed(runs, classes), "runs": runs,
        "total_seconds": time.perf_counter() - t_start, "notes": args.note,
    }
    name = "serving_classes_quick" if args.quick else "serving_classes_cpu"
    save_record(record, Path(args.out) / f"{name}.json", plot)
    print_table(record)
    return record


if __name__ == "__main__":
    main()
