"""The scheduler alone: admission, the token budget, chunked prefill, the
preemption victim, priority order and the pool's invariants (in the spirit of
vLLM's tests/core/test_scheduler.py).

No model, no engine, no tensors: dummy requests of a few token ids, and a
driver (``step``) that mirrors ``LLMEngine.step``: schedule, "run the model"
(``record_computed``), append a token to every ready row, free the finished
sequences and remove the finished groups. Blocks hold 4 tokens and the pools
a handful of blocks (under 100, so the block manager's 1% watermark is 0).
"""

import itertools
import random

import pytest

from minipaged.config import CacheConfig, SchedulerConfig
from minipaged.core.scheduler import Scheduler, SchedulerOutput
from minipaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.sampling_params import SamplingParams

BLOCK = 4
MODES = ["recompute", "swap"]
_seq_ids = itertools.count()


def make_group(request_id: str, prompt_len: int, arrival: float = 0.0, priority: int = 0,
               max_tokens: int = 64) -> SequenceGroup:
    """A waiting request of ``prompt_len`` token ids, built as ``add_request`` builds it."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence(next(_seq_ids), list(range(1, prompt_len + 1)), BLOCK)
    return SequenceGroup(request_id, [seq], params, arrival, None, priority)


def make_scheduler(num_device_blocks: int, num_cpu_blocks: int = 0, *, max_num_seqs: int = 16,
                   budget: int | None = 64, mode: str = "recompute",
                   policy: str = "fcfs") -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             preemption_mode=mode, scheduling_policy=policy)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    return Scheduler(config, cache, num_device_blocks=num_device_blocks,
                     num_cpu_blocks=num_cpu_blocks, max_model_len=256)


def seq_of(group: SequenceGroup) -> Sequence:
    (seq,) = group.get_seqs()
    return seq


def tokens_of(out: SchedulerOutput) -> dict[str, int]:
    """``request_id -> num_new_tokens`` of one step."""
    return {item.group.request_id: item.num_new_tokens for item in out.scheduled}


def check_pools(sched: Scheduler) -> None:
    bm = sched.block_manager
    for pool in (bm.device_pool, bm.cpu_pool):
        assert pool.num_free + pool.num_used == pool.num_total
        assert 0 <= pool.num_used <= pool.num_total
    bm.check_invariants()


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[int]]:
    """One engine step without a model; returns the output and the ready rows."""
    out = sched.schedule()
    check_pools(sched)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    for item in out.scheduled:
        assert 1 <= item.num_new_tokens <= item.seq.num_uncomputed_tokens
        assert item.seq.status == SequenceStatus.RUNNING
    for group in out.ended:  # ended: finished, and out of every queue
        assert group.is_finished()
        assert group not in sched.running and group not in sched.swapped
        assert group not in sched.waiting
    ready = sched.record_computed(out.scheduled)
    for row in ready:
        item = out.scheduled[row]
        item.seq.append_token(token, 0.0, None)
        if item.seq.num_output_tokens >= item.group.sampling_params.max_tokens:
            item.seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    for group in out.groups:
        sched.free_finished_seqs(group)
        if group.is_finished():
            sched.remove(group)
    check_pools(sched)
    return out, ready


def used(sched: Scheduler) -> int:
    return sched.block_manager.device_pool.num_used


def run_to_end(sched: Scheduler, limit: int = 500) -> list[SchedulerOutput]:
    outs = []
    for _ in range(limit):
        if not sched.has_unfinished():
            assert used(sched) == 0
            assert sched.block_manager.cpu_pool.num_used == 0
            return outs
        outs.append(step(sched)[0])
    pytest.fail(f"still unfinished after {limit} steps")


# -- admission -------------------------------------------------------------------------

def test_a_group_is_admitted_when_its_blocks_fit():
    sched = make_scheduler(8)
    group = make_group("a", 6)
    assert sched.admission_error(group) is None
    sched.add(group)
    out, ready = step(sched)
    assert tokens_of(out) == {"a": 6}
    assert out.scheduled[0].is_prefill and out.groups == [group]
    assert ready == [0]
    assert sched.running == [group] and not sched.waiting
    assert used(sched) == 2  # ceil(6 / 4)
    out, _ = step(sched)  # the decode of the token just appended: no new block (7 <= 8)
    assert tokens_of(out) == {"a": 1} and not out.scheduled[0].is_prefill
    assert used(sched) == 2
    assert seq_of(group).num_computed_tokens == 7


def test_a_prompt_larger_than_the_pool_is_refused_and_ended_as_length():
    sched = make_scheduler(4)  # 16 token slots
    assert sched.admission_error(make_group("fits", 16)) is None
    big = make_group("big", 17)
    error = sched.admission_error(big)
    assert error is not None and "big" in error
    # Queued anyway (the engine would have refused it): it ends instead of waiting forever.
    small = make_group("small", 4, arrival=1.0)
    sched.add(big)
    sched.add(small)
    out, _ = step(sched)
    assert out.ended == [big]
    assert seq_of(big).status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert seq_of(big).status.finish_reason == "length"
    assert tokens_of(out) == {"small": 4}  # the one behind it is not held up
    assert not sched.block_manager.holds_blocks(seq_of(big))


def test_a_running_group_that_outgrows_the_whole_pool_ends_with_its_tokens():
    sched = make_scheduler(2)  # 8 slots: the prompt fills them, the first output needs a 9th
    group = make_group("a", 8)
    sched.add(group)
    step(sched)
    assert seq_of(group).get_len() == 9
    out, _ = step(sched)
    assert out.ended == [group] and not out.scheduled and not out.preempted
    assert seq_of(group).status.finish_reason == "length"
    assert seq_of(group).output_token_ids == [7]
    assert not sched.has_unfinished() and used(sched) == 0


def test_a_group_that_does_not_fit_now_waits_and_no_later_one_overtakes_it():
    sched = make_scheduler(6)
    a, b, c = make_group("a", 12, 0.0), make_group("b", 16, 1.0), make_group("c", 4, 2.0)
    for g in (a, b, c):
        sched.add(g)
    out, _ = step(sched)
    assert tokens_of(out) == {"a": 12}  # b needs 4 blocks, 3 are free; c would fit but waits
    assert list(sched.waiting) == [b, c]
    for _ in range(3):  # a decodes in its 4th block; 2 blocks free, enough for c, not for b
        out, _ = step(sched)
        assert tokens_of(out) == {"a": 1}
        assert list(sched.waiting) == [b, c]
    assert used(sched) == 4
    sched.remove(a)
    assert used(sched) == 0
    out, _ = step(sched)
    assert tokens_of(out) == {"b": 16, "c": 4}
    assert [item.group for item in out.scheduled] == [b, c]


def test_max_num_seqs_bounds_the_running_groups():
    sched = make_scheduler(32, max_num_seqs=2)
    groups = [make_group(f"g{i}", 3, float(i)) for i in range(3)]
    for g in groups:
        sched.add(g)
    out, _ = step(sched)
    assert set(tokens_of(out)) == {"g0", "g1"}
    assert list(sched.waiting) == [groups[2]]
    sched.remove(groups[0])
    out, _ = step(sched)
    assert tokens_of(out) == {"g1": 1, "g2": 3}


def test_max_num_seqs_counts_an_unforked_request_as_its_best_of():
    sched = make_scheduler(32, max_num_seqs=2)
    wide = make_group("wide", 3, 0.0)
    wide.sampling_params = SamplingParams(n=2, best_of=2, max_tokens=4)
    narrow = make_group("narrow", 3, 1.0)
    sched.add(wide)
    sched.add(narrow)
    out, _ = step(sched)
    assert tokens_of(out) == {"wide": 3}  # one sequence now, two seats
    assert list(sched.waiting) == [narrow]


# -- the token budget --------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("mode", MODES)
def test_no_step_schedules_more_than_the_budget(policy, mode):
    rng = random.Random(0)
    sched = make_scheduler(12, 24, budget=5, mode=mode, policy=policy, max_num_seqs=4)
    for i in range(10):
        sched.add(make_group(f"r{i}", rng.randint(1, 14), float(i),
                             rng.randint(0, 2) if policy == "priority" else 0,
                             max_tokens=rng.randint(1, 8)))
    outs = run_to_end(sched)
    assert all(out.num_batched_tokens <= 5 for out in outs)
    assert all(len(out.groups) <= 4 for out in outs)
    assert max(out.num_batched_tokens for out in outs) == 5  # the budget is used


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_decodes_are_served_before_an_older_prompts_chunks(policy):
    """``young`` decodes; ``old`` (better ranked) is prefilling a long prompt: the
    decode goes first and the chunk takes what it leaves."""
    sched = make_scheduler(16, budget=8, policy=policy)
    # Under FCFS "old" arrived first; under priority it has the better priority.
    young = make_group("young", 2, arrival=1.0, priority=1 if policy == "priority" else 0)
    old = make_group("old", 20, arrival=0.0 if policy == "fcfs" else 2.0, priority=0)
    sched.add(young)
    step(sched)
    sched.add(old)
    out, _ = step(sched)
    assert tokens_of(out) == {"young": 1, "old": 7}
    out, ready = step(sched)
    assert sched.rank(old) < sched.rank(young)
    assert [item.group.request_id for item in out.scheduled] == ["young", "old"]
    assert tokens_of(out) == {"young": 1, "old": 7}
    assert ready == [0]  # the decode samples; the chunk in the middle of the prompt does not
    out, ready = step(sched)
    assert tokens_of(out) == {"young": 1, "old": 6}  # the rest of the prompt
    assert ready == [0, 1]


def test_decodes_that_take_the_whole_budget_leave_nothing_to_admit():
    sched = make_scheduler(16, budget=2)
    g0, g1, g2 = (make_group(f"g{i}", 1, float(i)) for i in range(3))
    for g in (g0, g1, g2):
        sched.add(g)
    out, _ = step(sched)
    assert tokens_of(out) == {"g0": 1, "g1": 1} and list(sched.waiting) == [g2]
    for _ in range(3):  # the blocks are there, the tokens are not
        out, _ = step(sched)
        assert tokens_of(out) == {"g0": 1, "g1": 1} and list(sched.waiting) == [g2]
    sched.remove(g1)
    out, _ = step(sched)
    assert tokens_of(out) == {"g0": 1, "g2": 1}


# -- chunked prefill ---------------------------------------------------------------------

def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    sched = make_scheduler(16, budget=4)
    group = make_group("a", 10)
    sched.add(group)
    seq = seq_of(group)
    chunks, readies = [], []
    for _ in range(3):
        out, ready = step(sched)
        assert out.scheduled[0].is_prefill
        chunks.append(out.scheduled[0].num_new_tokens)
        readies.append(ready)
    assert chunks == [4, 4, 2]
    assert readies == [[], [], [0]]  # a token only after the last chunk
    assert seq.num_computed_tokens == 10 and seq.output_token_ids == [7]
    assert used(sched) == 3  # all the prompt's blocks, allocated at admission
    out, ready = step(sched)
    assert tokens_of(out) == {"a": 1} and not out.scheduled[0].is_prefill and ready == [0]


def test_chunks_take_the_budget_the_decodes_leave():
    sched = make_scheduler(16, budget=4)
    decoder = make_group("d", 2, 0.0)
    sched.add(decoder)
    step(sched)
    long = make_group("p", 10, 1.0)
    sched.add(long)
    chunks, readies = [], []
    while not seq_of(long).output_token_ids:
        out, ready = step(sched)
        assert tokens_of(out)["d"] == 1
        chunks.append(tokens_of(out)["p"])
        readies.append([out.scheduled[row].group.request_id for row in ready])
    assert chunks == [3, 3, 3, 1]
    assert readies == [["d"], ["d"], ["d"], ["d", "p"]]
    assert seq_of(long).num_computed_tokens == 10


# -- the preemption victim ----------------------------------------------------------------

def fill_the_pool(sched: Scheduler, *groups: SequenceGroup) -> None:
    """Admit ``groups`` (8-token prompts: two full blocks each) in one step; each
    then holds one new token that needs a third block."""
    for g in groups:
        sched.add(g)
    out, _ = step(sched)
    assert [item.group for item in out.scheduled] == list(groups)
    assert sched.block_manager.device_pool.num_free == 0


def test_recompute_preempts_the_latest_arrival_to_the_front_of_the_queue():
    sched = make_scheduler(4)
    a, b = make_group("a", 8, 0.0), make_group("b", 8, 1.0)
    fill_the_pool(sched, a, b)
    d = make_group("d", 1, 3.0)
    sched.add(d)
    out, _ = step(sched)
    assert out.preempted == [b] and sched.num_preemptions == 1
    assert tokens_of(out) == {"a": 1}
    assert list(sched.waiting) == [b, d]  # in front of the later arrival
    assert seq_of(b).status == SequenceStatus.WAITING and seq_of(b).num_computed_tokens == 0
    assert not sched.block_manager.holds_blocks(seq_of(b))
    assert seq_of(b).output_token_ids == [7]  # what it generated is kept, to recompute
    assert used(sched) == 3 and not out.blocks_to_swap_out
    out, _ = step(sched)  # b needs 3 blocks, 1 is free; d would fit but waits behind it
    assert tokens_of(out) == {"a": 1} and list(sched.waiting) == [b, d]
    sched.remove(a)
    out, _ = step(sched)
    assert tokens_of(out) == {"b": 9, "d": 1}  # prompt and output prefilled again
    assert out.scheduled[0].is_prefill
    run_to_end(sched)


def test_swap_preempts_the_latest_arrival_to_the_cpu_and_brings_it_back_first():
    sched = make_scheduler(4, 8, mode="swap")
    a, b = make_group("a", 8, 0.0), make_group("b", 8, 1.0)
    fill_the_pool(sched, a, b)
    b_blocks = list(seq_of(b).block_table.blocks)
    out, _ = step(sched)
    assert out.preempted == [b] and sched.swapped == [b] and not sched.waiting
    assert [src for src, _ in out.blocks_to_swap_out] == b_blocks
    assert seq_of(b).status == SequenceStatus.SWAPPED
    assert seq_of(b).num_computed_tokens == 8  # its cache is kept, on the CPU
    assert sched.block_manager.cpu_pool.num_used == 2 and used(sched) == 3
    assert tokens_of(out) == {"a": 1}
    d = make_group("d", 1, 3.0)
    sched.add(d)
    out, _ = step(sched)  # b needs 2 + 1 blocks back, 1 is free: it waits, and d behind it
    assert tokens_of(out) == {"a": 1} and not out.blocks_to_swap_in
    assert sched.swapped == [b] and list(sched.waiting) == [d]
    sched.remove(a)
    out, _ = step(sched)
    assert len(out.blocks_to_swap_in) == 2 and not sched.swapped
    assert [item.group for item in out.scheduled] == [b, d]
    assert tokens_of(out) == {"b": 1, "d": 1}
    assert not out.scheduled[0].is_prefill  # b goes on decoding
    assert sched.block_manager.cpu_pool.num_used == 0
    run_to_end(sched)


@pytest.mark.parametrize("mode", MODES)
def test_the_victim_is_the_latest_arrival_not_the_group_that_is_short(mode):
    sched = make_scheduler(6, 8, mode=mode)
    a, b, c = make_group("a", 8, 0.0), make_group("b", 8, 1.0), make_group("c", 8, 2.0)
    fill_the_pool(sched, a, b, c)
    out, _ = step(sched)
    assert out.preempted == [c]  # two blocks back: a and b both grow
    assert tokens_of(out) == {"a": 1, "b": 1}
    assert (c in sched.swapped) if mode == "swap" else (list(sched.waiting) == [c])
    run_to_end(sched)


@pytest.mark.parametrize("mode", MODES)
def test_the_latest_arrival_yields_when_it_is_the_one_that_is_short(mode):
    sched = make_scheduler(4, 8, mode=mode)
    a, b = make_group("a", 6, 0.0), make_group("b", 8, 1.0)  # a has room in its last block
    fill_the_pool(sched, a, b)
    out, _ = step(sched)
    assert out.preempted == [b] and tokens_of(out) == {"a": 1}
    assert sched.running == [a]
    run_to_end(sched)


def fork_group(sched: Scheduler, group: SequenceGroup) -> Sequence:
    """Fork the group's one sequence after its prefill, as parallel sampling does."""
    parent = seq_of(group)
    child = parent.fork(next(_seq_ids))
    sched.fork(parent, child)
    group.add(child)
    return child


