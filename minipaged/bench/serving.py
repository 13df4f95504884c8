"""Serving: normalized latency vs request rate per KV policy (the paper's figures 12 and 13).

    python -m minipaged.bench.serving                          # ShareGPT-like, 4 policies, CPU
    python -m minipaged.bench.serving --dataset alpaca
    python -m minipaged.bench.serving --policies paged,max --num-requests 40
    python -m minipaged.bench.serving --quick                  # a tiny run, to check it works

For each KV policy (``paged``, the engine with ``admission_headroom=True``;
``paged-no-headroom``, the engine's default admission, vLLM's; ``oracle``,
``pow2`` and ``max``, the paper's Orca baselines, see
``ReservingBlockSpaceManager``) one ``LLMEngine`` serves Poisson traces in
real time (``serve_trace``): greedy, EOS ignored, ``max_tokens`` the trace's
output length (the policies' "true output"), prefix caching off (the paper
has none). Per policy ``search_knee`` finds the highest request rate whose
mean normalized latency (end-to-end latency / output tokens, the paper's
metric) stays under the bound with every request finished within
``--max-seconds`` of the trace's end. The bound: ``--bound-factor`` (default
3) times the lowest mean normalized latency at ``--start-rate`` over all
policies (a light load, where no policy queues), unless ``--bound`` gives
seconds/token.

The model is a tiny random-weight LLaMA (``harness.MODELS["tiny"]``: 2
layers, hidden 64, fp32) and the KV pool is small (``--num-blocks`` blocks of
16 tokens, 1536 tokens by default), so memory limits the batch to a handful
of ShareGPT-like requests. Both keep a step's time nearly flat in the batch,
as a GPU's is for the paper's models (on a CPU a bigger model's step grows
with every sequence added, and so does this one's past a dozen sequences);
the record's ``decode_step_ms_by_batch`` shows it. ``max_model_len`` is 512,
the traces' cap, and what ``max`` reserves. Writes ``serving_cpu.json`` and
``.png`` (``serving_alpaca_cpu.*`` for ``--dataset alpaca``; left: latency
against rate, figure 12; right: mean batched requests at the highest rate
any policy ran at, figure 13) to ``--out`` (default ``assets/``) and prints a
table last. ``scripts/reproduce.py`` runs it for both workloads;
``scripts/sweeps.py`` and ``scripts/serving_classes.py`` serve their own
workloads through ``serve_trace`` and ``ServingBench``.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .harness import (
    MODELS,
    arguments,
    build_model,
    environment,
    parse,
    plain_log_axes,
    pyplot,
    save_figure,
    save_record,
)

# "paged" is the engine with admission_headroom on (a free block kept per
# running sequence when admitting); "paged-no-headroom" is its default
# admission, vLLM's (a 1 % watermark), which preempts far more at the knee.
POLICIES = ("paged", "paged-no-headroom", "oracle", "pow2", "max")
PAPER_RATIOS = {"oracle": 2.2, "max": 4.3}  # figure 13: paged batches 2.2x Oracle, 4.3x Max

# Per setting: model shape key, requests per rate, trace cap (prompt + output),
# max_model_len, KV blocks (16 tokens each), start rate (req/s), max rates, refine steps.
SETTINGS = {
    "cpu": dict(model="tiny", num_requests=200, trace_max_len=512, max_model_len=512,
                num_blocks=96, start_rate=24.0, max_rates=6, refine=3, max_seconds=30.0,
                seeds=[0]),
    "quick": dict(model="quick", num_requests=8, trace_max_len=64, max_model_len=128,
                  num_blocks=24, start_rate=32.0, max_rates=2, refine=0, max_seconds=10.0),
}
# Alpaca-like requests are short (mean 19 + 58 tokens): a run needs more of
# them to reach a steady state, and the knee sits at a higher rate.
DATASET_SETTINGS = {("cpu", "alpaca"): dict(num_requests=600, start_rate=64.0)}
BLOCK_SIZE = 16


# -- pure helpers ----------------------------------------------------------------

def search_knee(measure: Callable[[float], tuple[float, bool]], start_rate: float,
                bound: float | Callable[[], float], max_rates: int = 6,
                refine: int = 1) -> tuple[float | None, list[float]]:
    """Highest request rate whose latency stays under ``bound``.

    ``measure(rate)`` returns (mean normalized latency, finished every request).
    From ``start_rate`` the rate doubles while it passes (latency < bound and
    every request finished), or halves while it fails, until the knee is
    bracketed or ``max_rates`` rates were tried; then ``refine`` bisections
    between the highest passing and the lowest failing rate. ``bound`` may be
    a callable, read after the first measurement (so it can depend on it).
    Returns (the highest passing rate, or None if none passed; every rate
    measured, in order).
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
            if bad is not None:
                break
        else:
            bad, rate = rate, rate / 2
            if best is not None:
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
    """TTFT, time per output token (after the first), end-to-end latency and
    normalized latency (end-to-end / output tokens), in seconds."""
    if finished is None or first_token is None or output_tokens < 1:
        return {"ttft": None, "tpot": None, "latency": None, "normalized_latency": None}
    return {"ttft": first_token - arrival,
            "tpot": (finished - first_token) / (output_tokens - 1) if output_tokens > 1 else 0.0,
            "latency": finished - arrival,
            "normalized_latency": (finished - arrival) / output_tokens}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


