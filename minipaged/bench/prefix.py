"""Prefix caching: prompt tokens not computed again, and what that saves in time.

    python -m minipaged.bench.prefix                  # the CPU run: under a minute on 2 idle cores
    python -m minipaged.bench.prefix --quick          # a tiny run, to check it works
    python -m minipaged.bench.prefix --out /tmp/pfx   # write the JSON and PNG elsewhere

Two workloads, each served by the same engine settings with
``enable_prefix_caching=False`` and with ``True``, each time by a fresh
``LLM`` (random-weight LLaMA from ``harness.build_model``, CPU shape, fp32,
``attention_backend="auto"``; prompts as token ids, greedy, EOS ignored, so
every request makes exactly its requested number of tokens):

* ``shared_prefix``: ``--requests`` requests (default 48) whose prompts are one
  shared ~300-token prefix (a system prompt) plus a question of their own
  (10..60 tokens), answered in 16..64 tokens. They are submitted in
  ``--waves`` waves (default 3), each one ``LLM.generate`` call, so later waves
  find the prefix cached. Requests admitted in the same step cannot hit each
  other: a block enters the cache once it has been computed, at the end of the
  step that computed it. Within a wave, only the requests that the step's token
  budget (2048) leaves for later steps hit the first ones' prefix.
* ``multi_turn``: ``--conversations`` conversations (default 8) of ``--turns``
  turns (default 4). Turn 1's prompt is a user message of 10..40 tokens; turn
  t+1's is turn t's prompt, its answer (the generated token ids: 16..64 of
  them) and a new user message of 10..40 tokens. Each turn of all
  conversations is one ``generate`` call, so turn t+1 can reuse every full block
  that turn t's prompt and answer filled, blocks filled by decode steps included
  (all but the answer's last token, whose K/V was never computed).

Per workload and mode: prompt tokens, prompt tokens computed (less those
whose K/V came from the cache, ``RequestOutput.num_cached_tokens``), the
engine's hit rate, the mean time to first token (from when ``generate``
queued the request), the wall time of the ``generate`` calls and output
tokens/s, counted over the timed calls after a short warm-up (prompts shorter
than a block: nothing cached). Each workload and mode runs ``--repeats``
times (default 3, off and on alternating), each by a fresh engine; the run of
median wall time counts, every run's is recorded. The greedy outputs with the
cache on must equal those with it off, token for token (the run fails after
writing its files otherwise).

Other processes can slow a run on a small shared machine many times over, so
before each engine the run waits up to ``--max-wait`` seconds (default 30, 0
with ``--quick``) for the CPUs to go idle, and records their CPU use during
the timed calls (``other_cores``; the table flags a busy run). Writes
``prefix_cpu.json`` and ``prefix_cpu.png`` (prompt tokens computed; mean TTFT
with output tokens/s, off against on) to ``--out`` (default ``assets/``) and
prints the table last.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from .harness import (
    BUSY_CORES,
    MODELS,
    RunClock,
    arguments,
    build_model,
    environment,
    model_description,
    num_params,
    parse,
    pyplot,
    save_figure,
    save_record,
    wait_for_quiet,
)

MODES = {"off": False, "on": True}
WORKLOADS = ("shared_prefix", "multi_turn")
SETTINGS = {
    "cpu": dict(requests=48, waves=3, prefix=300, question=(10, 60), output=(16, 64),
                conversations=8, turns=4, message=(10, 40), answer=(16, 64), kv_blocks=4096),
    "quick": dict(requests=6, waves=2, prefix=40, question=(4, 12), output=(4, 8),
                  conversations=2, turns=3, message=(10, 20), answer=(8, 16), kv_blocks=256),
}
WARMUP_PROMPTS, WARMUP_PROMPT_LEN, WARMUP_TOKENS = 2, 8, 4


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, size=int(n)).tolist()  # clear of BOS/EOS ids


def _between(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    return int(rng.integers(lo_hi[0], lo_hi[1] + 1))


def shared_prefix_calls(s: dict, vocab: int, seed: int) -> list[list[tuple[list[int], int]]]:
    """The waves: each a list of (prompt ids, output length)."""
    rng = np.random.default_rng(seed)
    prefix = _ids(rng, s["prefix"], vocab)
    requests = [(prefix + _ids(rng, _between(rng, s["question"]), vocab),
                 _between(rng, s["output"])) for _ in range(s["requests"])]
    size = -(-len(requests) // s["waves"])
    return [requests[i:i + size] for i in range(0, len(requests), size)]


def multi_turn_plan(s: dict, vocab: int, seed: int) -> dict:
    """Every conversation's user messages and answer lengths, per turn."""
    rng = np.random.default_rng(seed + 1)
    return {"messages": [[_ids(rng, _between(rng, s["message"]), vocab)
                          for _ in range(s["turns"])] for _ in range(s["conversations"])],
            "answer_lens": [[_between(rng, s["answer"]) for _ in range(s["turns"])]
                            for _ in range(s["conversations"])]}