def test_a_group_of_several_sequences_is_swapped_even_under_recompute():
    sched = make_scheduler(4, 8, mode="recompute")
    a, b = make_group("a", 8, 0.0), make_group("b", 4, 1.0)
    for g in (a, b):
        sched.add(g)
    step(sched)
    fork_group(sched, b)  # two sequences of 5 tokens sharing one full block
    assert used(sched) == 3
    out, _ = step(sched)  # a takes the last block; b needs two more
    assert out.preempted == [b] and sched.swapped == [b] and not sched.waiting
    assert len(out.blocks_to_swap_out) == 1  # the shared block, copied once
    assert all(s.status == SequenceStatus.SWAPPED for s in b.get_seqs())
    sched.remove(a)
    out, _ = step(sched)
    assert len(out.blocks_to_swap_in) == 1 and tokens_of(out) == {"b": 1}
    assert len(out.scheduled) == 2  # the two sequences advance together
    run_to_end(sched)


def test_a_group_of_several_sequences_that_the_cpu_cannot_take_is_aborted():
    sched = make_scheduler(4, 0, mode="swap")
    a, b = make_group("a", 8, 0.0), make_group("b", 4, 1.0)
    for g in (a, b):
        sched.add(g)
    step(sched)
    fork_group(sched, b)
    out, _ = step(sched)
    assert out.preempted == [b] and out.ended == [b]
    assert {s.status.finish_reason for s in b.get_seqs()} == {"abort"}
    assert not sched.swapped and not sched.waiting and sched.running == [a]
    assert used(sched) == 3  # a's three blocks; b's one went back
    run_to_end(sched)


