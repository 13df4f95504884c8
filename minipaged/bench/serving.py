"""Serving: normalized latency vs request rate per KV policy (the paper's figures 12 and 13).

    python -m minipaged.bench.serving                          # ShareGPT-like, 4 policies, CPU
    python -m minipaged.bench.serving --dataset alpaca
    python -m minipaged.bench.serving --policies paged,max --num-requests 40
    python -m minipaged.bench.serving --quick                  # a tiny run, to check it works

For each KV policy (``paged``, the engine; ``oracle``, ``pow2`` and ``max``,
the paper's Orca baselines, see ``ReservingBlockSpaceManager``) one
``LLMEngine`` serves Poisson traces in real time: a loop adds every request
whose arrival time has passed (with ``arrival_time`` = start + its trace
time, so queueing counts), then calls ``step()`` if anything is unfinished,
else sleeps until the next arrival. Each request is greedy with EOS ignored
and ``max_tokens`` = its trace output length (the policies' "true output").
Prefix caching is off for every policy (the paper has none).

Per policy the request rate is searched for the knee: start at
``--start-rate``, double while the mean normalized latency (end-to-end
latency / output tokens, the paper's metric) stays under the bound and every
request finished within ``--max-seconds`` of the trace's end, then bisect
``--refine`` times between the last good and the first bad rate. The bound:
``--bound-factor`` (default 3) times the lowest mean normalized latency
measured at ``--start-rate`` over all policies (a light load, where no policy
queues), unless ``--bound`` gives seconds/token. The sustained rate is the
highest rate measured under it.

The model is a small random-weight LLaMA (``throughput.MODELS["cpu"]``, fp32)
and the KV pool is small (``--num-blocks`` blocks of 16 tokens), so memory and
not compute is what limits the batch, as on the paper's GPUs;
``max_model_len`` is 1024, so ``max`` reserves 1024 tokens per request while
the ShareGPT-like trace is cut at 512 (prompt and output each <= 256).
Records, per (policy, rate): mean normalized latency, TTFT, time per output
token, mean batched (running) requests per step, and whether every request
finished. Writes ``serving_<device>.json`` and ``serving_<device>.png``
(left: normalized latency vs rate, figure 12; right: mean batched requests at
one common rate, the highest any policy ran at, figure 13) to ``--out``
(default ``assets/``) and prints a table last.

On 2 CPU cores this model's step slows as the batch grows (compute, not
memory bandwidth, sets its time), so paging's larger batches buy less
latency than on a GPU: in the committed run paging batched 1.28x Oracle's
requests and 4.1x Max's but sustained the same rate as Oracle and Pow2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

POLICIES = ("paged", "oracle", "pow2", "max")
PAPER_RATIOS = {"oracle": 2.2, "max": 4.3}  # figure 13: paged batches 2.2x Oracle, 4.3x Max

# Per setting: model shape key, requests per rate, trace cap (prompt + output),
# max_model_len, KV blocks (16 tokens each), start rate (req/s), max rates, refine steps.
SETTINGS = {
    "cpu": dict(model="cpu", num_requests=100, trace_max_len=512, max_model_len=1024,
                num_blocks=136, start_rate=4.0, max_rates=6, refine=1, max_seconds=60.0),
    "quick": dict(model="quick", num_requests=8, trace_max_len=64, max_model_len=128,
                  num_blocks=24, start_rate=32.0, max_rates=2, refine=0, max_seconds=10.0),
}
BLOCK_SIZE = 16


# -- pure helpers ----------------------------------------------------------------

def search_knee(measure: Callable[[float], tuple[float, bool]], start_rate: float,
                bound: float | Callable[[], float], max_rates: int = 6,
                refine: int = 1) -> tuple[float | None, list[float]]:
    """Highest request rate whose latency stays under ``bound``.

    ``measure(rate)`` returns (mean normalized latency, finished every request).
    Rates double from ``start_rate`` until one fails (latency >= bound or not
    finished) or ``max_rates`` were tried, then ``refine`` bisections between
    the last good and the first bad rate. ``bound`` may be a callable, read
    after the first measurement (so it can depend on it). Returns (the highest
    good rate or None if even ``start_rate`` failed, every rate measured in order).
    """
    tried: list[float] = []

    def good(rate: float) -> bool:
        latency, finished = measure(rate)
        tried.append(rate)
        limit = bound() if callable(bound) else bound
        return finished and latency < limit

    best, bad, rate = None, None, start_rate
    while len(tried) < max_rates:
        if good(rate):
            best, rate = rate, rate * 2
        else:
            bad = rate
            break
    if best is None or bad is None:
        return best, tried
    for _ in range(refine):
        mid = (best + bad) / 2
        if good(mid):
            best = mid
        else:
            bad = mid
    return best, tried


def request_metrics(arrival: float, first_token: float | None, finished: float | None,
                    output_tokens: int) -> dict:
    """TTFT, time per output token (after the first) and normalized latency, in seconds."""
    if finished is None or first_token is None or output_tokens < 1:
        return {"ttft": None, "tpot": None, "normalized_latency": None}
    return {"ttft": first_token - arrival,
            "tpot": (finished - first_token) / (output_tokens - 1) if output_tokens > 1 else 0.0,
            "normalized_latency": (finished - arrival) / output_tokens}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


# -- one trace through one engine in real time ------------------------------------

def serve_trace(engine, trace, prompts: list[list[int]], tag: str, max_seconds: float) -> dict:
    """Feed ``trace`` to ``engine`` as its requests arrive; per-request and per-step records.

    Requests still unfinished ``max_seconds`` after the last arrival are aborted.
    """
    from ..sampling_params import SamplingParams

    start = time.monotonic()
    deadline = start + trace[-1].arrival_time + max_seconds
    pending = 0
    groups = {}
    running_per_step: list[int] = []
    done_metrics = {}
    while True:
        now = time.monotonic()
        while pending < len(trace) and start + trace[pending].arrival_time <= now:
            r = trace[pending]
            rid = f"{tag}-{r.request_id}"
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
            engine.add_request(rid, None, params, prompt_token_ids=prompts[pending],
                               arrival_time=start + r.arrival_time)
            groups[rid] = r
            pending += 1
        if engine.has_unfinished_requests():
            if now > deadline:
                for rid in list(engine.requests):
                    engine.abort_request(rid)
                break
            for out in engine.step():
                if out.finished:
                    done_metrics[out.request_id] = (out.metrics, len(out.outputs[0].token_ids))
            running_per_step.append(len(engine.scheduler.running))
        elif pending < len(trace):
            time.sleep(max(0.0, start + trace[pending].arrival_time - time.monotonic()))
        else:
            break
    per_request = []
    for rid, r in groups.items():
        metrics, produced = done_metrics.get(rid, (None, 0))
        m = (request_metrics(metrics.arrival_time, metrics.first_token_time,
                             metrics.finished_time, produced) if metrics and produced == r.output_len
             else request_metrics(0, None, None, 0))
        per_request.append({"prompt_len": r.prompt_len, "output_len": r.output_len,
                            "produced": produced, **m})
    finished = sum(p["normalized_latency"] is not None for p in per_request)
    return {
        "num_requests": len(trace), "finished_requests": finished,
        "finished_all": finished == len(trace),
        "wall_seconds": time.monotonic() - start,
        "trace_seconds": trace[-1].arrival_time,
        "mean_normalized_latency": _mean(p["normalized_latency"] for p in per_request),
        "mean_ttft": _mean(p["ttft"] for p in per_request),
        "mean_tpot": _mean(p["tpot"] for p in per_request),
        "steps": len(running_per_step),
        "mean_batched_requests": _mean([n for n in running_per_step if n > 0]) or 0.0,
        "max_batched_requests": max(running_per_step, default=0),
    }


# -- the benchmark ---------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, a handful of requests, 2 rates")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of "
                   + ",".join(POLICIES))
    p.add_argument("--dataset", choices=("sharegpt", "alpaca"), default="sharegpt")
    p.add_argument("--num-requests", type=int, help="requests per rate")
    p.add_argument("--start-rate", type=float, help="first request rate (req/s)")
    p.add_argument("--max-rates", type=int, help="rates to try while doubling")
    p.add_argument("--refine", type=int, help="bisections after the knee is bracketed")
    p.add_argument("--num-blocks", type=int, help="KV pool blocks (16 tokens each)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--bound", type=float, help="normalized-latency bound, seconds/token")
    p.add_argument("--bound-factor", type=float, default=3.0,
                   help="bound = this x the lowest latency at the start rate (without --bound)")
    p.add_argument("--max-seconds", type=float,
                   help="abort what is unfinished this long after the last arrival")
    p.add_argument("--model", choices=("quick", "cpu", "tiny"), help="model shape (bench.throughput.MODELS)")
    p.add_argument("--trace-max-len", type=int)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="assets")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    # No change to TRITON_INTERPRET here (it runs in-process, under pytest too):
    # attention_backend="auto" picks the torch path on a CPU whatever it says.
    from .. import __version__
    from ..engine import LLMEngine
    from .throughput import MODELS, build_model
    from .throughput import machine_description
    from .workloads import alpaca_like, random_prompt_ids, sharegpt_like

    setting = "quick" if args.quick else "cpu"
    cfg = dict(SETTINGS[setting])
    for key in ("model", "trace_max_len", "num_requests", "start_rate", "max_rates", "refine", "num_blocks",
                "max_model_len", "max_seconds"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"unknown policy {p!r}; choose from {POLICIES}")
    if args.threads:
        torch.set_num_threads(args.threads)
    make_trace = sharegpt_like if args.dataset == "sharegpt" else alpaca_like
    shape = MODELS[cfg["model"]]

    tmp = tempfile.TemporaryDirectory(prefix="minipaged-serving-")
    model_dir = build_model(Path(tmp.name) / "model", shape, "float32", "cpu", seed=args.seed)

    def trace_at(rate: float):
        trace = make_trace(cfg["num_requests"], rate=rate, seed=args.seed,
                           max_len=cfg["trace_max_len"])
        return trace, random_prompt_ids(trace, shape["vocab_size"], args.seed)

    engines = {}

    def engine_for(policy: str):
        if policy not in engines:
            t0 = time.perf_counter()
            engine = LLMEngine(str(model_dir), dtype="float32", device="cpu",
                               kv_policy=policy, enable_prefix_caching=False,
                               num_gpu_blocks_override=cfg["num_blocks"], block_size=BLOCK_SIZE,
                               max_model_len=cfg["max_model_len"], max_num_seqs=256,
                               attention_backend="auto", swap_space=0.25, seed=args.seed)
            warm_trace, warm_prompts = trace_at(math.inf)
            serve_trace(engine, warm_trace[:2], warm_prompts[:2], "warmup", 60.0)
            engines[policy] = (engine, time.perf_counter() - t0)
        return engines[policy][0]

    results: dict[str, dict] = {p: {"runs": {}} for p in policies}

    def measure(policy: str, rate: float) -> tuple[float, bool]:
        key = f"{rate:g}"
        if key not in results[policy]["runs"]:
            trace, prompts = trace_at(rate)
            run = serve_trace(engine_for(policy), trace, prompts, f"r{key}", cfg["max_seconds"])
            run["rate"] = rate
            results[policy]["runs"][key] = run
            print(f"  {policy:6s} rate {rate:7.3f} req/s: normalized latency "
                  f"{_fmt(run['mean_normalized_latency'])} s/token, batched "
                  f"{run['mean_batched_requests']:.1f}, finished {run['finished_requests']}/"
                  f"{run['num_requests']}, {run['wall_seconds']:.1f} s", flush=True)
        run = results[policy]["runs"][key]
        lat = run["mean_normalized_latency"]
        return (lat if lat is not None else math.inf), run["finished_all"]

    t_start = time.perf_counter()
    # The bound, from a light load: every policy's latency at the start rate.
    for p in policies:
        measure(p, cfg["start_rate"])
    base = min(results[p]["runs"][f"{cfg['start_rate']:g}"]["mean_normalized_latency"] or math.inf
               for p in policies)
    bound = args.bound if args.bound is not None else args.bound_factor * base
    print(f"bound: {bound:.4f} s/token", flush=True)
    for p in policies:
        sustained, tried = search_knee(lambda r, p=p: measure(p, r), cfg["start_rate"], bound,
                                       cfg["max_rates"], cfg["refine"])
        results[p]["sustained_rate"] = sustained
        results[p]["rates_tried"] = tried

    # Figure 13: batched requests at one common rate, the highest any policy ran at
    # (a load where the reserving policies are memory-bound); policies that
    # stopped below it are measured there too.
    common = max(max(results[p]["runs"][f"{r:g}"]["rate"] for r in results[p]["rates_tried"])
                 for p in policies)
    for p in policies:
        measure(p, common)
    for p in policies:
        engine, setup_seconds = engines[p]
        results[p]["engine_setup_seconds"] = setup_seconds
        results[p]["engine"] = {"kv_blocks": engine.stats.total_blocks,
                                "preemptions": engine.stats.num_preemptions,
                                "steps": engine.stats.num_steps,
                                "attention_backend_resolved": engine.attention_backend}
    batched = {p: results[p]["runs"][f"{common:g}"]["mean_batched_requests"] for p in policies}
    ratios = {}
    if "paged" in batched:
        for other in ("oracle", "pow2", "max"):
            if other in batched and batched[other]:
                ratios[f"paged/{other}"] = batched["paged"] / batched[other]

    env = machine_description(torch.device("cpu"))
    env["minipaged"] = __version__
    env["torch_threads"] = torch.get_num_threads()
    env["cpu_count"] = os.cpu_count()
    record = {
        "benchmark": "serving", "environment": env, "setting": setting,
        "model": {"shape": shape, "dtype": "float32"},
        "workload": {"dataset": args.dataset, "num_requests_per_rate": cfg["num_requests"],
                     "trace_max_len": cfg["trace_max_len"], "seed": args.seed,
                     "arrivals": "Poisson", "max_tokens": "trace output length, ignore_eos"},
        "engine_config": {"max_model_len": cfg["max_model_len"], "num_blocks": cfg["num_blocks"],
                          "block_size": BLOCK_SIZE, "kv_tokens": cfg["num_blocks"] * BLOCK_SIZE,
                          "max_num_seqs": 256, "attention_backend": "auto",
                          "enable_prefix_caching": False},
        "search": {"start_rate": cfg["start_rate"], "max_rates": cfg["max_rates"],
                   "refine": cfg["refine"], "max_seconds_after_last_arrival": cfg["max_seconds"],
                   "bound_seconds_per_token": bound,
                   "bound_rule": (f"--bound {args.bound}" if args.bound is not None else
                                  f"{args.bound_factor} x the lowest mean normalized latency "
                                  f"at {cfg['start_rate']:g} req/s ({base:.4f} s/token)")},
        "policies": results,
        "common_rate": common, "batched_at_common_rate": batched, "batched_ratios": ratios,
        "paper_batched_ratios": {f"paged/{k}": v for k, v in PAPER_RATIOS.items()},
        "total_seconds": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving_cpu.json").write_text(json.dumps(record, indent=1))
    plot(record, out / "serving_cpu.png")
    tmp.cleanup()
    print_table(record)
    return record


def _fmt(x, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    policies = list(record["policies"])
    for p in policies:
        runs = sorted(record["policies"][p]["runs"].values(), key=lambda r: r["rate"])
        xs = [r["rate"] for r in runs if r["mean_normalized_latency"] is not None]
        ys = [r["mean_normalized_latency"] for r in runs if r["mean_normalized_latency"] is not None]
        left.plot(xs, ys, marker="o", label=p)
    left.axhline(record["search"]["bound_seconds_per_token"], color="grey", ls="--", lw=1,
                 label="bound")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("mean normalized latency (s/token)")
    left.set_title(f"{record['workload']['dataset']}-like, {record['environment']['device']}",
                   fontsize=9)
    left.legend(fontsize=8)
    batched = record["batched_at_common_rate"]
    right.bar(list(batched), list(batched.values()), color="C0")
    for i, v in enumerate(batched.values()):
        right.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ratios = ", ".join(f"{k} {v:.1f}x" for k, v in record["batched_ratios"].items())
    right.set_title(f"mean batched requests at {record['common_rate']:g} req/s\n"
                    f"measured: {ratios or '-'}\npaper (fig. 13): paged 2.2x Oracle, 4.3x Max",
                    fontsize=9)
    right.set_ylabel("running requests per step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(record: dict) -> None:
    print(f"\n{record['environment']['device']}, {record['environment']['torch_threads']} "
          f"threads; {record['workload']['dataset']}-like, "
          f"{record['workload']['num_requests_per_rate']} requests per rate; KV pool "
          f"{record['engine_config']['kv_tokens']} tokens; bound "
          f"{record['search']['bound_seconds_per_token']:.4f} s/token")
    print(f"{'policy':8s} {'sustained req/s':>16s} {'batched@' + format(record['common_rate'], 'g'):>12s}"
          f" {'rates tried':>s}")
    for p, r in record["policies"].items():
        print(f"{p:8s} {_fmt(r['sustained_rate'], '.3g'):>16s} "
              f"{record['batched_at_common_rate'][p]:12.2f} "
              f"{', '.join(format(x, 'g') for x in r['rates_tried'])}")
    for k, v in record["batched_ratios"].items():
        paper = record["paper_batched_ratios"].get(k)
        print(f"batched {k}: {v:.2f}x" + (f" (paper {paper}x)" if paper else ""))


if __name__ == "__main__":
    main()
