"""paged_attention (Triton) against the torch reference and against SDPA on
the same K/V gathered into contiguous memory."""

import numpy as np
import pytest
import torch

from kernel_cases import DEVICE, SCALE, TOLERANCE, LaunchSpy, make_case, scaled, sdpa_reference
from minipaged.kernels import paged_attention
from minipaged.kernels.paged_decode import choose_num_splits

pytestmark = pytest.mark.cuda  # gpu_check runs these on the GPU

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


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128, 256])
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


# -- the prefill kernel's tile map -----------------------------------------------------

def test_tile_map_lists_exactly_the_real_query_tiles():
    from minipaged.kernels.attention_triton import prefill_tile_map

    tiles = prefill_tile_map(np.array([37, 1, 1, 9]), 16)
    assert tiles.dtype == np.int32 and tiles.shape == (6, 2)
    assert tiles.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0], [3, 0]]
    # Exact multiples get no empty tile, empty sequences get none, lists work.
    assert prefill_tile_map([16, 0, 32, 1], 16).tolist() == [[0, 0], [2, 0], [2, 1], [3, 0]]
    assert prefill_tile_map([], 16).shape == (0, 2)


def real_tiles(q_lens, block_q):
    """The tiles by definition: ``(s, j)`` for each sequence ``s`` and each
    ``j`` whose tokens ``[j * block_q, (j + 1) * block_q)`` include a real one."""
    return [(s, t // block_q) for s, n in enumerate(q_lens) for t in range(0, n, block_q)]


# One long prefill chunk (several query tiles) in a batch of many decodes.
LONG_Q = 45 * SCALE
MANY_DECODES = 24


def long_prefill_and_decodes(seed, dtype=torch.float32):
    ctx = [LONG_Q + 20 * SCALE] + [3 + 7 * i for i in range(MANY_DECODES)]
    q_lens = [LONG_Q] + [1] * MANY_DECODES
    return q_lens, make_case(q_lens, ctx, 8, 2, 64, 16, dtype, seed=seed)


def test_mixed_batch_of_one_long_prefill_and_many_decodes(monkeypatch):
    import minipaged.kernels.attention_triton as at

    q_lens, case = long_prefill_and_decodes(seed=21)
    spy = LaunchSpy(at._prefill_kernel)
    monkeypatch.setattr(at, "_prefill_kernel", spy)
    check(case, torch.float32, query_lens_host=np.array(q_lens))

    # One program per real (sequence, query tile) and KV head: on a CPU,
    # cdiv(45, BLOCK_Q=16) + 24 = 27 per KV head, not 25 sequences x 3 tiles.
    (_, grid, args, kwargs), = spy.launches
    block_q = kwargs["BLOCK_Q"]
    tile_map = args[spy.kernel.arg_names.index("tile_map_ptr")]
    expected = real_tiles(q_lens, block_q)
    assert [tuple(t) for t in tile_map.tolist()] == expected
    assert grid == (len(expected), case.k_cache.shape[2])
    assert len(expected) == -(-LONG_Q // block_q) + MANY_DECODES


@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_query_lens_host_or_not_gives_identical_outputs(kind):
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    case = (mixed(seed=22, **shape) if kind == "mixed" else
            make_case([1] * len(MIXED_CTX), scaled(MIXED_CTX), seed=22, **shape))
    lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    without = paged_attention(*case.args())
    for host in (np.array(lens), lens):
        assert torch.equal(paged_attention(*case.args(), query_lens_host=host), without)
    # With the maxima known too (the engine's call): still the same.
    assert torch.equal(paged_attention(*case.args(), query_lens_host=lens,
                                       max_query_len=max(lens),
                                       max_seq_len=int(case.seq_lens.max())), without)


def test_query_lens_host_must_match_the_batch():
    case = make_case([3, 1], [5, 9], 4, 2, 64, 16, torch.float32, seed=23)
    for bad in ([3], [3, 2], [1, 1, 2]):
        with pytest.raises(ValueError, match="query_lens_host"):
            paged_attention(*case.args(), query_lens_host=bad)


def test_tile_map_copy_is_reused_while_the_lengths_stay_the_same():
    from minipaged.kernels.attention_triton import _TileMapCache

    cache = _TileMapCache()
    lens = np.array([37, 1, 1, 9])
    first = cache.get(lens, 16, DEVICE)
    assert cache.get(lens.copy(), 16, DEVICE) is first          # same lengths: no new copy
    lens[0] = 5                                                 # mutated in place: rebuilt
    assert cache.get(lens, 16, DEVICE).tolist() == [[0, 0], [1, 0], [2, 0], [3, 0]]
    assert cache.get(lens, 32, DEVICE).tolist() == [[0, 0], [1, 0], [2, 0], [3, 0]]


@pytest.mark.parametrize("block_size", [24, 40])
def test_block_sizes_that_are_not_powers_of_two(block_size):
    # Neither divides nor is divided by BLOCK_N: the per-position table path.
    check(mixed(seed=block_size, num_q_heads=4, num_kv_heads=2, head_dim=64,
                block_size=block_size, dtype=torch.float32), torch.float32)
    ctx = scaled([300, 45])
    case = make_case([1, 1], ctx, 4, 2, 64, block_size, torch.float32, seed=block_size + 1)
    check(case, torch.float32, num_kv_splits=3)


# -- decode split counts -----------------------------------------------------------------

def test_automatic_split_counts_are_powers_of_two():
    from minipaged.kernels.paged_decode import MAX_SPLITS, MIN_TOKENS_PER_SPLIT, possible_num_splits

    seen = set()
    for num_seqs in (1, 2, 3, 5, 17, 64, 300):
        for kv_heads in (1, 2, 8):
            for max_len in (1, 255, 256, 700, 3000, 33000, 10**6):
                n = choose_num_splits(num_seqs, kv_heads, max_len, DEVICE)
                assert n & (n - 1) == 0 and 1 <= n <= MAX_SPLITS
                assert n == 1 or max_len // n >= MIN_TOKENS_PER_SPLIT   # parts stay long enough
                seen.add((kv_heads, n))
    for kv_heads in (1, 2, 8):
        possible = possible_num_splits(kv_heads, 300, DEVICE)
        assert possible == [1 << i for i in range(len(possible))]
        assert {n for h, n in seen if h == kv_heads} <= set(possible)
    # A short maximum context caps the splits (parts of >= 256 tokens).
    assert possible_num_splits(1, 4, DEVICE, max_seq_len=600) == [1, 2]


# -- empty KV parts ------------------------------------------------------------------------

@pytest.mark.parametrize("splits", [1, 4, 16])
def test_split_kv_decode_with_empty_parts_and_a_row_without_keys(splits):
    # With 16 parts, a 1-token row has 15 empty ones and a 45-token row most
    # of its parts empty too; a seq_len-0 row has no key in any part. Every
    # empty part must weigh 0, and the keyless row must come out zeros, not
    # NaN from exp2(-inf - -inf) in the merge.
    ctx = scaled([300, 1, 45]) + [1]
    case = make_case([1] * len(ctx), ctx, 8, 2, 64, 16, torch.float16, seed=30 + splits)
    case.seq_lens[3] = 0
    case.k_cache[case.block_tables[3, 0].long()] = float("nan")   # must not be read
    case.v_cache[case.block_tables[3, 0].long()] = float("nan")
    out = paged_attention(*case.args(), num_kv_splits=splits)
    assert not out.isnan().any(), "an empty part or a keyless row made NaN"
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    ref = paged_attention(*case.args(), backend="reference")
    assert torch.equal(ref[3], torch.zeros_like(ref[3]))
    assert_close(out, ref, torch.float16, f"{splits} splits vs torch reference")
    assert_close(out[:3], sdpa_reference(case)[:3], torch.float16, "vs SDPA on contiguous KV")


def test_decode_merge_kernel_weighs_empty_parts_zero():
    # The merge alone, on parts made up to hit every order of empty and full
    # parts: the first part empty and a later one not (which the split kernel
    # never writes but the merge must not depend on), empties between full
    # parts, and a row of empty parts only.
    from minipaged.kernels.paged_decode import _decode_merge_kernel, merge_launch_config
    from minipaged.kernels.reference import merge_decode_parts_reference

    num_seqs, num_heads, parts, head_dim = 4, 2, 4, 16
    gen = torch.Generator().manual_seed(40)
    part_out = torch.randn(num_seqs, num_heads, parts, head_dim, generator=gen)
    part_lse = torch.randn(num_seqs, num_heads, parts, generator=gen) * 4
    empty = torch.tensor([[False, False, True, True],     # a short row's tail
                          [True, False, True, False],     # empty first, then full
                          [False, True, False, True],
                          [True, True, True, True]])      # no keys at all
    part_lse[empty[:, None, :].expand_as(part_lse)] = float("-inf")
    part_out[empty[:, None, :].expand_as(part_lse)] = 0.0     # as the split kernel writes them
    expected = merge_decode_parts_reference(part_out, part_lse)
    assert torch.equal(expected[3], torch.zeros_like(expected[3]))

    out = torch.full((num_seqs, num_heads, head_dim), float("nan"), device=DEVICE)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE)
    config = merge_launch_config(head_dim)
    _decode_merge_kernel[(num_seqs, num_heads)](
        out, part_out.to(DEVICE), part_lse.to(DEVICE), starts, out.stride(0), out.stride(1),
        parts, **config.constexprs, num_warps=config.num_warps)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