# -- priority ------------------------------------------------------------------------------

def start_order(sched: Scheduler) -> list[str]:
    order: list[str] = []
    for out in run_to_end(sched):
        order += [g.request_id for g in out.groups if g.request_id not in order]
    return order


def test_priority_admits_the_lower_value_first_then_by_arrival():
    sched = make_scheduler(32, max_num_seqs=1, policy="priority")
    for i, (rid, rank) in enumerate([("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2)]):
        sched.add(make_group(rid, 3, float(i), rank, max_tokens=2))
    assert start_order(sched) == ["b", "d", "c", "a", "e"]


def test_priority_ties_go_by_arrival_time_not_by_the_order_added():
    sched = make_scheduler(32, max_num_seqs=1, policy="priority")
    sched.add(make_group("late", 3, 5.0, 0, max_tokens=1))
    sched.add(make_group("early", 3, 1.0, 0, max_tokens=1))
    sched.add(make_group("worse", 3, 0.0, 1, max_tokens=1))
    assert start_order(sched) == ["early", "late", "worse"]


def test_fcfs_admits_in_arrival_order_whatever_the_priority_field():
    sched = make_scheduler(32, max_num_seqs=1)
    for i, rank in enumerate([2, 0, 1]):
        sched.add(make_group(f"r{i}", 3, float(i), rank, max_tokens=1))
    assert start_order(sched) == ["r0", "r1", "r2"]


@pytest.mark.parametrize("mode", MODES)
def test_a_better_priority_arrival_preempts_the_worst_running_group(mode):
    sched = make_scheduler(4, 8, mode=mode, policy="priority")
    worst, middle = make_group("worst", 8, 0.0, 5), make_group("middle", 8, 1.0, 3)
    fill_the_pool(sched, middle, worst)  # admitted in rank order
    best = make_group("best", 4, 2.0, 0)
    sched.add(best)
    out, _ = step(sched)
    assert out.preempted == [worst]  # the worst priority, though it arrived first
    assert tokens_of(out) == {"middle": 1, "best": 4}
    assert (worst in sched.swapped) if mode == "swap" else (list(sched.waiting) == [worst])
    assert set(sched.running) == {middle, best}
    run_to_end(sched)


@pytest.mark.parametrize("mode", MODES)
def test_an_equal_priority_arrival_preempts_nobody(mode):
    sched = make_scheduler(4, 8, mode=mode, policy="priority")
    a, b = make_group("a", 6, 0.0, 1), make_group("b", 6, 1.0, 1)  # both have room to grow
    fill_the_pool(sched, a, b)
    c = make_group("c", 4, 2.0, 1)
    sched.add(c)
    out, _ = step(sched)
    assert not out.preempted and tokens_of(out) == {"a": 1, "b": 1}
    assert list(sched.waiting) == [c]


@pytest.mark.parametrize("mode", MODES)
def test_under_priority_the_pool_preempts_the_worst_ranked_not_the_latest(mode):
    sched = make_scheduler(4, 8, mode=mode, policy="priority")
    older, newer = make_group("older", 8, 0.0, 1), make_group("newer", 8, 1.0, 0)
    fill_the_pool(sched, newer, older)  # admitted in rank order
    out, _ = step(sched)
    assert out.preempted == [older] and tokens_of(out) == {"newer": 1}
    run_to_end(sched)


# -- the allocator's invariants --------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_pools_stay_consistent_and_empty_at_the_end(policy, mode, seed):
    """A random workload with preemptions; ``step`` checks free + used == total
    and every reference count after each schedule and each step, and
    ``run_to_end`` that nothing is held once every group is gone."""
    rng = random.Random(seed)
    sched = make_scheduler(10, 6, budget=rng.choice([3, 8, 64]), mode=mode, policy=policy,
                           max_num_seqs=rng.randint(2, 6))
    total = sched.block_manager.device_pool.num_total
    pending = [make_group(f"r{i}", rng.randint(1, 16), float(i),
                          rng.randint(0, 3) if policy == "priority" else 0,
                          max_tokens=rng.randint(1, 12)) for i in range(12)]
    outs = []
    for _ in range(400):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        outs.append(step(sched)[0])
        pool = sched.block_manager.device_pool
        assert pool.num_free + pool.num_used == total
    else:
        pytest.fail("still unfinished after 400 steps")
    assert used(sched) == 0 and sched.block_manager.device_pool.num_free == total
    assert sched.block_manager.cpu_pool.num_used == 0
    assert sum(len(out.preempted) for out in outs) > 0  # the pool was short at some point


def test_removing_every_group_in_every_queue_frees_every_block():
    sched = make_scheduler(4, 8, mode="swap")
    a, b = make_group("a", 8, 0.0), make_group("b", 8, 1.0)
    fill_the_pool(sched, a, b)
    step(sched)  # b swapped out
    waiting = make_group("w", 20, 2.0)
    sched.add(waiting)
    assert sched.running == [a] and sched.swapped == [b] and list(sched.waiting) == [waiting]
    assert used(sched) == 3 and sched.block_manager.cpu_pool.num_used == 2
    for g in (b, a, waiting):
        sched.remove(g)
        check_pools(sched)
    assert used(sched) == 0 and sched.block_manager.cpu_pool.num_used == 0
    assert not sched.has_unfinished()


def _decode_trace(seed: int, fast_path: bool, monkeypatch, window: int | None = None,
                  kv_policy: str = "paged") -> tuple[list, int]:
    """Every step of one random workload (forks, shared prompt prefixes, a pool
    short enough to preempt) as plain values, and how many decodes took the
    scheduler's one-sequence fast path (``_lone_decode`` + ``take_decode_slot``)."""
    from minipaged.core import scheduler as scheduler_module

    if not fast_path:
        monkeypatch.setattr(scheduler_module, "_lone_decode", lambda group: None)
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=rng.choice([8, 64]),
                             preemption_mode=rng.choice(MODES))
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=kv_policy == "paged",
                        kv_policy=kv_policy)
    sched = Scheduler(config, cache, num_device_blocks=14 if kv_policy == "paged" else 60,
                      num_cpu_blocks=16, max_model_len=40, sliding_window=window)
    taken = 0
    take = sched.block_manager.take_decode_slot

    def counting_take(seq):
        nonlocal taken
        took = take(seq)
        taken += took
        return took

    sched.block_manager.take_decode_slot = counting_take
    ids = itertools.count(10_000)
    shared = [rng.randrange(1, 50) for _ in range(8)]
    pending = []
    for i in range(10):
        own = [rng.randrange(1, 50) for _ in range(rng.randint(1, 9))]
        prompt = shared[:rng.randint(0, 8)] + own
        params = SamplingParams(max_tokens=rng.randint(2, 14), ignore_eos=True)
        pending.append(SequenceGroup(f"r{i}", [Sequence(next(ids), prompt, BLOCK)], params,
                                     float(i), None, 0))
    trace = []
    for _ in range(300):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        out, _ = step(sched, token=rng.randrange(1, 50))
        for group in out.groups:   # some requests fork after their prompt, as n=2 does
            if (kv_policy == "paged" and len(group.seqs) == 1
                    and seq_of(group).num_output_tokens == 1
                    and rng.random() < 0.3 and not group.is_finished()):
                child = seq_of(group).fork(next(ids))
                sched.fork(seq_of(group), child)
                group.add(child)
        trace.append((
            [(item.group.request_id, item.seq.seq_id, item.num_new_tokens, item.is_prefill)
             for item in out.scheduled],
            [g.request_id for g in out.preempted], [g.request_id for g in out.ended],
            list(out.blocks_to_copy), list(out.blocks_to_swap_out), list(out.blocks_to_swap_in),
            sorted((s.seq_id, list(s.block_table.blocks), s.block_table.num_tokens)
                   for g in sched.running for s in g.get_seqs())))
    else:
        pytest.fail("still unfinished after 300 steps")
    return trace, taken


@pytest.mark.parametrize("seed, window, kv_policy",
                         [(4, None, "paged"), (5, None, "paged"), (6, 6, "paged"),
                          (7, 6, "paged"), (8, None, "pow2")])
def test_the_decode_fast_path_schedules_what_the_general_path_does(seed, window, kv_policy,
                                                                   monkeypatch):
    """The same random workload, with and without the fast path: the same
    sequences, tokens, preemptions, copies and block tables at every step
    (``step`` checks the pool's invariants after each); under a sliding
    window and an Orca reservation too."""
    general, none_taken = _decode_trace(seed, False, monkeypatch, window, kv_policy)
    monkeypatch.undo()
    fast, taken = _decode_trace(seed, True, monkeypatch, window, kv_policy)
    assert none_taken == 0 and taken > 10
    assert fast == general


def test_take_decode_slot_refuses_a_shared_or_full_last_block():
    """The fast path takes a slot only where ``append_slots`` would take no block
    and copy nothing: a partial last block shared with a fork needs a copy, a
    full one a new block; either way the table is left as it was."""
    sched = make_scheduler(8)
    group = make_group("a", 5)
    sched.add(group)
    step(sched)                       # 5 prompt tokens computed, a 6th appended
    parent = seq_of(group)
    manager = sched.block_manager
    child = fork_group(sched, group)  # shares the partial block of tokens 5 to 8
    assert not manager.take_decode_slot(parent) and parent.block_table.num_tokens == 5
    group.remove(child.seq_id)
    manager.free(child)
    assert manager.take_decode_slot(parent) and parent.block_table.num_tokens == 6
    for n in (6, 7):                  # two more decodes fill the block
        parent.num_computed_tokens = n
        parent.append_token(7, 0.0, None)
        assert manager.take_decode_slot(parent) and parent.block_table.num_tokens == n + 1
    parent.num_computed_tokens = 8
    parent.append_token(7, 0.0, None)
    blocks = list(parent.block_table.blocks)
    assert not manager.take_decode_slot(parent)
    assert parent.block_table.blocks == blocks and parent.block_table.num_tokens == 8
    check_pools(sched)
