"""The 8-bit KV cache (float8 e4m3): the stores, the attention kernels and the
warm-up against their references, on fresh random inputs.

Tolerances. A kernel reading an fp8 cache is compared with the reference
reading the *same* bytes (``paged_attention_reference_fp8``: the cache
widened to fp32, then plain attention), so both see identical K/V values and
differ only by summation order: the tolerance of the query's dtype
(``TOLERANCE``), as for a cache in that dtype. How far fp8 attention may
stray from attention over the unquantized K/V is a property of e4m3's 3
mantissa bits, checked once with a bound derived from them
(``test_fp8_attention_is_within_the_e4m3_rounding_bound``).
"""

import math

import pytest
import torch

from kernel_cases import DEVICE, SCALE, TOLERANCE, LaunchSpy, make_case
from minipaged.kernels import paged_attention, store_kv
from minipaged.kernels.reference import (
    FP8_E4M3,
    FP8_E4M3_MAX,
    dequantize_kv_fp8,
    quantize_kv_fp8,
)

pytestmark = pytest.mark.cuda  # gpu_check runs these on the GPU

HALF_ULP = 2.0 ** -4      # e4m3's largest relative rounding error, normal values
SUBNORMAL_STEP = 2.0 ** -9  # its spacing below 2^-6: absolute error at most half of it


def bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def fp8_case(q_lens, seq_lens, *, dtype=torch.float32, poison=float("nan"), seed=0, **shape):
    """``make_case`` with its caches quantized (k_scale, v_scale applied by the
    caller). Unused slots hold ``poison``: NaN (byte 0x7F) for the Triton
    kernels, which never read them, a finite value for the torch path, which
    reads whole blocks and masks them out (``torch_attention``)."""
    case = make_case(q_lens, seq_lens, dtype=torch.float32, seed=seed, **shape)
    case.q = case.q.to(dtype)
    case.k_cache = torch.nan_to_num(case.k_cache, nan=poison)
    case.v_cache = torch.nan_to_num(case.v_cache, nan=poison)
    return case


