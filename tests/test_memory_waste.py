import pytest

from minipaged.bench.memory_waste import POLICIES, FirstFit, next_pow2, reservation, simulate
from minipaged.bench.workloads import TraceRequest, sharegpt_like


def test_next_pow2_and_reservations():
    assert [next_pow2(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    r = TraceRequest("0", 0.0, prompt_len=100, output_len=70)
    assert reservation(r, "orca_max", 2048) == 2048
    assert reservation(r, "orca_pow2", 2048) == 228
    assert reservation(r, "orca_oracle", 2048) == 170


def test_first_fit_merges_gaps():
    heap = FirstFit(10)
    a, b, c = heap.allocate(3), heap.allocate(3), heap.allocate(4)
    assert (a, b, c) == (0, 3, 6) and heap.allocate(1) is None
    heap.free(0, 3)
    heap.free(6, 4)
    assert heap.allocate(4) == 6            # the 3-slot hole at 0 is too small
    assert heap.stranded(4) == 3
    heap.free(3, 3)
    assert heap.gaps == [[0, 6]]


def test_every_policy_finishes_every_request_in_the_budget():
    trace = sharegpt_like(40, seed=2, max_len=512)
    total_tokens = sum(r.total_len for r in trace)
    for policy in POLICIES:
        r = simulate(trace, policy, budget_tokens=2048, max_len=512)
        reserved = r.reserved
        assert (reserved <= 2048).all()
        assert (reserved + r.external <= 2048).all()
        # The token states summed over steps are at least each request's
        # tokens once (a request holds its final length in its last step).
        assert max(r.tokens) > 0 and sum(r.tokens) >= total_tokens
        assert r.running[-1] >= 1


def test_paging_wastes_least_and_runs_the_largest_batches():
    trace = sharegpt_like(80, seed=0, max_len=1024)
    results = {p: simulate(trace, p, budget_tokens=4096, max_len=1024) for p in POLICIES}
    paged = results.pop("paged")
    assert paged.token_share_of_reserved > 0.9
    for r in results.values():
        assert paged.token_share_of_reserved > r.token_share_of_reserved
        assert paged.mean_batch > r.mean_batch
    # Paging wastes at most block_size - 1 slots per running request.
    assert all(i <= 15 * n for i, n in zip(paged.internal, paged.running))


def test_bad_policy_and_budget():
    trace = sharegpt_like(3, seed=0)
    with pytest.raises(ValueError, match="policy"):
        simulate(trace, "buddy", 4096)
    with pytest.raises(ValueError, match="budget_tokens"):
        simulate(trace, "paged", 100)
