"""Decodes first: short chats' time per output token beside long chunked prompts.

    python scripts/decodes_first.py --out run.json        # one run, one engine
    python scripts/decodes_first.py --rate 1000 --backdate 1.0 --out run.json
    python scripts/decodes_first.py --summarize before=a.json,b.json after=c.json,d.json

Why: a prompt longer than the token budget (``max_num_batched_tokens``) is
prefilled in chunks over several steps. If the scheduler hands the budget to
running groups oldest first, a long prompt that arrived before some chats
takes the whole budget for each of its chunks, and the chats that are
decoding get no token that step: their time per output token (TPOT) jumps.
Serving decodes first and giving prompt chunks what is left (issue 26, as
vLLM's chunked prefill does) removes those stalls.

One run serves a seeded Poisson trace mixing long prompts (longer than the
budget) with short chats, in real time, through a tiny random-weight LLaMA on
the CPU, with a KV pool large enough that nobody is preempted (so only the
order within a step differs). It records, for the chats: TPOT per request
(mean and 99th percentile), the gaps between consecutive tokens (inter-token
latency, 99th percentile and max) and TTFT; for the long prompts, TTFT.

The engine is driven only through APIs that predate the change (``LLMEngine``,
``SamplingParams``, ``add_request``, ``step``), so the same file measures an
older checkout: copy it out of the tree and run it with that checkout first
on ``PYTHONPATH`` (the model and the CPU description come from
``minipaged.bench.harness``: copy this commit's ``harness.py`` beside it when
the older checkout has none). ``--summarize`` then gathers the runs of each label into
one record (``assets/decodes_first_cpu.json`` and a plot beside it), keeping
every run's numbers, because a shared CPU's speed drifts between runs.

What the committed record shows: under FCFS, with each request stamped when
it is added, the old scheduler stalled no decode either (a prompt mid-prefill
is then always the youngest running request, so it came after the decodes
anyway); it did when a long prompt ranked before chats already decoding,
which ``--backdate`` arranges (``--rate 1000``: every request at once). The
stall count is in engine steps, so it holds however slow the machine was;
the seconds on a shared 2-core VM vary more between runs than between
commits.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

try:  # an older checkout, measured with this file, may not have the harness
    from minipaged.bench.harness import (
        MODELS,
        arguments,
        build_model,
        cpu_description,
        git_describe,
        pyplot,
        save_figure,
    )
except ImportError:  # ... then it sits beside this file
    from harness import (
        MODELS,
        arguments,
        build_model,
        cpu_description,
        git_describe,
        pyplot,
        save_figure,
    )

DEFAULTS = dict(num_requests=60, rate=3.0, long_fraction=0.25, long_prompt=(640, 1024),
                long_output=(8, 16), chat_prompt=(16, 64), chat_output=(32, 64),
                max_num_batched_tokens=256, max_model_len=1280, warmup_requests=4, backdate=0.0)


def make_trace(num_requests: int, rate: float, long_fraction: float, long_prompt, long_output,
               chat_prompt, chat_output, seed: int) -> list[dict]:
    """Seeded requests: Poisson arrivals, each a long prompt with probability
    ``long_fraction``, else a chat; lengths uniform in the given (low, high)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    trace = []
    for i, t in enumerate(arrivals):
        kind = "long" if rng.random() < long_fraction else "chat"
        prompt, output = (long_prompt, long_output) if kind == "long" else (chat_prompt,
                                                                            chat_output)
        trace.append({"id": f"{kind}-{i}", "kind": kind, "arrival": float(t),
                      "prompt_len": int(rng.integers(prompt[0], prompt[1] + 1)),
                      "output_len": int(rng.integers(output[0], output[1] + 1))})
    return trace


