"""What the Triton kernels would cost a real GPU, measured on any machine.

    python scripts/kernel_report.py [--out assets/kernel_resources.json]

Triton compiles ahead of time for a GPU target without one:
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` runs the
whole pipeline down to a cubin with the ``ptxas`` bundled in the triton
wheel, and the bundled ``cuobjdump --dump-resource-usage`` reads the
registers per thread, the stack (where ptxas spills registers it lacks) and
the static shared memory out of it. This module compiles every kernel the
engine can launch, in every configuration it can launch (dtypes, head sizes,
query heads per KV head, block sizes, the decode split counts; the store
and copy kernels; the quantized-weight GEMMs at each of their tile shapes),
for sm_80 and sm_90 (and sm_100 when the wheel bundles a
compiler for it), the attention, store and copy kernels also for an fp8 KV
cache (``kv_cache_dtype="fp8"``: the caches' uint8 bits, widened in the
kernel), and prints one table with the occupancy those resources
allow. It writes the table as JSON, with the Triton version (register counts
change from one Triton release to the next).

Each configuration is compiled exactly as the engine launches it: the
constexprs come from the same ``*_launch_config`` function the launcher
calls, and the other arguments are specialized as Triton's launcher does for
a contiguous cache of Llama-like shape (``Hkv = 8``): pointers 16-byte
aligned, integers divisible by 16 marked so (which lets loads be vectorized),
integers equal to 1 folded into constants. The GEMMs are compiled for a
4096 x 4096 weight (Llama-3-8B's attention projections).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

DTYPES = ("fp16", "bf16", "fp32")
HEAD_SIZES = (64, 80, 96, 128, 256)
GROUPS = (1, 4, 8)              # query heads per KV head
BLOCK_SIZES = (16, 32)
NUM_KV_HEADS = 8                # representative; the compiled code does not depend on it
ARCHS = (80, 90)
NEWER_ARCHS = (100,)            # compiled when the bundled ptxas knows them

# The resources of one streaming multiprocessor, sm_80 to sm_100 alike, but
# shared memory (CUDA programming guide, "compute capabilities" table).
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256             # registers are allocated per warp in units of 256
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32
MAX_REGISTERS_PER_THREAD = 255
SHARED_PER_SM = {80: 167936, 90: 233472, 100: 233472}       # bytes
SHARED_PER_PROGRAM = {80: 166912, 90: 232448, 100: 232448}  # the most one program may use
SHARED_RESERVED_PER_PROGRAM = 1024                          # kept by the driver per program

# The quantized-weight GEMMs (kernels.quant_gemm_triton): one M per tile shape
# of quant_gemm_launch_config (1: the GEMV; 16: one 16-row tile; 32, 64, 128
# rows and more: the prefill tiles), groups of 32 (GGUF) and 128 (GPTQ), and
# per-channel int8 (one group per row, group_size == K).
GEMM_KERNELS = {"w4a16": 4, "w8a16": 8}          # kernel: bits
GEMM_ROWS = (1, 16, 32, 64, 128)
GEMM_GROUPS = (32, 128)
GEMM_N = GEMM_K = 4096
KV_DTYPES = ("", "fp8")          # KernelConfig.kv: the activation dtype, float8 e4m3


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant: a kernel and the shape it is specialized for.

    ``kernel`` is one of "decode", "decode_merge", "prefill", "store_kv",
    "copy_blocks", "w4a16", "w8a16"; fields a kernel does not depend on are 0.
    The GEMMs use ``rows`` (M), ``group_size`` (``GEMM_K``: per-channel) and
    ``num_splits`` (for M <= 16: 1 writes the output, 2 stands for every
    count above 1, which write fp32 partials).
    """
    kernel: str
    arch: int
    dtype: str
    head_dim: int = 0
    group: int = 0
    block_size: int = 0
    num_splits: int = 0
    rows: int = 0
    group_size: int = 0
    # "fp8": the KV cache holds float8 e4m3 (prefill, decode, store_kv and
    # copy_blocks, whose dtype then does not matter); "": the activation dtype.
    kv: str = ""

    @property
    def label(self) -> str:
        parts = [self.kernel, f"sm_{self.arch}", self.dtype + (f"/{self.kv}" if self.kv else "")]
        for name, value in (("D", self.head_dim), ("G", self.group), ("bs", self.block_size),
                            ("splits", self.num_splits), ("M", self.rows),
                            ("gs", self.group_size)):
            if value:
                parts.append(f"{name}={value}")
        return " ".join(parts)


