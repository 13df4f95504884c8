"""The float32 GEMVs on 4- and 8-bit weights read as bytes or as int32 words, side by side.

    python scripts/word_gemv_bench.py                      # SmolLM2's GGUF, eager, float32
    python scripts/word_gemv_bench.py --llamacpp-python /path/bin/python

``quantization.exact_gemm`` reads a one-row GEMV's weight four bytes at a
time on AVX2 CPUs without AVX-512 (``READ_WORDS``). This script measures both
forms on this CPU, whatever its default:

* each GEMV alone at the shapes of SmolLM2's projections (weight in cache,
  best of five runs);
* one eager engine on SmolLM2's Q4_1 file kept quantized (the default
  ``quantization="gguf"``, float32 activations), serving ``--single`` chat
  requests one at a time, greedy, ``--tokens`` each, ``--rounds`` times
  with each form in turn (the flag is read at every call), and llama.cpp on
  the same file and chats in each round with ``--llamacpp-python``.

Records the rounds, the medians, where the forms' greedy tokens first
differ, and the memory bandwidth; writes ``word_gemv_cpu.json`` to
``--out``. A repository script: not part of the package.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from compiled_body_bench import (
    chat_prompt_ids,
    llamacpp_tokens_per_second,
    run_modes,
    side_by_side_parser,
    tokens_per_second,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.bench.harness import save_record  # noqa: E402
from minipaged.bench.spec_decode import first_divergence  # noqa: E402
from minipaged.quantization import exact_gemm  # noqa: E402
from minipaged.quantization.formats import Int4Weight, Int8Weight  # noqa: E402

FORMS = {"bytes": False, "words": True}
SHAPES = [("int4", 576, 3072), ("int4", 1536, 576), ("int4", 576, 576), ("int4", 576, 192),
          ("int8", 576, 192), ("int8", 576, 49152)]
"""(kind, in, out): SmolLM2's projections and its int8 head, as its Q4_1 file stores them
(the engine merges q, k, v into one GEMV, 576 -> 960, and gate, up into another, 576 -> 6144)."""


def best_of_five_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - start) / reps)
    return 1e6 * min(runs)


def gemv_table() -> list[dict]:
    """Each shape's GEMV in both forms, microseconds per call, on random weights."""
    g = torch.Generator().manual_seed(0)
    rows = []
    default = exact_gemm.READ_WORDS
    for kind, k, n in SHAPES:
        if kind == "int4":
            scale = torch.rand(n, k // 32, generator=g) * 0.02
            weight = Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                                scale, -8 * scale, 32)
            gemm = exact_gemm.CpuExactInt4Gemm(weight)
        else:
            weight = Int8Weight(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                                torch.rand(n, k // 32, generator=g) * 0.01, 32)
            gemm = exact_gemm.CpuExactInt8Gemm(weight)
        x = torch.randn(1, k, generator=g)
        row = {"weight": kind, "in": k, "out": n}
        try:
            for form, words in FORMS.items():
                exact_gemm.READ_WORDS = words
                row[f"{form}_us"] = round(best_of_five_us(lambda: gemm(x), 5 if n > 10000 else 20),
                                          1)
        finally:
            exact_gemm.READ_WORDS = default   # run_mode records this CPU's default form
        rows.append(row)
        print(f"{kind} {k} -> {n}: bytes {row['bytes_us']:.0f} us, words {row['words_us']:.0f} us",
              flush=True)
    return rows


def run_mode(model: str, mode: str, args: argparse.Namespace) -> dict:
    """One eager engine, each form in turn (see the module doc)."""
    default = exact_gemm.READ_WORDS
    llm = LLM(model, quantization=mode, dtype=args.dtype, enable_prefix_caching=False)
    chats = chat_prompt_ids(llm, args.single)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    rounds = {name: [] for name in FORMS}
    outputs = {}
    try:
        for words in FORMS.values():   # warm-up: each form's graphs compiled out of the timing
            exact_gemm.READ_WORDS = words
            tokens_per_second(llm, chats[:1], SamplingParams(max_tokens=4, ignore_eos=True), False)
        for r in range(args.rounds):
            for name, words in FORMS.items():
                exact_gemm.READ_WORDS = words
                speed, outputs[name] = tokens_per_second(llm, chats, params, False)
                rounds[name].append(round(speed, 2))
                print(f"{mode} round {r + 1}: {name:5s} one user {speed:6.1f} tok/s", flush=True)
            if args.llamacpp_python:
                peer = llamacpp_tokens_per_second(args.llamacpp_python, model, chats, args.tokens)
                rounds.setdefault("llama.cpp", []).append(round(peer["tokens_per_s"], 2))
                outputs["llama.cpp"] = peer["outputs"]
                print(f"{mode} round {r + 1}: llama.cpp one user {peer['tokens_per_s']:6.1f} "
                      f"tok/s ({peer['engine']})", flush=True)
    finally:
        exact_gemm.READ_WORDS = default
    medians = {name: statistics.median(v) for name, v in rounds.items()}
    return {
        "mode": mode,
        "default_form": "words" if default else "bytes",
        "rounds_tokens_per_s": rounds,
        "median_tokens_per_s": medians,
        "words_over_bytes": round(medians["words"] / medians["bytes"], 3),
        "first_divergence": [first_divergence(a, b)
                             for a, b in zip(outputs["bytes"], outputs["words"])],
        "llamacpp_first_divergence": [first_divergence(a, b) for a, b in
                                      zip(outputs["words"], outputs.get("llama.cpp", []))],
    }


def main(argv=None) -> None:
    parser = side_by_side_parser(__doc__)
    parser.set_defaults(modes="gguf", single=3, tokens=48)
    args = parser.parse_args(argv)
    gemvs = gemv_table()
    record = run_modes(args, run_mode, "word_gemv", {"single": args.single})
    record["gemv_us"] = gemvs
    print("\n| mode | bytes, 1 user | words, 1 user | words / bytes | llama.cpp "
          "| first divergences |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in record["results"]:
        m = r["median_tokens_per_s"]
        peer = f"{m['llama.cpp']:.1f}" if "llama.cpp" in m else ""
        print(f"| {r['mode']} | {m['bytes']:.1f} | {m['words']:.1f} | "
              f"{r['words_over_bytes']:.2f} | {peer} | {r['first_divergence']} |")
    print(f"memory bandwidth {record['bandwidth_gbs']} GB/s")
    save_record(record, Path(args.out) / "word_gemv_cpu.json")


if __name__ == "__main__":
    main()
