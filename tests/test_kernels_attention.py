"""paged_attention (Triton) against the torch reference and against SDPA on
the same K/V gathered into contiguous memory."""

import pytest
import torch

from minipaged.kernels import paged_attention
from minipaged.kernels.paged_decode import choose_num_splits

from kernel_cases import DEVICE, SCALE, TOLERANCE, make_case, scaled, sdpa_reference

# A batch mixing every kind of sequence: a prefill, a decode, cached context
# plus a chunk of new tokens, a length-1 sequence, and lengths that are not
# multiples of any block size.
MIXED_Q = [37, 1, 9, 1, 5]
MIXED_CTX = [37, 70, 61, 1, 133]


def mixed(seed, **kw):
    q_lens = [q * SCALE if q > 1 else 1 for q in MIXED_Q]
    ctx = [n * SCALE if n > 1 else 1 for n in MIXED_CTX]
    return make_case(q_lens, ctx, seed=seed, **kw)


def assert_close(out, ref, dtype, what):
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"{what}: max abs err {err:.2e} > {TOLERANCE[dtype]:.0e}"


def check(case, dtype, **kw):
    out = paged_attention(*case.args(), **kw)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert not out.isnan().any(), "output read a slot no sequence owns"
    ref = paged_attention(*case.args(), backend="reference")
    assert_close(out, ref, dtype, "vs torch reference")
    assert_close(out, sdpa_reference(case), dtype, "vs SDPA on contiguous KV")
    return out


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_block_sizes(block_size):
    check(mixed(seed=block_size, num_q_heads=8, num_kv_heads=2, head_dim=64,
                block_size=block_size, dtype=torch.float32), torch.float32)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_sizes(head_dim):
    check(mixed(seed=head_dim, num_q_heads=4, num_kv_heads=4, head_dim=head_dim,
                block_size=16, dtype=torch.float16), torch.float16)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2), (16, 2), (8, 1), (6, 3)],
                         ids=["mha", "gqa4", "gqa8", "mqa", "gqa2-non-pow2-heads"])
def test_gqa_and_mqa(num_q_heads, num_kv_heads):
    check(mixed(seed=num_q_heads * 10 + num_kv_heads, num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads, head_dim=64, block_size=16, dtype=torch.bfloat16),
          torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    check(mixed(seed=7, num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                dtype=dtype), dtype)


def test_prefill_of_one_long_sequence_spans_many_query_tiles():
    case = make_case([150 * SCALE], [150 * SCALE], 4, 1, 64, 16, torch.float32, seed=3)
    check(case, torch.float32)


def test_every_query_token_sees_only_its_past():
    # Changing a future token's K/V must not change earlier outputs.
    case = make_case([12], [12], 2, 2, 64, 8, torch.float32, seed=4)
    before = paged_attention(*case.args())
    block = case.block_tables[0, 1].long()               # holds positions 8..11
    case.k_cache[block, 3] += 10.0                       # position 11
    after = paged_attention(*case.args())
    assert torch.equal(before[:11], after[:11])
    assert not torch.allclose(before[11], after[11])


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_split_kv_decode_matches_any_split_count(splits):
    ctx = scaled([300, 1, 45, 129, 64])
    case = make_case([1] * len(ctx), ctx, 8, 2, 128, 16, torch.float16, seed=splits)
    out = check(case, torch.float16, num_kv_splits=splits)
    one = paged_attention(*case.args(), num_kv_splits=1)
    assert_close(out, one, torch.float16, "split vs unsplit")


def test_split_kv_decode_with_mqa_and_odd_head_size():
    ctx = scaled([200, 17])
    case = make_case([1, 1], ctx, 8, 1, 80, 32, torch.float32, seed=11)
    check(case, torch.float32, num_kv_splits=4)


def test_decode_chooses_splits_for_small_batches_and_long_contexts():
    assert choose_num_splits(1, 1, 32768, DEVICE) > 1
    assert choose_num_splits(1, 1, 100, DEVICE) == 1      # too short to split
    assert choose_num_splits(256, 8, 32768, DEVICE) == 1  # already enough programs
    ctx = scaled([1000])
    case = make_case([1], ctx, 4, 1, 64, 16, torch.float32, seed=12)
    check(case, torch.float32)                                        # auto path


def test_scale_argument():
    case = make_case([5, 1], [9, 20], 4, 2, 64, 16, torch.float32, seed=13)
    for kw in ({}, {"max_query_len": 5, "max_seq_len": 20}):
        out = paged_attention(*case.args(), scale=0.3, **kw)
        ref = paged_attention(*case.args(), scale=0.3, backend="reference")
        assert_close(out, ref, torch.float32, "scale=0.3")


def test_bad_arguments_are_refused():
    case = make_case([2], [4], 4, 2, 64, 16, torch.float32, seed=1)
    q, k, v, bt, sl, qsl = case.args()
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(q[:, :3], k, v, bt, sl, qsl)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(q, k, v, bt, sl, qsl[:1])
    with pytest.raises(ValueError, match="head size"):
        paged_attention(q[..., :32], k, v, bt, sl, qsl)
    with pytest.raises(ValueError, match="backend"):
        paged_attention(q, k, v, bt, sl, qsl, backend="cuda")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU-without-interpreter message")
def test_cpu_without_interpreter_says_what_to_do(monkeypatch):
    case = make_case([2], [4], 4, 2, 64, 16, torch.float32, seed=1)
    import minipaged.kernels._common as common
    monkeypatch.setattr(common, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        paged_attention(*case.args())