# -- the store ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.05, 3.0)])
def test_store_writes_the_bytes_of_the_torch_quantization(dtype, k_scale, v_scale):
    gen = torch.Generator().manual_seed(int(k_scale * 100) + dtype.itemsize)
    num_heads, head_dim, block_size, num_blocks, tokens = 2, 48, 8, 5, 24
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:3]] = -1
    # Views of a fused qkv, as a model hands them over; magnitudes from 2^-12
    # (subnormal in e4m3) to past 448 (saturated), some exactly representable.
    qkv = torch.randn(tokens, 3, num_heads, head_dim, generator=gen)
    qkv = qkv * torch.pow(2.0, torch.randint(-12, 11, qkv.shape, generator=gen))
    qkv = qkv.to(DEVICE, dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    shape = (num_blocks, block_size, num_heads, head_dim)
    init = torch.randint(0, 0x7F, shape, dtype=torch.uint8, generator=gen).to(DEVICE)
    caches = {b: [init.clone().view(FP8_E4M3), init.clone().view(FP8_E4M3)]
              for b in ("triton", "torch")}
    slots = slots.to(DEVICE)
    for backend, (k_cache, v_cache) in caches.items():
        store_kv(key, value, k_cache, v_cache, slots, backend=backend,
                 k_scale=k_scale, v_scale=v_scale)
    (k_tri, v_tri), (k_ref, v_ref) = caches["triton"], caches["torch"]
    assert torch.equal(bits(k_tri), bits(k_ref)) and torch.equal(bits(v_tri), bits(v_ref))
    keep = slots >= 0
    stored = bits(k_tri).view(-1, num_heads, head_dim)[slots[keep].long()]
    assert torch.equal(stored, bits(quantize_kv_fp8(key[keep], k_scale)))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[keep].long()] = False
    assert torch.equal(bits(v_tri).view(-1, num_heads, head_dim)[untouched],
                       init.view(-1, num_heads, head_dim)[untouched])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_store_saturates_at_448_and_rounds_every_tie_to_even(backend):
    """Every value the kernel can meet at a rounding boundary: each e4m3 value,
    each midpoint between neighbours (a tie: to the even code) and the floats
    just either side of it, past 448 and the infinities (+-448), +-0 and NaN."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_E4M3).float()
    grid = codes[~codes.isnan()].unique()                          # 253 values, sorted
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1]),
                   torch.tensor([449.0, 464.0, 465.0, 1e4, math.inf, -500.0, -math.inf, -0.0,
                                 math.nan])])
    # 64 values a token (the interpreter runs one program per token: few tokens).
    tokens = -(-x.numel() // (64 * 8)) * 8
    key = torch.zeros(tokens * 64)
    key[:x.numel()] = x
    key = key.view(tokens, 1, 64).to(DEVICE)
    k_cache = torch.zeros(tokens // 8, 8, 1, 64, dtype=FP8_E4M3, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(tokens, device=DEVICE)
    store_kv(key, key * 3.0, k_cache, v_cache, slots, backend=backend, v_scale=0.5)
    got = bits(k_cache).view(-1)[:x.numel()].cpu()
    want = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3).view(torch.uint8)
    assert torch.equal(got, want)
    assert got[-9:-1].tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x80]  # +-448, -0
    assert got[-1] & 0x7F == 0x7F                                                    # NaN
    # 3x / 0.5 = 6x: everything past 74.67 saturates to 448.
    v = dequantize_kv_fp8(v_cache).view(-1)[:x.numel()].cpu()
    assert v.nan_to_num().abs().max() == FP8_E4M3_MAX
    assert torch.equal(v[(6 * x).abs() >= FP8_E4M3_MAX].abs().unique(),
                       torch.tensor([FP8_E4M3_MAX]))


def test_quantization_error_is_within_half_an_ulp_of_e4m3():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 14, generator=gen) * torch.pow(2.0, torch.randint(-14, 9, (1 << 14,),
                                                                         generator=gen))
    for scale in (1.0, 0.01, 7.0):
        x_in = (x * scale).clamp(-FP8_E4M3_MAX * scale, FP8_E4M3_MAX * scale)
        err = (dequantize_kv_fp8(quantize_kv_fp8(x_in, scale), scale) - x_in).abs()
        bound = torch.maximum(HALF_ULP * x_in.abs(),
                              torch.full_like(x_in, SUBNORMAL_STEP / 2 * scale))
        assert (err <= bound * (1 + 1e-6)).all()


# -- attention: the kernels against the reference on the same bytes ----------------------

# A prefill, a decode, cached context plus a chunk, a length-1 sequence.
MIXED_Q = [13, 1, 5, 1]
MIXED_CTX = [13, 30, 21, 1]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_fp8_attention_matches_the_reference(backend, dtype, decode):
    q_lens = [1] * len(MIXED_Q) if decode else [q * SCALE if q > 1 else 1 for q in MIXED_Q]
    ctx = [n * SCALE if n > 1 else 1 for n in MIXED_CTX]
    case = fp8_case(q_lens, ctx, dtype=dtype, num_q_heads=4, num_kv_heads=2, head_dim=32,
                    block_size=8, seed=int(decode) + 10 * dtype.itemsize,
                    poison=float("nan") if backend == "triton" else 300.0)
    k_scale, v_scale = 0.5, 2.0
    k = quantize_kv_fp8(case.k_cache, k_scale).to(DEVICE)
    v = quantize_kv_fp8(case.v_cache, v_scale).to(DEVICE)
    args = (case.q, k, v, case.block_tables, case.seq_lens, case.query_start_loc)
    ref = paged_attention(*args, backend="reference", k_scale=k_scale, v_scale=v_scale)
    # The reference is attention over the widened bytes, nothing more.
    widened = paged_attention(case.q, dequantize_kv_fp8(k, k_scale), dequantize_kv_fp8(v, v_scale),
                              *args[3:], backend="reference")
    assert torch.equal(ref, widened)
    splits = [1, 3] if decode and backend == "triton" else [None]
    for num_kv_splits in splits:
        out = paged_attention(*args, backend=backend, k_scale=k_scale, v_scale=v_scale,
                              num_kv_splits=num_kv_splits)
        assert out.dtype == dtype and not out.isnan().any()
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= TOLERANCE[dtype], f"{backend} splits={num_kv_splits}: {err:.2e}"


def test_decode_reads_every_e4m3_value_exactly():
    """One key per sequence: the softmax weight is exactly 1, so the output is
    V as the kernel widened it; every one of the 254 finite codes, times v_scale."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    head_dim = 32
    num_seqs = -(-codes.numel() // head_dim)
    flat = torch.zeros(num_seqs * head_dim, dtype=torch.uint8)
    flat[:codes.numel()] = codes
    v_cache = torch.zeros(num_seqs, 4, 1, head_dim, dtype=torch.uint8)
    v_cache[:, 0, 0] = flat.view(num_seqs, head_dim)
    v_cache = v_cache.view(FP8_E4M3).to(DEVICE)
    k_cache = torch.zeros_like(v_cache)
    q = torch.randn(num_seqs, 1, head_dim).to(DEVICE)
    tables = torch.arange(num_seqs, dtype=torch.int32, device=DEVICE)[:, None]
    lens = torch.ones(num_seqs, dtype=torch.int32, device=DEVICE)
    loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE)
    out = paged_attention(q, k_cache, v_cache, tables, lens, loc, backend="triton", v_scale=0.75)
    want = v_cache[:, 0, 0].float() * 0.75
    assert torch.equal(out[:, 0], want)