# -- one trace through one engine in real time ------------------------------------

def greedy_params(request):
    """The paper's requests: greedy, EOS ignored, exactly the trace's output length."""
    from ..sampling_params import RequestOutputKind, SamplingParams
    return SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def serve_trace(engine, trace, prompts: list[list[int]], tag: str, max_seconds: float,
                params_for: Callable = greedy_params, priority_for: Callable | None = None,
                keep_requests: bool = False) -> dict:
    """Feed ``trace`` to ``engine`` as its requests arrive; per-request and per-step records.

    ``params_for(request)`` gives each request's ``SamplingParams`` (its
    ``max_tokens`` must be the trace's output length; ``FINAL_ONLY`` outputs
    keep the loop from building a cumulative output per request per step,
    while the engine still stamps each request's first-token time). Requests
    still unfinished ``max_seconds`` after the last arrival are aborted.
    ``priority_for(request)``, if given, is each request's ``priority`` (for
    an engine with ``scheduling_policy="priority"``). ``keep_requests`` adds
    every request's own record (``requests``), which per-class latency needs.
    """
    start = time.monotonic()
    deadline = start + trace[-1].arrival_time + max_seconds
    preemptions_before = engine.stats.num_preemptions
    pending = 0
    groups = {}
    running_per_step: list[int] = []
    done_metrics = {}
    while True:
        now = time.monotonic()
        while pending < len(trace) and start + trace[pending].arrival_time <= now:
            r = trace[pending]
            rid = f"{tag}-{r.request_id}"
            extra = {} if priority_for is None else {"priority": priority_for(r)}
            engine.add_request(rid, None, params_for(r), prompt_token_ids=prompts[pending],
                               arrival_time=start + r.arrival_time, **extra)
            groups[rid] = r
            pending += 1
        if engine.has_unfinished_requests():
            if now > deadline:
                for rid in list(engine.requests):
                    engine.abort_request(rid)
                break
            for out in engine.step():
                if out.finished:
                    done_metrics[out.request_id] = (out.metrics,
                                                    min(len(o.token_ids) for o in out.outputs))
            running_per_step.append(len(engine.scheduler.running))
        elif pending < len(trace):
            time.sleep(max(0.0, start + trace[pending].arrival_time - time.monotonic()))
        else:
            break
    per_request = []
    for rid, r in groups.items():
        metrics, produced = done_metrics.get(rid, (None, 0))
        m = (request_metrics(metrics.arrival_time, metrics.first_token_time,
                             metrics.finished_time, produced)
             if metrics and produced == r.output_len
             else request_metrics(0, None, None, 0))
        per_request.append({"request_id": r.request_id, "prompt_len": r.prompt_len,
                            "output_len": r.output_len, "produced": produced, **m})
    finished = sum(p["normalized_latency"] is not None for p in per_request)
    kept = {"requests": per_request} if keep_requests else {}
    return {**kept,
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
        "preemptions": engine.stats.num_preemptions - preemptions_before,
    }


