"""The batch decode graph under Inductor's default settings and under the decode graph's.

    python scripts/batch_decode_options_bench.py --dtype float32
    python scripts/batch_decode_options_bench.py --dtype bfloat16 --rounds 4

One compiled engine (``enforce_eager=False``) of SmolLM2's file with float
weights (``--modes none``: the GGUF dequantized) builds its batch decode
graph twice, once with Inductor's default settings and once with the
one-user decode graph's (``models.compiled.batch_decode_options`` picks
between them by the cache's dtype). Then, ``--rounds`` times, each graph in
turn (the order alternating from round to round, so that a machine that
drifts weighs on both alike) serves the throughput benchmark's
``--requests`` chat requests at once (``scripts/throughput.py``'s chat
workload: output lengths uniform in ``--output-len``, seed 0), greedy.
Records every round's tokens/s, the medians, the graphs' build seconds and
how many requests gave the same greedy tokens under both; writes
``batch_decode_options_cpu_<dtype>.json`` to ``--out``. A repository
script: not part of the package.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from compiled_body_bench import run_modes, side_by_side_parser, tokens_per_second
from throughput import chat_workload, parse_output_len

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.bench.harness import save_record  # noqa: E402
from minipaged.models import compiled as compiled_body  # noqa: E402

SETTINGS = {"default": {}, "threshold_8": compiled_body._DECODE_OPTIONS}


def run_mode(model: str, mode: str, args: argparse.Namespace) -> dict:
    llm = LLM(model, quantization=mode, dtype=args.dtype, enforce_eager=False,
              enable_prefix_caching=False)
    forward = llm.engine.executor.runner.compiled
    workload = chat_workload(llm.get_tokenizer(), args.requests,
                             parse_output_len(args.output_len), seed=0)
    prompts = workload["prompts"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in workload["output_lens"]]
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    graphs, build = {}, {}
    for name, options in SETTINGS.items():
        graphs[name] = forward._compile(compiled_body.CompiledForward._decode_body, options)
        forward._batch_decode = graphs[name]
        forward._traced.discard("_batch_decode")   # trace this graph on its first batch
        start = time.perf_counter()
        tokens_per_second(llm, prompts[:4], warm, True)
        build[name] = round(time.perf_counter() - start, 1)
    rounds = {name: [] for name in SETTINGS}
    outputs = {}
    for r in range(args.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            forward._batch_decode = graphs[name]
            speed, outputs[name] = tokens_per_second(llm, prompts, params, True)
            rounds[name].append(round(speed, 2))
            print(f"{mode} {args.dtype} round {r + 1}: {name:11s} {speed:6.1f} tok/s", flush=True)
    medians = {name: statistics.median(v) for name, v in rounds.items()}
    same = sum(a == b for a, b in zip(outputs["default"], outputs["threshold_8"]))
    return {
        "mode": mode,
        "chosen_for_this_dtype": ("default" if compiled_body.batch_decode_options(
            llm.engine.executor.runner.cache.device_cache[0][0].dtype) == {} else "threshold_8"),
        "build_seconds": build,
        "rounds": rounds,
        "median_tokens_per_s": medians,
        "default_over_threshold_8": round(medians["default"] / medians["threshold_8"], 3),
        "requests_with_the_same_greedy_tokens": f"{same}/{len(prompts)}",
    }


def main() -> None:
    parser = side_by_side_parser(__doc__)
    parser.set_defaults(modes="none", rounds=3, tokens=None)   # lengths: --output-len
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", default="32..256", metavar="N|LO..HI")
    args = parser.parse_args()
    workload = {"description": f"{args.requests} chat requests at once (scripts/throughput.py's "
                               f"chat workload, output lengths {args.output_len}, seed 0), one "
                               f"compiled engine, its batch decode graph built both ways"}
    record = run_modes(args, run_mode, "batch_decode_options", workload)
    save_record(record, Path(args.out) / f"batch_decode_options_cpu_{args.dtype}.json")
    for result in record["results"]:
        print(f"{result['mode']}: {result['median_tokens_per_s']} tok/s (medians), default "
              f"{result['default_over_threshold_8']}x, same tokens "
              f"{result['requests_with_the_same_greedy_tokens']}")


if __name__ == "__main__":
    main()