def _serve(llm, requests: list[tuple[list[int], int]]) -> tuple[list, float]:
    from .. import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def _call_record(requests, outs, seconds: float) -> dict:
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return {"requests": len(outs),
            "prompt_tokens": sum(len(p) for p, _ in requests),
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "requested_tokens": sum(n for _, n in requests),
            "seconds": seconds, "ttft": ttft}


def run_workload(workload: str, model_dir: Path, caching: bool, s: dict, vocab: int,
                 seed: int, engine_args: dict) -> tuple[dict, list[list[int]]]:
    """Serve one workload with a fresh engine; returns its record and every
    request's output token ids, in order."""
    from .. import LLM

    llm = LLM(str(model_dir), enable_prefix_caching=caching, **engine_args)
    warm = np.random.default_rng(seed + 2)
    _serve(llm, [(_ids(warm, WARMUP_PROMPT_LEN, vocab), WARMUP_TOKENS)
                 for _ in range(WARMUP_PROMPTS)])
    before = llm.engine.stats
    calls, tokens = [], []
    # The clock records other processes' CPU use while this one served: a busy
    # machine slows a run.
    with RunClock() as clock:
        if workload == "shared_prefix":
            for requests in shared_prefix_calls(s, vocab, seed):
                outs, seconds = _serve(llm, requests)
                calls.append(_call_record(requests, outs, seconds))
                tokens += [list(o.outputs[0].token_ids) for o in outs]
        else:
            plan = multi_turn_plan(s, vocab, seed)
            history = [[] for _ in range(s["conversations"])]
            for t in range(s["turns"]):
                requests = [(history[c] + plan["messages"][c][t], plan["answer_lens"][c][t])
                            for c in range(s["conversations"])]
                outs, seconds = _serve(llm, requests)
                calls.append(_call_record(requests, outs, seconds))
                for c, o in enumerate(outs):
                    answer = list(o.outputs[0].token_ids)
                    history[c] = requests[c][0] + answer
                    tokens.append(answer)
    after = llm.engine.stats
    del llm

    ttft = [x for c in calls for x in c.pop("ttft")]
    prompt = sum(c["prompt_tokens"] for c in calls)
    cached = sum(c["cached_tokens"] for c in calls)
    out_tokens = sum(c["output_tokens"] for c in calls)
    seconds = sum(c["seconds"] for c in calls)
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    for c, ms in zip(calls, _chunks_mean_ms(ttft, [c["requests"] for c in calls])):
        c["mean_ttft_ms"] = ms
    record = {
        "enable_prefix_caching": caching,
        "requests": len(ttft), "generate_calls": len(calls),
        "prompt_tokens": prompt, "cached_prompt_tokens": cached,
        "computed_prompt_tokens": prompt - cached,
        "cached_share_of_prompt_tokens": cached / prompt if prompt else 0.0,
        "prefix_cache_queries": queries, "prefix_cache_hit_tokens": hits,
        "hit_rate": hits / queries if queries else 0.0,
        "output_tokens": out_tokens,
        "requested_tokens": sum(c["requested_tokens"] for c in calls),
        "wall_seconds": seconds,
        "output_tokens_per_s": out_tokens / seconds if seconds else 0.0,
        "mean_ttft_ms": 1e3 * statistics.fmean(ttft),
        "median_ttft_ms": 1e3 * statistics.median(ttft),
        "engine_steps": after.num_steps - before.num_steps,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "other_cores": clock.machine["other_cores"],
        "per_call": calls,
    }
    return record, tokens


