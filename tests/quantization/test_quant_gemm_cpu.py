"""The quantized GEMMs a model's layers run, each against the reference
(dequantize the canonical weight, then ``F.linear``), on fresh random weights.

Tolerances: the float32 GEMMs (``exact_gemm``) differ from the reference by
summation order only (``assert_float32_exact``). The bf16 CPU ops compute in
bfloat16 (their only fast path: ``quantization.gemm``), rounding the
activations, the scales and the output to 8 significant bits (relative
error 2^-9 each). Over K products of random sign the rounding errors add
like a random walk, so the error is bounded by a few units of 2^-8 times
the output's scale; 2e-2 of the largest output leaves room and still fails
for a wrong scale, zero or nibble order
(each of which moves outputs by their own size).
"""

import pytest
import torch
import torch.nn.functional as F

from minipaged.quantization import exact_gemm
from minipaged.quantization.exact_gemm import CpuExactInt4Gemm, CpuExactInt8Gemm, pack_halves
from minipaged.quantization.formats import (
    Int4Weight,
    Int8Weight,
    cat_rows,
    quantize_int8,
    to_int8_per_channel,
)
from minipaged.quantization.gemm import (
    CpuInt4Gemm,
    CpuInt8Gemm,
    FloatGemm,
    ReferenceGemm,
    pick_gemm,
)

CPU = torch.device("cpu")