def test_fp8_attention_is_within_the_e4m3_rounding_bound():
    """fp8 against the unquantized K/V. With every element off by at most
    ``e(x) = max(2^-4 |x|, 2^-10)`` (3 mantissa bits, round to nearest; half
    the subnormal step below 2^-6):

    - each score ``s_j = scale * q . k_j`` moves by at most ``scale * sum_i
      |q_i| e(k_ji)``; with ``D`` the largest of these over a query's keys,
      each softmax weight ``p_j`` moves by a factor in ``[e^-2D, e^2D]``, so
      by at most ``p_j (e^2D - 1)``;
    - ``out' - out = sum_j p_j (v'_j - v_j) + sum_j (p'_j - p_j) v'_j``, so
      each output element moves by at most ``sum_j p_j e(v_j) + (e^2D - 1)
      sum_j p_j (|v_j| + e(v_j))``, the weights ``p`` being the exact ones.
    """
    head_dim, block_size = 32, 8
    case = fp8_case(MIXED_Q, MIXED_CTX, num_q_heads=2, num_kv_heads=2, head_dim=head_dim,
                    block_size=block_size, seed=7)
    k = quantize_kv_fp8(case.k_cache).to(DEVICE)
    v = quantize_kv_fp8(case.v_cache).to(DEVICE)
    exact = paged_attention(*case.args(), backend="reference").float().cpu()
    out = paged_attention(case.q, k, v, *case.args()[3:], backend="triton").float().cpu()

    def e(x):
        return torch.maximum(HALF_ULP * x.abs(), torch.full_like(x, SUBNORMAL_STEP / 2))

    scale = 1 / math.sqrt(head_dim)
    starts = case.query_start_loc.tolist()
    worst = 0.0
    for s, n in enumerate(case.seq_lens.tolist()):
        blocks = case.block_tables[s, :-(-n // block_size)].long().cpu()
        k_s = case.k_cache.cpu()[blocks].reshape(-1, 2, head_dim)[:n]         # [n, H, D]
        v_s = case.v_cache.cpu()[blocks].reshape(-1, 2, head_dim)[:n]
        q_s = case.q.cpu()[starts[s]:starts[s + 1]].float()                   # [q, H, D]
        q_len = q_s.shape[0]
        visible = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]   # [q, n]
        scores = scale * torch.einsum("qhd,khd->qhk", q_s, k_s)
        p_exact = scores.masked_fill(~visible[:, None], -math.inf).softmax(dim=-1)
        moves = scale * torch.einsum("qhd,khd->qhk", q_s.abs(), e(k_s))
        drift = torch.expm1(2 * moves.masked_fill(~visible[:, None], 0).amax(dim=-1))
        through_v = torch.einsum("qhk,khd->qhd", p_exact, e(v_s))
        through_p = drift[..., None] * torch.einsum("qhk,khd->qhd", p_exact, v_s.abs() + e(v_s))
        bound = through_v + through_p                                         # [q, H, D]
        err = (out[starts[s]:starts[s + 1]] - exact[starts[s]:starts[s + 1]]).abs()
        assert (err <= bound + 1e-5).all(), (s, (err - bound).max())
        worst = max(worst, (err / bound).max().item())
    # ... and fp8 did move the output, by a good part of what the bound allows.
    assert 0.05 < worst <= 1.0


def test_scales_apply_to_fp8_caches_only():
    case = make_case([1], [3], num_q_heads=1, num_kv_heads=1, head_dim=16, block_size=4,
                     dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="k_scale and v_scale apply to a float8_e4m3fn"):
        paged_attention(*case.args(), backend="torch", k_scale=2.0)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_attention(case.q, case.k_cache, quantize_kv_fp8(case.v_cache), *case.args()[3:],
                        backend="torch")


# -- warm-up: the fp8 variants are the ones compiled --------------------------------------

def test_warm_up_launches_the_fp8_variants(monkeypatch):
    import importlib

    from minipaged.kernels.warmup import warm_up_kernels
    log = []
    for module, attr in (("minipaged.kernels.store_kv_triton", "_store_kv_kernel"),
                         ("minipaged.kernels.attention_triton", "_prefill_kernel"),
                         ("minipaged.kernels.paged_decode", "_decode_split_kernel"),
                         ("minipaged.kernels.copy_blocks_triton", "_copy_blocks_kernel")):
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, attr, LaunchSpy(getattr(mod, attr), attr, log))
    done = warm_up_kernels(head_dim=16, num_q_heads=2, num_kv_heads=1, block_size=8,
                           dtype=torch.float16, device=DEVICE, max_num_seqs=2,
                           split_counts=[1, 2], kv_dtype=FP8_E4M3)
    assert done == ["store_kv", "copy_blocks", "prefill", "decode(splits=1)", "decode(splits=2)"]
    for name, _, args, kwargs in log:
        if name == "_copy_blocks_kernel":
            assert str(kwargs["DTYPE"]) == "uint8"       # bytes, unchanged
        else:
            assert kwargs["KV_FP8"] is True, name
            assert args[2].dtype == torch.uint8          # the cache's bits