# -- which variants the engine launches -------------------------------------------------

def decode_split_counts() -> list[int]:
    """Every split count the automatic choice can return, any batch and
    context (``choose_num_splits`` rounds to powers of two up to MAX_SPLITS)."""
    from minipaged.kernels.paged_decode import MAX_SPLITS
    return [1 << i for i in range(MAX_SPLITS.bit_length())]


def all_configs(archs=ARCHS, dtypes=DTYPES, head_sizes=HEAD_SIZES, groups=GROUPS,
                block_sizes=BLOCK_SIZES, kv_fp8: bool = True) -> list[KernelConfig]:
    """Every variant the engine can launch with these shapes, for each target.

    Variants that compile to the same kernel are listed once: the decode
    kernel depends on the split count only through whether it writes
    partials (``decode_split_variants``); the merge kernel does not depend on
    the group, the block size or the split count, the store kernel not on the
    group. The copy kernel depends on the dtype and on its chunk, 4096
    elements for any block of at least that many (``NUM_KV_HEADS`` x 128 x 16
    has 16384); a smaller cache gets a smaller chunk. The GEMMs depend on
    none of the attention shapes (``gemm_configs``).
    """
    from minipaged.kernels.paged_decode import decode_split_variants
    splits = decode_split_counts()
    configs = []
    for arch in archs:
        for dtype in dtypes:
            for d in head_sizes:
                for g in groups:
                    for bs in block_sizes:
                        configs.append(KernelConfig("prefill", arch, dtype, d, g, bs))
                        configs += [KernelConfig("decode", arch, dtype, d, g, bs, n)
                                    for n in decode_split_variants(splits)]
                for bs in block_sizes:
                    configs.append(KernelConfig("store_kv", arch, dtype, d, 0, bs))
                # The merge kernel reads the split count at run time: one variant.
                configs.append(KernelConfig("decode_merge", arch, dtype, d, num_splits=2))
            configs.append(KernelConfig("copy_blocks", arch, dtype))
        configs += gemm_configs([arch], dtypes)
        if kv_fp8:
            configs += fp8_kv_configs([arch], dtypes, head_sizes, groups, block_sizes)
    return configs


def fp8_kv_configs(archs=ARCHS, dtypes=DTYPES, head_sizes=HEAD_SIZES, groups=GROUPS,
                   block_sizes=BLOCK_SIZES) -> list[KernelConfig]:
    """The variants an fp8 KV cache adds (``kv="fp8"``): the prefill, decode
    and store kernels at every shape, and the byte copy (one: it does not
    depend on the activations). The merge kernel reads fp32 partials, the
    same whatever the cache holds."""
    from minipaged.kernels.paged_decode import decode_split_variants
    splits = decode_split_counts()
    configs = []
    for arch in archs:
        for dtype in dtypes:
            for d in head_sizes:
                for g in groups:
                    for bs in block_sizes:
                        configs.append(KernelConfig("prefill", arch, dtype, d, g, bs, kv="fp8"))
                        configs += [KernelConfig("decode", arch, dtype, d, g, bs, n, kv="fp8")
                                    for n in decode_split_variants(splits)]
                configs += [KernelConfig("store_kv", arch, dtype, d, 0, bs, kv="fp8")
                            for bs in block_sizes]
        configs.append(KernelConfig("copy_blocks", arch, dtypes[0], kv="fp8"))
    return configs