def _chunks_mean_ms(values: list[float], sizes: list[int]) -> list[float]:
    out, i = [], 0
    for n in sizes:
        out.append(1e3 * statistics.fmean(values[i:i + n]))
        i += n
    return out


def _workload_description(workload: str, s: dict) -> str:
    if workload == "shared_prefix":
        return (f"{s['requests']} requests in {s['waves']} waves (one generate call each): a "
                f"shared {s['prefix']}-token prefix + a question of {s['question'][0]}.."
                f"{s['question'][1]} tokens; outputs {s['output'][0]}..{s['output'][1]} tokens")
    return (f"{s['conversations']} conversations x {s['turns']} turns (one generate call per "
            f"turn): prompt = previous prompt + its answer + a user message of "
            f"{s['message'][0]}..{s['message'][1]} tokens; answers {s['answer'][0]}.."
            f"{s['answer'][1]} tokens")


def format_table(record: dict) -> list[str]:
    lines = [f"{'workload':<14}{'cache':>6}{'prompt':>8}{'computed':>9}{'hit%':>7}"
             f"{'TTFT ms':>9}{'wall s':>8}{'out tok/s':>10}"]
    for w, modes in record["results"].items():
        for mode, r in modes.items():
            lines.append(f"{w:<14}{mode:>6}{r['prompt_tokens']:>8}"
                         f"{r['computed_prompt_tokens']:>9}{100 * r['hit_rate']:>7.1f}"
                         f"{r['mean_ttft_ms']:>9.1f}{r['wall_seconds']:>8.2f}"
                         f"{r['output_tokens_per_s']:>10.1f}"
                         + ("  (machine busy)" if (r.get("other_cores") or 0) > BUSY_CORES
                            else ""))
    for w, eq in record["outputs_equal"].items():
        lines.append(f"{w}: greedy outputs with the cache on {'==' if eq else '!='} off")
    return lines


