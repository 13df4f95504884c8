"""The compiled body's one-user decode graph against the attention op, side by side in one process.

    python scripts/decode_graph_bench.py            # SmolLM2's GGUF, none and gguf
    python scripts/decode_graph_bench.py --modes gguf --llamacpp-python /path/bin/python

For each quantization mode (``--modes``) one compiled engine
(``enforce_eager=False``) is loaded. Then, ``--rounds`` times, it serves
``--single`` chat requests one at a time and one long request (a
``--long``-token prompt), greedy, ``--tokens`` output tokens each, once with
each path for one sequence's decode steps, alternating:

* ``op``: the body graph with attention as the opaque op
  ``minipaged::attention`` (gather and SDPA per layer);
* ``graph``: the decode graph, the default, where the KV store and the
  attention are traced into the body (``layers.traced_decode_attention``).

With ``--llamacpp-python`` (or ``MINIPAGED_LLAMACPP_PYTHON``) llama.cpp serves
the same chats from the same file in each round of the ``gguf`` mode. Records
every round, the medians, whether both paths gave the same greedy tokens
(first divergence of each request) and the memory bandwidth; writes
``decode_graph_cpu.json`` to ``--out``. A repository script: not part of the
package.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

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


def run_mode(model: str, mode: str, args: argparse.Namespace) -> dict:
    """One mode's engine, each path in turn (see the module doc)."""
    llm = LLM(model, quantization=mode, dtype=args.dtype, enforce_eager=False,
              enable_prefix_caching=False)
    compiled = llm.engine.executor.runner.compiled
    paths = {"op": None, "graph": compiled._decode}
    chats = chat_prompt_ids(llm, args.single)
    workloads = {"chats": chats, "long": [[100 + i % 1000 for i in range(args.long)]]}
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    tokens_per_second(llm, chats[:1], SamplingParams(max_tokens=4, ignore_eos=True), False)
    rounds = {name: {w: [] for w in workloads} for name in paths}
    outputs = {name: {} for name in paths}
    for r in range(args.rounds):
        for name, graph in paths.items():
            compiled._decode = graph
            for w, prompts in workloads.items():
                speed, tokens = tokens_per_second(llm, prompts, params, False)
                rounds[name][w].append(round(speed, 2))
                outputs[name][w] = tokens
            print(f"{mode} round {r + 1}: {name:5s} " + ", ".join(
                f"{w} {rounds[name][w][-1]:6.1f} tok/s" for w in workloads), flush=True)
        if mode == "gguf" and args.llamacpp_python:
            peer = llamacpp_tokens_per_second(args.llamacpp_python, model, chats, args.tokens)
            rounds.setdefault("llama.cpp", {"chats": []})["chats"].append(
                round(peer["tokens_per_s"], 2))
            print(f"{mode} round {r + 1}: llama.cpp chats {peer['tokens_per_s']:6.1f} tok/s",
                  flush=True)
    compiled._decode = paths["graph"]
    medians = {name: {w: statistics.median(v) for w, v in runs.items()}
               for name, runs in rounds.items()}
    return {
        "mode": mode,
        "rounds": rounds,
        "median_tokens_per_s": medians,
        "speedup": {w: round(medians["graph"][w] / medians["op"][w], 3) for w in workloads},
        "first_divergence": {w: [first_divergence(a, b) for a, b in
                                 zip(outputs["op"][w], outputs["graph"][w])]
                             for w in workloads},
    }


def main(argv=None) -> None:
    parser = side_by_side_parser(__doc__)
    parser.add_argument("--long", type=int, default=400, help="the long request's prompt tokens")
    args = parser.parse_args(argv)
    record = run_modes(args, run_mode, "decode_graph",
                       {"single": args.single, "long_prompt": args.long})
    results = record["results"]
    print("\n| mode | op, chats | graph, chats | x | op, long | graph, long | x "
          "| first divergences (chats) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        o, g, x = r["median_tokens_per_s"]["op"], r["median_tokens_per_s"]["graph"], r["speedup"]
        print(f"| {r['mode']} | {o['chats']:.1f} | {g['chats']:.1f} | {x['chats']:.2f} | "
              f"{o['long']:.1f} | {g['long']:.1f} | {x['long']:.2f} | "
              f"{r['first_divergence']['chats']} |")
        peer = r["median_tokens_per_s"].get("llama.cpp")
        if peer:
            print(f"| llama.cpp, same file | | {peer['chats']:.1f} | | | | | |")
    print(f"memory bandwidth {record['bandwidth_gbs']} GB/s")
    save_record(record, Path(args.out) / "decode_graph_cpu.json")


if __name__ == "__main__":
    main()