def fp8_kv_representative_configs(archs=ARCHS) -> list[KernelConfig]:
    """The fp8 KV cache's variants in the CI subset: prefill and decode with
    partials at Llama-3-8B shapes in bf16 (head 128, 4 query heads per KV
    head, block size 16), one-split decode at an odd head size in fp16,
    prefill with fp32 activations (one pipeline stage), the store and the
    byte copy."""
    configs = []
    for arch in archs:
        configs += [KernelConfig("prefill", arch, "bf16", 128, 4, 16, kv="fp8"),
                    KernelConfig("decode", arch, "bf16", 128, 4, 16, 8, kv="fp8"),
                    KernelConfig("decode", arch, "fp16", 80, 1, 32, 1, kv="fp8"),
                    KernelConfig("prefill", arch, "fp32", 64, 1, 16, kv="fp8"),
                    KernelConfig("store_kv", arch, "bf16", 128, block_size=16, kv="fp8"),
                    KernelConfig("copy_blocks", arch, "bf16", kv="fp8")]
    return configs


def gemm_configs(archs=ARCHS, dtypes=DTYPES) -> list[KernelConfig]:
    """Every tile shape of the quantized GEMMs (``GEMM_ROWS``), for each group
    size (``GEMM_GROUPS``, and per-channel for int8) and, for M <= 16, both
    split variants (the split count is read at run time; with several the
    output is fp32 partials)."""
    from minipaged.kernels.quant_gemm_triton import SMALL_M
    configs = []
    for arch in archs:
        for dtype in dtypes:
            for kernel, bits in GEMM_KERNELS.items():
                groups = GEMM_GROUPS + ((GEMM_K,) if bits == 8 else ())
                for gs in groups:
                    for m in GEMM_ROWS:
                        splits = (1, 2) if m <= SMALL_M else (0,)
                        configs += [KernelConfig(kernel, arch, dtype, num_splits=n, rows=m,
                                                 group_size=gs) for n in splits]
    return configs


def representative_configs(archs=ARCHS) -> list[KernelConfig]:
    """A subset for CI that still reaches every kernel, every dtype, an odd
    (80), the usual (128) and the largest (256) head size, grouped and
    ungrouped queries, both block sizes and both decode variants (one split,
    and partials)."""
    configs = []
    for arch in archs:
        for kernel in ("prefill", "decode"):
            for dtype, d, g, bs in (("bf16", 128, 4, 16), ("fp16", 80, 1, 32),
                                    ("fp32", 256, 8, 16)):
                configs.append(KernelConfig(kernel, arch, dtype, d, g, bs,
                                            (1 if d != 128 else 8) if kernel == "decode" else 0))
        configs += [KernelConfig("decode_merge", arch, "bf16", 128, num_splits=2),
                    KernelConfig("store_kv", arch, "bf16", 128, block_size=16),
                    KernelConfig("copy_blocks", arch, "fp16"),
                    # The GEMMs: the GEMV (with partials), a 16-row tile (per-channel
                    # int8) and the largest prefill tile.
                    KernelConfig("w4a16", arch, "fp16", num_splits=2, rows=1, group_size=32),
                    KernelConfig("w4a16", arch, "bf16", rows=128, group_size=128),
                    KernelConfig("w8a16", arch, "fp32", num_splits=1, rows=16,
                                 group_size=GEMM_K),
                    KernelConfig("w8a16", arch, "bf16", rows=128, group_size=32)]
    return configs + fp8_kv_representative_configs(archs)


# -- compiling one variant ----------------------------------------------------------------

_TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _launch(config: KernelConfig):
    """(kernel, {argument: value or pointer type}, LaunchConfig) as the
    engine's launcher would call it for ``config``. Values are those of a
    contiguous layout with ``NUM_KV_HEADS`` KV heads; a pointer is given by
    its element type ("*bf16")."""
    import torch

    from minipaged.kernels import paged_decode as dec
    from minipaged.kernels.attention_triton import _prefill_kernel, prefill_launch_config
    from minipaged.kernels.copy_blocks_triton import _copy_blocks_kernel, copy_blocks_launch_config
    from minipaged.kernels.store_kv_triton import _store_kv_kernel, store_kv_launch_config

    dtype = getattr(torch, _TORCH_DTYPES[config.dtype])
    elem = f"*{config.dtype}"
    fp8 = config.kv == "fp8"
    cache = "*u8" if fp8 else elem      # an fp8 cache is launched as its uint8 view
    d, bs, hkv = config.head_dim, config.block_size, NUM_KV_HEADS
    hq = hkv * config.group
    # q and out [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; all contiguous.
    attention = dict(stride_qt=hq * d, stride_qh=d, stride_ot=hq * d, stride_oh=d,
                     stride_kb=bs * hkv * d, stride_kt=hkv * d, stride_kh=d,
                     stride_vb=bs * hkv * d, stride_vt=hkv * d, stride_vh=d,
                     stride_bt=None,  # not specialized (do_not_specialize)
                     q_ptr=elem, k_cache_ptr=cache, v_cache_ptr=cache, out_ptr=elem,
                     block_tables_ptr="*i32", seq_lens_ptr="*i32",
                     query_start_loc_ptr="*i32", scale_log2="fp32",
                     k_scale="fp32", v_scale="fp32")
    if config.kernel == "prefill":
        return (_prefill_kernel, dict(attention, tile_map_ptr="*i32"),
                prefill_launch_config(d, config.group, bs, dtype, fp8))
    if config.kernel == "decode":
        return (dec._decode_split_kernel,
                dict(attention, part_out_ptr="*fp32", part_lse_ptr="*fp32"),
                dec.decode_launch_config(d, config.group, bs, dtype, config.num_splits, fp8))
    if config.kernel == "decode_merge":
        return (dec._decode_merge_kernel,
                dict(out_ptr=elem, part_out_ptr="*fp32", part_lse_ptr="*fp32",
                     query_start_loc_ptr="*i32", stride_ot=hkv * d, stride_oh=d,
                     num_splits=None),  # not specialized (do_not_specialize)
                dec.merge_launch_config(d))
    if config.kernel == "store_kv":
        # key and value as views of a fused qkv projection (the largest row stride).
        row = (hkv * 4 + 2 * hkv) * d
        return (_store_kv_kernel,
                dict(key_ptr=elem, value_ptr=elem, k_cache_ptr=cache, v_cache_ptr=cache,
                     slot_ptr="*i64", k_scale="fp32", v_scale="fp32",
                     stride_kt=row, stride_kh=d, stride_vt=row, stride_vh=d,
                     stride_cb=bs * hkv * d, stride_ct=hkv * d, stride_ch=d),
                store_kv_launch_config(hkv, d, bs, fp8))
    if config.kernel == "copy_blocks":
        return (_copy_blocks_kernel,
                dict(k_ptrs="*i64", v_ptrs="*i64", mapping_ptr="*i64",
                     numel_per_block=16 * hkv * 128),
                copy_blocks_launch_config(torch.float8_e4m3fn if fp8 else dtype,
                                          16 * hkv * 128))
    if config.kernel in GEMM_KERNELS:
        from minipaged.kernels.quant_gemm_triton import _quant_gemm_kernel, quant_gemm_launch_config
        bits, m, n, k, gs = (GEMM_KERNELS[config.kernel], config.rows, GEMM_N, GEMM_K,
                             config.group_size)
        # x [M, K], q [N, K // 2] (int4) or [N, K], scales [N, K // gs], out [M, N]
        # (fp32 partials [splits, M, N] with several splits); all contiguous.
        return (_quant_gemm_kernel,
                dict(x_ptr=elem, q_ptr="*u8" if bits == 4 else "*i8", scale_ptr="*fp32",
                     offset_ptr="*fp32", out_ptr="*fp32" if config.num_splits > 1 else elem,
                     M=None, k_tiles_per_split=None,  # not specialized (do_not_specialize)
                     N=n, K=k, stride_xm=k, stride_qn=k * bits // 8, stride_sn=k // gs,
                     stride_om=n),
                quant_gemm_launch_config(m, n, k, gs, bits, dtype))
    raise ValueError(f"kernel must be one of decode, decode_merge, prefill, store_kv, "
                     f"copy_blocks, {', '.join(GEMM_KERNELS)}, got {config.kernel!r}")


