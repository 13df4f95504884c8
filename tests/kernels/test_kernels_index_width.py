"""Offsets that grow with the number of tokens are 64-bit in every kernel.

``T x Hq x D`` query/output elements (and ``S x Hq x splits x D_PAD`` split-KV
partials, and ``num_blocks x block`` cache elements) can pass 2^31 at long
contexts and big batches, where a 32-bit offset wraps and the kernel reads
or writes the wrong memory. Tensors that large do not fit here, so the
kernels are compiled for a CUDA target, which needs no GPU, and their Triton
IR is read instead: the address of every load from q / key / value /
partials / cache and every store to out / partials / cache must add a 64-bit
offset somewhere on its way from the kernel argument.

The attention kernels' cache reads must also stay cheap: the 64-bit part is
per block (or position), never per element of a tile (offsets inside a block
are 32-bit), and the block table is read once per block of a KV tile.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

import minipaged

pytestmark = [
    pytest.mark.cuda,  # gpu_check runs these on the GPU machine's Triton
    pytest.mark.skipif("nvidia" not in triton.backends.backends,
                       reason="Triton's CUDA backend cannot be imported")]

# Runs without TRITON_INTERPRET (the kernels must be real JITFunctions) and
# prints {label: TTIR}. Shapes are typical (fp16, Hq=32, Hkv=8, D=128); the
# width of an offset does not depend on them.
_COMPILE = r"""
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minipaged.kernels._common import dot_config
from minipaged.kernels.attention_triton import _prefill_kernel, _prefill_tiles
from minipaged.kernels.paged_decode import _decode_merge_kernel, _decode_split_kernel
from minipaged.kernels.store_kv_triton import _store_kv_kernel

upcast, precision = dot_config(torch.float16)
block_q, _ = _prefill_tiles(4, 128)
attn = dict(HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, GROUP=4, UPCAST=upcast, PRECISION=precision,
            KV_FP8=False)
fp8 = dict(attn, KV_FP8=True)

