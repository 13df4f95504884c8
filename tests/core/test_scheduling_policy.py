"""Scheduling policy: FCFS and priority (vLLM's ``--scheduling-policy``).

Under ``scheduling_policy="priority"`` a lower ``priority`` is served first and
ties go by arrival; the pool preempts the worst-ranked running group first; a
waiting request of a strictly better priority preempts running ones to get in.
Every test drives the engine with a step watchdog (``drive`` or ``steps``) and
runs in both preemption modes where preemption can happen.
"""

import random

import pytest

from helpers import drive, engine_for
from minipaged import LLM, SamplingParams
from minipaged.config import SchedulerConfig

MODES = ["recompute", "swap"]


def small(model_dir, **kw):
    """An engine with a context of 48 tokens, so that a pool of a few blocks is allowed."""
    kw.setdefault("max_model_len", 48)
    return engine_for(model_dir, **kw)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def prompt(length: int, salt: int = 0) -> list[int]:
    """Token ids of a prompt that shares no full block with another salt's."""
    return [3 + (salt * 7 + i) % 90 for i in range(length)]


def steps(engine, limit: int = 500):
    """Step to the end, yielding each step's scheduler output (the watchdog: a
    run longer than ``limit`` steps fails)."""
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        engine.step()
        engine.block_manager.check_invariants()
        yield engine.last_scheduler_output
    pytest.fail(f"still unfinished after {limit} steps")


def start_order(engine) -> list[str]:
    """Request ids in the order they were first scheduled."""
    order: list[str] = []
    for out in steps(engine):
        order += [g.request_id for g in out.groups if g.request_id not in order]
    assert engine.stats.used_blocks == 0
    return order