def _specialize(fn, args: dict, constexprs: dict, aligned: bool = True):
    """Triton's signature, constexprs and attributes for a launch with
    ``args``, specialized as its launcher does: a pointer is 16-byte aligned
    (divisibility 16), an integer divisible by 16 is marked so, one equal to
    1 becomes a constant; ``None`` is an integer left unspecialized.

    ``aligned=False`` drops the divisibility facts, as for a launch whose
    strides are not multiples of 16 (or a compile that forgets them): loads
    can then not be proven 16-byte aligned, so they are not vectorized."""
    missing = [n for n in fn.arg_names if n not in args and n not in constexprs]
    if missing:
        raise ValueError(f"kernel_report does not know the arguments {missing} of "
                         f"{fn.__name__}: add them to _launch")
    signature, constants, attrs = {}, dict(constexprs), {}
    divisible = [["tt.divisibility", 16]]
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, str):
            signature[name] = value
            if value.startswith("*") and aligned:
                attrs[(i,)] = divisible
        elif value is None:
            signature[name] = "i32"
        elif value == 1:
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and aligned:
                attrs[(i,)] = divisible
    return signature, constants, attrs


def _tool(name: str) -> str | None:
    """A CUDA binary tool bundled with Triton's NVIDIA backend, else on PATH."""
    import triton.backends.nvidia as nvidia
    bundled = Path(nvidia.__file__).parent / "bin" / name
    return str(bundled) if bundled.is_file() else shutil.which(name)


def compile_variant(config: KernelConfig, aligned: bool = True):
    """Compile ``config`` to a cubin for its target: ``(CompiledKernel,
    num_warps)``. Needs Triton's CUDA backend, not a GPU; the kernels must not
    have been imported under ``TRITON_INTERPRET=1``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, args, launch = _launch(config)
    signature, constants, attrs = _specialize(fn, args, launch.constexprs, aligned)
    src = ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", config.arch, 32),
                            options=launch.options)
    return kernel, launch.num_warps


_RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    cuobjdump = _tool("cuobjdump")
    if cuobjdump is None:
        raise RuntimeError("cuobjdump was found neither in triton/backends/nvidia/bin nor on PATH")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, flag, f.name], check=True, capture_output=True,
                              text=True).stdout


def cubin_resources(cubin: bytes) -> dict:
    """Registers per thread, stack bytes, static shared and local memory of
    the one kernel in ``cubin`` (``cuobjdump --dump-resource-usage``)."""
    text = _cuobjdump(cubin, "--dump-resource-usage")
    m = _RESOURCES.search(text)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{text}")
    reg, stack, shared, local = map(int, m.groups())
    return dict(registers=reg, stack_bytes=stack, static_shared_bytes=shared, local_bytes=local)


# Global loads in SASS: LDG (to registers) and LDGSTS (cp.async, straight to
# shared memory), with their width as a suffix (none: 32 bits).
_GLOBAL_LOAD = re.compile(r"\b(?:LDGSTS|LDG)((?:\.[A-Z0-9_]+)*)")
_WIDTHS = {".128": 128, ".64": 64, ".U16": 16, ".S16": 16, ".U8": 8, ".S8": 8}


def global_loads(sass: str) -> dict[str, int]:
    """How many global-load instructions of each width (bits) a kernel's SASS
    (``cuobjdump -sass``) holds: ``{"128": 32, "32": 8}``. K and V tiles read
    with 128-bit loads move 8 bf16 values per instruction and thread."""
    counts: dict[str, int] = {}
    for suffix in _GLOBAL_LOAD.findall(sass):
        parts = re.findall(r"\.[A-Z0-9_]+", suffix)
        width = max([_WIDTHS[p] for p in parts if p in _WIDTHS], default=32)
        counts[str(width)] = counts.get(str(width), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -int(kv[0])))


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"\bBRA(?:\.[A-Z]+)* (?:`\()?.*?0x([0-9a-f]+)")


def spills_in_loops(sass: str) -> int:
    """Local-memory accesses (``LDL``/``STL``: spills) inside a loop of the
    SASS, a loop being the span of a backward branch. A value spilled before
    the KV loop and reloaded after it costs two accesses per program; one
    spilled inside costs one per tile."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in _SASS_LINE.finditer(sass)]
    loops = []
    for addr, text in lines:
        b = _BRANCH.search(text)
        if b and int(b.group(1), 16) < addr:          # backward (not the final self-loop)
            loops.append((int(b.group(1), 16), addr))
    return sum(1 for addr, text in lines if re.search(r"\b(?:LDL|STL)\b", text)
               and any(lo <= addr <= hi for lo, hi in loops))


