"""The compiled model body against the eager one on a CPU, side by side in one process.

    python scripts/compiled_body_bench.py                    # SmolLM2's GGUF, none and gguf
    python scripts/compiled_body_bench.py --modes gguf --rounds 2 --tokens 64

For each quantization mode (``--modes``: ``none`` dequantizes the file to
float32, ``gguf`` keeps its blocks) one ``LLM`` runs eagerly and one with
``enforce_eager=False`` (``minipaged.models.compiled``), both loaded here;
its start-up compile is timed. Then, ``--rounds`` times, each engine in
turn (eager, compiled: alternating, so that a machine that slows down or
speeds up during the run weighs on both alike) serves ``--single`` chat
requests one at a time and ``--batch`` chat requests at once, greedy, each
exactly ``--tokens`` output tokens (end of text ignored). Recorded: every
round's output tokens/s, their medians, the greedy tokens of the two
engines compared (the first divergence of each request), and the memory
bandwidth (``bandwidth.memory_read_gbs``: a ``torch`` sum over 1 GiB, two
threads; 512 MiB before 2026-12-06) before and after,
which bounds a one-user step: it reads every weight once. With
``--llamacpp-python`` (or ``MINIPAGED_LLAMACPP_PYTHON``), llama.cpp serves
the same one-user requests from the same file in each round of the ``gguf``
mode (``llamacpp_worker.py``, in a process of its own, 2 threads). Writes
``compiled_body_cpu.json`` to ``--out`` (default ``assets/``) and prints the
table. A repository script: not part of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bandwidth import memory_read_gbs  # noqa: E402
from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.assets import smollm2_path  # noqa: E402
from minipaged.bench.chat_prompts import chat_conversations  # noqa: E402
from minipaged.bench.harness import environment, save_record  # noqa: E402
from minipaged.bench.spec_decode import first_divergence  # noqa: E402
from minipaged.quantization.linear import resident_weight_bytes  # noqa: E402


def tokens_per_second(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                      at_once: bool) -> tuple[float, list[list[int]]]:
    """Output tokens/s serving ``prompts`` (token ids) one at a time or all at
    once, and each request's output tokens."""
    start = time.perf_counter()
    if at_once:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    else:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                for p in prompts]
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def llamacpp_tokens_per_second(python: str, model: str, prompts: list[list[int]],
                               tokens: int) -> dict:
    """llama.cpp serving ``prompts`` one at a time, ``tokens`` greedy tokens each
    (``llamacpp_worker.py``'s result: tokens/s and the output tokens)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"model": model, "threads": 2, "n_ctx": 2048,
                                    "prompts": prompts, "output_lens": [tokens] * len(prompts)}))
        subprocess.run([python, str(HERE / "llamacpp_worker.py"), "--spec", str(spec),
                        "--result", str(result)], check=True, timeout=1800)
        return json.loads(result.read_text())


def chat_prompt_ids(llm: LLM, count: int) -> list[list[int]]:
    """The first ``count`` benchmark chats as prompt token ids, through the model's template."""
    tokenizer = llm.get_tokenizer()
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
            for c in chat_conversations(count)]