class ServingBench:
    """One small random-weight model on disk and the engines that serve it.

    Every engine gets the same KV pool in tokens (``kv_tokens``), whatever its
    block size, policy or preemption mode, so the runs differ only in how
    that memory is managed. Engines are built on first use and kept (the
    model is tiny); each is warmed up with two requests before it is timed.
    """

    def __init__(self, setting: dict, seed: int = 0):
        self.cfg = setting
        self.seed = seed
        self.shape = MODELS[setting["model"]]
        self._tmp = tempfile.TemporaryDirectory(prefix="minipaged-serving-")
        self.model_dir = build_model(Path(self._tmp.name) / "model", self.shape, "float32", "cpu",
                                     seed=seed)
        self.engines: dict[tuple, object] = {}
        self.setup_seconds: dict[tuple, float] = {}

    @property
    def kv_tokens(self) -> int:
        return self.cfg["num_blocks"] * BLOCK_SIZE

    def trace(self, dataset: str, rate: float, num_requests: int | None = None,
              seed: int | None = None):
        """A seeded trace (lengths, arrivals) and its prompts' token ids."""
        from .workloads import alpaca_like, random_prompt_ids, sharegpt_like

        make = {"sharegpt": sharegpt_like, "alpaca": alpaca_like}[dataset]
        seed = self.seed if seed is None else seed
        trace = make(num_requests or self.cfg["num_requests"], rate=rate, seed=seed,
                     max_len=self.cfg["trace_max_len"])
        return trace, random_prompt_ids(trace, self.shape["vocab_size"], seed)

    def engine(self, policy: str = "paged", block_size: int = BLOCK_SIZE,
               preemption_mode: str | None = None, **options):
        """The engine for a KV policy, built once; ``options`` are further
        ``LLMEngine`` options (``scheduling_policy``, ``max_num_batched_tokens``)
        and each distinct set gets its own engine."""
        from ..engine import LLMEngine

        preemption_mode = preemption_mode or self.cfg.get("preemption_mode", "recompute")
        key = (policy, block_size, preemption_mode, *sorted(options.items()))
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if key not in self.engines:
            t0 = time.perf_counter()
            engine = LLMEngine(str(self.model_dir), dtype="float32", device="cpu",
                               kv_policy="paged" if policy.startswith("paged") else policy,
                               admission_headroom=policy == "paged", enable_prefix_caching=False,
                               num_gpu_blocks_override=self.kv_tokens // block_size,
                               block_size=block_size, max_model_len=self.cfg["max_model_len"],
                               max_num_seqs=256, attention_backend="auto", swap_space=0.25,
                               preemption_mode=preemption_mode, seed=self.seed, **options)
            warm_trace, warm_prompts = self.trace("sharegpt", math.inf, 2)
            serve_trace(engine, warm_trace, warm_prompts, "warmup", 60.0)
            self.engines[key] = engine
            self.setup_seconds[key] = time.perf_counter() - t0
        return self.engines[key]

    def run(self, rate: float, policy: str = "paged", dataset: str = "sharegpt",
            params_for: Callable = greedy_params, tag: str = "r", seed: int | None = None,
            **engine_options) -> dict:
        """Serve one Poisson trace at ``rate`` req/s (``seed``: which trace,
        default the bench's); the run's record."""
        engine = self.engine(policy, **engine_options)
        trace, prompts = self.trace(dataset, rate, seed=seed)
        run = serve_trace(engine, trace, prompts, f"{tag}{rate:g}", self.cfg["max_seconds"],
                          params_for)
        run["rate"] = rate
        return run

    def close(self) -> None:
        self.engines.clear()
        self._tmp.cleanup()