def serve(engine, trace: list[dict], vocab_size: int, seed: int, backdate: float = 0.0
          ) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Add each request when its arrival time has passed and step the engine;
    per request id, the wall-clock times of its tokens (seconds since its
    arrival) and the engine steps that produced them.

    Tokens are timed when a step returns them (cumulative outputs: a request's
    token count grows by one per decode step). The step numbers do not depend
    on the machine's speed the way seconds do: a gap of more than one step
    between two tokens is a step that left the request out.

    ``backdate``: each long prompt's ``arrival_time`` is stamped that many
    seconds before it is added, as by a frontend that stamps a request when
    it comes in and hands it over after tokenizing it. Only then can a long
    prompt mid-prefill rank before chats that are already decoding under
    FCFS; the old scheduler let it take the whole budget first."""
    from minipaged.sampling_params import SamplingParams

    rng = np.random.default_rng(seed + 1)
    prompts = [rng.integers(0, vocab_size, r["prompt_len"]).tolist() for r in trace]
    times: dict[str, list[float]] = {r["id"]: [] for r in trace}
    steps: dict[str, list[int]] = {r["id"]: [] for r in trace}
    start, pending, step = time.monotonic(), 0, 0
    while True:
        now = time.monotonic()
        while pending < len(trace) and start + trace[pending]["arrival"] <= now:
            r = trace[pending]
            params = SamplingParams(max_tokens=r["output_len"], ignore_eos=True, temperature=0.0)
            early = backdate if r["kind"] == "long" else 0.0
            engine.add_request(r["id"], None, params, prompt_token_ids=prompts[pending],
                               arrival_time=start + r["arrival"] - early)
            pending += 1
        if engine.has_unfinished_requests():
            outputs = engine.step()
            stamp, step = time.monotonic(), step + 1
            for out in outputs:
                new = len(out.outputs[0].token_ids) - len(times[out.request_id])
                times[out.request_id].extend([stamp] * new)
                steps[out.request_id].extend([step] * new)
        elif pending < len(trace):
            time.sleep(max(0.0, start + trace[pending]["arrival"] - time.monotonic()))
        else:
            return ({r["id"]: [t - start - r["arrival"] for t in times[r["id"]]] for r in trace},
                    steps)


def _pct(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _mean(values) -> float | None:
    return float(np.mean(values)) if len(values) else None


def class_stats(trace: list[dict], token_times: dict[str, list[float]],
                token_steps: dict[str, list[int]], kind: str) -> dict:
    """TTFT, per-request TPOT and inter-token gaps (seconds) for one kind of
    request, and the steps that skipped a request mid-decode (``stalled_steps``:
    each gap of k > 1 steps between two of its tokens counts k - 1)."""
    rows = [(r, token_times[r["id"]]) for r in trace if r["kind"] == kind]
    done = [(r, t) for r, t in rows if len(t) == r["output_len"]]
    step_gaps = [b - a for r, _ in done for a, b in zip(token_steps[r["id"]],
                                                         token_steps[r["id"]][1:])]
    ttft = [t[0] for _, t in done]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for _, t in done if len(t) > 1]
    gaps = [b - a for _, t in done for a, b in zip(t, t[1:])]
    return {"requests": len(rows), "finished": len(done),
            "mean_ttft": _mean(ttft), "p99_ttft": _pct(ttft, 99),
            "mean_tpot": _mean(tpot), "p99_tpot": _pct(tpot, 99),
            "p99_inter_token": _pct(gaps, 99), "max_inter_token": max(gaps, default=None),
            "mean_e2e": _mean([t[-1] for _, t in done]),
            "decode_steps": sum(step_gaps), "stalled_steps": sum(g - 1 for g in step_gaps)}


def run_once(cfg: dict, seed: int) -> dict:
    """Build the model and one engine, warm it up, serve the trace; the run's record."""
    import torch

    import minipaged
    from minipaged.engine import LLMEngine

    shape = MODELS["tiny"]
    trace_args = {k: cfg[k] for k in ("long_fraction", "long_prompt", "long_output",
                                      "chat_prompt", "chat_output")}
    trace = make_trace(cfg["num_requests"], cfg["rate"], seed=seed, **trace_args)
    most = max(r["prompt_len"] + r["output_len"] for r in trace)
    with tempfile.TemporaryDirectory(prefix="minipaged-decodes-first-") as tmp:
        model_dir = build_model(Path(tmp) / "model", shape, "float32", "cpu", seed=seed)
        # A pool for every request at once: no preemption, only the step's order differs.
        blocks = sum(math.ceil((r["prompt_len"] + r["output_len"]) / 16) + 1 for r in trace)
        engine = LLMEngine(str(model_dir), dtype="float32", device="cpu",
                           enable_prefix_caching=False, num_gpu_blocks_override=blocks,
                           max_model_len=max(cfg["max_model_len"], most),
                           max_num_batched_tokens=cfg["max_num_batched_tokens"],
                           attention_backend="auto", swap_space=0, seed=seed)
        warm = make_trace(cfg["warmup_requests"], math.inf, seed=seed + 1000, **trace_args)
        serve(engine, warm, shape["vocab_size"], seed + 1000)
        t0 = time.perf_counter()
        token_times, token_steps = serve(engine, trace, shape["vocab_size"], seed,
                                         cfg["backdate"])
        wall = time.perf_counter() - t0
        steps = engine.stats.num_steps
    package = Path(minipaged.__file__).resolve().parent
    return {"minipaged_path": str(package), "commit": git_describe(package),
            "seed": seed, "wall_seconds": wall, "engine_steps_total": steps,
            "torch_threads": torch.get_num_threads(), "cpu": cpu_description(),
            "load_average_after": os.getloadavg(),
            "chat": class_stats(trace, token_times, token_steps, "chat"),
            "long": class_stats(trace, token_times, token_steps, "long")}


# -- gathering runs ------------------------------------------------------------------

METRICS = ("mean_tpot", "p99_tpot", "p99_inter_token", "mean_ttft")
STEP_METRICS = ("stalled_steps", "decode_steps")


