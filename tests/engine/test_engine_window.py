"""The engine on an all-windowed model (like Mistral 7B v0.1): the blocks
behind each sequence's window go back to the pool, so a context 4x the
window runs through a pool far smaller than it.

A tiny random Mistral with ``sliding_window`` W = 32, blocks of 4 tokens and
a token budget C = 8 (every prompt is prefilled in chunks) serves prompts
and outputs of 4W. After every step (a watchdog bounds them) no sequence
holds more than ``ceil((W + C) / block_size) + 1`` blocks and the
allocator's invariants hold; with a pool too small for the batch, both
preemption modes finish every request with the same greedy tokens as an
unconstrained pool. (Token equality with transformers is the kernels'
tests' business.)
"""

import numpy as np
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from helpers import GREEDY, drive, engine_for
from minipaged import SamplingParams
from minipaged.core.block_table import NO_BLOCK, Location, blocks_for_tokens
from minipaged.executor.model_runner import _TableMirror
from tiny_models import VOCAB

WINDOW, BLOCK, CHUNK = 32, 4, 8
MAX_LEN = 4 * WINDOW + 8
BOUND = blocks_for_tokens(WINDOW + CHUNK, BLOCK) + 1   # 11 blocks a sequence at most
MAX_STEPS = 800
SWAP_GB = 0.0001   # ~100 CPU blocks of this model: the per-step invariant checks stay cheap


@pytest.fixture(scope="module")
def window_model_dir(tmp_path_factory):
    """A tiny random Mistral whose every layer attends to the last 32 positions."""
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=512, sliding_window=WINDOW,
                           tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-mistral-window")
    MistralForCausalLM(config).eval().save_pretrained(str(path))
    return path


