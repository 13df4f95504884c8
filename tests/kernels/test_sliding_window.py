"""Sliding-window attention and logit soft-capping (``paged_attention(...,
sliding_window=W, logits_soft_cap=c)``), every backend, on fresh random inputs.

The definition (Hugging Face transformers'): the query at position ``p`` sees
key ``j`` iff ``j <= p`` and ``p - j < W``; scores ``s = (q . k) * scale``
become ``c * tanh(s / c)`` before the mask and the softmax. ``dense`` below
is that, written out over contiguous K/V in float64; the reference backend
is checked against it, and the torch and Triton backends against the
reference.

Every windowed case is given back what a block manager that frees the
blocks behind the window would leave: each sequence's table entries for
blocks wholly older than its first new token's window point nowhere (-1) or
at a block since reused, and every position older than that window holds
NaN in the pool. A Triton kernel that loaded one of those positions, or a
block through one of those entries, would poison its output (0 * NaN is
NaN); ``TileLog`` records, under the interpreter, which tiles each program
folds in. The torch path reads whole blocks and masks, which is exact for
finite values only (the engine zeroes its pools: ``test_torch_attention``),
so its cases hold large finite garbage there instead.
"""

import math

import pytest
import torch

from kernel_cases import DEVICE, TOLERANCE, LaunchSpy, make_case
from minipaged.kernels import paged_attention, plan_attention
from minipaged.kernels._common import (
    decode_kv_positions,
    max_decode_kv_positions,
    window_kv_start,
)
from minipaged.kernels.reference import dequantize_kv_fp8, quantize_kv_fp8, window_first_position

pytestmark = pytest.mark.cuda  # gpu_check runs these on the GPU

# Query scores are multiplied by this much (q is), so that a cap of 5 bends
# most of them and the tests can tell a capped softmax from a plain one.
Q_GAIN = 4.0

# A prefill longer than the windows (two query tiles with 4 query heads per
# KV head), a chunk of 12 new tokens on 30 cached ones (its window's edge
# moves through the chunk), decodes 5 to 9 times the smallest window, and a
# prefill shorter than it.
MIXED_Q = [23, 12, 1, 1, 3]
MIXED_CTX = [23, 42, 40, 61, 3]
DECODE_CTX = [40, 61, 5]


# -- the cases -----------------------------------------------------------------------------

