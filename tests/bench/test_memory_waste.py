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


def test_tokens_processed_price_prefill_and_recomputation():
    # A pool small enough that paging preempts: every policy runs each prompt token
    # and every generated token but the last once; paging adds exactly what it recomputes.
    trace = sharegpt_like(60, seed=1, max_len=512)
    once = sum(r.prompt_len + r.output_len - 1 for r in trace)
    runs = {p: simulate(trace, p, budget_tokens=1024, max_len=512) for p in POLICIES}
    paged = runs["paged"]
    assert paged.num_preemptions > 0 and paged.num_recomputed_tokens > 0
    for policy, r in runs.items():
        assert len(r.prefill) == len(r.decode) == len(r.recomputed) == r.num_steps
        assert r.tokens_processed - r.num_recomputed_tokens == once, policy
        assert all(rc <= pf for rc, pf in zip(r.recomputed, r.prefill))
        # Each request holds the same tokens for the same number of its own steps.
        assert sum(r.tokens) == sum(paged.tokens)
    for policy in POLICIES[:3]:
        assert runs[policy].num_recomputed_tokens == 0
        assert sum(runs[policy].prefill) == sum(r.prompt_len for r in trace)


def test_a_lone_request_prefills_once_then_decodes_one_token_a_step():
    trace = [TraceRequest("0", 0.0, prompt_len=20, output_len=5)]
    for policy in POLICIES:
        r = simulate(trace, policy, budget_tokens=2048)
        assert r.prefill == [20, 0, 0, 0, 0] and r.decode == [0, 1, 1, 1, 1], policy
        assert r.recomputed == [0] * 5 and r.tokens_processed == 24


def test_the_default_heap_is_first_fit_and_unchanged():
    # Steps and stranded slots of this trace, pinned from before ``heap`` existed.
    trace = sharegpt_like(40, seed=2, max_len=512)
    pinned = {"orca_max": (1441, 0), "orca_pow2": (1077, 307266), "orca_oracle": (859, 222843)}
    for policy, (steps, external) in pinned.items():
        default = simulate(trace, policy, budget_tokens=2048, max_len=512)
        explicit = simulate(trace, policy, budget_tokens=2048, max_len=512, heap=FirstFit)
        assert (default.num_steps, sum(default.external)) == (steps, external), policy
        assert default.tokens == explicit.tokens and default.external == explicit.external


class _HalfHeap(FirstFit):
    """First-fit that refuses every slot past the first half of the range."""

    def __init__(self, size: int):
        super().__init__(size)
        self.limit = size // 2

    def allocate(self, n: int) -> int | None:
        start = super().allocate(n)
        if start is not None and start + n > self.limit:
            super().free(start, n)
            return None
        return start


def test_simulate_places_chunks_in_the_heap_it_is_given():
    trace = sharegpt_like(40, seed=2, max_len=512)
    made = []

    def half_heap(size):
        made.append(size)
        return _HalfHeap(size)

    for policy in POLICIES[:3]:
        full = simulate(trace, policy, budget_tokens=2048, max_len=512)
        half = simulate(trace, policy, budget_tokens=2048, max_len=512, heap=half_heap)
        assert made == [2048]                      # called once, with the budget
        made.clear()
        assert (half.reserved <= 1024).all() and (full.reserved > 1024).any(), policy
        assert half.num_steps > full.num_steps and half.mean_batch < full.mean_batch, policy
        assert sum(half.tokens) == sum(full.tokens)
    # The paged policy has no contiguous chunks: it never builds the heap.
    paged = simulate(trace, "paged", budget_tokens=2048, max_len=512, heap=half_heap)
    assert made == [] and paged.tokens == simulate(trace, "paged", 2048, max_len=512).tokens