def mean_of_runs(runs: list[dict]) -> dict:
    """One record for the same rate served with several traces: the means of
    their figures (None where a trace has none: no request finished), with
    each trace's record under ``"traces"`` when there are several."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for key in ("mean_normalized_latency", "mean_ttft", "mean_tpot"):
        values = [r[key] for r in runs]
        out[key] = None if None in values else float(np.mean(values))
    for key in ("mean_batched_requests", "preemptions", "wall_seconds", "steps"):
        out[key] = float(np.mean([r[key] for r in runs]))
    for key in ("num_requests", "finished_requests"):
        out[key] = sum(r[key] for r in runs)
    out["max_batched_requests"] = max(r["max_batched_requests"] for r in runs)
    out["finished_all"] = all(r["finished_all"] for r in runs)
    out["traces"] = runs
    return out


def step_time_by_batch(bench: ServingBench, batches=(1, 2, 4, 8, 16, 32),
                       prompt_len: int = 200, steps: int = 30) -> dict[str, float]:
    """Milliseconds per decode step of the bench's model at each batch size.

    Why paging's bigger batches pay off only partly on a CPU: ``batch``
    requests with ``prompt_len``-token prompts are prefilled, then ``steps``
    decode steps are timed (a pool big enough that nothing is preempted).
    """
    from ..engine import LLMEngine
    from ..sampling_params import RequestOutputKind, SamplingParams

    rng = np.random.default_rng(bench.seed)
    prompt_len = min(prompt_len, bench.cfg["max_model_len"] - steps - 8)
    need = max(batches) * (prompt_len + steps + 8)
    engine = LLMEngine(str(bench.model_dir), dtype="float32", device="cpu",
                       enable_prefix_caching=False, num_gpu_blocks_override=need // BLOCK_SIZE + 8,
                       max_model_len=bench.cfg["max_model_len"], max_num_seqs=256,
                       attention_backend="auto", swap_space=0, seed=bench.seed)
    params = SamplingParams(max_tokens=steps + 6, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    out = {}
    for b in batches:
        for i in range(b):
            engine.add_request(f"{b}-{i}", None, params, prompt_token_ids=rng.integers(
                0, bench.shape["vocab_size"], prompt_len).tolist())
        for _ in range(3):  # the prefill and a couple of decode steps
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        out[str(b)] = (time.perf_counter() - t0) / steps * 1e3
        while engine.has_unfinished_requests():
            engine.step()
    return out


def print_run(label: str, run: dict) -> None:
    print(f"  {label:24s} rate {run['rate']:7.2f} req/s: normalized latency "
          f"{_fmt(run['mean_normalized_latency'])} s/token, batched "
          f"{run['mean_batched_requests']:.1f}, preempted {run['preemptions']}, finished "
          f"{run['finished_requests']}/{run['num_requests']}, {run['wall_seconds']:.1f} s",
          flush=True)


# -- the benchmark ---------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = arguments(__doc__, out_help="folder for the .json and .png", out="assets",
                  quick="tiny model, a handful of requests, 2 rates", seed=True, threads=True)
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
    p.add_argument("--model", choices=("quick", "cpu", "tiny"),
                   help="model shape (bench.harness.MODELS)")
    p.add_argument("--trace-max-len", type=int)
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute",
                   help="how paging preempts (the reserving policies never do)")
    return parse(p, argv)


def rate_sweep(bench: ServingBench, policies: list[str], dataset: str, bound: float | None,
               bound_factor: float, params_for: Callable = greedy_params,
               label: str = "") -> dict:
    """Figures 12 and 13 for one workload: each policy's knee, and batching at a common rate.

    The bound (unless given): ``bound_factor`` x the lowest mean normalized
    latency over the policies at the start rate. Each rate is served with
    one trace per seed in ``cfg["seeds"]`` (default: the bench's seed) and
    its figures are their means. Returns the record's ``policies``,
    ``search`` and figure-13 fields.
    """
    cfg = bench.cfg
    seeds = list(cfg.get("seeds", [bench.seed]))
    results: dict[str, dict] = {p: {"runs": {}} for p in policies}

    def measure(policy: str, rate: float) -> tuple[float, bool]:
        key = f"{rate:g}"
        if key not in results[policy]["runs"]:
            per_seed = []
            for seed in seeds:
                per_seed.append(bench.run(rate, policy, dataset, params_for, seed=seed))
                print_run(f"{label}{policy}" + (f" s{seed}" if len(seeds) > 1 else ""),
                          per_seed[-1])
            results[policy]["runs"][key] = mean_of_runs(per_seed)
        run = results[policy]["runs"][key]
        lat = run["mean_normalized_latency"]
        return (lat if lat is not None else math.inf), run["finished_all"]

    for p in policies:  # a light load, where no policy queues: the bound's reference
        measure(p, cfg["start_rate"])
    base = min(results[p]["runs"][f"{cfg['start_rate']:g}"]["mean_normalized_latency"] or math.inf
               for p in policies)
    limit = bound if bound is not None else bound_factor * base
    print(f"  {label}bound: {limit:.4f} s/token", flush=True)
    for p in policies:
        sustained, tried = search_knee(lambda r, p=p: measure(p, r), cfg["start_rate"], limit,
                                       cfg["max_rates"], cfg["refine"])
        results[p]["sustained_rate"] = sustained
        results[p]["rates_tried"] = tried
    # Figure 13: batched requests at one common rate, the highest any policy ran at
    # (a load where the reserving policies are memory-bound); policies that
    # stopped below it are measured there too.
    common = max(r for p in policies for r in results[p]["rates_tried"])
    for p in policies:
        measure(p, common)
    batched = {p: results[p]["runs"][f"{common:g}"]["mean_batched_requests"] for p in policies}
    ratios = {}
    if "paged" in batched:
        for other in ("paged-no-headroom", "oracle", "pow2", "max"):
            if other in batched and batched[other]:
                ratios[f"paged/{other}"] = batched["paged"] / batched[other]
    sustained_ratios = {}
    paged_rate = results.get("paged", {}).get("sustained_rate")
    for other in ("paged-no-headroom", "oracle", "pow2", "max"):
        if paged_rate and other in results and results[other]["sustained_rate"]:
            sustained_ratios[f"paged/{other}"] = paged_rate / results[other]["sustained_rate"]
    return {
        "policies": results,
        "search": {"start_rate": cfg["start_rate"], "max_rates": cfg["max_rates"],
                   "refine": cfg["refine"], "max_seconds_after_last_arrival": cfg["max_seconds"],
                   "bound_seconds_per_token": limit,
                   "bound_rule": (f"--bound {bound}" if bound is not None else
                                  f"{bound_factor} x the lowest mean normalized latency "
                                  f"at {cfg['start_rate']:g} req/s ({base:.4f} s/token)")},
        "common_rate": common, "batched_at_common_rate": batched, "batched_ratios": ratios,
        "sustained_ratios": sustained_ratios,
    }


def setting_from_args(args: argparse.Namespace) -> tuple[str, dict]:
    setting = "quick" if args.quick else "cpu"
    cfg = dict(SETTINGS[setting])
    cfg.update(DATASET_SETTINGS.get((setting, getattr(args, "dataset", "sharegpt")), {}))
    for key in ("model", "trace_max_len", "num_requests", "start_rate", "max_rates", "refine",
                "num_blocks", "max_model_len", "max_seconds", "preemption_mode"):
        if getattr(args, key, None) is not None:
            cfg[key] = getattr(args, key)
    seed = getattr(args, "seed", 0)
    cfg["seeds"] = [seed + i for i in range(len(cfg.get("seeds", [0])))]
    return setting, cfg


def workload_record(bench: ServingBench, dataset: str) -> dict:
    return {"dataset": dataset, "num_requests_per_rate": bench.cfg["num_requests"],
            "trace_max_len": bench.cfg["trace_max_len"],
            "seeds": list(bench.cfg.get("seeds", [bench.seed])),
            "arrivals": "Poisson", "max_tokens": "trace output length, ignore_eos"}


def engine_record(bench: ServingBench, **extra) -> dict:
    return {"max_model_len": bench.cfg["max_model_len"], "num_blocks": bench.cfg["num_blocks"],
            "block_size": BLOCK_SIZE, "kv_tokens": bench.kv_tokens, "max_num_seqs": 256,
            "attention_backend": "auto", "enable_prefix_caching": False,
            "admission_headroom": {"paged": True, "paged-no-headroom": False},
            "preemption_mode": bench.cfg.get("preemption_mode", "recompute"), **extra}


def main(argv=None) -> dict:
    args = parse_args(argv)
    # No change to TRITON_INTERPRET here (it runs in-process, under pytest too):
    # attention_backend="auto" picks the torch path on a CPU whatever it says.
    setting, cfg = setting_from_args(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"unknown policy {p!r}; choose from {POLICIES}")

    t_start = time.perf_counter()
    bench = ServingBench(cfg, args.seed)
    try:
        step_ms = step_time_by_batch(bench, (1, 2, 4) if setting == "quick" else
                                     (1, 2, 4, 8, 16, 32))
        print("  decode step, ms by batch: "
              + ", ".join(f"{b}: {ms:.2f}" for b, ms in step_ms.items()), flush=True)
        sweep = rate_sweep(bench, policies, args.dataset, args.bound, args.bound_factor)
        for p in policies:
            engine = bench.engine(p)
            sweep["policies"][p]["engine_setup_seconds"] = bench.setup_seconds[
                (p, BLOCK_SIZE, cfg.get("preemption_mode", "recompute"))]
            sweep["policies"][p]["engine"] = {
                "kv_blocks": engine.stats.total_blocks, "preemptions": engine.stats.num_preemptions,
                "steps": engine.stats.num_steps,
                "attention_backend_resolved": engine.attention_backend}
    finally:
        bench.close()
    record = {
        "benchmark": "serving", "environment": environment(), "setting": setting,
        "model": {"shape": bench.shape, "dtype": "float32"},
        "workload": workload_record(bench, args.dataset),
        "engine_config": engine_record(bench),
        "decode_step_ms_by_batch": step_ms,
        **sweep,
        "paper_batched_ratios": {f"paged/{k}": v for k, v in PAPER_RATIOS.items()},
        "total_seconds": time.perf_counter() - t_start,
    }
    name = f"serving_{args.dataset}_cpu" if args.dataset != "sharegpt" else "serving_cpu"
    save_record(record, Path(args.out) / f"{name}.json", plot)
    print_table(record)
    return record


def _fmt(x, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def plot(record: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    policies = list(record["policies"])
    for p in policies:
        runs = sorted(record["policies"][p]["runs"].values(), key=lambda r: r["rate"])
        xs = [r["rate"] for r in runs if r["mean_normalized_latency"] is not None]
        ys = [r["mean_normalized_latency"] for r in runs
              if r["mean_normalized_latency"] is not None]
        sustained = record["policies"][p].get("sustained_rate")
        left.plot(xs, ys, marker="o", label=f"{p} (sustains {_fmt(sustained, 'g')} req/s)")
    left.axhline(record["search"]["bound_seconds_per_token"], color="grey", ls="--", lw=1,
                 label="bound")
    plain_log_axes(left)
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("mean normalized latency (s/token)")
    left.set_title(f"{record['workload']['dataset']}-like, {record['environment']['device']}",
                   fontsize=9)
    left.legend(fontsize=8)
    batched = record["batched_at_common_rate"]
    labels = [p.replace("paged-no-headroom", "paged\n(no headroom)") for p in batched]
    right.bar(labels, list(batched.values()), color="C0")
    for i, v in enumerate(batched.values()):
        right.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ratios = ", ".join(f"{k.split('/')[1]} {v:.2f}x" for k, v in record["batched_ratios"].items()
                       if k != "paged/paged-no-headroom")
    right.set_title(f"mean batched requests at {record['common_rate']:g} req/s\n"
                    f"paged over: {ratios or '-'}\npaper (fig. 13): paged 2.2x Oracle, 4.3x Max",
                    fontsize=9)
    right.tick_params(axis="x", labelsize=8)
    right.set_ylabel("running requests per step")
    save_figure(fig, path)


def print_table(record: dict) -> None:
    print(f"\n{record['environment']['device']}, {record['environment']['torch_threads']} "
          f"threads; {record['workload']['dataset']}-like, "
          f"{record['workload']['num_requests_per_rate']} requests per rate; KV pool "
          f"{record['engine_config']['kv_tokens']} tokens; bound "
          f"{record['search']['bound_seconds_per_token']:.4f} s/token")
    print(f"{'policy':8s} {'sustained req/s':>16s} "
          f"{'batched@' + format(record['common_rate'], 'g'):>12s}"
          f" {'rates tried':>s}")
    for p, r in record["policies"].items():
        print(f"{p:8s} {_fmt(r['sustained_rate'], '.3g'):>16s} "
              f"{record['batched_at_common_rate'][p]:12.2f} "
              f"{', '.join(format(x, 'g') for x in r['rates_tried'])}")
    for k, v in record["batched_ratios"].items():
        paper = record["paper_batched_ratios"].get(k)
        print(f"batched {k}: {v:.2f}x" + (f" (paper {paper}x)" if paper else ""))
    for k, v in record.get("sustained_ratios", {}).items():
        print(f"sustained rate {k}: {v:.2f}x")


if __name__ == "__main__":
    main()