# -- admission order -------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_admission_goes_by_priority_then_arrival(model_dir, mode):
    engine = engine_for(model_dir, scheduling_policy="priority", max_num_seqs=1,
                        preemption_mode=mode)
    for i, (rid, rank) in enumerate([("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2)]):
        engine.add_request(rid, None, greedy(3), prompt_token_ids=prompt(5, i), priority=rank)
    assert start_order(engine) == ["b", "d", "c", "a", "e"]


def test_fcfs_goes_by_arrival(model_dir):
    engine = engine_for(model_dir, max_num_seqs=1)
    for i, rid in enumerate("abcde"):
        engine.add_request(rid, None, greedy(3), prompt_token_ids=prompt(5, i))
    assert start_order(engine) == list("abcde")


def test_ties_go_by_arrival_time_not_by_the_order_added(model_dir):
    engine = engine_for(model_dir, scheduling_policy="priority", max_num_seqs=1)
    for i, (rid, arrival) in enumerate([("late", 30.0), ("early", 10.0), ("middle", 20.0)]):
        engine.add_request(rid, None, greedy(2), prompt_token_ids=prompt(5, i),
                           arrival_time=arrival, priority=1)
    assert start_order(engine) == ["early", "middle", "late"]


# -- the victim when the pool runs dry ---------------------------------------------------

def first_victims(engine) -> list[str]:
    """The request ids preempted in the first step that preempts anyone; the run
    then goes on to the end."""
    victims = None
    for out in steps(engine):
        if out.preempted and victims is None:
            victims = [g.request_id for g in out.preempted]
    assert victims is not None, "nobody was preempted"
    assert engine.stats.used_blocks == 0
    return victims


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ranks, victim", [
    ((0, 1, 1), "r2"),   # the worst priority; the latest arrival among equals
    ((1, 0, 0), "r0"),   # the worst priority, though it arrived first
    ((0, 2, 1), "r1"),
    ((0, 0, 0), "r2"),   # all equal: the latest arrival, as FCFS
])
def test_the_victim_is_the_worst_ranked_running_group(model_dir, mode, ranks, victim):
    # 3 requests of 1 block that grow to 5 blocks each, in a pool of 10 blocks
    # of 8: all are admitted at once, and the pool runs dry while they decode.
    engine = small(model_dir, scheduling_policy="priority", preemption_mode=mode,
                   block_size=8, num_gpu_blocks_override=10)
    for i, rank in enumerate(ranks):
        engine.add_request(f"r{i}", None, greedy(32), prompt_token_ids=prompt(8, i),
                           arrival_time=float(i), priority=rank)
    assert first_victims(engine)[0] == victim


@pytest.mark.parametrize("mode", MODES)
def test_fcfs_preempts_the_latest_arrival(model_dir, mode):
    engine = small(model_dir, preemption_mode=mode, block_size=8, num_gpu_blocks_override=10)
    for i in range(3):
        engine.add_request(f"r{i}", None, greedy(32), prompt_token_ids=prompt(8, i),
                           arrival_time=float(i))
    assert first_victims(engine)[0] == "r2"


# -- a waiting request of better priority takes a running one's place --------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("limit", ["seats", "blocks"])
def test_a_better_waiting_request_preempts_a_running_one(model_dir, mode, limit):
    # Two batch jobs fill the seats (max_num_seqs=2) or the blocks (6 blocks of 8
    # for two 2-block prompts growing by 1 block each, then a 3-block newcomer).
    kw = dict(max_num_seqs=2) if limit == "seats" else dict(num_gpu_blocks_override=6)
    engine = small(model_dir, scheduling_policy="priority", preemption_mode=mode,
                   block_size=8, **kw)
    for i in range(2):
        engine.add_request(f"batch{i}", None, greedy(6), prompt_token_ids=prompt(12, i),
                           priority=1)
    engine.step()
    assert {g.request_id for g in engine.scheduler.running} == {"batch0", "batch1"}
    engine.add_request("urgent", None, greedy(4), prompt_token_ids=prompt(20, 5), priority=0)
    engine.step()
    out = engine.last_scheduler_output
    assert [g.request_id for g in out.preempted] == ["batch1"]   # the later of the two
    assert "urgent" in [g.request_id for g in out.groups]       # admitted in the same step
    done = drive(engine)
    assert sorted(done) == ["batch0", "batch1", "urgent"]
    assert all(c.finish_reason == "length" for o in done.values() for c in o.outputs)


@pytest.mark.parametrize("rank", [1, 2])
def test_an_equal_or_worse_waiting_request_preempts_nobody(model_dir, rank):
    engine = engine_for(model_dir, scheduling_policy="priority", max_num_seqs=2, block_size=8)
    for i in range(2):
        engine.add_request(f"batch{i}", None, greedy(6), prompt_token_ids=prompt(12, i),
                           priority=1)
    engine.step()
    engine.add_request("later", None, greedy(4), prompt_token_ids=prompt(20, 5), priority=rank)
    order = [g.request_id for out in steps(engine) for g in out.preempted]
    assert order == []
    assert engine.stats.num_preemptions == 0


# -- a mixed workload: everything ends, greedy outputs unchanged ----------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_mixed_workload_ends_with_the_outputs_of_a_roomy_fcfs_run(model_dir, mode):
    rng = random.Random(7)
    work = []
    for i in range(12):
        n = rng.choice([1, 1, 2])
        params = (greedy(rng.randint(4, 40)) if n == 1 else
                  SamplingParams(n=n, temperature=1.0, seed=rng.randint(0, 99),
                                 max_tokens=rng.randint(4, 30), ignore_eos=True))
        work.append((f"q{i}", prompt(rng.randint(3, 30), i), params, rng.randint(0, 3)))

    def run(**kw):
        engine = small(model_dir, block_size=8, max_model_len=80, **kw)
        for i, (rid, ids, params, rank) in enumerate(work):
            engine.add_request(rid, None, params, prompt_token_ids=ids, arrival_time=float(i),
                               priority=rank if kw.get("scheduling_policy") else 0)
        done = drive(engine, max_steps=1500)
        return {rid: [c.token_ids for c in o.outputs] for rid, o in done.items()}, engine

    roomy, _ = run(num_gpu_blocks_override=256)
    tight, engine = run(num_gpu_blocks_override=16, scheduling_policy="priority",
                        preemption_mode=mode, max_num_seqs=6)
    assert engine.stats.num_preemptions > 0
    assert tight == roomy


# -- bad input -----------------------------------------------------------------------

@pytest.mark.parametrize("priority", [1.5, "1", None, True])
def test_a_priority_that_is_not_an_integer_is_refused(model_dir, priority):
    engine = engine_for(model_dir, scheduling_policy="priority")
    with pytest.raises(ValueError, match="^priority must be an integer"):
        engine.add_request("x", None, greedy(2), prompt_token_ids=[3, 4], priority=priority)
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", None, greedy(2), prompt_token_ids=[3, 4], priority=-3)
    assert sorted(drive(engine)) == ["ok"]


def test_a_priority_under_fcfs_is_refused_as_in_vllm(model_dir):
    engine = engine_for(model_dir)
    with pytest.raises(ValueError, match="^priority is 1 but scheduling_policy is 'fcfs'"):
        engine.add_request("x", None, greedy(2), prompt_token_ids=[3, 4], priority=1)
    assert not engine.has_unfinished_requests()


def test_an_unknown_policy_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="^scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lifo")