def plot(record: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    workloads = list(record["results"])
    x = np.arange(len(workloads))
    width = 0.38
    colors = {"off": "tab:gray", "on": "tab:blue"}
    panels = (("computed_prompt_tokens", "prompt tokens computed", "{:.0f}"),
              ("mean_ttft_ms", "mean time to first token (ms)", "{:.0f}"))
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    for ax, (key, label, fmt) in zip(axes, panels):
        top = 1.0
        for k, mode in enumerate(MODES):
            values = [record["results"][w][mode][key] for w in workloads]
            bars = ax.bar(x + (k - 0.5) * width, values, width, color=colors[mode],
                          label=f"prefix caching {mode}")
            for w, bar, v in zip(workloads, bars, values):
                r = record["results"][w][mode]
                text = fmt.format(v)
                if mode == "on" and key == "computed_prompt_tokens":
                    text += f"\n(hit {100 * r['hit_rate']:.0f}%)"
                if key == "mean_ttft_ms":
                    text += f"\n{r['output_tokens_per_s']:.0f} tok/s"
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
            top = max(top, *values)
        ax.set_xticks(x, workloads)
        ax.set_ylabel(label)
        ax.set_ylim(0, top * 1.3)
        ax.legend(fontsize=8, loc="upper right")
    env = record["environment"]
    fig.suptitle(f"{record['model']['description']}\n{env['device']} · {env['date']} · "
                 f"minipaged {env['minipaged_git']} · torch {env['torch']}", fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> dict:
    parser = arguments(__doc__, out_help="folder for prefix_cpu.json/.png", out="assets",
                       quick="tiny model and workloads: checks that it works", seed=True,
                       threads=True)
    parser.add_argument("--requests", type=int, default=None, help="shared_prefix requests")
    parser.add_argument("--waves", type=int, default=None, help="shared_prefix generate calls")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each workload and mode, each by a fresh engine; the "
                             "median (by wall time) counts (default 3, 1 with --quick)")
    parser.add_argument("--max-wait", type=float, default=None,
                        help="seconds to wait, before each engine, for other processes to "
                             "leave the CPUs idle (0: do not wait; default 30, 0 with --quick)")
    args = parse(parser, argv)
    import torch

    setting = "quick" if args.quick else "cpu"
    args.repeats = max(1, args.repeats or (1 if args.quick else 3))
    if args.max_wait is None:
        args.max_wait = 0 if args.quick else 30
    s = dict(SETTINGS[setting])
    for key in ("requests", "waves", "conversations", "turns"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    shape = MODELS[setting]
    vocab = shape["vocab_size"]
    engine_args = {"device": "cpu", "dtype": torch.float32, "attention_backend": "auto",
                   "swap_space": 0.05, "seed": args.seed,
                   # Room for every block either workload fills: nothing is evicted.
                   "num_gpu_blocks_override": s["kv_blocks"]}
    results: dict[str, dict] = {}
    outputs_equal: dict[str, bool] = {}
    mismatches: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="minipaged-prefix-") as tmp:
        t0 = time.perf_counter()
        model_dir = build_model(Path(tmp) / "model", shape, "float32", "cpu", seed=args.seed)
        print(f"model written in {time.perf_counter() - t0:.1f} s", flush=True)
        for w in WORKLOADS:
            runs: dict[str, list[dict]] = {m: [] for m in MODES}
            tokens: dict[str, list] = {}
            for rep in range(args.repeats):  # off and on alternate: drift hits both alike
                for mode, caching in MODES.items():
                    quiet = wait_for_quiet(args.max_wait)
                    r, got = run_workload(w, model_dir, caching, s, vocab, args.seed,
                                          engine_args)
                    r["start"] = quiet
                    runs[mode].append(r)
                    if mode not in tokens:
                        tokens[mode] = got
                    elif got != tokens[mode]:  # same engine settings, same greedy tokens
                        raise AssertionError(f"{w}, cache {mode}: repeat {rep} differs")
                    print(f"{w} cache {mode}: {r['computed_prompt_tokens']}/"
                          f"{r['prompt_tokens']} prompt tokens computed, TTFT "
                          f"{r['mean_ttft_ms']:.1f} ms, {r['wall_seconds']:.2f} s (other "
                          f"processes: {r['other_cores']} cores)", flush=True)
            results[w] = {}
            for mode, rs in runs.items():
                ranked = sorted(rs, key=lambda r: r["wall_seconds"])
                results[w][mode] = {**ranked[(len(ranked) - 1) // 2],
                                    "repeat_wall_seconds": [r["wall_seconds"] for r in rs],
                                    "repeat_mean_ttft_ms": [r["mean_ttft_ms"] for r in rs],
                                    "repeat_other_cores": [r["other_cores"] for r in rs]}
            mismatches[w] = [i for i, (a, b) in enumerate(zip(tokens["off"], tokens["on"]))
                             if a != b]
            outputs_equal[w] = len(tokens["off"]) == len(tokens["on"]) and not mismatches[w]

    record = {
        "benchmark": "prefix_caching",
        "unit": "tokens; ms (time to first token, mean over requests); seconds (wall clock of "
                "the workload's generate calls); output tokens/s",
        "environment": environment(),
        "busy_threshold_cores": BUSY_CORES,
        "model": {"description": model_description(shape, "float32"), "config": shape,
                  "dtype": "float32", "parameters": num_params(shape),
                  "weights": f"random (seed {args.seed}), no tokenizer"},
        "engine_args": {**{k: str(v) for k, v in engine_args.items()},
                        "block_size": 16, "max_num_batched_tokens": "default (2048)"},
        "sampling": "greedy (temperature 0), EOS ignored, token-id prompts",
        "repeats": args.repeats,
        "threads": args.threads or "torch default",
        "workloads": {w: {"description": _workload_description(w, s)} for w in WORKLOADS},
        "settings": s,
        "results": results,
        "savings": {w: {"computed_prompt_tokens_on_over_off":
                        results[w]["on"]["computed_prompt_tokens"]
                        / max(1, results[w]["off"]["computed_prompt_tokens"]),
                        "ttft_off_over_on": results[w]["off"]["mean_ttft_ms"]
                        / results[w]["on"]["mean_ttft_ms"],
                        "throughput_on_over_off": results[w]["on"]["output_tokens_per_s"]
                        / results[w]["off"]["output_tokens_per_s"]} for w in WORKLOADS},
        "outputs_equal": outputs_equal,
        "output_mismatches": mismatches,
    }
    save_record(record, Path(args.out) / "prefix_cpu.json", plot)
    print("\n".join(format_table(record)))
    if not all(outputs_equal.values()):
        raise AssertionError(f"greedy outputs differ with prefix caching on: {mismatches}")
    return record


if __name__ == "__main__":
    main()
