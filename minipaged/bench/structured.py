"""Structured output: what constrained rows cost the host, per engine step.

    python -m minipaged.bench.structured                 # SmolLM2-135M-Instruct if installed
    python -m minipaged.bench.structured --model tiny    # a random one-layer model
    python -m minipaged.bench.structured --quick         # a small run, to check it works

The same decode workload runs unconstrained and with every row constrained:
``batch`` requests with one chat prompt, sampled at temperature 1 (seeded per
request), ``ignore_eos``. Only decode steps are timed: the prompt's steps run
first, untimed, then ``--steps`` decode steps are timed and the requests are
aborted. A constrained run counts only if every row was still running in
every timed step (a grammar that completes ends its sequence); the schema's
string fields have a ``minLength`` and the regex asks for many characters, so
that none completes within the window.

``mask_logits`` (each row's matcher fills its row of the bitmask, then the
logits it forbids are set to -inf) is timed directly, by wrapping the
function the sampler calls; the rest of a constraint's cost, the matcher
advancing by the token drawn, is in the difference between the step times.
Runs alternate (none, json, regex, none, ...) over ``--reps`` rounds, so that
the machine's drift falls on every mode alike; each figure is the median over
rounds of a run's mean per decode step, in the process's CPU time, which
other processes change far less than wall-clock time (kept too, as
``*_wall_ms``). The one-time cost of compiling the schema (xgrammar's
tokenizer info, then the grammar) is timed on fresh compilers. Writes JSON to
``--out`` (default ``assets/structured_cpu.json``) and a plot beside it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from ..sampling import sampler as sampler_module
from .harness import (
    arguments,
    environment,
    parse,
    plain_log_axes,
    pyplot,
    save_figure,
    save_record,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 200},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "minLength": 200},
        "languages": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}
REGEX = r"[A-Za-z ,.]{300,600}"
PROMPT = "Describe a person who lives in Paris, as a JSON object with their name, age, " \
         "city and the languages they speak."
MODES = ("none", "json", "regex")


class MaskClock:
    """Wraps ``sampler.mask_logits``: seconds spent in it and rows masked, per step."""

    def __init__(self):
        self.seconds, self.wall, self.rows = 0.0, 0.0, 0
        self._original = sampler_module.mask_logits

    def __enter__(self):
        original = self._original

        def timed(logits, matchers):
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                return original(logits, matchers)
            finally:
                self.seconds += time.process_time() - c0
                self.wall += time.perf_counter() - t0
                self.rows += len(matchers)
        sampler_module.mask_logits = timed
        return self

    def __exit__(self, *exc):
        sampler_module.mask_logits = self._original

    def take(self) -> tuple[float, float, int]:
        """(CPU seconds, wall seconds, rows masked) since the last take."""
        taken = (self.seconds, self.wall, self.rows)
        self.seconds, self.wall, self.rows = 0.0, 0.0, 0
        return taken


def model_path(model: str, tmp: Path) -> tuple[str, str]:
    """(path, name) of the model to run: SmolLM2-135M-Instruct, or a random tiny one."""
    if model == "smollm2":
        from ..assets import SMOLLM2_NAME, smollm2_path

        path = smollm2_path()
        if path is None:
            raise SystemExit("SmolLM2-135M-Instruct is not installed; use --model tiny")
        return str(path), SMOLLM2_NAME
    from .stand_ins import tiny_llama_dir

    return str(tiny_llama_dir(tmp / "tiny", vocab_size=320)), "tiny random one-layer LLaMA"


def constraint(mode: str):
    from ..sampling.structured_output import StructuredOutputsParams

    if mode == "json":
        return StructuredOutputsParams(json=SCHEMA)
    if mode == "regex":
        return StructuredOutputsParams(regex=REGEX)
    return None


def make_engine(path: str, max_batch: int, steps: int):
    from ..engine import LLMEngine

    return LLMEngine(path, device="cpu", dtype="float32", attention_backend="torch",
                     max_num_seqs=max_batch, max_model_len=256,
                     num_gpu_blocks_override=max_batch * (-(-(128 + steps + 8) // 16) + 1) + 16,
                     max_num_batched_tokens=max(2048, max_batch * 128), swap_space=0.01,
                     enable_prefix_caching=False)


def prompt_ids(engine) -> list[int]:
    from ..input_processor import render_chat

    text = render_chat(engine.tokenizer, [{"role": "user", "content": PROMPT}])
    return engine.tokenizer(text).input_ids[:120]


def run_once(engine, ids: list[int], batch: int, mode: str, steps: int, tag: str,
             clock: MaskClock) -> dict | None:
    """``batch`` requests decoding ``steps`` timed steps; mean ms per step and per step
    in ``mask_logits``. None if a constrained row ended inside the window."""
    from ..sampling_params import SamplingParams

    for i in range(batch):
        params = SamplingParams(temperature=1.0, seed=1000 * i + len(tag), max_tokens=steps + 4,
                                ignore_eos=True, structured_outputs=constraint(mode))
        engine.add_request(f"{tag}-{i}", None, params, prompt_token_ids=ids)
    # the prompts' steps, untimed: until every sequence has its first token
    while any(s.num_output_tokens == 0 for g in engine.requests.values() for s in g.seqs.values()):
        engine.step()
    clock.take()
    step_s, step_wall, mask_s, mask_wall, complete = [], [], [], [], True
    for _ in range(steps):
        c0, t0 = time.process_time(), time.perf_counter()
        engine.step()
        step_s.append(time.process_time() - c0)
        step_wall.append(time.perf_counter() - t0)
        seconds, wall, rows = clock.take()
        mask_s.append(seconds)
        mask_wall.append(wall)
        if mode != "none" and rows != batch:
            complete = False
    if len(engine.requests) != batch:
        complete = False
    for rid in list(engine.requests):
        engine.abort_request(rid)
    if not complete:
        return None
    ms = lambda xs: 1e3 * statistics.fmean(xs)  # noqa: E731
    return {"step_ms": ms(step_s), "mask_ms": ms(mask_s), "step_wall_ms": ms(step_wall),
            "mask_wall_ms": ms(mask_wall)}


def compile_times(engine, reps: int) -> dict:
    """Median seconds, on fresh compilers, of xgrammar's tokenizer info and of
    compiling the schema and the regex; and of a cached compile (a dict lookup)."""
    from ..sampling.structured_output import GrammarCompilerCache

    inputs = engine.input_processor   # its end tokens: what a complete answer ends with
    info, schema, regex, cached = [], [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        cache = GrammarCompilerCache(inputs.tokenizer, inputs.vocab_size,
                                     list(inputs.end_token_ids))
        t1 = time.perf_counter()
        cache.compile(constraint("json"))
        t2 = time.perf_counter()
        cache.compile(constraint("regex"))
        t3 = time.perf_counter()
        cache.compile(constraint("json"))
        t4 = time.perf_counter()
        info.append(t1 - t0)
        schema.append(t2 - t1)
        regex.append(t3 - t2)
        cached.append(t4 - t3)
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"tokenizer_info_ms": ms(info), "json_schema_ms": ms(schema), "regex_ms": ms(regex),
            "cached_ms": ms(cached)}


def summarize(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["runs"] = len(runs)
    return out


def plot(record: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    batches = [int(b) for b in record["results"]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"none": ("black", "o", "unconstrained"), "json": ("tab:blue", "s", "JSON schema"),
              "regex": ("tab:orange", "^", "regex")}
    for mode in record["modes"]:
        colour, marker, label = styles[mode]
        ax.plot(batches, [record["results"][str(b)][mode]["step_ms"] for b in batches],
                marker=marker, color=colour, label=label)
        if mode != "none":
            ax.plot(batches, [record["results"][str(b)][mode]["mask_ms"] for b in batches],
                    marker=marker, color=colour, ls="--", label=f"{label}: in mask_logits")
            bx.plot(batches, [record["results"][str(b)][mode]["mask_per_row_ms"]
                              for b in batches], marker=marker, color=colour,
                    label=f"{label}: mask_logits / rows")
            bx.plot(batches, [record["results"][str(b)][mode]["overhead_per_row_ms"]
                              for b in batches], marker=marker, color=colour, ls=":",
                    label=f"{label}: (step - unconstrained step) / rows")
    plain_log_axes(ax)
    ax.set_xticks(batches)
    ax.set_xlabel("batch (sequences decoding)")
    ax.set_ylabel("CPU ms per decode step (median)")
    ax.set_title(f"decode step, {record['model']}", fontsize=10)
    ax.legend(fontsize=8)
    bx.set_xscale("log", base=2)
    bx.set_xticks(batches)
    bx.set_xticklabels([str(b) for b in batches])
    bx.axhline(0, color="gray", lw=0.8)
    bx.set_xlabel("batch (sequences decoding)")
    bx.set_ylabel("CPU ms per step, per constrained row")
    bx.set_title("cost per constrained row (the step difference is noisier)", fontsize=10)
    bx.legend(fontsize=8)
    cpu = record["environment"]["cpu"]
    fig.suptitle(f"structured output on {cpu['model']} ({cpu['cores']} cores), "
                 f"{record['environment']['date']}", fontsize=9)
    save_figure(fig, path, dpi=110)


def format_table(record: dict) -> list[str]:
    lines = [f"{'batch':>5} {'mode':>6} {'ms/step':>9} {'mask ms':>9} {'extra/row':>10}"]
    for b, by_mode in record["results"].items():
        for mode, r in by_mode.items():
            extra = r.get("overhead_per_row_ms")
            lines.append(f"{b:>5} {mode:>6} {r['step_ms']:>9.2f} {r['mask_ms']:>9.2f} "
                         f"{'' if extra is None else f'{extra:>10.3f}'}")
    return lines


def main(argv=None) -> dict:
    parser = arguments(__doc__, out_help="JSON file (default assets/structured_cpu.json; "
                       "--quick writes only with --out)",
                       quick="tiny model, batches 1 and 4, 3 steps, 1 round", threads=True)
    parser.add_argument("--model", default=None, choices=["smollm2", "tiny"],
                        help="default: smollm2 when installed, else tiny")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per run")
    parser.add_argument("--reps", type=int, default=3, help="rounds of alternating runs")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parse(parser, argv)
    if args.quick:
        args.model, args.batches, args.steps, args.reps = "tiny", [1, 4], 3, 1
    if args.model is None:
        from ..assets import smollm2_path

        args.model = "smollm2" if smollm2_path() is not None else "tiny"
    modes = ["none"] + [m for m in args.modes if m != "none"]
    runs: dict[int, dict[str, list[dict]]] = {b: {m: [] for m in modes} for b in args.batches}
    dropped = 0
    with tempfile.TemporaryDirectory() as tmp:
        path, name = model_path(args.model, Path(tmp))
        engine = make_engine(path, max(args.batches), args.steps)
        ids = prompt_ids(engine)
        compiled = compile_times(engine, 1 if args.quick else 3)
        print(f"{name}: prompt {len(ids)} tokens; compile " + ", ".join(
            f"{k} {v:.1f}" for k, v in compiled.items()), flush=True)
        with MaskClock() as clock:
            for mode in modes:  # warm-up: compiles, allocates, fills xgrammar's caches
                run_once(engine, ids, min(args.batches), mode, 2, f"warm-{mode}", clock)
            for rep in range(args.reps):
                for batch in args.batches:
                    for mode in modes:
                        result = run_once(engine, ids, batch, mode, args.steps,
                                          f"{rep}-{batch}-{mode}", clock)
                        if result is None:
                            dropped += 1
                            continue
                        runs[batch][mode].append(result)
                        print(f"round {rep} batch {batch:>3} {mode:>5}: "
                              f"{result['step_ms']:8.2f} ms/step, mask {result['mask_ms']:.2f}",
                              flush=True)
    results = {}
    for batch, by_mode in runs.items():
        results[str(batch)] = {m: summarize(r) for m, r in by_mode.items() if r}
        base = results[str(batch)].get("none")
        for m, r in results[str(batch)].items():
            if m != "none" and base is not None:
                r["overhead_ms"] = r["step_ms"] - base["step_ms"]
                r["overhead_per_row_ms"] = r["overhead_ms"] / batch
                r["mask_per_row_ms"] = r["mask_ms"] / batch
    record = {"benchmark": "structured",
              "unit": "ms per decode step (median over rounds of each run's mean); step_ms "
                      "and mask_ms are the process's CPU time (all threads), which other "
                      "processes on the machine barely change; *_wall_ms are wall-clock",
              "model": name, "vocab_size": engine.model_config.vocab_size,
              "prompt_tokens": len(ids), "timed_steps": args.steps, "rounds": args.reps,
              "modes": modes, "schema": SCHEMA, "regex": REGEX,
              "sampling": "temperature 1, seeded, ignore_eos",
              "dropped_runs": dropped, "compile": compiled,
              "environment": environment(),
              "results": results}
    out = Path(args.out) if args.out else Path("assets") / "structured_cpu.json"
    if not args.quick or args.out:
        save_record(record, out, plot)
    print("\n".join(format_table(record)))
    return record


if __name__ == "__main__":
    main()