def ttir(fn, cache="*fp16", **constexprs):
    # Pointers f16 (tables i32, partials f32; an fp8 cache's, cache="*u8"),
    # plain ints i32, as a launch with ordinary strides specializes them.
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("k_cache_ptr", "v_cache_ptr"):
            sig[name] = cache
        elif name.endswith("_ptr"):
            sig[name] = ("*i32" if name.startswith(("block_tables", "seq_lens", "query_start",
                                                    "slot", "tile_map")) else
                         "*fp32" if name.startswith("part_") else "*fp16")
        else:
            sig[name] = "fp32" if name in ("scale_log2", "k_scale", "v_scale") else "i32"
    src = ASTSource(fn, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttir"]

# KV tiles of 64 positions, the launchers' choice from Triton 3.8 on (below
# it they take 16: kv_tile_positions), whatever this Triton is, and block
# sizes below, above and not a divisor of it (three ways to read the block
# table: per block, one entry per tile, per position).
big = dict(attn, BLOCK_SIZE=128)
odd = dict(attn, BLOCK_SIZE=24)
json.dump({
    "prefill": ttir(_prefill_kernel, G_PAD=4, BLOCK_Q=block_q, BLOCK_N=64, **attn),
    "prefill_bs128": ttir(_prefill_kernel, G_PAD=4, BLOCK_Q=block_q, BLOCK_N=64, **big),
    "decode": ttir(_decode_split_kernel, ROWS=16, BLOCK_N=64, WRITE_PARTS=False, **attn),
    "decode_split": ttir(_decode_split_kernel, ROWS=16, BLOCK_N=64, WRITE_PARTS=True, **attn),
    "decode_split_bs128": ttir(_decode_split_kernel, ROWS=16, BLOCK_N=64, WRITE_PARTS=True,
                               **big),
    "decode_split_bs24": ttir(_decode_split_kernel, ROWS=16, BLOCK_N=64, WRITE_PARTS=True,
                              **odd),
    "decode_merge": ttir(_decode_merge_kernel, HEAD_DIM=128, D_PAD=128),
    "store_kv": ttir(_store_kv_kernel, NUM_HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128,
                     BLOCK_SIZE=16, KV_FP8=False),
    # An fp8 cache (kv_cache_dtype="fp8"): its uint8 bits, widened in the kernel.
    "prefill_fp8": ttir(_prefill_kernel, "*u8", G_PAD=4, BLOCK_Q=block_q, BLOCK_N=64, **fp8),
    "decode_split_fp8": ttir(_decode_split_kernel, "*u8", ROWS=16, BLOCK_N=32,
                             WRITE_PARTS=True, **fp8),
    "store_kv_fp8": ttir(_store_kv_kernel, "*u8", NUM_HEADS=8, HEAD_DIM=128, H_PAD=8,
                         D_PAD=128, BLOCK_SIZE=16, KV_FP8=True),
}, sys.stdout)
"""

# (kernel, "load" or "store", pointer argument): accesses indexed by token or
# by split-KV partial, then the cache accesses (64-bit already; they keep it).
ACCESSES = [
    ("prefill", "load", "q_ptr"), ("prefill", "store", "out_ptr"),
    ("decode", "load", "q_ptr"), ("decode", "store", "out_ptr"),
    ("decode_split", "load", "q_ptr"), ("decode_split", "store", "part_out_ptr"),
    ("decode_merge", "load", "part_out_ptr"), ("decode_merge", "store", "out_ptr"),
    ("store_kv", "load", "key_ptr"), ("store_kv", "load", "value_ptr"),
    ("store_kv", "store", "k_cache_ptr"), ("store_kv", "store", "v_cache_ptr"),
    ("prefill_fp8", "load", "q_ptr"), ("prefill_fp8", "store", "out_ptr"),
    ("decode_split_fp8", "load", "q_ptr"), ("decode_split_fp8", "store", "part_out_ptr"),
    ("store_kv_fp8", "load", "key_ptr"), ("store_kv_fp8", "store", "k_cache_ptr"),
    ("store_kv_fp8", "store", "v_cache_ptr"),
]
# The attention kernels' cache reads, at every block-size case: (kernel,
# cache argument, BLOCK_SIZE, BLOCK_N).
CACHE_READS = [(k, arg, bs, 64) for k, bs in [("prefill", 16), ("prefill_bs128", 128),
                                              ("decode_split", 16), ("decode_split_bs128", 128),
                                              ("decode_split_bs24", 24), ("prefill_fp8", 16)]
               for arg in ("k_cache_ptr", "v_cache_ptr")]
CACHE_READS += [("decode_split_fp8", arg, 16, 32) for arg in ("k_cache_ptr", "v_cache_ptr")]
ACCESSES += [(k, "load", arg) for k, arg, _, _ in CACHE_READS]


@pytest.fixture(scope="module")
def ttirs(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(minipaged.__file__).resolve().parents[1])  # the minipaged under test
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"compiling the kernels for CUDA failed:\n{run.stderr[-3000:]}"
    return json.loads(run.stdout)


_DEF = re.compile(r"^\s*(%[\w.]+) = ([\w.]+) (.*?)(?: loc\(.*)?$")
_USE = re.compile(r"^\s*(?:%[\w.]+ = )?tt\.(load|store) (%[\w.]+)")
# Ops that carry a pointer along unchanged in value (shape only).
_SHAPE_OPS = {"tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape"}


def _definitions(ttir: str) -> dict[str, tuple[str, str]]:
    """SSA value -> (op, rest of its line)."""
    defs = {}
    for line in ttir.splitlines():
        m = _DEF.match(line)
        if m:
            defs[m.group(1)] = (m.group(2), m.group(3))
    return defs


def _trace(defs: dict[str, tuple[str, str]], value: str) -> tuple[str, list[str]]:
    """Follow a pointer back through ``tt.addptr`` and shape ops to where it
    starts: (that value, the types of the offsets added on the way)."""
    offsets = []
    while value in defs:
        op, rest = defs[value]
        operands = re.findall(r"%[\w.]+", rest.split(" : ")[0])
        if op == "tt.addptr":
            offsets.append(rest.split(" : ")[1].split(", ")[1])
        elif op not in _SHAPE_OPS:
            break
        value = operands[0]
    return value, offsets


def address_offsets(ttir: str, kind: str, arg: str) -> list[list[str]]:
    """For each ``tt.<kind>`` whose address derives from argument ``%arg``, the
    types of the offsets that ``tt.addptr`` adds on the way."""
    defs = _definitions(ttir)
    found = []
    for line in ttir.splitlines():
        m = _USE.match(line)
        if m and m.group(1) == kind:
            root, offsets = _trace(defs, m.group(2))
            if root == "%" + arg:
                found.append(offsets)
    return found


@pytest.mark.parametrize("kernel, kind, arg", ACCESSES,
                         ids=[f"{k}-{kind}-{a}" for k, kind, a in ACCESSES])
def test_token_offsets_are_64_bit(ttirs, kernel, kind, arg):
    accesses = address_offsets(ttirs[kernel], kind, arg)
    assert accesses, f"{kernel}: found no tt.{kind} through {arg} in the TTIR"
    for offsets in accesses:
        assert any(t.endswith("i64") or t.endswith("i64>") for t in offsets), (
            f"{kernel}: tt.{kind} through {arg} adds only 32-bit offsets {offsets}; "
            f"a token or partial index times its stride can pass 2^31")


def _num_elements(ir_type: str) -> int:
    """``tensor<1x64xi64>`` -> 64; a scalar type -> 1."""
    m = re.match(r"tensor<([\dx]+)x", ir_type)
    return math.prod(int(n) for n in m.group(1).split("x")) if m else 1


@pytest.mark.parametrize("kernel, arg, block_size, block_n", CACHE_READS,
                         ids=[f"{k}-{a}" for k, a, _, _ in CACHE_READS])
def test_cache_reads_are_64_bit_per_position_and_32_bit_inside_blocks(
        ttirs, kernel, arg, block_size, block_n):
    accesses = address_offsets(ttirs[kernel], "load", arg)
    assert accesses, f"{kernel}: found no tt.load through {arg} in the TTIR"
    for offsets in accesses:
        wide = [t for t in offsets if t.endswith(("i64", "i64>"))]
        tile = max(_num_elements(t) for t in offsets)
        # The block's offset is 64-bit (test_token_offsets_are_64_bit), but
        # formed per position of the tile at most, not per element; a scalar
        # when the whole tile lies in one block ...
        assert wide and all(_num_elements(t) <= block_n for t in wide), (
            f"{kernel}: {arg} adds 64-bit offsets {wide} over a {tile}-element tile")
        if block_size % block_n == 0:
            assert all(_num_elements(t) == 1 for t in wide), (
                f"{kernel}: {arg}: a tile inside one block, yet 64-bit offsets {wide}")
        # ... while the token-within-block offset (one per position) and the
        # offsets over the whole [D, BLOCK_N] tile are 32-bit.
        for size in (block_n, tile):
            assert any(_num_elements(t) == size and t.endswith("i32>") for t in offsets), (
                f"{kernel}: {arg} has no 32-bit offset of {size} elements: {offsets}")


def _table_loads(ttir: str) -> list[int]:
    """Elements of each tt.load from the block table (through %block_tables_ptr)."""
    defs = _definitions(ttir)
    sizes = []
    for line in ttir.splitlines():
        m = _USE.match(line)
        if m and m.group(1) == "load" and _trace(defs, m.group(2))[0] == "%block_tables_ptr":
            sizes.append(_num_elements(line.split(" : ")[-1].split(" loc(")[0]))
    return sizes


@pytest.mark.parametrize("kernel, block_size, entries", [
    ("prefill", 16, 4), ("decode_split", 16, 4),            # 64-position tile, 4 blocks
    ("prefill_bs128", 128, 1), ("decode_split_bs128", 128, 1),  # the tile lies in one block
])
def test_block_table_is_read_once_per_block_of_a_tile(ttirs, kernel, block_size, entries):
    loads = _table_loads(ttirs[kernel])
    assert loads == [entries], (
        f"{kernel}: block-table loads of {loads} entries, want one of {entries} per KV tile")