def side_by_side_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments this script and ``decode_graph_bench.py`` share."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2's Q4_1)")
    parser.add_argument("--modes", default="none,gguf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single", type=int, default=3, help="chats served one at a time")
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per request")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="activations (bfloat16: the int4 and int8 ops' own dtype)")
    parser.add_argument("--llamacpp-python", default=os.environ.get("MINIPAGED_LLAMACPP_PYTHON"),
                        help="an interpreter with llama-cpp-python (the peer, gguf mode)")
    parser.add_argument("--out", default=str(HERE.parent / "assets"))
    return parser


def run_modes(args: argparse.Namespace, run_mode: Callable, benchmark: str,
              workload: dict) -> dict:
    """``run_mode(model, mode, args)`` for each of ``args.modes``, as a record with
    the machine and the memory bandwidth before and after."""
    model = args.model or str(smollm2_path())
    before = memory_read_gbs()
    results = [run_mode(model, mode, args) for mode in args.modes.split(",")]
    return {
        "benchmark": benchmark,
        "model": Path(model).name,
        "environment": environment(),
        "workload": {**workload, "tokens": args.tokens, "rounds": args.rounds,
                     "dtype": args.dtype, "greedy": True},
        "bandwidth_gbs": {"before": round(before, 1), "after": round(memory_read_gbs(), 1)},
        "results": results,
    }


def run_mode(model: str, mode: str, args: argparse.Namespace) -> dict:
    """One mode's eager and compiled engines, alternating (see the module doc)."""
    engines, ready = {}, {}
    for name, eager in (("eager", True), ("compiled", False)):
        start = time.perf_counter()
        engines[name] = LLM(model, quantization=mode, dtype=args.dtype, enforce_eager=eager,
                            enable_prefix_caching=False, max_num_seqs=max(args.batch, 1))
        ready[name] = round(time.perf_counter() - start, 1)
    runner = engines["compiled"].engine.executor.runner
    prompts = chat_prompt_ids(engines["eager"], max(args.single, args.batch))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for llm in engines.values():   # warm-up: first-call costs out of the timed runs
        tokens_per_second(llm, prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), True)
    rounds = {name: {"single": [], "batch": []} for name in engines}
    outputs = {}
    for r in range(args.rounds):
        for name, llm in engines.items():
            single, tokens = tokens_per_second(llm, prompts[:args.single], params, False)
            batch, _ = tokens_per_second(llm, prompts[:args.batch], params, True)
            rounds[name]["single"].append(round(single, 2))
            rounds[name]["batch"].append(round(batch, 2))
            outputs[name] = tokens
            print(f"{mode} round {r + 1}: {name:8s} one user {single:6.1f} tok/s, "
                  f"{args.batch} at once {batch:6.1f} tok/s", flush=True)
        if mode == "gguf" and args.llamacpp_python:
            peer = llamacpp_tokens_per_second(args.llamacpp_python, model,
                                              prompts[:args.single], args.tokens)
            rounds.setdefault("llama.cpp", {"single": []})["single"].append(
                round(peer["tokens_per_s"], 2))
            outputs["llama.cpp"] = peer["outputs"]
            print(f"{mode} round {r + 1}: llama.cpp one user {peer['tokens_per_s']:6.1f} tok/s "
                  f"({peer['engine']})", flush=True)
    medians = {name: {k: statistics.median(v) for k, v in runs.items()}
               for name, runs in rounds.items()}
    return {
        "mode": mode,
        "weight_bytes": resident_weight_bytes(engines["eager"].engine.executor.model),
        "ready_seconds": ready,
        "compile_seconds": round(runner.compile_seconds, 1),
        "rounds": rounds,
        "median_tokens_per_s": medians,
        "speedup": {k: round(medians["compiled"][k] / medians["eager"][k], 3)
                    for k in ("single", "batch")},
        "first_divergence": [first_divergence(a, b)
                             for a, b in zip(outputs["eager"], outputs["compiled"])],
        "llamacpp_first_divergence": [first_divergence(a, b) for a, b in
                                      zip(outputs["eager"], outputs.get("llama.cpp", []))],
    }


def main(argv=None) -> None:
    parser = side_by_side_parser(__doc__)
    parser.add_argument("--batch", type=int, default=32, help="requests served at once")
    args = parser.parse_args(argv)
    record = run_modes(args, run_mode, "compiled_body",
                       {"single": args.single, "batch": args.batch})
    results = record["results"]
    print(f"\n| mode | eager 1 user | compiled 1 user | x | eager {args.batch} at once "
          f"| compiled | x | compile s | first divergences |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        e, c = r["median_tokens_per_s"]["eager"], r["median_tokens_per_s"]["compiled"]
        x = r["speedup"]
        print(f"| {r['mode']} | {e['single']:.1f} | {c['single']:.1f} | {x['single']:.2f}"
              f" | {e['batch']:.1f} | {c['batch']:.1f} | {x['batch']:.2f} | "
              f"{r['compile_seconds']} | {r['first_divergence']} |")
        peer = r["median_tokens_per_s"].get("llama.cpp")
        if peer:
            print(f"| llama.cpp, same file | {peer['single']:.1f} | | | | | | | "
                  f"{r['llamacpp_first_divergence']} |")
    print(f"memory bandwidth {record['bandwidth_gbs']} GB/s")
    save_record(record, Path(args.out) / "compiled_body_cpu.json")


if __name__ == "__main__":
    main()
