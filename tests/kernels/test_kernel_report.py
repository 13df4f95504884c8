"""The kernel resource report: the kernels compile for real GPUs, here, without one.

A representative subset of the variants the engine launches is compiled for
sm_80 and sm_90 with the ptxas bundled in the triton wheel (the report,
``python scripts/kernel_report.py``, compiles them all). Register
counts and spills change with the Triton version, and CI takes the newest,
so only compilation and the report's own arithmetic are asserted here; the
resource targets are judged from the committed report, which names its
Triton version.
"""

import json
from pathlib import Path

import pytest
import triton

import kernel_report as kr
from kernel_cases import DEVICE
from minipaged.kernels.paged_decode import decode_split_variants, possible_num_splits

pytestmark = pytest.mark.cuda  # gpu_check runs these on the GPU

needs_cuda_backend = pytest.mark.skipif(
    "nvidia" not in triton.backends.backends, reason="Triton's CUDA backend cannot be imported")

COMMITTED = Path(__file__).resolve().parents[2] / "assets" / "kernel_resources.json"


@needs_cuda_backend
def test_representative_subset_compiles_for_sm80_and_sm90(tmp_path):
    configs = kr.representative_configs([80, 90])
    # The subset reaches every kernel, dtype and target, and both decode variants.
    assert {c.kernel for c in configs} == {"prefill", "decode", "decode_merge", "store_kv",
                                           "copy_blocks", "w4a16", "w8a16"}
    assert {c.dtype for c in configs} == set(kr.DTYPES)
    assert {c.arch for c in configs} == {80, 90}
    assert {c.num_splits > 1 for c in configs if c.kernel == "decode"} == {False, True}

    # A fresh Triton cache: every variant is really compiled, down to a cubin.
    rows = kr.compile_configs(configs, jobs=2, cache_dir=str(tmp_path / "triton_cache"))
    failed = [f"{kr.KernelConfig(**{k: r[k] for k in kr.KernelConfig.__dataclass_fields__}).label}"
              f": {r['error']}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
    for config, row in zip(configs, rows):
        assert (row["kernel"], row["arch"]) == (config.kernel, config.arch)
        # Read back from the cubin: plausible for the warps it was compiled with.
        assert 0 < row["registers"] <= kr.MAX_REGISTERS_PER_THREAD, row
        assert row["spill_bytes"] >= 0 and row["shared_bytes"] >= 0, row
        assert row["global_loads"] and row["loop_spill_accesses"] >= 0, row   # SASS was read
        assert 1 <= row["warps_per_sm"] <= kr.MAX_WARPS_PER_SM, row
        assert row["warps_per_sm"] % row["num_warps"] == 0, row
    # The attention kernels stage K/V tiles in shared memory (the merge kernel
    # need not).
    assert all(r["shared_bytes"] > 0 for r in rows if r["kernel"] in ("prefill", "decode"))
    table = kr.format_table(rows)
    assert len(table) == len(rows) + 2 and not any("FAILED" in line for line in table)


@pytest.mark.parametrize("registers, warps, shared, want_warps, bound", [
    (255, 4, 0, 8, "registers"),        # 8192 registers a warp: 8 warps, 2 programs
    (128, 4, 0, 16, "registers"),       # the decode target: 16 warps
    (129, 4, 0, 12, "registers"),       # 129 rounds up to 136 a thread: 15 warps, 3 programs
    (24, 4, 0, 64, "warps"),            # few registers: the warp slots bound it
    (32, 4, 0, 64, "warps+registers"),  # 1024 a warp: 64 warps, both limits at once
    (16, 1, 0, 32, "programs"),         # one-warp programs: 32 programs at most
    (64, 4, 100_000, 8, "shared"),      # 2 x (100000 + 1024) bytes fit 233472
    (64, 4, 240_000, 0, "shared"),      # more than a program may have: not launchable
])
def test_occupancy_of_an_sm90(registers, warps, shared, want_warps, bound):
    occ = kr.occupancy(90, registers, warps, shared)
    assert occ["warps_per_sm"] == want_warps
    assert occ["bound_by"] == bound


def test_sm80_has_less_shared_memory_than_sm90():
    assert kr.occupancy(80, 64, 4, 40_000)["warps_per_sm"] == 16   # 4 x 41024 <= 167936
    assert kr.occupancy(90, 64, 4, 40_000)["warps_per_sm"] == 20   # 5 x 41024 <= 233472


def test_every_split_count_decode_can_choose_is_a_compiled_variant():
    splits = kr.decode_split_counts()
    for kv_heads in (1, 8):
        assert set(possible_num_splits(kv_heads, 256, DEVICE)) <= set(splits)
    configs = kr.all_configs(archs=[90], dtypes=["bf16"], head_sizes=[128], groups=[4],
                             block_sizes=[16])
    for kv in kr.KV_DTYPES:      # a cache in the activation dtype, and an fp8 one
        decode = sorted(c.num_splits for c in configs if c.kernel == "decode" and c.kv == kv)
        assert decode == decode_split_variants(splits) == [1, 2]
    assert [c.kernel for c in configs].count("decode_merge") == 1


def test_every_gemm_tile_shape_is_a_compiled_variant():
    # Whatever M the engine brings, the quantized GEMMs launch one of the
    # variants the report compiles (same constexprs and warps).
    import torch

    from minipaged.kernels.quant_gemm_triton import quant_gemm_launch_config

    def key(launch):
        return tuple(sorted(launch.constexprs.items())), launch.options

    compiled = [(c.kernel, c.dtype, c.group_size, key(kr._launch(c)[2]))
                for c in kr.gemm_configs([90])]
    for kernel, bits in kr.GEMM_KERNELS.items():
        for dtype in kr.DTYPES:
            for gs in kr.GEMM_GROUPS + ((kr.GEMM_K,) if bits == 8 else ()):
                for m in (*range(1, 300), 4096, 100_000):
                    launch = quant_gemm_launch_config(m, kr.GEMM_N, kr.GEMM_K, gs, bits,
                                                      getattr(torch, kr._TORCH_DTYPES[dtype]))
                    assert (kernel, dtype, gs, key(launch)) in compiled, (kernel, dtype, gs, m)


def test_report_arguments_cover_every_kernel_argument():
    # A kernel argument the report does not know (a new stride, say) is an
    # error, not a silently different compile.
    gemms = [kr.KernelConfig(kernel, 90, "fp16", num_splits=n, rows=m, group_size=gs)
             for kernel in kr.GEMM_KERNELS for m, n in ((1, 2), (128, 0)) for gs in (32, 4096)]
    for config in [kr.KernelConfig(kernel, 90, "fp16", 128, 4, 16, 2) for kernel in
                   ("prefill", "decode", "decode_merge", "store_kv", "copy_blocks")] + gemms:
        fn, args, launch = kr._launch(config)
        signature, constants, attrs = kr._specialize(fn, args, launch.constexprs)
        assert list(signature) == list(fn.arg_names)
        assert set(launch.constexprs) <= set(constants)
    fn, args, launch = kr._launch(kr.KernelConfig("decode", 90, "fp16", 128, 4, 16, 2))
    with pytest.raises(ValueError, match="stride_kb"):
        kr._specialize(fn, {k: v for k, v in args.items() if k != "stride_kb"}, launch.constexprs)


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel must be one of"):
        kr._launch(kr.KernelConfig("attention", 90, "fp16", 128, 4, 16))


def test_committed_report_covers_every_variant_and_names_its_triton():
    record = json.loads(COMMITTED.read_text())
    assert record["triton"] and record["failed"] == 0
    assert {80, 90} <= set(record["archs"])
    want = {c.label for c in kr.all_configs(record["archs"])}
    got = {kr.KernelConfig(**{k: r.get(k, f.default)  # a report older than a field lacks it
                              for k, f in kr.KernelConfig.__dataclass_fields__.items()}).label
           for r in record["rows"]}
    assert got == want, (f"the committed report is stale: missing {sorted(want - got)[:5]}, "
                         f"extra {sorted(got - want)[:5]}")


# A SASS excerpt in cuobjdump's format: a spill before the loop, a load of
# each width inside it, a reload after it, then the final self-branch.
_SASS = """
        /*0100*/                   STL [R1], R8 ;                         /* 0x0 */
        /*0110*/                   LDGSTS.E.BYPASS.128 [R67], desc[UR20][R22.64], P5 ;  /* 0x0 */
        /*0120*/              @!P0 LDG.E R2, desc[UR4][R2.64] ;           /* 0x0 */
        /*0130*/                   LDG.E.U16 R4, desc[UR4][R6.64] ;       /* 0x0 */
        /*0140*/              @!P1 BRA 0x110 ;                            /* 0x0 */
        /*0150*/                   LDL.LU R22, [R1] ;                     /* 0x0 */
        /*0160*/                   BRA 0x160;                             /* 0x0 */
"""


def test_sass_reading_finds_load_widths_and_spills_inside_loops():
    assert kr.global_loads(_SASS) == {"128": 1, "32": 1, "16": 1}
    assert kr.spills_in_loops(_SASS) == 0                      # around the loop only
    inside = _SASS.replace("LDG.E.U16 R4, desc[UR4][R6.64]", "LDL R4, [R1+0x8]")
    assert kr.spills_in_loops(inside) == 1


def test_a_kv_tile_read_element_by_element_misses_its_target():
    # Triton 3.6 compiles the bf16 decode kernel with one load per element
    # (16-bit) when a KV tile spans blocks; its widest load is still 128-bit.
    row = dict(ok=True, kernel="decode", arch=90, dtype="bf16", head_dim=128, group=4,
               block_size=16, num_splits=8, registers=72, spill_bytes=0, warps_per_sm=20,
               bound_by="shared", widest_load_bits=128,
               global_loads={"128": 1, "32": 6, "16": 128})
    [line] = kr.target_lines([row])
    assert line.startswith("MISS decode") and "128-bit loads, 128 under 32 bits" in line
    row["global_loads"] = {"128": 33, "32": 18}
    assert kr.target_lines([row])[0].startswith("PASS decode")
