"""AsyncLLMEngine: DELTA streams equal LLM.generate, aborts free blocks, errors come first.

Every test runs under ``asyncio.wait_for``: a stepping loop that hangs fails
the test instead of blocking the run.
"""

import asyncio
import time

import pytest

from minipaged import LLM, SamplingParams
from minipaged.async_engine import AsyncLLMEngine
from minipaged.engine import LLMEngine

GREEDY = dict(temperature=0.0, ignore_eos=True)
TIMEOUT_S = 30


def engine_kwargs():
    return dict(attention_backend="torch", device="cpu", num_gpu_blocks_override=64,
                swap_space=0.01, max_model_len=128)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **engine_kwargs())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def collect(engine, prompt, params, request_id=None):
    items = [out async for out in engine.generate(prompt, params, request_id)]
    return items


def test_delta_stream_concatenates_to_the_offline_output(model_dir, llm):
    prompts = ["Hello", "abcdefgh", "PagedAttention!"]
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    async def main():
        engine = AsyncLLMEngine(LLMEngine(str(model_dir), **engine_kwargs()))
        try:
            streams = await asyncio.gather(*(collect(engine, p, params) for p in prompts))
            return streams, engine.stats.used_blocks
        finally:
            await engine.shutdown()

    streams, used = run(main())
    assert used == 0
    for items, want in zip(streams, expected):
        assert len(items) > 1                      # streamed, not one final output
        assert all(not o.finished for o in items[:-1]) and items[-1].finished
        assert items[-1].outputs[0].finish_reason == "length"
        tokens = [t for o in items for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in items)
        assert tokens == want.token_ids
        assert text == want.text


def test_token_id_prompts_and_n_choices(model_dir):
    async def main():
        engine = AsyncLLMEngine(LLMEngine(str(model_dir), **engine_kwargs()))
        try:
            items = await collect(engine, [5, 6, 7, 8],
                                  SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3,
                                                 ignore_eos=True))
            return items, engine.stats.used_blocks
        finally:
            await engine.shutdown()

    items, used = run(main())
    assert used == 0
    per_index = {0: [], 1: []}
    for o in items:
        for c in o.outputs:
            per_index[c.index] += c.token_ids
    assert len(per_index[0]) == len(per_index[1]) == 6
    assert {c.finish_reason for c in items[-1].outputs} == {"length"}


def test_a_refused_request_raises_before_any_output(model_dir):
    async def main():
        engine = AsyncLLMEngine(LLMEngine(str(model_dir), **engine_kwargs()))
        try:
            agen = engine.generate("x" * 200, SamplingParams(max_tokens=4, **GREEDY))
            with pytest.raises(ValueError, match="max_model_len"):
                await agen.__anext__()
            assert engine.num_unfinished_requests() == 0
            # the engine still serves
            items = await collect(engine, "ok", SamplingParams(max_tokens=3, **GREEDY))
            return items
        finally:
            await engine.shutdown()

    items = run(main())
    assert items[-1].finished


def test_closing_or_cancelling_the_stream_aborts_and_frees_blocks(model_dir):
    async def main():
        engine = AsyncLLMEngine(LLMEngine(str(model_dir), **engine_kwargs()))
        params = SamplingParams(max_tokens=100, **GREEDY)
        try:
            # 1. the consumer closes the generator after two outputs
            agen = engine.generate("close me", params, "closed")
            await agen.__anext__()
            await agen.__anext__()
            assert engine.stats.used_blocks > 0
            await agen.aclose()

            # 2. the consuming task is cancelled mid-stream
            started = asyncio.Event()

            async def consume():
                async for _ in engine.generate("cancel me", params, "cancelled"):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # aborts that landed mid-step are applied before the next step
            for _ in range(500):
                if engine.stats.used_blocks == 0 and not engine.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            return (engine.stats.used_blocks, engine.engine.get_num_unfinished_requests(),
                    engine.stats.num_generated_tokens)
        finally:
            await engine.shutdown()

    used, unfinished, generated = run(main())
    assert used == 0
    assert unfinished == 0
    assert generated < 2 * 100   # neither ran to its 100 tokens


def test_the_loop_answers_during_steps(model_dir):
    """While a step runs, other coroutines keep running: the step is off the loop's thread.

    Each step is slowed to 50 ms (a sleep on the worker thread); a ticker of
    5 ms then ticks several times per step. A step run on the loop's thread
    would block it, and the ticker would tick about once per step.
    """
    async def main():
        engine = AsyncLLMEngine(LLMEngine(str(model_dir), **engine_kwargs()))
        real_step = engine.engine.step

        def slow_step():
            time.sleep(0.05)
            return real_step()

        engine.engine.step = slow_step
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        t = asyncio.create_task(ticker())
        try:
            items = await collect(engine, "tick", SamplingParams(max_tokens=8, **GREEDY))
        finally:
            done.set()
            await t
            await engine.shutdown()
        return ticks, len(items)

    ticks, steps = run(main())
    assert ticks >= 3 * steps


def test_a_failed_step_reaches_every_consumer_and_marks_the_engine_dead(model_dir):
    from minipaged.async_engine import EngineDeadError

    async def main():
        engine = AsyncLLMEngine(LLMEngine(str(model_dir), **engine_kwargs()))

        def broken_step():
            raise RuntimeError("device lost")

        engine.engine.step = broken_step
        try:
            results = await asyncio.gather(
                *(collect(engine, p, SamplingParams(max_tokens=4, **GREEDY)) for p in "ab"),
                return_exceptions=True)
            alive = engine.is_running
            with pytest.raises(EngineDeadError):
                await collect(engine, "c", SamplingParams(max_tokens=4, **GREEDY))
            return results, alive
        finally:
            await engine.shutdown()

    results, alive = run(main())
    assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results)
    assert not alive


def test_priority_goes_through_and_fcfs_refuses_one(model_dir):
    async def main():
        fcfs = AsyncLLMEngine(LLMEngine(str(model_dir), **engine_kwargs()))
        try:
            agen = fcfs.generate("ok", SamplingParams(max_tokens=3, **GREEDY), priority=1)
            with pytest.raises(ValueError, match="^priority is 1 but scheduling_policy"):
                await agen.__anext__()
        finally:
            await fcfs.shutdown()
        engine = AsyncLLMEngine(LLMEngine(str(model_dir), scheduling_policy="priority",
                                          **engine_kwargs()))
        try:
            items = [out async for out in engine.generate(
                "ok", SamplingParams(max_tokens=3, **GREEDY), priority=-2)]
            return items, engine.engine.stats.used_blocks
        finally:
            await engine.shutdown()

    items, used = run(main())
    assert items[-1].finished and used == 0
