"""RequestTrace: one request followed through prefix hit, preemption and return."""

import pytest

from helpers import drive, engine_for  # step watchdog, invariants after every step
from minipaged import SamplingParams
from minipaged.teaching.trace import RequestTrace

PREFIX = list(range(1, 33))          # two full 16-token blocks


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def traced_run(model_dir, mode):
    """B warms the prefix cache; X1 and X2 then crowd the 12-block pool, so A
    (the last to arrive, hence the first preempted) is preempted and brought back."""
    engine = engine_for(model_dir, num_gpu_blocks_override=12, max_model_len=128,
                        enable_prefix_caching=True, preemption_mode=mode)
    engine.add_request("B", None, greedy(4), prompt_token_ids=PREFIX + list(range(40, 48)))
    drive(engine)
    engine.add_request("X1", None, greedy(60), prompt_token_ids=list(range(100, 120)))
    engine.add_request("X2", None, greedy(60), prompt_token_ids=list(range(200, 220)))
    engine.add_request("A", None, greedy(40), prompt_token_ids=PREFIX + list(range(230, 240)))
    trace = RequestTrace(engine, "A")
    done = drive(engine)
    trace.detach()
    return engine, trace.records, done["A"]


@pytest.fixture(scope="module")
def runs(model_dir):
    return {mode: traced_run(model_dir, mode) for mode in ("swap", "recompute")}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_trace_follows_a_request_through_its_whole_life(runs, mode):
    engine, records, final = runs[mode]
    ran = [r for r in records if r.new_tokens]
    # prefill after a 2-block prefix-cache hit: only the 10 uncached prompt tokens
    assert ran[0].phase == "prefill" and ran[0].new_tokens == 10 and ran[0].cached_tokens == 32
    assert ran[0].batch_seqs == 3
    # preempted once, then back
    preempted = [i for i, r in enumerate(records) if r.preempted]
    assert len(preempted) >= 1
    at = records[preempted[0]]
    if mode == "swap":
        assert at.status == "swapped" and at.location == "cpu" and at.swapped_out > 0
        assert sum(r.swapped_in for r in records) == sum(r.swapped_out for r in records)
        assert any(r.swapped_in for r in records[preempted[0]:])
    else:
        assert at.status == "waiting" and at.block_ids == ()
        assert any(r.phase == "recompute" for r in records[preempted[0]:])
    assert "".join(r.text for r in records) == final.outputs[0].text
    last = records[-1]
    assert last.status == "finished_length_capped" and last.block_ids == ()
    assert engine.stats.used_blocks == 0 and engine.step_hooks == []


def test_swap_and_recompute_traces_end_with_the_same_text(runs):
    assert runs["swap"][2].outputs[0].token_ids == runs["recompute"][2].outputs[0].token_ids
    assert len(runs["swap"][2].outputs[0].token_ids) == 40


def test_tracing_an_unknown_request_is_refused(model_dir):
    engine = engine_for(model_dir)
    with pytest.raises(ValueError, match="request_id"):
        RequestTrace(engine, "nope")


def test_a_trace_that_detaches_does_not_make_another_miss_a_step(model_dir):
    """Two traces; the first request ends early and its trace removes its hook
    mid-step: the second trace still records every step."""
    engine = engine_for(model_dir, max_model_len=128)
    engine.add_request("short", None, greedy(2), prompt_token_ids=list(range(1, 9)))
    engine.add_request("long", None, greedy(12), prompt_token_ids=list(range(10, 18)))
    short, long = RequestTrace(engine, "short"), RequestTrace(engine, "long")
    drive(engine)
    assert short.records[-1].status == "finished_length_capped"
    assert [r.step for r in long.records] == list(range(1, engine.stats.num_steps + 1))
    assert long.records[-1].status == "finished_length_capped"


def test_a_trace_detaches_on_the_step_its_request_finishes(model_dir):
    """The last request to finish gets no later step: its trace must let go of
    the engine then, or the hook keeps trace and engine alive (the engine is
    frozen out of the garbage collector's view)."""
    engine = engine_for(model_dir, max_model_len=128)
    engine.add_request("only", None, greedy(3), prompt_token_ids=list(range(1, 9)))
    trace = RequestTrace(engine, "only")
    drive(engine)
    assert trace.records[-1].status.startswith("finished")
    assert engine.step_hooks == []