def summarize(labelled: dict[str, list[Path]]) -> dict:
    """Every run's record under its label (in the order given), and per label the
    median of each chat metric over its runs."""
    runs = {label: [json.loads(Path(p).read_text()) for p in paths]
            for label, paths in labelled.items()}
    medians = {label: {m: float(np.median([r["chat"][m] for r in rs]))
                       for m in METRICS + STEP_METRICS}
               for label, rs in runs.items()}
    first = next(iter(runs.values()))[0]
    return {"benchmark": "decodes_first", "cpu": first["cpu"],
            "torch_threads": first["torch_threads"], "cpu_count": os.cpu_count(),
            "commits": {label: sorted({r["commit"] or "-" for r in rs})
                        for label, rs in runs.items()},
            "trace_by_label": {label: rs[0]["trace"] for label, rs in runs.items()},
            "setup": {"arrivals": "Poisson", "sampling": "greedy, ignore_eos",
                      "scheduling_policy": "fcfs (the default; the only one before)",
                      "model": "bench.throughput.MODELS['tiny'] (random weights, fp32)",
                      "kv_pool": "room for every request at once (no preemption)"},
            "median_chat": medians, "runs": runs}


def plot(record: dict, path: Path) -> None:
    """Per label, every run's chat p99 TPOT (left) and stalled steps (right):
    dots, not bars, so the spread between runs on a drifting CPU shows."""
    plt = pyplot(path)
    if plt is None:
        return
    labels = list(record["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(17, 5.4))
    panels = (("p99_tpot", 1e3, "chats' p99 time per output token (ms)"),
              ("stalled_steps", 1, "steps that skipped a decoding chat"))
    for ax, (key, scale, title) in zip(axes, panels):
        for i, label in enumerate(labels):
            ys = [r["chat"][key] * scale for r in record["runs"][label]]
            ax.scatter([i] * len(ys), ys, s=80, color=f"C{i % 2}", zorder=3)
            ax.hlines(np.median(ys), i - 0.25, i + 0.25, color="black", lw=2)
        ax.set_xticks(range(len(labels)), [lb.replace("_", "\n") for lb in labels],
                      fontsize=12)
        ax.set_title(title, fontsize=14)
        ax.tick_params(axis="y", labelsize=12)
        ax.set_ylim(bottom=0)
    before, after = (", ".join(sorted({c[:7] for label, cs in record["commits"].items()
                                        if label.startswith(side) for c in cs}))
                     for side in ("before", "after"))
    fig.suptitle(f"chats beside long chunked prompts, FCFS; before: {before}; after: {after}"
                 f" (line: median); {record['cpu']['model']}", fontsize=12)
    save_figure(fig, path, dpi=110)


def print_summary(record: dict) -> None:
    print(f"{record['cpu']['model']} ({', '.join(record['cpu']['isa'])}), "
          f"{record['torch_threads']} threads; chats' times in ms")
    print(f"{'label':8s} {'commit':8s} " + " ".join(f"{m:>16s}" for m in METRICS)
          + " stalled/decode steps")
    for label, runs in record["runs"].items():
        for r in runs:
            print(f"{label:8s} {(r['commit'] or '-')[:8]:8s} "
                  + " ".join(f"{r['chat'][m] * 1e3:16.2f}" for m in METRICS)
                  + f" {r['chat']['stalled_steps']}/{r['chat']['decode_steps']}")


def parse_args(argv=None):
    p = arguments(__doc__, out_help="write this run's record here (JSON)", seed=True)
    p.add_argument("--num-requests", type=int, default=DEFAULTS["num_requests"])
    p.add_argument("--rate", type=float, default=DEFAULTS["rate"])
    p.add_argument("--backdate", type=float, default=DEFAULTS["backdate"],
                   help="stamp long prompts' arrival_time this many seconds before adding them")
    p.add_argument("--summarize", nargs="+", metavar="LABEL=RUN.json,...",
                   help="gather runs into one record instead of running")
    p.add_argument("--record", default="assets/decodes_first_cpu.json",
                   help="where --summarize writes")
    p.add_argument("--note", action="append", default=[],
                   help="with --summarize: a remark stored in the record (repeatable)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = {**DEFAULTS, "num_requests": args.num_requests, "rate": args.rate,
           "backdate": args.backdate}
    if args.summarize:
        labelled = {}
        for item in args.summarize:
            label, _, paths = item.partition("=")
            labelled[label] = [Path(p) for p in paths.split(",")]
        record = {**summarize(labelled), "notes": args.note}
        Path(args.record).write_text(json.dumps(record, indent=1))
        plot(record, Path(args.record).with_suffix(".png"))
        print_summary(record)
        return record
    record = run_once(cfg, args.seed)
    record["trace"] = cfg
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    chat = record["chat"]
    print(f"{record['commit']} chats: TPOT mean {chat['mean_tpot'] * 1e3:.2f} ms, p99 "
          f"{chat['p99_tpot'] * 1e3:.2f} ms; inter-token p99 {chat['p99_inter_token'] * 1e3:.2f}"
          f" ms; stalled steps {chat['stalled_steps']}/{chat['decode_steps']}; finished "
          f"{chat['finished']}/{chat['requests']}; {record['wall_seconds']:.1f} s")
    return record


if __name__ == "__main__":
    main()
