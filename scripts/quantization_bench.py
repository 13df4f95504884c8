"""Quantized weights against float32: memory, speed and accuracy, with llama.cpp beside.

    python scripts/quantization_bench.py                        # SmolLM2's Q4_1 GGUF file
    python scripts/quantization_bench.py --llamacpp-python /work/llamacpp-venv/bin/python
    python scripts/quantization_bench.py --modes none,gguf --quick
    python scripts/quantization_bench.py --compiled       # every mode's body compiled

Each mode (``--modes``, ``quantization=`` of ``LLM``: ``none`` dequantizes
the file to float32, ``gguf`` keeps its blocks, ``int8`` requantizes every
linear layer per channel; ``gguf:fp8`` the same with an 8-bit KV cache)
runs in a process of its own, one after the other, with the same requests,
and records:

- memory: the weights' resident bytes (``quantization.linear.resident_weight_bytes``),
  the process's resident set right after loading (``VmRSS``, the default pool
  allocated), the pool's blocks and bytes;
- accuracy: perplexity over ``bench.perplexity.REFERENCE_TEXT``, and the
  single-user run's output tokens against the first mode's (the first
  divergence of each request);
- speed: one request at a time over ``--single-requests`` chats (greedy,
  exactly their output lengths, end of text ignored) and ``--batch-requests``
  chats submitted at once, output tokens/s of each;
- the batch memory allows: ``--memory-requests`` chats (more than any pool
  here holds at once, so memory and not the request count sets the batch)
  through a pool of ``--pool-mb`` MB (as many blocks as fit at this mode's
  bytes per block), the peak of requests running at once.

With ``--llamacpp-python`` (or ``MINIPAGED_LLAMACPP_PYTHON``), llama.cpp
serves the single-user requests from the same GGUF file with ``--threads``
threads (``llamacpp_worker.py``), its tokens compared too. With
``--compiled`` every mode runs its model body compiled by Inductor
(``enforce_eager=False``; the compile time is recorded, and the memory-bound
run, which counts requests, stays eager). Writes
``quantization_[compiled_]<model>_cpu.json`` and ``.png`` to ``--out``
(default ``assets/``) and prints the table. A repository script: it runs a peer.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from minipaged.bench.harness import environment, read_json, save_record, write_json  # noqa: E402
from minipaged.bench.spec_decode import first_divergence  # noqa: E402


def rss_bytes() -> int:
    """This process's resident set now (``VmRSS``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# -- a mode's worker ---------------------------------------------------------------------

def run_mode(spec: dict) -> dict:
    import torch

    from minipaged import LLM, SamplingParams
    from minipaged.bench.perplexity import perplexity
    from minipaged.quantization.linear import resident_weight_bytes

    torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    llm = LLM(spec["model"], quantization=spec["mode"], kv_cache_dtype=spec["kv_cache_dtype"],
              dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              enable_prefix_caching=False, enforce_eager=not spec["compiled"])
    load_s = time.perf_counter() - start
    engine = llm.engine
    record = {"mode": spec["mode"], "kv_cache_dtype": spec["kv_cache_dtype"],
              "load_s": load_s, "compile_s": engine.executor.runner.compile_seconds,
              "rss_after_load": rss_bytes(),
              "weight_bytes": resident_weight_bytes(engine.model),
              "pool_blocks": engine.stats.total_blocks,
              "kv_bytes_per_token": engine.executor.kv_config.kv_bytes_per_token}

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def serve(prompts, lens) -> tuple[float, list[list[int]]]:
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [params(n) for n in lens], use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    record["perplexity"] = perplexity(llm, spec["text_ids"])
    serve(spec["single_prompts"][:1], [8])                       # warm-up
    seconds, outputs = 0.0, []
    for p, n in zip(spec["single_prompts"], spec["single_lens"]):
        dt, out = serve([p], [n])
        seconds += dt
        outputs += out
    tokens = sum(map(len, outputs))
    record["single"] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                        "outputs": outputs}
    dt, outs = serve(spec["batch_prompts"], spec["batch_lens"])
    tokens = sum(map(len, outs))
    record["batch"] = {"seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt}
    record["rss_end"] = rss_bytes()
    block_bytes = engine.executor.kv_block_bytes
    llm.close()
    record["memory_bound"] = memory_bound_batch(spec, block_bytes, params)
    return record


def memory_bound_batch(spec: dict, block_bytes: int, params) -> dict:
    """The batch a fixed pool of ``spec["pool_bytes"]`` holds: the memory-bound
    requests submitted at once to an engine with only that pool (its blocks:
    the bytes over this mode's block size), stepped to the end; the peak of
    running requests is the batch the memory allowed."""
    from minipaged.engine import LLMEngine

    blocks = spec["pool_bytes"] // block_bytes
    engine = LLMEngine(spec["model"], quantization=spec["mode"],
                       kv_cache_dtype=spec["kv_cache_dtype"], dtype=spec["dtype"],
                       max_model_len=min(spec["max_model_len"], blocks * 16),
                       num_gpu_blocks_override=blocks, enable_prefix_caching=False,
                       preemption_mode="recompute")
    for i, (p, n) in enumerate(zip(spec["memory_prompts"], spec["memory_lens"])):
        engine.add_request(str(i), None, params(n), prompt_token_ids=p)
    peak, steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats.num_running)
        steps += 1
        if steps > 100_000:
            raise RuntimeError("memory-bound run did not finish")   # a step watchdog
    seconds = time.perf_counter() - start
    stats = engine.stats
    engine.close()
    return {"pool_bytes": spec["pool_bytes"], "blocks": blocks, "peak_running": peak,
            "requests": len(spec["memory_prompts"]),
            "preemptions": stats.num_preemptions, "seconds": seconds,
            "tokens_per_s": stats.num_generated_tokens / seconds}


