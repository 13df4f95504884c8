"""A seed promises the same output whatever else the engine is doing.

A seeded request (``n``, ``best_of`` and a filter or none) must end with the
same tokens whether or not it was preempted, in both preemption modes, with
and without prefix caching, at any pool size that can hold it. The case that
once broke it: a request without a filter draws over its vocabulary in id
order, but was drawn in probability order whenever a filtered request
(``top_p``) shared its step, so the same seed gave other tokens once
preemption changed who ran beside it.
"""

import random

import pytest
import torch

from helpers import drive, engine_for
from minipaged import SamplingParams
from minipaged.sampling.sampler import Sampler, SamplingRow

MODES_SEED = {"recompute": 1, "swap": 2}


def seeded_workload(rng: random.Random) -> list[tuple[str, list[int], SamplingParams]]:
    """Seeded requests with and without filters, forking and not, beside greedy ones."""
    shapes = [dict(n=2), dict(n=1, best_of=3, top_p=0.9), dict(n=1, top_k=20),
              dict(n=2, min_p=0.05), dict(n=1), dict(n=1, best_of=2)]
    work = []
    for i, shape in enumerate(shapes):
        params = SamplingParams(temperature=1.0, seed=rng.randint(0, 2**31), ignore_eos=True,
                                max_tokens=rng.randint(12, 28), **shape)
        work.append((f"seeded{i}", [3 + (7 * i + j) % 90 for j in range(rng.randint(4, 20))],
                     params))
    for i in range(3):
        work.append((f"greedy{i}", [5 + (11 * i + j) % 80 for j in range(rng.randint(4, 20))],
                     SamplingParams(temperature=0.0, ignore_eos=True,
                                    max_tokens=rng.randint(12, 28))))
    return work


def serve(model_dir, work, **kw) -> tuple[dict, int]:
    engine = engine_for(model_dir, block_size=8, max_model_len=56, **kw)
    for t, (rid, ids, params) in enumerate(work):
        engine.add_request(rid, None, params, prompt_token_ids=ids, arrival_time=float(t))
    done = drive(engine, max_steps=1500)
    outputs = {rid: ([c.token_ids for c in o.outputs], [c.finish_reason for c in o.outputs])
               for rid, o in done.items()}
    return outputs, engine.stats.num_preemptions


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_outputs_do_not_depend_on_preemption(model_dir, mode, prefix_caching):
    rng = random.Random(10 * MODES_SEED[mode] + prefix_caching)
    work = seeded_workload(rng)
    roomy, preempted = serve(model_dir, work, num_gpu_blocks_override=256,
                             enable_prefix_caching=prefix_caching)
    assert preempted == 0
    for pool in rng.sample(range(14, 30), 2):   # every request fits alone in 7 blocks
        tight, preempted = serve(model_dir, work, num_gpu_blocks_override=pool,
                                 preemption_mode=mode, enable_prefix_caching=prefix_caching)
        assert preempted > 0, pool
        assert tight == roomy, pool   # the same tokens, and every choice ends on length


def test_a_seeded_row_draws_the_same_token_beside_a_filtered_row():
    """The sampler's part: a row's token depends on its own filters only."""
    torch.manual_seed(0)
    logits = torch.randn(2, 300)
    plain = SamplingParams(temperature=1.0, seed=1)
    filtered = SamplingParams(temperature=1.0, top_p=0.8, seed=2)
    sampler = Sampler(torch.device("cpu"))

    def draw(rows_params):
        rows = [SamplingRow(p, torch.Generator().manual_seed(p.seed)) for p in rows_params]
        return sampler(logits[:len(rows)], rows).token_ids[0]

    for _ in range(20):
        logits = torch.randn(2, 300)
        assert draw([plain]) == draw([plain, filtered])
