"""Speculative decoding with a draft model against plain decoding: tokens/s, acceptance.

    python scripts/draft_model_bench.py          # SmolLM2-135M-Instruct: ~13 min, 2 cores
    python scripts/draft_model_bench.py --quick  # a tiny random model, to check it works

The target is SmolLM2-135M-Instruct with float32 weights
(``quantization="none"``); the drafts are the ones a user can build from it
without another checkpoint:

- ``gguf``: the same GGUF file with its weights kept quantized (Q4_1), which
  reads an eighth of the bytes per step and almost always agrees with the
  float32 model;
- ``layers-N`` (``--draft-layers``): the target's own first ``N`` layers with
  its final norm and head (``spec_decode.truncate``), an early exit nobody
  trained to exit early.

Each is run at every ``--ks`` value (the truncated drafts at ``--layers-k``
only), on the requests of ``assets/spec_decode_workloads.json`` (``quoting``
and ``chat``, greedy, chat template, ``--max-tokens``), at each batch size,
beside a plain run and the n-gram proposer's (``--ngram-k``) of the same
workload and batch. Per run, as in ``spec_decode``: tokens/s, speed-up over
plain, acceptance rate, mean tokens a verifying step emits, requests whose
tokens equal plain decoding's. Writes ``draft_model_cpu.json`` and ``.png``.

A script, not a ``minipaged bench`` entry: it records one measurement of the
drafts one can build from SmolLM2 (the package's ``spec_decode`` benchmark is
the one to rerun), on the package's own ``serve`` and workloads.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from minipaged.bench.harness import (
    arguments,
    environment,
    parse,
    pyplot,
    save_figure,
    save_record,
)
from minipaged.bench.spec_decode import (
    WORKLOADS,
    model_or_stand_in,
    ngram_config,
    report,
    serve,
)


def drafts_of(model: Path, gguf: bool, layers: list[int], where: Path) -> list[tuple[str, dict]]:
    """``(name, speculative_config without k)`` of each draft to run."""
    from minipaged.models.loader import load_hf_config
    from minipaged.spec_decode.truncate import truncated_draft

    drafts = []
    if gguf:
        drafts.append(("gguf", {"model": str(model), "quantization": "gguf"}))
    total = load_hf_config(model).num_hidden_layers
    for n in layers:
        # All of the target's layers: it drafts for itself (a check, not a speed-up).
        path = model if n == total else truncated_draft(model, n, where / f"layers-{n}")
        drafts.append((f"layers-{n}", {"model": str(path), "quantization": "none"}))
    return drafts


def main(argv: list[str] | None = None) -> dict:
    p = arguments(__doc__, out="assets", out_help="where the JSON and PNG go", threads=True,
                  quick="a tiny random model drafting for itself, two requests of each kind")
    p.add_argument("--ks", default="2,3,4,5")
    p.add_argument("--draft-layers", default="4")
    p.add_argument("--layers-k", type=int, default=3)
    p.add_argument("--ngram-k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,8")
    args = parse(p, argv)
    workloads = json.loads(WORKLOADS.read_text())
    tmp = tempfile.TemporaryDirectory()
    model, quick = model_or_stand_in(args.quick, Path(tmp.name))
    if quick:
        args.ks, args.draft_layers, args.layers_k, args.ngram_k = "2", "1", 2, 2
        args.max_tokens, args.batches = 16, "1,2"
        workloads = {name: workloads[name][:2] for name in ("quoting", "chat")}
    drafts = drafts_of(model, not quick, [int(n) for n in args.draft_layers.split(",") if n],
                       Path(tmp.name))
    record = {"model": str(model), "target": "float32/none", "environment": environment(),
              "workloads": {n: len(workloads[n]) for n in ("quoting", "chat")},
              "max_tokens": args.max_tokens, "runs": []}
    ks = [int(k) for k in args.ks.split(",")]
    for name in ("quoting", "chat"):
        for batch in (int(b) for b in args.batches.split(",")):
            def run(spec: dict | None, draft: str, what: str, plain: dict | None) -> dict:
                result = serve(str(model), "float32", "none", spec, workloads[name], batch,
                               args.max_tokens)
                result |= {"group": "float32/none", "workload": name, "draft": draft}
                record["runs"].append(report(result, plain or result, what))
                return result

            plain = run(None, "none", "plain", None)
            run(ngram_config(args.ngram_k, 2), "ngram", f"n-gram k {args.ngram_k}", plain)
            for draft, config in drafts:
                for k in ks if draft == "gguf" else [args.layers_k]:
                    spec = {"method": "draft_model", "num_speculative_tokens": k, **config}
                    run(spec, draft, f"draft {draft} k {k}", plain)
    if args.out:
        save_record(record, Path(args.out) / "draft_model_cpu.json", plot)
    tmp.cleanup()
    return record


def plot(record: dict, png: Path) -> None:
    """Speed-up and acceptance against k for each draft, per workload and batch."""
    plt = pyplot(png)
    if plt is None:
        return
    fig, (speed, accept) = plt.subplots(1, 2, figsize=(10, 4))
    drafts = sorted({r["draft"] for r in record["runs"]} - {"none", "ngram"})
    for name, style in (("quoting", "-"), ("chat", "--")):
        for batch in sorted({r["batch"] for r in record["runs"]}):
            for draft in drafts:
                runs = sorted((r for r in record["runs"] if r["draft"] == draft
                               and r["workload"] == name and r["batch"] == batch),
                              key=lambda r: r["k"])
                label = f"{draft}, {name}, batch {batch}"
                ks = [r["k"] for r in runs]
                speed.plot(ks, [r["speedup"] for r in runs], style, marker="o", label=label)
                accept.plot(ks, [r["acceptance_rate"] for r in runs], style, marker="o",
                            label=label)
    speed.axhline(1.0, color="grey", lw=0.8)
    speed.set(xlabel="draft tokens per step (k)", ylabel="tokens/s over plain",
              title="draft model: speed-up (float32 target)")
    accept.set(xlabel="draft tokens per step (k)", ylabel="kept / proposed",
               title="acceptance rate", ylim=(0, 1.05))
    speed.legend(fontsize=7)
    save_figure(fig, png)


if __name__ == "__main__":
    main()