def occupancy(arch: int, registers: int, num_warps: int, shared_bytes: int) -> dict:
    """Programs and warps one SM can hold at once, and what bounds them.

    Registers go to warps in units of ``REGISTER_UNIT``; shared memory to
    programs, each also costing the driver's reserved kilobyte.
    """
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    limits = {
        "warps": MAX_WARPS_PER_SM // num_warps,
        "programs": MAX_PROGRAMS_PER_SM,
        "registers": (REGISTERS_PER_SM // per_warp) // num_warps,
        "shared": (SHARED_PER_SM[arch] // (shared_bytes + SHARED_RESERVED_PER_PROGRAM)
                   if shared_bytes <= SHARED_PER_PROGRAM[arch] else 0),
    }
    programs = min(limits.values())
    bound = "+".join(k for k, v in limits.items() if v == programs)  # every limit reached
    return dict(programs_per_sm=programs, warps_per_sm=programs * num_warps, bound_by=bound)


def measure(config: KernelConfig, aligned: bool = True) -> dict:
    """Compile ``config`` and read its resources: a JSON-ready row
    (``aligned``: see ``_specialize``)."""
    t0 = time.perf_counter()
    row = asdict(config)
    try:
        kernel, num_warps = compile_variant(config, aligned)
        res = cubin_resources(kernel.asm["cubin"])
        sass = _cuobjdump(kernel.asm["cubin"], "-sass")
    except Exception as e:  # a variant that does not compile is a result, not a crash
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-2000:]}")
        return row
    # Triton's shared memory is dynamic: the cubin's SHARED is the static part only.
    shared = res["static_shared_bytes"] + int(kernel.metadata.shared)
    row.update(ok=True, num_warps=num_warps, num_stages=int(kernel.metadata.num_stages),
               spill_bytes=res["stack_bytes"] + res["local_bytes"], shared_bytes=shared,
               loop_spill_accesses=spills_in_loops(sass), global_loads=global_loads(sass),
               widest_load_bits=max(map(int, global_loads(sass)), default=0),
               **res, **occupancy(config.arch, res["registers"], num_warps, shared),
               compile_s=round(time.perf_counter() - t0, 2))
    return row


def compile_configs(configs: list[KernelConfig], jobs: int | None = None,
                    cache_dir: str | None = None, aligned: bool = True) -> list[dict]:
    """``measure`` every config in ``jobs`` worker processes; rows in the
    order of ``configs``.

    The workers are fresh interpreters (``python scripts/kernel_report.py
    --worker``) without ``TRITON_INTERPRET``,
    so the kernels are compiled even when the caller imported them for the
    interpreter (a test, a notebook), and they import this same minipaged.
    ``cache_dir``: Triton's cache for the workers (a fresh one forces every
    compile).
    """
    if not configs:
        return []
    jobs = max(1, min(len(configs), jobs or os.cpu_count() or 1))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache_dir:
        env["TRITON_CACHE_DIR"] = cache_dir
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    if not aligned:
        cmd.append("--unaligned")
    chunks = [configs[i::jobs] for i in range(jobs)]   # interleaved: similar work each

    def run(chunk: list[KernelConfig]) -> list[dict]:
        proc = subprocess.run(cmd, input=json.dumps([asdict(c) for c in chunk]), env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"kernel_report worker failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout)

    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(run, chunks))
    rows: list[dict] = [{}] * len(configs)
    for i, chunk_rows in enumerate(results):
        rows[i::jobs] = chunk_rows
    return rows


