"""Kernel benchmark: paged decode bandwidth and prefill throughput against SDPA.

    python -m minipaged.bench.kernels            # on a CUDA GPU; writes assets/
    python -m minipaged.bench.kernels --quick    # a small grid

Decode: batch x context grid at Llama-3-8B shapes (32 query heads, 8 KV
heads, head size 128, bf16). Our ``paged_attention`` reads K/V through
shuffled block tables; ``torch.nn.functional.scaled_dot_product_attention``
reads the same K/V stored contiguously. Achieved bandwidth = bytes of Q, K,
V and O moved / median time, shown beside the device's measured copy
bandwidth. Prefill: causal attention over whole prompts, TFLOP/s of both.
Writes ``kernel_bench.json`` (with the GPU name, date and versions) and
``kernel_bench.png`` to ``--out``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .harness import arguments, bench_ms, environment, parse, pyplot, save_figure, save_record

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = [1, 4, 16, 32, 64, 128, 256]
DECODE_CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
PREFILL_LENS = [512, 1024, 2048, 4096, 8192]
MAX_TOKENS = 1 << 22  # cap batch x context: 16 GiB of bf16 K+V per copy


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3)


def _paged_kv(batch: int, context: int, dtype, device, gen):
    """Random K/V for ``batch`` sequences of ``context`` tokens in shuffled blocks."""
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, dtype=dtype, device=device,
                          generator=gen)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    return k_cache, v_cache, perm.view(batch, per_seq)


def _contiguous(cache, block_tables, context):
    """[B, Hkv, context, D]: the same K/V laid out contiguously, for SDPA."""
    b = block_tables.shape[0]
    flat = cache[block_tables.long()].reshape(b, -1, HKV, HEAD_DIM)[:, :context]
    return flat.transpose(1, 2).contiguous()


def bench_decode(batch: int, context: int, device, dtype=torch.bfloat16) -> dict:
    from ..kernels import paged_attention
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + context)
    k_cache, v_cache, tables = _paged_kv(batch, context, dtype, device, gen)
    q = torch.randn(batch, HQ, HEAD_DIM, dtype=dtype, device=device, generator=gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    # The caches are bound as defaults, not closed over: the del below then
    # removes the function's last references to them, as before.
    ours = bench_ms(lambda k_cache=k_cache, v_cache=v_cache:
                    paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl,
                                    max_query_len=1, max_seq_len=context), device)
    k, v = _contiguous(k_cache, tables, context), _contiguous(v_cache, tables, context)
    del k_cache, v_cache
    q4 = q.unsqueeze(2)                                                   # [B, Hq, 1, D]
    sdpa = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        q4, k, v, enable_gqa=True), device)
    elem = torch.finfo(dtype).bits // 8
    nbytes = elem * (2 * batch * HQ * HEAD_DIM + 2 * batch * context * HKV * HEAD_DIM)
    return {"batch": batch, "context": context, "bytes": nbytes, "ours_ms": ours,
            "sdpa_ms": sdpa, "ours_GBps": nbytes / ours / 1e6, "sdpa_GBps": nbytes / sdpa / 1e6}


def bench_prefill(length: int, device, batch: int = 1, dtype=torch.bfloat16) -> dict:
    from ..kernels import paged_attention
    gen = torch.Generator(device=device).manual_seed(length)
    k_cache, v_cache, tables = _paged_kv(batch, length, dtype, device, gen)
    q = torch.randn(batch * length, HQ, HEAD_DIM, dtype=dtype, device=device, generator=gen)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device) * length
    ours = bench_ms(lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl,
                                            max_query_len=length, max_seq_len=length), device)
    k, v = _contiguous(k_cache, tables, length), _contiguous(v_cache, tables, length)
    q4 = q.view(batch, length, HQ, HEAD_DIM).transpose(1, 2).contiguous()
    sdpa = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        q4, k, v, is_causal=True, enable_gqa=True), device)
    flops = 4 * batch * HQ * HEAD_DIM * length * length / 2   # causal: half the square
    return {"batch": batch, "length": length, "ours_ms": ours, "sdpa_ms": sdpa,
            "ours_TFLOPs": flops / ours / 1e9, "sdpa_TFLOPs": flops / sdpa / 1e9}


def run(device: torch.device, batches, contexts, prefill_lens, copy_bytes: int,
        progress: bool = True) -> dict:
    from tqdm import tqdm
    result = {"env": environment(device),
              "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM,
                         "block_size": BLOCK_SIZE, "dtype": "bfloat16"},
              "copy_GBps": copy_bandwidth(device, copy_bytes) / 1e9,
              "decode": [], "prefill": []}
    grid = [(b, c) for b in batches for c in contexts if b * c <= MAX_TOKENS]
    for b, c in tqdm(grid, desc="decode", disable=not progress):
        result["decode"].append(bench_decode(b, c, device))
        torch.cuda.empty_cache() if device.type == "cuda" else None
    for n in tqdm(prefill_lens, desc="prefill", disable=not progress):
        result["prefill"].append(bench_prefill(n, device))
    return result


def summary_lines(result: dict) -> list[str]:
    """The headline: decode at batch >= 32 and context >= 4096."""
    copy = result["copy_GBps"]
    lines = [f"device: {result['env']['device']}  copy bandwidth {copy:.0f} GB/s",
             f"{'batch':>6}{'context':>8}{'ours GB/s':>11}{'% copy':>8}{'SDPA GB/s':>11}"
             f"{'ours/SDPA time':>16}"]
    for r in result["decode"]:
        if r["batch"] >= 32 and r["context"] >= 4096:
            lines.append(f"{r['batch']:>6}{r['context']:>8}{r['ours_GBps']:>11.0f}"
                         f"{r['ours_GBps'] / copy:>8.0%}{r['sdpa_GBps']:>11.0f}"
                         f"{r['ours_ms'] / r['sdpa_ms']:>16.2f}")
    for r in result["prefill"]:
        lines.append(f"prefill {r['length']:>6} tokens: ours {r['ours_TFLOPs']:.0f} TFLOP/s, "
                     f"SDPA {r['sdpa_TFLOPs']:.0f} TFLOP/s")
    return lines


def plot(result: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    batches = sorted({r["batch"] for r in result["decode"]})
    colors = plt.cm.viridis([i / max(1, len(batches) - 1) for i in range(len(batches))])
    for b, c in zip(batches, colors):
        rows = [r for r in result["decode"] if r["batch"] == b]
        x = [r["context"] for r in rows]
        ax1.plot(x, [r["ours_GBps"] for r in rows], "-o", color=c, ms=3, label=f"batch {b}")
        ax1.plot(x, [r["sdpa_GBps"] for r in rows], "--", color=c, alpha=0.6)
    ax1.axhline(result["copy_GBps"], color="k", lw=1, ls=":", label="device copy")
    ax1.set(xscale="log", xlabel="context (tokens)", ylabel="GB/s",
            title="decode: paged Triton (solid) vs SDPA contiguous (dashed)")
    ax1.legend(fontsize=7)
    pre = result["prefill"]
    ax2.plot([r["length"] for r in pre], [r["ours_TFLOPs"] for r in pre], "-o",
             label="paged Triton")
    ax2.plot([r["length"] for r in pre], [r["sdpa_TFLOPs"] for r in pre], "--s", label="SDPA")
    ax2.set(xscale="log", xlabel="prompt length", ylabel="TFLOP/s", title="causal prefill, batch 1")
    ax2.legend()
    env = result["env"]
    fig.suptitle(f"{env['device']} · {env['date']} · torch {env['torch']} · triton {env['triton']}"
                 f" · Llama-3-8B heads (32 q / 8 kv, d=128, bf16)", fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> dict:
    args = parse(arguments(__doc__, out_help="folder for kernel_bench.json/.png", out="assets",
                           quick="a small grid"), argv)
    if not torch.cuda.is_available():
        raise SystemExit("the kernel benchmark needs a CUDA GPU (the kernels' CPU tests run "
                         "under pytest with TRITON_INTERPRET=1)")
    os.environ.pop("TRITON_INTERPRET", None)
    device = torch.device("cuda")
    if args.quick:
        result = run(device, [1, 32, 128], [1024, 4096, 16384], [1024, 4096], 1 << 30)
    else:
        result = run(device, DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_LENS, 1 << 31)
    save_record(result, Path(args.out) / "kernel_bench.json", plot)
    print("\n".join(summary_lines(result)))
    return result


if __name__ == "__main__":
    main()
