"""CUDA graphs versus eager on one engine: parity, then decode latency at batch 1.

    python scripts/cuda_graphs_check.py --out cuda_graphs.json      # CUDA only

``gpu_check``'s ``graphs`` step runs it; a GPU-only check of the engine
against itself, so a repository script rather than one of the package's
benchmarks.

A random Llama-shaped checkpoint is written first (by ``transformers``,
nothing downloaded): 8 layers, hidden size 1024, 16 query and 4 KV heads,
vocabulary 32000, tied embeddings, about 100M parameters: enough layers that
a decode step launches a few hundred kernels, small enough to build in seconds.

1. Parity, in float32, so that the two paths differ by rounding only (the
   graphs' decode kernel splits the KV in a number of parts fixed for
   ``max_model_len``, the eager one chooses from the batch's real lengths).
   One engine with graphs (``max_num_seqs=8``: buckets 1, 2, 4, 8) generates
   greedily for 8 prompts of 1 to 300 tokens with 8 to 32 new tokens each,
   so the batch shrinks through the buckets; then the same engine with its
   graphs switched off generates again. Every token must be equal; a
   difference is counted as a near-tie rather than a failure only where the
   eager run's two candidates are within ``NEAR_TIE`` in log-probability.
   The logits of single decode steps at batch 1, 3 and 8 (padded to 1, 4
   and 8) must agree within ``LOGITS_ATOL``.
2. Latency, in bfloat16: one request decoding after a 128-token prompt;
   milliseconds per ``LLMEngine.step`` (forward, sampling, outputs), the
   median of three runs of ``--steps`` steps, with graphs and eagerly.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from minipaged.bench.harness import arguments, build_model, environment, save_record

NEAR_TIE = 1e-3
LOGITS_ATOL = 1e-3
PROMPT_LENS = (1, 7, 16, 33, 64, 120, 200, 300)
MAX_TOKENS = (8, 16, 24, 32, 12, 20, 28, 32)
LOGITS_BATCHES = ((100,), (50, 2, 300), (2, 9, 17, 33, 64, 100, 180, 257))


SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
             tie_word_embeddings=True)


def make_llm(path: Path, dtype: str):
    from minipaged import LLM
    return LLM(str(path), dtype=dtype, device="cuda", attention_backend="triton",
               enforce_eager=False, max_num_seqs=8, max_model_len=2048,
               num_gpu_blocks_override=1024, swap_space=0)


@contextmanager
def eager(engine):
    """The engine with its graphs switched off (every step eager)."""
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        yield engine
    finally:
        engine.runner.graphs = graphs


def compare_tokens(graph_outs, eager_outs) -> dict:
    """Sequences equal, differing at a near-tie, or differing (a failure)."""
    equal = ties = mismatches = 0
    for g, e in zip(graph_outs, eager_outs):
        if g.token_ids == e.token_ids:
            equal += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b)
        top = e.logprobs[i]  # the eager run's top two (and its own choice)
        a, b = g.token_ids[i], e.token_ids[i]
        if a in top and abs(top[a] - top[b]) < NEAR_TIE:
            ties += 1
        else:
            mismatches += 1
    return {"equal": equal, "near_ties": ties, "mismatches": mismatches}


def decode_logits_diff(engine, prompt_lens, seed: int = 0) -> float:
    """Max |graph - eager| over the logits of one decode step of
    ``len(prompt_lens)`` sequences (their prompts but the last token cached)."""
    from minipaged.core.sequence import Sequence, SequenceGroup
    from minipaged.executor.model_runner import ScheduledSequence

    runner, block_size = engine.runner, engine.cache_config.block_size
    gen = torch.Generator().manual_seed(seed)
    seqs, batch = [], []
    try:
        with eager(engine):
            for i, n in enumerate(prompt_lens):
                ids = torch.randint(3, engine.model_config.vocab_size, (n,), generator=gen)
                seq = Sequence(-1 - i, ids.tolist(), block_size)
                engine.block_manager.allocate(SequenceGroup(f"logits-{i}", [seq]))
                seqs.append(seq)
                runner.execute([ScheduledSequence(seq, n - 1, is_prefill=True)])
                seq.num_computed_tokens = n - 1
                batch.append(ScheduledSequence(seq, 1))
        replays = runner.graphs.num_replays
        graph = runner.execute(batch)
        if runner.graphs.num_replays != replays + 1:
            raise RuntimeError(f"a decode batch of {len(batch)} did not replay a graph")
        with eager(engine):
            reference = runner.execute(batch)
        return (graph - reference).abs().max().item()
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)


def ms_per_decode_step(engine, steps: int, tag: str) -> float:
    from minipaged import SamplingParams

    params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
    engine.add_request(tag, None, params, prompt_token_ids=list(range(3, 131)))
    engine.step()  # the prompt and the first token
    engine.step()  # one decode step, not timed
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def parity(path: Path) -> dict:
    from minipaged import SamplingParams

    llm = make_llm(path, "float32")
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 32000, (n,), generator=gen).tolist()}
               for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2)
              for m in MAX_TOKENS]
    replays = engine.runner.graphs.num_replays
    graph_outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    replays = engine.runner.graphs.num_replays - replays
    with eager(engine):
        eager_outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    tokens = compare_tokens(graph_outs, eager_outs)
    diffs = {len(lens): decode_logits_diff(engine, lens) for lens in LOGITS_BATCHES}
    ok = (tokens["mismatches"] == 0 and replays > 0
          and all(d <= LOGITS_ATOL for d in diffs.values()))
    graphs = engine.runner.graphs
    result = {"dtype": "float32", "passed": ok, "tokens": tokens, "replays": replays,
              "decode_logits_max_abs_diff": diffs, "logits_atol": LOGITS_ATOL,
              "buckets": graphs.sizes, "num_kv_splits": graphs.num_kv_splits,
              "capture_seconds": graphs.capture_seconds, "graph_memory_bytes": graphs.memory_bytes}
    del llm, engine, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def latency(path: Path, steps: int) -> dict:
    llm = make_llm(path, "bfloat16")
    engine = llm.engine
    runs = {"graphs": [], "eager": []}
    for r in range(3):
        runs["graphs"].append(ms_per_decode_step(engine, steps, f"graphs-{r}"))
        with eager(engine):
            runs["eager"].append(ms_per_decode_step(engine, steps, f"eager-{r}"))
    ms = {mode: statistics.median(v) for mode, v in runs.items()}
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"dtype": "bfloat16", "batch": 1, "steps": steps, "ms_per_step": ms, "runs": runs,
            "speedup": ms["eager"] / ms["graphs"]}


def main(argv=None) -> dict:
    parser = arguments(__doc__, out_help="JSON file for the results", out="cuda_graphs.json")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the CUDA graphs benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), SHAPE, "bfloat16")
        record = {"environment": environment(device), "parity": parity(path),
                  "latency": latency(path, args.steps)}
    save_record(record, args.out)
    print("\n".join(summary_lines(record)))
    return record


def summary_lines(record: dict) -> list[str]:
    p, lat = record["parity"], record["latency"]
    t = p["tokens"]
    diffs = ", ".join(f"batch {b}: {d:.1e}" for b, d in p["decode_logits_max_abs_diff"].items())
    ms = lat["ms_per_step"]
    return [
        f"parity, graphs vs eager (fp32): {'PASS' if p['passed'] else 'FAIL'}: "
        f"{t['equal']}/{sum(t.values())} sequences token-for-token equal, "
        f"{t['near_ties']} near-ties, {t['mismatches']} mismatches; {p['replays']} replays",
        f"  decode logits max |diff| ({diffs}; tolerance {p['logits_atol']:.0e})",
        f"  {len(p['buckets'])} graphs captured in {p['capture_seconds']:.1f} s, "
        f"{p['graph_memory_bytes'] / 2**20:.0f} MiB",
        f"decode at batch 1 (bf16), ms per step: eager {ms['eager']:.2f}, "
        f"graphs {ms['graphs']:.2f} ({lat['speedup']:.2f}x)",
    ]


if __name__ == "__main__":
    main()
