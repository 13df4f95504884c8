"""Host overhead: what one engine step costs besides the model's forward.

    python -m minipaged.bench.host_overhead              # batches 64/128/256, ~32 and ~1000 tokens
    python -m minipaged.bench.host_overhead --quick      # a small run, to check it works

On a GPU, a decode step of an 8B model at batch 256 takes about 10 ms; the
host must schedule, build inputs, sample and turn tokens into text faster
than that, and at the same cost whatever the output length. To see the host
alone, the model is ``StandInModel`` (a forward that costs almost nothing)
over a Llama-style tokenizer of 320 tokens; ``--model one-layer`` keeps the
real one-layer LLaMA (paged attention over every sequence's whole context,
torch backend), so that block tables and the attention's plan are built and
read as in serving (the stand-in reads no plan, so makes none). Every request
samples at temperature 1 with top-p 0.9, carries a stop string (searched for
every step, never found) and ignores EOS, so a batch stays whole until
``max_tokens``. The stand-in's text reads like a model's (``rare_bytes_bias``);
``--text bytes`` keeps the byte tokens at 256 of 320, the detokenizer's worst
case (the only text until 2026-12-07).

Each phase is timed by wrapping the engine's own pieces: ``schedule``,
``prepare`` (input tensors), ``forward``, ``sample``, ``detok+stop``
(incremental detokenization and stop checks) and ``outputs`` (the step's
last part: finished sequences' blocks freed and ``RequestOutput``s built:
for finished requests only with the default ``--output-kind FINAL_ONLY``,
as ``LLM.generate`` asks; every step's new tokens with ``DELTA``, as a
streaming server would; everything so far with ``CUMULATIVE``,
``LLMEngine``'s default); ``other`` is the rest of the step,
``host`` the step without ``forward``. Figures are mean milliseconds per step
over the ``WINDOW`` steps that end at ~32 and ~1000 output tokens of one run:
as many steps as a block has slots, because the requests advance in
lockstep and all take a new block in the same step, once per block, so
every window holds exactly one such step (a window of 8 held it at ~1000
tokens and not at ~16, which read as growth with length). The
step in which every request finishes (blocks freed, final outputs built:
work done once per request) is recorded apart, as ``finishing_step``. The
garbage collector runs as in serving, its pauses landing in whichever phase
triggers them; ``--no-gc`` turns it off. Writes JSON to ``--out`` (default
``assets/host_overhead_cpu.json``; ``_nogc``, ``_delta``, ``_one_layer``
with those options).
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from .harness import arguments, environment, parse, save_record
from .stand_ins import StandInModel, rare_bytes_bias, tiny_llama_dir

PHASES = ("schedule", "prepare", "forward", "sample", "detok+stop", "outputs", "other", "step",
          "host")
MODELS = ("stand-in", "one-layer")
VOCAB = 320
PROMPT_LEN = 32
WINDOW = 16
"""Steps per measured window: the block size, so each window holds one step
in which every sequence takes a new block."""


class PhaseClock:
    """Accumulates seconds per phase for the step in progress."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - t0
        return timed

    def take(self) -> dict[str, float]:
        step, self.current = dict(self.current), defaultdict(float)
        return step