def requests(n=3):
    """``n`` greedy requests of 4 windows each: prompts of 2-2.5 windows, the rest output."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt_len = 2 * WINDOW + 8 * i
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=gen).tolist()
        out.append((f"r{i}", prompt, SamplingParams(max_tokens=4 * WINDOW - prompt_len,
                                                    **GREEDY)))
    return out


def check_window_bound(engine):
    """No sequence holds more than BOUND live blocks, the pool holds no more
    than they do, and every freed entry is one no query can see."""
    bm = engine.block_manager
    on_device = [s for s in bm.sequences() if s.block_table.location == Location.DEVICE]
    for seq in on_device:
        t = seq.block_table
        assert t.num_live_blocks <= BOUND, f"{seq}: {t.num_live_blocks} live blocks"
        assert t.num_freed_blocks == min(
            max(0, seq.num_computed_tokens - WINDOW + 1) // BLOCK, t.num_blocks)
    assert bm.device_pool.num_used <= BOUND * len(on_device)


def windowed_engine(model_dir, num_blocks, **kw):
    return engine_for(model_dir, block_size=BLOCK, max_num_batched_tokens=CHUNK,
                      max_model_len=MAX_LEN, num_gpu_blocks_override=num_blocks,
                      swap_space=SWAP_GB, **kw)


def serve(model_dir, num_blocks, **kw):
    engine = windowed_engine(model_dir, num_blocks, **kw)
    assert engine.model_config.sliding_window == WINDOW
    assert engine.block_manager.sliding_window == WINDOW
    for rid, prompt, params in requests():
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    done = drive(engine, max_steps=MAX_STEPS, on_step=check_window_bound)
    assert sorted(done) == ["r0", "r1", "r2"]
    for rid, prompt, _ in requests():
        assert len(prompt) + len(done[rid].outputs[0].token_ids) == 4 * WINDOW
    return engine, {rid: out.outputs[0].token_ids for rid, out in done.items()}


@pytest.fixture(scope="module")
def unconstrained(window_model_dir):
    # Room for every sequence's bound: nobody is preempted.
    engine, tokens = serve(window_model_dir, num_blocks=3 * BOUND + 4)
    assert engine.stats.num_preemptions == 0
    # A sequence of 4W tokens would need 32 blocks without the window; it never held 12.
    assert engine.stats.peak_used_blocks <= 3 * BOUND
    return tokens


def test_a_context_of_four_windows_stays_within_the_bound(unconstrained):
    assert all(len(t) > 0 for t in unconstrained.values())


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_within_the_window_gives_the_same_outputs(window_model_dir, unconstrained,
                                                             mode):
    # A pool for two sequences' bounds (22 blocks) while three run, and less
    # than one 4W sequence needs without the window (32): the engine accepts
    # it, and preempts.
    engine, tokens = serve(window_model_dir, num_blocks=2 * BOUND, preemption_mode=mode)
    stats = engine.stats
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0
    else:
        assert stats.num_swapped_out_blocks == 0
    assert stats.used_blocks == 0 and engine.block_manager.cpu_pool.num_used == 0
    assert tokens == unconstrained


def test_a_pool_below_the_window_bound_is_refused(window_model_dir):
    with pytest.raises(ValueError, match="more than the KV pool can hold"):
        windowed_engine(window_model_dir, BOUND - 1)


def test_the_runner_mirror_blanks_blocks_freed_behind_the_window():
    """The model runner's numpy copy of a table catches up with entries freed in
    place: a freed block is never read as live."""
    blocks = [10, 11, 12]
    mirror = _TableMirror(blocks)
    blocks += [13, 14]
    blocks[0] = blocks[1] = NO_BLOCK
    ids = mirror.sync(blocks, num_freed=2)
    assert ids.tolist() == [NO_BLOCK, NO_BLOCK, 12, 13, 14]
    blocks[2] = NO_BLOCK
    blocks.append(15)
    assert mirror.sync(blocks, num_freed=3).tolist() == [NO_BLOCK, NO_BLOCK, NO_BLOCK, 13, 14, 15]
    assert isinstance(ids, np.ndarray)


def test_prefix_caching_with_a_window_still_hits(window_model_dir):
    """A repeated long prompt hits the prefix cache although the first
    request's blocks behind its window were freed (they stayed evictable)."""
    engine = windowed_engine(window_model_dir, 64, enable_prefix_caching=True)
    prompt = list(range(3, 3 + 3 * WINDOW))
    outputs = []
    for rid in ("first", "again"):
        engine.add_request(rid, None, SamplingParams(max_tokens=8, **GREEDY),
                           prompt_token_ids=prompt)
        done = drive(engine, max_steps=MAX_STEPS, on_step=check_window_bound)
        outputs.append(done[rid].outputs[0].token_ids)
    assert engine.stats.prefix_cache_hit_tokens > 2 * WINDOW
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("kind", [
    dict(n=2, temperature=1.0, seed=0),                            # parallel sampling: forks
    dict(n=2, best_of=3, use_beam_search=True, temperature=0.0),   # beams forked and freed
])
def test_shared_tables_slide_within_the_bound(window_model_dir, kind):
    """Sequences forked from one prompt share its tables, NO_BLOCK entries
    included; each drops its own hold as it slides. Two such requests (four
    sequences) through a pool of two sequences' bounds: groups are swapped
    out and back in (a group of several is never recomputed)."""
    engine = windowed_engine(window_model_dir, 2 * BOUND, preemption_mode="swap")
    for i, rid in enumerate(("a", "b")):
        start = 3 + 50 * i
        engine.add_request(rid, None, SamplingParams(max_tokens=2 * WINDOW, ignore_eos=True,
                                                     **kind),
                           prompt_token_ids=list(range(start, start + 2 * WINDOW)))
    done = drive(engine, max_steps=MAX_STEPS, on_step=check_window_bound)
    assert sorted(done) == ["a", "b"]
    assert all(len(o.token_ids) == 2 * WINDOW for out in done.values() for o in out.outputs)
    assert engine.stats.num_swapped_out_blocks > 0 and engine.stats.num_swapped_in_blocks > 0


def test_speculative_rollback_within_the_window(window_model_dir, unconstrained):
    """Prompt-lookup drafts scored and rolled back (``trim``) while the window
    slides: the same greedy tokens, within the bound."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    engine = windowed_engine(window_model_dir, 3 * BOUND + 4, speculative_config=spec)
    for rid, prompt, params in requests():
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    done = drive(engine, max_steps=MAX_STEPS, on_step=check_window_bound)
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == unconstrained
    assert engine.stats.spec_decode.num_draft_tokens > 0
