"""Automatic prefix caching: full blocks keyed by their whole prefix, reused
across requests, evicted least recently used first. Outputs with the cache on
must equal outputs with it off, whatever else happens to the blocks."""

import random

import pytest

from helpers import drive  # step watchdog, invariants after every step
from minipaged import LLM, SamplingParams
from minipaged.core.allocator import BlockAllocator
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.engine import LLMEngine

BS = 16


def cached_llm(model_dir):
    return LLM(str(model_dir), attention_backend="torch", device="cpu",
               num_gpu_blocks_override=64, enable_prefix_caching=True)


def engine(model_dir, caching, **kw):
    kw.setdefault("num_gpu_blocks_override", 64)
    return LLMEngine(str(model_dir), attention_backend="torch", device="cpu", swap_space=0.01,
                     enable_prefix_caching=caching, **kw)


def test_hits_are_exact_and_never_the_last_prompt_token(untokenized_model_dir):
    llm = cached_llm(untokenized_model_dir)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 256) for _ in range(100)]
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prefix}, p, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = llm.generate([{"prompt_token_ids": prefix + [rng.randrange(3, 256)
                                                          for _ in range(rng.randint(0, 20))]}
                         for _ in range(11)], p, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [96] * 11
    assert llm.engine.stats.prefix_cache_hit_tokens == 11 * 96
    # A prompt of exactly 6 cached blocks still computes its last block's tokens.
    again = llm.generate({"prompt_token_ids": prefix[:96]}, p, use_tqdm=False)[0]
    assert again.num_cached_tokens == 80


def workload(seed, n=12):
    """Requests sharing prefixes of random lengths (cut from three stems that
    every call shares), with several sampling kinds."""
    stem_rng = random.Random(1234)
    stems = [[stem_rng.randrange(3, 256) for _ in range(stem_rng.randint(5, 70))]
             for _ in range(3)]
    rng = random.Random(seed)
    kinds = [dict(temperature=0.0), dict(temperature=0.9, seed=7),
             dict(n=2, temperature=0.8, seed=3), dict(n=2, use_beam_search=True, temperature=0.0)]
    reqs = []
    for i in range(n):
        stem = rng.choice(stems)
        prompt = stem[:rng.randint(1, len(stem))] + [rng.randrange(3, 256)
                                                    for _ in range(rng.randint(0, 20))]
        params = SamplingParams(max_tokens=rng.randint(4, 24), ignore_eos=True,
                                **rng.choice(kinds))
        reqs.append((str(i), prompt or [5], params))
    return reqs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("blocks", [64, 14])
def test_outputs_equal_with_and_without_the_cache(untokenized_model_dir, mode, blocks):
    results = []
    for caching in (False, True):
        eng = engine(untokenized_model_dir, caching, num_gpu_blocks_override=blocks,
                     preemption_mode=mode, max_model_len=128)
        done = {}
        for wave in range(2):  # the second wave finds the first one's blocks (or their ghosts)
            for rid, prompt, p in workload(seed=blocks + wave):
                eng.add_request(f"{wave}-{rid}", None, p, prompt_token_ids=prompt)
            done.update(drive(eng))
        results.append({rid: [(c.token_ids, c.finish_reason) for c in o.outputs]
                        for rid, o in done.items()})
        if caching:
            assert eng.stats.prefix_cache_hit_tokens > 0
            if blocks == 14:  # a small pool: cached blocks are evicted, requests preempted
                assert eng.stats.num_preemptions > 0
                assert eng.block_manager.device_pool.num_evictions > 0
    assert results[0] == results[1]


def test_a_recomputed_request_finds_its_own_blocks(untokenized_model_dir):
    eng = engine(untokenized_model_dir, True, num_gpu_blocks_override=12, max_model_len=160)
    rng = random.Random(3)
    for i in range(3):
        eng.add_request(str(i), None, SamplingParams(temperature=0.0, max_tokens=40,
                                                     ignore_eos=True),
                        prompt_token_ids=[rng.randrange(3, 256) for _ in range(40)])
    drive(eng)
    assert eng.stats.num_preemptions > 0
    assert eng.stats.prefix_cache_hit_tokens > 0


def test_eviction_takes_the_least_recently_released_and_the_tail_first():
    pool = BlockAllocator(4, BS, enable_caching=True)
    a, b, c = pool.allocate_many(3)
    for block, key in ((a, "k0"), (b, "k1"), (c, "k2")):
        assert pool.register(block, key)
    assert not pool.register(pool.allocate(), "k0")     # a key stays with its first block
    pool.free_many(reversed([a, b, c]))                  # a sequence frees its tail first
    assert pool.num_free == 3 and pool.num_used == 1
    assert pool.evictable_blocks() == [c, b, a]
    pool.take_cached(b)                                  # a hit: out of the evictor
    assert pool.evictable_blocks() == [c, a] and pool.refcount(b) == 1
    got = pool.allocate_many(1)                          # evicts c, the end of the prefix
    assert got == [c] and pool.cached_block("k2") is None and pool.cached_block("k0") == a


def test_the_manager_checks_what_the_cache_holds():
    manager = BlockSpaceManager(BS, 8, 0, watermark=0.0, enable_caching=True)
    seq = Sequence(0, list(range(40)), BS)
    group = SequenceGroup("r", [seq])
    manager.allocate(group)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = 40
    manager.cache_full_blocks(seq)
    assert manager.device_pool.num_cached == 2
    manager.check_invariants()
    # A block cached under a key that its tokens do not give is caught.
    dev = manager.device_pool
    k0, k1 = dev.key_of(seq.block_table.blocks[0]), dev.key_of(seq.block_table.blocks[1])
    dev._key_of[seq.block_table.blocks[0]], dev._key_of[seq.block_table.blocks[1]] = k1, k0
    dev._block_of[k0], dev._block_of[k1] = seq.block_table.blocks[1], seq.block_table.blocks[0]
    with pytest.raises(AssertionError, match="another prefix"):
        manager.check_invariants()


def test_a_chats_next_turn_hits_the_blocks_its_answer_filled(untokenized_model_dir):
    llm = cached_llm(untokenized_model_dir)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 256) for _ in range(20)]
    p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    answer = llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].outputs[0].token_ids
    history = prompt + answer                                 # 50 tokens: 3 full blocks
    turn = llm.generate({"prompt_token_ids": history + [9, 10, 11]}, p, use_tqdm=False)[0]
    assert turn.num_cached_tokens == 48   # blocks 1 and 2 were filled while decoding the answer
    llm.engine.block_manager.check_invariants()