def random_int4(n: int, k: int, group: int, seed: int) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    offset = -8 * scale + (torch.rand(n, k // group, generator=g) - 0.5) * 0.01
    return Int4Weight(q, scale, offset, group)


def random_int8(n: int, k: int, group: int, seed: int) -> Int8Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return Int8Weight(q, torch.rand(n, k // group, generator=g) * 0.01 + 1e-4, group)


def assert_close_to_reference(gemm, weight, x):
    want = F.linear(x.float(), weight.dequantize())
    got = gemm(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), f"error {err:.3g}"


@pytest.mark.parametrize("n,k,group,rows", [(48, 96, 32, 1), (40, 128, 64, 5),
                                            (16, 256, 128, 3), (7, 256, 256, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int4_matches_the_reference(n, k, group, rows, dtype):
    """Row counts that are not a multiple of 16 (40, 7) are padded and cut back."""
    weight = random_int4(n, k, group, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    assert_close_to_reference(CpuInt4Gemm(weight), weight, x)


@pytest.mark.parametrize("n,k,rows", [(33, 64, 1), (64, 96, 6)])
def test_cpu_int8_matches_the_reference(n, k, rows):
    weight = random_int8(n, k, k, seed=n)
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(n))   # any leading dims
    assert_close_to_reference(CpuInt8Gemm(weight), weight, x)


def assert_float32_exact(gemm, weight, x):
    """float32 arithmetic on the weight's exact values: within float32
    summation-order noise of ``F.linear`` on the dequantized weight (an error
    of a bf16 rounding anywhere would be about 100x larger)."""
    want = F.linear(x.double(), weight.dequantize().double())
    got = gemm(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    bound = 1e-5 * (x.double().abs() @ weight.dequantize().double().abs().T).max().item()
    assert (got.double() - want).abs().max().item() <= bound


@pytest.fixture(params=[False, True], ids=["bytes", "words"])
def read_words(request, monkeypatch):
    """Each one-row GEMV form (``exact_gemm.READ_WORDS``), whatever this CPU's default."""
    monkeypatch.setattr(exact_gemm, "READ_WORDS", request.param)
    return request.param


@pytest.mark.parametrize("n,k,group,rows", [(48, 96, 32, 1), (40, 128, 64, 5),
                                            (7, 256, 256, 2), (24, 64, 16, 1), (8, 96, 24, 1),
                                            (8, 80, 20, 1)])
def test_float32_int4_is_exact_up_to_summation_order(n, k, group, rows, read_words):
    """One row runs the GEMV that widens nibbles in the dot product (read as
    bytes or as int32 words: 3 words a half-group of 24, while groups of 20
    fit no whole words and take bytes), more rows dequantize and call
    ``F.linear``; all read the nibbles as packed halves."""
    weight = random_int4(n, k, group, seed=n * k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(group))
    assert_float32_exact(CpuExactInt4Gemm(weight), weight, x)


def test_int4_halves_pack_as_gguf_nibbles():
    """Byte i of a group: column i low, column i + group / 2 high (Q4_0/Q4_1's order)."""
    weight = random_int4(3, 64, 32, seed=9)
    packed = pack_halves(weight.q, 32)                         # [3, 2, 16]
    assert packed.shape == (3, 2, 16)
    assert torch.equal(packed[1, 1, 5] & 15, weight.q[1, 32 + 5])
    assert torch.equal(packed[1, 1, 5] >> 4, weight.q[1, 32 + 16 + 5])


@pytest.mark.parametrize("n,k,group,rows", [(33, 64, 32, 1), (64, 96, 96, 6), (20, 64, 16, 3)])
def test_float32_int8_is_exact_up_to_summation_order(n, k, group, rows):
    weight = random_int8(n, k, group, seed=n + group)
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(k))   # any leading dims
    gemm = CpuExactInt8Gemm(weight)
    assert_float32_exact(lambda t: gemm(t).reshape(-1, n), weight, x.reshape(-1, k))
    assert gemm(x).shape == (2, rows, n)


@pytest.mark.parametrize("n,k,group", [(33, 64, 32), (12, 60, 60), (9, 54, 18), (40, 64, 64)])
def test_float32_int8_gemv_is_exact_up_to_summation_order(n, k, group, read_words):
    """One row: the GEMV, reading bytes, or int32 words where a group is a
    whole number of them (not 18 bytes)."""
    weight = random_int8(n, k, group, seed=n * group)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(group))
    gemm = CpuExactInt8Gemm(weight)
    assert gemm.group_size == (group if group % 4 == 0 else 0)
    assert_float32_exact(gemm, weight, x)


def test_reference_gemm_is_f_linear_on_the_dequantized_weight():
    weight = random_int4(24, 64, 32, seed=3)
    x = torch.randn(4, 64)
    assert torch.equal(ReferenceGemm(weight)(x), F.linear(x, weight.dequantize()))


def test_int4_dequantizes_as_scale_times_q_plus_offset():
    w = random_int4(3, 64, 32, seed=5)
    manual = torch.stack([w.scale[r].repeat_interleave(32) * w.q[r].float()
                          + w.offset[r].repeat_interleave(32) for r in range(3)])
    assert torch.equal(w.dequantize(), manual)


def test_quantize_int8_keeps_each_rows_maximum_and_errs_by_at_most_half_a_step():
    w = torch.randn(17, 80, generator=torch.Generator().manual_seed(11))
    w[3] = 0.0                                           # an all-zero row: scale 0, no NaN
    q = quantize_int8(w)
    assert q.per_channel and q.q.dtype == torch.int8
    err = (q.dequantize() - w).abs()
    assert torch.all(err <= q.scale / 2 + 1e-7)
    assert torch.equal(q.dequantize()[3], torch.zeros(80))
    rows = torch.arange(17) != 3
    peaks = w.abs().argmax(dim=1)
    assert torch.allclose(q.dequantize()[rows, peaks[rows]], w[rows, peaks[rows]], atol=1e-6)
    grouped = quantize_int8(w, group_size=16)
    assert grouped.scale.shape == (17, 5)
    assert (grouped.dequantize() - w).abs().max() <= err.max()   # finer groups, no worse
    with pytest.raises(ValueError, match="group_size"):
        quantize_int8(w, group_size=24)


def test_pick_gemm_converts_only_what_the_cpu_op_cannot_read():
    """bf16 activations: int4 with a group size the op takes stays int4; int8
    with group scales (GGUF's Q8_0) and int4 with 16-column groups become
    per-channel int8. float32 activations: every layout is read as it is."""
    bf16 = torch.bfloat16
    assert isinstance(pick_gemm(random_int4(16, 64, 32, 0), CPU, bf16), CpuInt4Gemm)
    grouped = random_int8(16, 64, 32, 1)
    gemm = pick_gemm(grouped, CPU, bf16)
    assert isinstance(gemm, CpuInt8Gemm)
    converted = to_int8_per_channel(grouped)
    assert torch.equal(gemm.q, converted.q)
    assert isinstance(pick_gemm(random_int4(16, 64, 16, 2), CPU, bf16), CpuInt8Gemm)
    assert isinstance(pick_gemm(random_int4(16, 64, 16, 2), CPU, torch.float32), CpuExactInt4Gemm)
    exact = pick_gemm(grouped, CPU, torch.float32)
    assert isinstance(exact, CpuExactInt8Gemm) and exact.q is grouped.q   # groups kept, not copied
    assert isinstance(pick_gemm(torch.randn(8, 16), CPU, torch.float32), FloatGemm)
    assert isinstance(pick_gemm(grouped, CPU, torch.float32, "reference"), ReferenceGemm)
    with pytest.raises(ValueError, match="backend"):
        pick_gemm(grouped, CPU, torch.float32, "fast")


def test_merged_parts_stack_into_one_weight():
    parts = [random_int4(8, 64, 32, s) for s in range(3)]
    merged = cat_rows(parts)
    assert torch.equal(merged.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(ValueError, match="kind and group size"):
        cat_rows([parts[0], random_int8(8, 64, 32, 0)])


def test_the_heads_top_logits_are_recomputed_in_float32():
    """The CPU int8 op rounds its output to bf16; the head's top entries are
    recomputed exactly from the int8 rows, the others left as the op gave them."""
    weight = random_int8(64, 96, 96, seed=21)
    gemm = CpuInt8Gemm(weight)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(22))
    rough = gemm(x).float()
    refined = gemm.refine_top(x, rough, 4)
    exact = F.linear(x, weight.dequantize())
    top = rough.topk(4, dim=-1).indices
    assert torch.allclose(refined.gather(-1, top), exact.gather(-1, top), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(rough.gather(-1, top), exact.gather(-1, top), atol=1e-5, rtol=1e-5)
    rest = torch.ones_like(rough, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(refined[rest], rough[rest])


def test_a_replaced_buffer_is_what_the_next_call_reads(read_words):
    """A layer keeps its weights' marked views between calls (``RowsFree``);
    replacing a buffer (as ``module.to`` does) must not leave them stale."""
    weight = random_int4(16, 64, 32, seed=4)
    gemm = CpuExactInt4Gemm(weight)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    before = gemm(x)
    gemm.scale, gemm.offset = gemm.scale * 2, gemm.offset * 2    # each weight times 2
    assert torch.allclose(gemm(x), 2 * before, rtol=1e-5, atol=1e-6)