# -- the driver ----------------------------------------------------------------------------

def workload(model: str, args) -> dict:
    """Prompt ids (through the chat template), output lengths and the text's ids."""
    import numpy as np

    from minipaged.bench.chat_prompts import chat_conversations
    from minipaged.bench.perplexity import text_token_ids
    from minipaged.input_processor import load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    n = max(args.single_requests, args.batch_requests, args.memory_requests)
    prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
               for c in chat_conversations(n)]
    lo, hi = args.output_len
    lens = [int(x) for x in np.random.default_rng(0).integers(lo, hi + 1, size=n)]
    return {"single_prompts": prompts[:args.single_requests],
            "single_lens": lens[:args.single_requests],
            "batch_prompts": prompts[:args.batch_requests],
            "batch_lens": lens[:args.batch_requests],
            "memory_prompts": prompts[:args.memory_requests],
            "memory_lens": lens[:args.memory_requests],
            "text_ids": text_token_ids(tokenizer)}


def run_worker(command: list[str], spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        write_json(spec_path, spec)
        proc = subprocess.run([*command, "--spec", str(spec_path), "--result", str(result_path)],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode or not result_path.is_file():
            return {"error": proc.stderr[-3000:]}
        return read_json(result_path)


def compare(record: dict) -> None:
    """Each run's single-user tokens against the first mode's: requests equal and
    the first divergence of the others."""
    runs = record["runs"]
    base = runs[0]["single"]["outputs"]
    for run in runs[1:] + ([record["llamacpp"]] if "outputs" in record.get("llamacpp", {}) else []):
        outs = run["single"]["outputs"] if "single" in run else run["outputs"]
        div = [first_divergence(a, b) for a, b in zip(base, outs)]
        run["agreement"] = {"equal_requests": sum(d is None for d in div), "of": len(div),
                            "first_divergence": div}


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def table(record: dict) -> list[str]:
    base = record["runs"][0]
    lines = ["| mode | activations | KV | weights | RSS after load | pool blocks | perplexity | "
             "1 user tok/s | x | 32 at once tok/s | x | batch in the small pool | "
             "tokens equal to none |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["runs"]:
        if "error" in r:
            lines.append(f"| {r.get('mode')} | error: {r['error'][-200:]} |")
            continue
        agree = r.get("agreement")
        agree_text = (f"{agree['equal_requests']}/{agree['of']} requests; first divergence "
                      f"{agree['first_divergence']}" if agree else "(reference)")
        lines.append(
            f"| {r['mode']} | {r['dtype']} | {r['kv_cache_dtype']} | {mb(r['weight_bytes'])} | "
            f"{mb(r['rss_after_load'])} | {r['pool_blocks']} | {r['perplexity']:.3f} | "
            f"{r['single']['tokens_per_s']:.1f} | "
            f"{r['single']['tokens_per_s'] / base['single']['tokens_per_s']:.2f} | "
            f"{r['batch']['tokens_per_s']:.1f} | "
            f"{r['batch']['tokens_per_s'] / base['batch']['tokens_per_s']:.2f} | "
            f"{r['memory_bound']['peak_running']} ({r['memory_bound']['blocks']} blocks) | "
            f"{agree_text} |")
    lc = record.get("llamacpp")
    if lc and "tokens_per_s" in lc:
        agree = lc.get("agreement", {})
        lines.append(f"| {lc['engine']}, {lc['threads']} threads | | | | | | | "
                     f"{lc['tokens_per_s']:.1f} | "
                     f"{lc['tokens_per_s'] / base['single']['tokens_per_s']:.2f} | | | | "
                     f"{agree.get('equal_requests')}/{agree.get('of')} requests |")
    elif lc:
        lines.append(f"| llama.cpp | error: {lc.get('error', '')[-200:]} |")
    return lines


def plot(record: dict, path: Path) -> None:
    from minipaged.bench.harness import pyplot, save_figure

    plt = pyplot(path)
    if plt is None:
        return
    runs = [r for r in record["runs"] if "error" not in r]
    names = [r["mode"] + ("\nbf16 act." if r["dtype"] == "bfloat16" else "")
             + (f"\nKV {r['kv_cache_dtype']}" if r["kv_cache_dtype"] != "auto" else "")
             for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    axes[0].bar(names, [r["weight_bytes"] / 1e6 for r in runs], color="#4c72b0")
    axes[0].set_title("weights resident (MB)")
    single = [r["single"]["tokens_per_s"] for r in runs]
    labels = list(names)
    lc = record.get("llamacpp", {})
    if "tokens_per_s" in lc:
        single.append(lc["tokens_per_s"])
        labels.append("llama.cpp\n(same file)")
    axes[1].bar(labels, single, color=["#55a868"] * len(runs) + ["#c44e52"] * (
        len(labels) - len(runs)))
    axes[1].set_title("one request at a time (tokens/s)")
    axes[2].bar(names, [r["batch"]["tokens_per_s"] for r in runs], color="#8172b2")
    axes[2].set_title(f"{len(record['workload']['batch_lens'])} requests at once (tokens/s)")
    axes[3].bar(names, [r["memory_bound"]["peak_running"] for r in runs], color="#dd8452")
    pool_mb = runs[0]["memory_bound"]["pool_bytes"] / 1e6
    axes[3].set_title(f"requests batched in a {pool_mb:.0f} MB KV pool")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    body = "compiled model body" if record.get("compiled") else "eager"
    fig.suptitle(f"{record['model']} on {record['environment']['device']} ({body})", fontsize=10)
    save_figure(fig, path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2's Q4_1)")
    parser.add_argument("--modes", default="none,gguf,gguf@bfloat16,int8,none:fp8,gguf:fp8",
                        help="comma-separated quantization modes, each optionally with a KV "
                             "cache dtype after a colon (gguf:fp8) and an activation dtype "
                             "after an at sign (gguf@bfloat16; default --dtype)")
    parser.add_argument("--pool-mb", type=float, default=24,
                        help="the pool of the memory-bound run, in MB")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--single-requests", type=int, default=6)
    parser.add_argument("--batch-requests", type=int, default=32)
    parser.add_argument("--memory-requests", type=int, default=64,
                        help="requests of the memory-bound run (more than its pool holds)")
    parser.add_argument("--output-len", default="32..256")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--llamacpp-python", default=os.environ.get("MINIPAGED_LLAMACPP_PYTHON"))
    parser.add_argument("--compiled", action="store_true",
                        help="run every mode with its model body compiled (enforce_eager=False)")
    parser.add_argument("--quick", action="store_true",
                        help="2 single and 4 batched requests of 8..16 tokens")
    parser.add_argument("--out", default=str(HERE.parent / "assets"))
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        write_json(args.result, run_mode(read_json(args.spec)))
        return {}
    if args.quick:
        args.single_requests, args.batch_requests, args.output_len = 2, 4, "8..16"
        args.memory_requests = 4
    lo, _, hi = args.output_len.partition("..")
    args.output_len = (int(lo), int(hi or lo))
    from minipaged.assets import SMOLLM2_NAME, smollm2_path

    model = args.model or str(smollm2_path())
    name = SMOLLM2_NAME if args.model is None else Path(model).stem
    work = workload(model, args)
    base = {"model": model, "threads": args.threads, "dtype": args.dtype,
            "pool_bytes": int(args.pool_mb * 1e6), "compiled": args.compiled,
            "max_model_len": args.max_model_len, **work}
    runs = []
    for item in args.modes.split(","):
        item, _, dtype = item.partition("@")
        mode, _, kv = item.partition(":")
        kv, dtype = kv or "auto", dtype or args.dtype
        print(f"-- {mode}, KV {kv}, {dtype} activations", flush=True)
        spec = {**base, "mode": mode, "kv_cache_dtype": kv, "dtype": dtype}
        run = run_worker([sys.executable, __file__, "--worker"], spec, args.timeout)
        runs.append({"mode": mode, "kv_cache_dtype": kv, "dtype": dtype, **run})
    record = {"benchmark": "quantization", "model": name, "file": Path(model).name,
              "compiled": args.compiled,
              "environment": environment("cpu"), "workload": {
                  k: work[k] for k in ("single_lens", "batch_lens", "memory_lens")} | {
                  "output_len": list(args.output_len), "greedy": True, "ignore_eos": True,
                  "text_tokens": len(work["text_ids"])},
              "runs": runs}
    if args.llamacpp_python:
        print("-- llama.cpp", flush=True)
        record["llamacpp"] = run_worker(
            [args.llamacpp_python, str(HERE / "llamacpp_worker.py")],
            {"model": model, "threads": args.threads, "n_ctx": args.max_model_len,
             "prompts": work["single_prompts"], "output_lens": work["single_lens"]},
            args.timeout)
    if "error" not in runs[0]:
        compare(record)
    record["table"] = table(record)
    out = Path(args.out)
    tag = ("quick_" if args.quick else "") + ("compiled_" if args.compiled else "")
    save_record(record, out / f"quantization_{tag}{name}_cpu.json",
                plot=plot if "error" not in runs[0] else None)
    print("\n".join(record["table"]))
    return record


if __name__ == "__main__":
    main()