def _worker(aligned: bool) -> None:
    """Measure the configs given as JSON on stdin; print the rows as JSON."""
    import warnings
    warnings.simplefilter("ignore")   # Triton's notices would not reach anyone
    configs = [KernelConfig(**c) for c in json.loads(sys.stdin.read())]
    with contextlib.redirect_stdout(sys.stderr):    # stdout carries the rows only
        rows = [measure(c, aligned) for c in configs]
    json.dump(rows, sys.stdout)


def available_archs() -> list[int]:
    """sm_80 and sm_90, and the newer targets the bundled ptxas can compile."""
    archs = list(ARCHS)
    ptxas = _tool("ptxas-blackwell") or _tool("ptxas")
    for arch in NEWER_ARCHS:
        if ptxas and _ptxas_knows(ptxas, arch):
            archs.append(arch)
    return archs


def _ptxas_knows(ptxas: str, arch: int) -> bool:
    out = subprocess.run([ptxas, "--help"], capture_output=True, text=True).stdout
    return f"sm_{arch}" in out


# -- the report ---------------------------------------------------------------------------

def triton_version() -> str:
    import triton
    return triton.__version__


def format_table(rows: list[dict]) -> list[str]:
    """One line per variant: warps, registers per thread, spilled bytes and
    spill accesses inside loops, shared memory, the widest global load (bits)
    and the resident warps per SM those allow."""
    header = (f"{'kernel':<13} {'arch':<7} {'dtype':<8} {'D':>4} {'G':>2} {'bs':>3} "
              f"{'splits':>6} {'M':>4} {'gs':>4} {'warps':>5} {'regs':>4} {'spill':>5} "
              f"{'inloop':>6} {'smem':>7} {'load':>4} {'warps/SM':>8}  bound by")
    lines = [header, "-" * len(header)]
    for r in rows:
        dtypes = r["dtype"] + (f"/{r['kv']}" if r.get("kv") else "")   # bf16/fp8: fp8 KV
        shape = (f"{r['kernel']:<13} sm_{r['arch']:<4} {dtypes:<8} {r['head_dim'] or '':>4} "
                 f"{r['group'] or '':>2} {r['block_size'] or '':>3} {r['num_splits'] or '':>6} "
                 f"{r.get('rows') or '':>4} {r.get('group_size') or '':>4}")
        if not r["ok"]:
            lines.append(f"{shape} FAILED: {r['error'].splitlines()[0][:80]}")
            continue
        lines.append(f"{shape} {r['num_warps']:>5} {r['registers']:>4} {r['spill_bytes']:>5} "
                     f"{r['loop_spill_accesses']:>6} {r['shared_bytes']:>7} "
                     f"{r['widest_load_bits']:>4} "
                     f"{r['warps_per_sm']:>5}/64  {r['bound_by']}")
    return lines


# Issue 15's targets, on sm_90 in bf16 at Llama-3-8B shapes (head 128, 4 query
# heads per KV head, block size 16): decode spills nothing and keeps at least
# 16 warps resident per SM; prefill spills nothing for head sizes up to 256.
DECODE_MIN_WARPS_PER_SM = 16


def target_configs(archs=ARCHS) -> list[KernelConfig]:
    """The variants the targets name (bf16, G=4, block size 16): decode at
    head sizes 128 and 256 (both variants), prefill at every head size."""
    from minipaged.kernels.paged_decode import decode_split_variants
    configs = []
    for arch in archs:
        configs += [KernelConfig("decode", arch, "bf16", d, 4, 16, n) for d in (128, 256)
                    for n in decode_split_variants(decode_split_counts())]
        configs += [KernelConfig("prefill", arch, "bf16", d, 4, 16) for d in HEAD_SIZES]
    return configs