def test_llm_generate_takes_one_priority_per_prompt(model_dir):
    llm = LLM(str(model_dir), attention_backend="torch", device="cpu",
              scheduling_policy="priority", max_num_seqs=1)
    prompts = [{"prompt_token_ids": prompt(5, i)} for i in range(3)]
    outs = llm.generate(prompts, greedy(3), use_tqdm=False, priority=[2, 0, 1])
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    finished = sorted(outs, key=lambda o: o.metrics.finished_time)
    assert [o.prompt_token_ids for o in finished] == [prompts[i]["prompt_token_ids"]
                                                      for i in (1, 2, 0)]
    with pytest.raises(ValueError, match="^priority: got 2 for 3 prompts"):
        llm.generate(prompts, greedy(3), use_tqdm=False, priority=[0, 1])
    assert not llm.engine.has_unfinished_requests()


# -- decodes before prompt chunks ----------------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_decodes_take_the_budget_before_an_older_prompts_chunks(model_dir, policy):
    # Two chats decode; then a long prompt that arrived earlier (so it ranks
    # first) is admitted and prefilled in chunks of what the budget leaves.
    engine = small(model_dir, scheduling_policy=policy, max_num_batched_tokens=16,
                   max_num_seqs=4, block_size=8, max_model_len=64)
    for i in range(2):
        engine.add_request(f"chat{i}", None, greedy(12), prompt_token_ids=prompt(4, i),
                           arrival_time=5.0 + i)
    engine.step()
    engine.add_request("long", None, greedy(2), prompt_token_ids=prompt(56, 3),
                       arrival_time=0.0)
    chunks = []
    for out in steps(engine):
        tokens = {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}
        by_request = {g.request_id: sum(tokens.get(s.seq_id, 0) for s in g.get_seqs())
                      for g in out.groups}
        if "long" in by_request and by_request["long"] > 1:        # a prompt chunk
            assert by_request.get("chat0") == by_request.get("chat1") == 1
            chunks.append(by_request["long"])
            assert out.num_batched_tokens <= 16
    assert chunks == [14, 14, 14, 14]   # 56 prompt tokens, 2 of every 16 to the chats


@pytest.mark.parametrize("mode", MODES)
def test_with_admission_headroom_a_request_that_preempts_gets_in(model_dir, mode):
    """The preemption for a waiting request counts the same headroom its
    admission will: else a running request is preempted for nothing."""
    engine = small(model_dir, scheduling_policy="priority", admission_headroom=True,
                   preemption_mode=mode, num_gpu_blocks_override=7, max_model_len=112,
                   enable_prefix_caching=False)
    for i in range(2):
        engine.add_request(f"batch{i}", None, greedy(40), prompt_token_ids=prompt(40, i),
                           priority=1)
    engine.step()
    engine.add_request("urgent", None, greedy(4), prompt_token_ids=prompt(60, 5), priority=0)
    engine.step()
    out = engine.last_scheduler_output
    assert out.preempted and "urgent" in [g.request_id for g in out.groups]
    assert sorted(drive(engine)) == ["batch0", "batch1", "urgent"]