def logical_kv(case, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``s``'s K and V, ``[seq_len, Hkv, D]``: position ``p`` is slot
    ``p % block_size`` of block ``table[p // block_size]``."""
    block_size = case.k_cache.shape[1]
    p = torch.arange(int(case.seq_lens[s]), device=case.k_cache.device)
    blocks = case.block_tables[s, p // block_size].long()
    return case.k_cache[blocks, p % block_size], case.v_cache[blocks, p % block_size]


def dense(case, window, cap, kv=None) -> torch.Tensor:
    """The definition, in float64: each sequence's queries against its
    contiguous K/V (``kv``: a list of ``(k, v)`` per sequence, default
    ``logical_kv``), masked by position, soft-capped, softmax."""
    q_all = case.q.double()
    group = case.q.shape[1] // case.k_cache.shape[2]
    scale = 1.0 / math.sqrt(case.q.shape[2])
    out = torch.zeros_like(q_all)
    starts = case.query_start_loc.tolist()
    for s, n in enumerate(case.seq_lens.tolist()):
        k, v = kv[s] if kv is not None else logical_kv(case, s)
        k = k.double().repeat_interleave(group, dim=1)                  # [n, Hq, D]
        v = v.double().repeat_interleave(group, dim=1)
        q = q_all[starts[s]:starts[s + 1]]                              # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        p = torch.arange(n - q.shape[0], n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        sees = (j <= p) if window is None else (j <= p) & (p - j < window)
        scores = scores.masked_fill(~sees, float("-inf"))
        out[starts[s]:starts[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def free_behind_window(case, window, freed: str, poison: float):
    """What a block manager that gives back the blocks behind the windows
    leaves: every position older than the oldest one each sequence's first
    new token sees holds ``poison``, and the table entries of the blocks
    wholly older than it are -1 (``freed="unmapped"``) or name a spare
    block, which holds ``poison`` too (``"reused"``)."""
    block_size = case.k_cache.shape[1]
    starts = case.query_start_loc.tolist()
    owned = {int(b) for b in case.block_tables.flatten().tolist() if b >= 0}
    spare = min(set(range(case.k_cache.shape[0])) - owned)
    case.k_cache[spare] = poison
    case.v_cache[spare] = poison
    for s, n in enumerate(case.seq_lens.tolist()):
        first = window_first_position(n - (starts[s + 1] - starts[s]), window)
        p = torch.arange(first, device=case.k_cache.device)
        blocks = case.block_tables[s, p // block_size].long()
        case.k_cache[blocks, p % block_size] = poison
        case.v_cache[blocks, p % block_size] = poison
        case.block_tables[s, :first // block_size] = -1 if freed == "unmapped" else spare


def windowed_case(q_lens, ctx, *, window, freed="unmapped", poison=float("nan"),
                  num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=4,
                  dtype=torch.float32, seed=0):
    """``(case, kv)``: a ``make_case`` batch (q scaled by ``Q_GAIN``) with
    everything behind its windows freed and poisoned (``free_behind_window``;
    a finite ``poison`` replaces the NaN of unowned slots too), and each
    sequence's K/V as they were before, for ``dense``."""
    case = make_case(q_lens, ctx, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                     seed=seed)
    case.q = case.q * Q_GAIN
    kv = [logical_kv(case, s) for s in range(len(ctx))]
    if window is not None:
        free_behind_window(case, window, freed, poison)
    if not math.isnan(poison):
        case.k_cache.nan_to_num_(poison)
        case.v_cache.nan_to_num_(-poison)
    return case, kv


def assert_close(out, ref, dtype, what):
    assert out.shape == ref.shape
    assert not out.isnan().any(), f"{what}: NaN, so a tile behind the window was read"
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"{what}: max abs err {err:.2e} > {TOLERANCE[dtype]:.0e}"


# -- the reference against the definition ------------------------------------------------

# Windows: none, only the query itself, smaller than most contexts, larger
# than some, larger than all; caps: none, a small one that bends most scores
# (and a mild one, once).
SETTINGS = [(w, c) for w in (None, 1, 7, 24, 1000) for c in (None, 5.0)] + [(7, 50.0)]


@pytest.mark.parametrize("block_size, freed", [(1, "unmapped"), (4, "reused"), (16, "unmapped")])
def test_reference_is_the_definition(block_size, freed):
    for window, cap in SETTINGS:
        for q_lens, ctx in ((MIXED_Q, MIXED_CTX), ([1] * len(DECODE_CTX), DECODE_CTX)):
            case, kv = windowed_case(q_lens, ctx, window=window, freed=freed,
                                     block_size=block_size, seed=block_size)
            out = paged_attention(*case.args(), backend="reference", sliding_window=window,
                                  logits_soft_cap=cap)
            assert_close(out, dense(case, window, cap, kv), torch.float32,
                         f"W={window} cap={cap}")


def test_window_and_cap_change_the_result():
    # The cases are strong enough to tell each setting apart: a window smaller
    # than the context changes the output, one larger does not; a cap of 5
    # changes it a lot, one of 50 a little.
    case, _ = windowed_case(MIXED_Q, MIXED_CTX, window=None, seed=1)

    def run(**kw):
        return paged_attention(*case.args(), backend="reference", **kw)

    plain = run()
    assert torch.equal(run(sliding_window=1000), plain)
    assert (run(sliding_window=7) - plain).abs().max() > 0.1
    assert (run(logits_soft_cap=5.0) - plain).abs().max() > 0.1
    assert 1e-4 < (run(logits_soft_cap=50.0) - plain).abs().max() < 0.1
    # W=1: each query sees only itself, so its output is its own V.
    one = run(sliding_window=1)
    starts = case.query_start_loc.tolist()
    group = case.q.shape[1] // case.k_cache.shape[2]
    for s, n in enumerate(MIXED_CTX):
        v = logical_kv(case, s)[1][n - (starts[s + 1] - starts[s]):]
        torch.testing.assert_close(one[starts[s]:starts[s + 1]], v.repeat_interleave(group, 1))


def test_poisoned_positions_are_what_attention_without_the_window_would_read():
    # The poisoning is not vacuous: read without the window, it gives NaN.
    case, _ = windowed_case(MIXED_Q, MIXED_CTX, window=7, freed="reused", seed=2)
    assert paged_attention(*case.args(), backend="reference").isnan().any()


# -- Triton ----------------------------------------------------------------------------------

F32, F16 = torch.float32, torch.float16
# (window, cap, block_size, dtype, (Hq, Hkv), freed): the product would be too
# slow for the interpreter, so each axis is covered by some case.
TRITON_CASES = [
    (7, None, 4, F32, (8, 2), "unmapped"),
    (7, 5.0, 16, F16, (8, 2), "reused"),
    (24, 50.0, 1, F32, (4, 4), "unmapped"),
    (1, None, 4, F16, (8, 2), "reused"),
    (200, 5.0, 4, F32, (8, 2), "unmapped"),     # larger than every context
    (None, 5.0, 16, F32, (4, 1), "unmapped"),   # the cap alone
]


def case_id(c):
    window, cap, block_size, dtype, (hq, hkv), freed = c
    return f"W{window}-cap{cap}-bs{block_size}-{str(dtype)[6:]}-{hq}:{hkv}-{freed}"


@pytest.mark.parametrize("window, cap, block_size, dtype, heads, freed", TRITON_CASES,
                         ids=map(case_id, TRITON_CASES))
def test_triton_prefill_and_mixed_batches(window, cap, block_size, dtype, heads, freed):
    case, kv = windowed_case(MIXED_Q, MIXED_CTX, window=window, freed=freed,
                             num_q_heads=heads[0], num_kv_heads=heads[1],
                             block_size=block_size, dtype=dtype, seed=block_size + 3)
    ref = paged_attention(*case.args(), backend="reference", sliding_window=window,
                          logits_soft_cap=cap)
    assert_close(ref, dense(case, window, cap, kv), dtype, "reference vs definition")
    out = paged_attention(*case.args(), backend="triton", sliding_window=window,
                          logits_soft_cap=cap, query_lens_host=MIXED_Q)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, "triton vs reference")


DECODE_CASES = [  # (window, cap, block_size, dtype, num_kv_splits)
    (7, None, 4, F32, None),
    (7, 5.0, 16, F16, 3),
    (24, 50.0, 4, F32, 2),
    (100, None, 16, F16, 2),                    # larger than every context
    (None, 5.0, 4, F32, 1),
]


@pytest.mark.parametrize("window, cap, block_size, dtype, splits", DECODE_CASES,
                         ids=[f"W{c[0]}-cap{c[1]}-bs{c[2]}-{str(c[3])[6:]}-splits{c[4]}"
                              for c in DECODE_CASES])
def test_triton_split_kv_decode(window, cap, block_size, dtype, splits):
    q_lens = [1] * len(DECODE_CTX)
    case, kv = windowed_case(q_lens, DECODE_CTX, window=window, block_size=block_size,
                             dtype=dtype, freed="reused" if splits == 3 else "unmapped",
                             seed=block_size + 7)
    ref = paged_attention(*case.args(), backend="reference", sliding_window=window,
                          logits_soft_cap=cap)
    assert_close(ref, dense(case, window, cap, kv), dtype, "reference vs definition")
    out = paged_attention(*case.args(), backend="triton", sliding_window=window,
                          logits_soft_cap=cap, num_kv_splits=splits)
    assert_close(out, ref, dtype, f"triton ({splits} splits) vs reference")


def test_decode_splits_only_the_window(monkeypatch):
    # The split count comes from the windowed length, not from max_seq_len:
    # 600 tokens would be cut in 2 parts (256 tokens at least each), a window
    # of 32 reads one part's worth.
    import minipaged.kernels.paged_decode as pd

    spy = LaunchSpy(pd._decode_split_kernel)
    monkeypatch.setattr(pd, "_decode_split_kernel", spy)
    window = 32
    case, _ = windowed_case([1], [600], window=window, num_q_heads=4, num_kv_heads=1,
                            block_size=16, seed=11)
    assert pd.choose_num_splits(1, 1, 600, DEVICE) == 2
    out = paged_attention(*case.args(), backend="triton", sliding_window=window,
                          max_seq_len=600)
    (_, grid, _, kwargs), = spy.launches
    assert grid[2] == 1 and kwargs["WINDOW"] == window
    ref = paged_attention(*case.args(), backend="reference", sliding_window=window)
    assert_close(out, ref, torch.float32, "triton vs reference")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
def test_fp8_cache(backend, decode):
    q_lens, ctx = ([1] * len(DECODE_CTX), DECODE_CTX) if decode else (MIXED_Q, MIXED_CTX)
    window, cap, k_scale, v_scale = 7, 5.0, 0.5, 2.0
    case, _ = windowed_case(q_lens, ctx, window=window, freed="unmapped", block_size=4,
                            poison=float("nan") if backend == "triton" else 300.0, seed=13)
    k = quantize_kv_fp8(case.k_cache, k_scale)
    v = quantize_kv_fp8(case.v_cache, v_scale)
    args = (case.q, k, v, case.block_tables, case.seq_lens, case.query_start_loc)
    layer = dict(sliding_window=window, logits_soft_cap=cap)
    ref = paged_attention(*args, backend="reference", k_scale=k_scale, v_scale=v_scale, **layer)
    # The fp8 reference is the reference over the widened bytes; a NaN byte
    # (0x7F) widens to NaN, so reading a poisoned position would show.
    widened = paged_attention(case.q, dequantize_kv_fp8(k, k_scale),
                              dequantize_kv_fp8(v, v_scale), *args[3:], backend="reference",
                              **layer)
    assert torch.equal(ref, widened) and not ref.isnan().any()
    out = paged_attention(*args, backend=backend, k_scale=k_scale, v_scale=v_scale,
                          num_kv_splits=2 if decode and backend == "triton" else None, **layer)
    assert_close(out, ref, torch.float32, f"{backend} fp8 vs reference")


# -- the torch path --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, block_size", [(F32, 1), (F16, 4), (F32, 16), (F16, 16)],
                         ids=["fp32-bs1", "fp16-bs4", "fp32-bs16", "fp16-bs16"])
def test_torch_path(dtype, block_size):
    for window, cap in SETTINGS:
        for q_lens, ctx in ((MIXED_Q, MIXED_CTX), ([1] * len(DECODE_CTX), DECODE_CTX)):
            case, _ = windowed_case(q_lens, ctx, window=window, poison=1e4,
                                    freed="unmapped" if block_size == 4 else "reused",
                                    block_size=block_size, dtype=dtype,
                                    seed=block_size + dtype.itemsize)
            layer = dict(sliding_window=window, logits_soft_cap=cap)
            ref = paged_attention(*case.args(), backend="reference", **layer)
            out = paged_attention(*case.args(), backend="torch", **layer)
            assert out.dtype == dtype
            assert_close(out, ref, dtype, f"torch W={window} cap={cap}")


def test_one_plan_serves_layers_with_different_windows():
    # The block manager frees only what is behind the widest window of the
    # model (none at all when a layer has no window); the plan is built once
    # for the step, without knowing any window.
    models = {24: [(24, None), (7, 5.0), (24, 50.0)], None: [(None, None), (7, None), (None, 5.0)]}
    for widest, layers in models.items():
        case, _ = windowed_case(MIXED_Q + [1], MIXED_CTX + [200], window=widest, poison=1e4,
                                block_size=4, seed=17)
        plan = plan_attention(case.block_tables, case.seq_lens, case.query_start_loc, 4)
        for _ in range(2):   # the second round finds the windowed views built
            for window, cap in layers:
                layer = dict(sliding_window=window, logits_soft_cap=cap)
                assert_close(paged_attention(*case.args(), backend="torch", plan=plan, **layer),
                             paged_attention(*case.args(), backend="reference", **layer),
                             torch.float32, f"W={window} cap={cap} with a shared plan")
        windows = {w for w, _ in layers if w is not None}
        for part in plan.parts:
            assert part.for_window(None) is part
            assert part.for_window(7) is part.for_window(7)        # built once per step
            assert set(part.windowed) == windows
    # The decode part gathers about a window's worth of blocks, not 200 tokens.
    decode_part = plan.parts[0]
    assert decode_part.row_ok is None and decode_part.table.shape[1] == 200 // 4
    assert decode_part.for_window(7).table.shape[1] <= -(-(7 - 1) // 4) + 1


# -- which tiles a windowed layer reads ------------------------------------------------------

class TileLog:
    """The KV tiles the Triton kernels read, under the interpreter (which runs
    their Python bodies, so the shared loop's helpers can be wrapped): one
    entry per ``attend_kv_range`` call (a program), its first query row's
    position and the start of every tile it folds in (``_tile_blocks`` is
    called once per tile)."""

    def __init__(self, monkeypatch):
        import minipaged.kernels._tile as tile
        import minipaged.kernels.attention_triton as at
        import minipaged.kernels.paged_decode as pd

        self.programs: list[dict] = []
        attend, blocks = tile.attend_kv_range, tile._tile_blocks

        def logged_attend(q, q_pos, *args, **kwargs):
            self.programs.append(dict(first_pos=int(q_pos.handle.data.min()), tiles=[],
                                      block_n=int(kwargs["BLOCK_N"])))
            return attend(q, q_pos, *args, **kwargs)

        def logged_blocks(table_ptr, start, kv_end, **kwargs):
            self.programs[-1]["tiles"].append(int(start))
            return blocks(table_ptr, start, kv_end, **kwargs)

        monkeypatch.setattr(at, "attend_kv_range", logged_attend)
        monkeypatch.setattr(pd, "attend_kv_range", logged_attend)
        monkeypatch.setattr(tile, "_tile_blocks", logged_blocks)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="reads the interpreter's program state")
def test_kernels_read_no_tile_behind_the_window(monkeypatch):
    # Decodes 3 to 10 windows long, then the same through the prefill kernel
    # with a 40-token chunk on 110 cached tokens: every tile a program reads
    # reaches into its first query's window, and the tiles per sequence stay
    # at ceil(W / BLOCK_N) + 1 (decode, all splits together) or
    # ceil(W / BLOCK_N) + ceil(BLOCK_Q / BLOCK_N) + 1 (a prefill query tile),
    # however long the sequence.
    window = 20
    log = TileLog(monkeypatch)
    for splits in (1, 3):
        case, _ = windowed_case([1, 1, 1], [60, 120, 200], window=window, num_q_heads=4,
                                num_kv_heads=1, seed=19)
        out = paged_attention(*case.args(), backend="triton", sliding_window=window,
                              num_kv_splits=splits)
        assert_close(out, paged_attention(*case.args(), backend="reference",
                                          sliding_window=window), F32, "decode")
        assert len(log.programs) == 3 * splits
        tiles = {}
        for prog in log.programs:
            assert all(t >= window_kv_start(prog["first_pos"], window, prog["block_n"])
                       for t in prog["tiles"])
            tiles.setdefault(prog["first_pos"], set()).update(prog["tiles"])
        bound = -(-window // log.programs[0]["block_n"]) + 1
        assert sorted(tiles) == [59, 119, 199]
        assert all(len(t) <= bound for t in tiles.values()), tiles
        log.programs.clear()

    case, _ = windowed_case([40, 1], [150, 200], window=window, num_q_heads=4, num_kv_heads=1,
                            seed=23)
    out = paged_attention(*case.args(), backend="triton", sliding_window=window)
    assert_close(out, paged_attention(*case.args(), backend="reference", sliding_window=window),
                 F32, "prefill")
    from minipaged.kernels.attention_triton import prefill_launch_config
    block_q = prefill_launch_config(32, 4, 4, F32).constexprs["BLOCK_Q"]
    assert len(log.programs) == -(-40 // block_q) + 1
    for prog in log.programs:
        block_n = prog["block_n"]
        assert min(prog["tiles"]) == window_kv_start(prog["first_pos"], window, block_n)
        assert len(prog["tiles"]) <= -(-window // block_n) + -(-block_q // block_n) + 1


@pytest.mark.parametrize("window", [1, 5, 16, 64, 100])
@pytest.mark.parametrize("block_n", [16, 64])
def test_tiles_read_stop_growing_past_the_window(window, block_n):
    # Decode: the split-KV kernel covers decode_kv_positions(seq_len) positions
    # from window_kv_start(seq_len - 1), a tile boundary: at most
    # ceil(W / BLOCK_N) + 1 tiles, however long the sequence.
    decode_bound = -(-window // block_n) + 1
    for seq_len in range(1, 10 * window + 3 * block_n):
        start = window_kv_start(seq_len - 1, window, block_n)
        assert start % block_n == 0 and start <= max(0, seq_len - window)
        positions = decode_kv_positions(seq_len, window, block_n)
        assert positions == seq_len - start
        assert min(seq_len, window) <= positions <= max_decode_kv_positions(seq_len, window,
                                                                           block_n)
        assert -(-positions // block_n) <= decode_bound
        assert max_decode_kv_positions(seq_len, window, block_n) <= window + block_n - 1
    # Prefill: a query tile of BLOCK_Q tokens from first_q reads the tiles from
    # window_kv_start(first_q) to its last token: at most ceil(W / BLOCK_N) +
    # ceil(BLOCK_Q / BLOCK_N) + 1, wherever the chunk sits.
    for block_q in (1, 16, 64):
        bound = -(-window // block_n) + -(-block_q // block_n) + 1
        for first_q in range(0, 10 * window, 3):
            kv_end = first_q + block_q
            assert -(-(kv_end - window_kv_start(first_q, window, block_n)) // block_n) <= bound
    assert window_kv_start(1000, None, block_n) == 0
    assert max_decode_kv_positions(1000, None, block_n) == 1000


# -- the arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_bad_window_and_cap_are_refused(backend):
    case = make_case([2], [4], 4, 2, 32, 4, torch.float32, seed=1)
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match=r"sliding_window must be an integer >= 1"):
            paged_attention(*case.args(), backend=backend, sliding_window=bad)
    for bad in (0.0, -1.0, float("nan"), float("inf"), "x"):
        with pytest.raises(ValueError, match=r"logits_soft_cap must be a finite number > 0"):
            paged_attention(*case.args(), backend=backend, logits_soft_cap=bad)


def test_warm_up_compiles_each_windowed_variant(monkeypatch):
    import minipaged.kernels.attention_triton as at
    import minipaged.kernels.paged_decode as pd
    from minipaged.kernels.warmup import warm_up_kernels

    log = []
    monkeypatch.setattr(at, "_prefill_kernel", LaunchSpy(at._prefill_kernel, "prefill", log))
    monkeypatch.setattr(pd, "_decode_split_kernel",
                        LaunchSpy(pd._decode_split_kernel, "decode", log))
    done = warm_up_kernels(head_dim=16, num_q_heads=2, num_kv_heads=1, block_size=8,
                           dtype=torch.float32, device=DEVICE, max_num_seqs=1,
                           split_counts=[1], sliding_windows=(4096, None, 4096),
                           logits_soft_cap=50.0)
    assert done[2:] == ["prefill(window=4096, soft_cap=50.0)",
                        "decode(splits=1, window=4096, soft_cap=50.0)",
                        "prefill(soft_cap=50.0)", "decode(splits=1, soft_cap=50.0)"]
    for kernel in ("prefill", "decode"):
        assert {(kw["WINDOW"], kw["SOFT_CAP"]) for name, _, _, kw in log if name == kernel} \
            == {(4096, 50.0), (None, 50.0)}