def target_lines(rows: list[dict]) -> list[str]:
    """The targets, each with its measured value and PASS or MISS (rows not
    compiled, e.g. a subset without them, are left out)."""
    def find(kernel, d, splits=0):
        return [r for r in rows if r["ok"] and r["kernel"] == kernel and r["arch"] == 90
                and r["dtype"] == "bf16" and not r.get("kv") and r["head_dim"] == d
                and r["group"] == 4
                and r["block_size"] == 16 and (not splits or r["num_splits"] == splits)]

    def narrow(r) -> int:
        # Loads of one bf16 element each: K and V read element by element
        # (Triton 3.6 does this when a KV tile spans several blocks).
        return sum(n for bits, n in r["global_loads"].items() if int(bits) < 32)

    lines = []
    for r in find("decode", 128):
        ok = (r["spill_bytes"] == 0 and r["warps_per_sm"] >= DECODE_MIN_WARPS_PER_SM
              and r["widest_load_bits"] == 128 and narrow(r) == 0)
        lines.append(f"{'PASS' if ok else 'MISS'} decode sm_90 bf16 D=128 splits="
                     f"{r['num_splits']}: {r['registers']} registers, {r['spill_bytes']} B "
                     f"spilled, {r['warps_per_sm']} warps/SM (bound by {r['bound_by']}), "
                     f"{r['widest_load_bits']}-bit loads, {narrow(r)} under 32 bits; want no "
                     f"spill, >= {DECODE_MIN_WARPS_PER_SM} warps, 128-bit loads, none under 32")
    for d in HEAD_SIZES:
        for r in find("prefill", d):
            ok = r["spill_bytes"] == 0 and narrow(r) == 0
            lines.append(f"{'PASS' if ok else 'MISS'} prefill sm_90 bf16 D={d}: "
                         f"{r['registers']} registers, {r['spill_bytes']} B spilled, "
                         f"{narrow(r)} loads under 32 bits; want no spill, none under 32")
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("assets/kernel_resources.json"),
                    help="the JSON to write; the table goes next to it as .txt")
    ap.add_argument("--jobs", type=int, default=None, help="compiling processes (default: CPUs)")
    ap.add_argument("--archs", default=None,
                    help="comma-separated SM versions (default: 80, 90 and newer ones bundled)")
    ap.add_argument("--subset", action="store_true",
                    help="only the representative subset that CI compiles")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--unaligned", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # one of compile_configs' processes
        _worker(aligned=not args.unaligned)
        return {}
    archs = ([int(a) for a in args.archs.split(",")] if args.archs else available_archs())
    configs = representative_configs(archs) if args.subset else all_configs(archs)
    t0 = time.time()
    rows = compile_configs(configs, args.jobs)
    # The targets' variants once more, without the divisibility facts a real
    # launch passes: what a launch with strides not multiple of 16 would get.
    unaligned = compile_configs(target_configs([a for a in archs if a in ARCHS]), args.jobs,
                                aligned=False)
    record = dict(triton=triton_version(), archs=archs, num_kv_heads=NUM_KV_HEADS,
                  compiled=len(rows), failed=sum(not r["ok"] for r in rows),
                  seconds=round(time.time() - t0), rows=rows, unaligned_rows=unaligned)
    table = format_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    spilling = [r for r in rows if r["ok"] and r["spill_bytes"]]
    summary = (f"Triton {record['triton']}: {len(rows)} variants compiled for "
               f"{', '.join(f'sm_{a}' for a in archs)}, {record['failed']} failed "
               f"({record['seconds']} s); {len(spilling)} spill (at most "
               f"{max([r['spill_bytes'] for r in spilling], default=0)} B), "
               f"{sum(r['loop_spill_accesses'] > 0 for r in spilling)} of them inside a loop")
    targets = target_lines(rows)
    record.update(summary=summary, targets=targets)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    unaligned_table = ["", "The targets' variants compiled without divisibility facts "
                       "(strides not multiples of 16):", ""] + format_table(unaligned)
    args.out.with_suffix(".txt").write_text(
        "\n".join([summary, ""] + targets + [""] + table + unaligned_table) + "\n")
    print("\n".join(table + unaligned_table + [""] + targets + ["", summary,
                     f"wrote {args.out} and {args.out.with_suffix('.txt')}"]))
    return record


if __name__ == "__main__":
    sys.exit(0 if main().get("failed", 0) == 0 else 1)