def instrumented_engine(model_dir: Path, batch: int, max_len: int, clock: PhaseClock,
                        model: str = "stand-in", text: str = "words"):
    from ..engine import LLMEngine

    blocks_per_seq = -(-(PROMPT_LEN + max_len) // 16) + 1
    engine = LLMEngine(str(model_dir), device="cpu", attention_backend="torch",
                       num_gpu_blocks_override=batch * blocks_per_seq + 64,
                       max_model_len=PROMPT_LEN + max_len + 16, max_num_seqs=batch,
                       max_num_batched_tokens=max(2048, batch * PROMPT_LEN), swap_space=0.01)
    bias = rare_bytes_bias(VOCAB) if text == "words" else None
    net = StandInModel(VOCAB, logit_bias=bias) if model == "stand-in" else engine.runner.model
    net.forward = clock.wrap("forward", net.forward)
    net.compute_logits = clock.wrap("forward", net.compute_logits)
    engine.runner.model = net
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine.runner.prepare = clock.wrap("prepare", engine.runner.prepare)
    sampling = engine.group_processor
    sampling.sampler = clock.wrap("sample", sampling.sampler)
    processor = engine.output_processor
    processor.process = clock.wrap("detok+stop", processor.process)
    # Once per step: per request, the wrapper (~0.25 us) added ~0.06 ms at batch 256.
    engine._collect_outputs = clock.wrap("outputs", engine._collect_outputs)
    return engine


def run_batch(model_dir: Path, batch: int, lengths: list[int], seed: int = 0,
              output_kind: str = "FINAL_ONLY", model: str = "stand-in",
              text: str = "words") -> tuple[dict, dict]:
    """One run of ``batch`` requests to ``max(lengths) + 1`` tokens.

    Returns the mean per-step phase times over the ``WINDOW`` steps that end
    at each of ``lengths``, and the phase times of the last step, in which
    every request finishes (its blocks are freed, its final output built:
    work done once per request, so it is kept out of the windows).
    """
    from ..sampling_params import RequestOutputKind, SamplingParams

    clock = PhaseClock()
    max_len = max(lengths)
    engine = instrumented_engine(model_dir, batch, max_len + 1, clock, model, text)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=max_len + 1,
                            ignore_eos=True, stop=["<never found>"],
                            output_kind=RequestOutputKind[output_kind])
    for i in range(batch):
        prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    per_length: dict[int, list[dict[str, float]]] = {n: [] for n in lengths}
    step: dict[str, float] = {}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        step = clock.take()
        step["step"] = time.perf_counter() - t0
        step["other"] = step["step"] - sum(v for k, v in step.items() if k != "step")
        step["host"] = step["step"] - step.get("forward", 0.0)
        group = next(iter(engine.requests.values()), None)
        made = group.seqs[next(iter(group.seqs))].num_output_tokens if group else max_len + 1
        for n in lengths:
            if n - WINDOW < made <= n:
                per_length[n].append(step)
    windows = {n: {p: 1e3 * sum(s.get(p, 0.0) for s in steps) / len(steps) for p in PHASES}
               for n, steps in per_length.items() if steps}
    return windows, {p: 1e3 * step.get(p, 0.0) for p in PHASES}


def format_table(results: dict) -> list[str]:
    head = f"{'batch':>5} {'tokens':>6} " + " ".join(f"{p:>10}" for p in PHASES)
    lines = [head]
    for batch, by_len in results.items():
        for n, ms in by_len.items():
            lines.append(f"{batch:>5} {n:>6} " + " ".join(f"{ms[p]:>10.2f}" for p in PHASES))
    return lines


def main(argv=None) -> dict:
    parser = arguments(__doc__, out_help="JSON file (default assets/...)",
                       quick="batch 16, 32 and 64 tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 1000])
    parser.add_argument("--no-gc", action="store_true", help="garbage collector off for the run")
    parser.add_argument("--output-kind", default="FINAL_ONLY", choices=["FINAL_ONLY", "DELTA",
                                                                        "CUMULATIVE"],
                        help="what each step returns: FINAL_ONLY as LLM.generate asks, DELTA "
                             "as a streaming server would")
    parser.add_argument("--model", default="stand-in", choices=MODELS,
                        help="stand-in: a forward that costs nothing; one-layer: a real "
                             "one-layer LLaMA with paged attention")
    parser.add_argument("--text", default="words", choices=["words", "bytes"],
                        help="the stand-in's output: text-like, or mostly byte tokens")
    args = parse(parser, argv)
    if args.quick:
        args.batches, args.lengths = [16], [32, 64]
    results, finish = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_llama_dir(Path(tmp) / "model", vocab_size=VOCAB)
        if args.no_gc:
            gc.disable()
        try:
            for batch in args.batches:
                results[batch], finish[batch] = run_batch(model_dir, batch, sorted(args.lengths),
                                                          output_kind=args.output_kind,
                                                          model=args.model, text=args.text)
                print("\n".join(format_table({batch: results[batch]})[1:]), flush=True)
        finally:
            gc.enable()
    record = {"benchmark": "host_overhead", "unit": "ms per engine step (mean)",
              "window_steps": WINDOW, "prompt_tokens": PROMPT_LEN, "vocab": VOCAB,
              "sampling": "temperature 1, top_p 0.9, one stop string, ignore_eos",
              "garbage_collector": "off" if args.no_gc else "on",
              "output_kind": args.output_kind, "model": args.model, "text": args.text,
              "environment": {**environment(), "host_loop_only": True},
              "results": {str(b): {str(n): ms for n, ms in r.items()} for b, r in results.items()},
              "finishing_step": {str(b): ms for b, ms in finish.items()}}
    name = "host_overhead_cpu" + ("_nogc" if args.no_gc else "") + (
        "" if args.output_kind == "FINAL_ONLY" else "_" + args.output_kind.lower()) + (
        "" if args.model == "stand-in" else "_" + args.model.replace("-", "_")) + (
        "" if args.text == "words" else "_bytes") + ".json"
    out = Path(args.out) if args.out else Path("assets") / name
    if not args.quick or args.out:
        save_record(record, out)
    print("\n".join(format_table(results)))
    return record


if __name__ == "__main__":
    main()
