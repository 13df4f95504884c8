"""The vectorized torch path (``backend="torch"``) against the one-sequence-at-a-
time reference, on the same random cases as the Triton kernels: shuffled block
tables, GQA and MQA, block sizes 8 to 128, prefill, chunked prefill and decode
mixed in one batch.

The Triton kernels never read a slot no sequence owns, and their cases fill
those with NaN to prove it. This path reads whole blocks and masks the extra
slots out of the softmax, which is exact for finite values only; the engine
guarantees them by zeroing its pools. Here those slots hold large finite
garbage instead (``stale``), as stale KV of earlier sequences would be."""

import pytest
import torch

import minipaged.kernels.torch_attention as torch_attention
from kernel_cases import TOLERANCE, make_case
from minipaged.kernels import AttentionPlan, paged_attention, plan_attention

CPU = torch.device("cpu")
MIXED_Q = [37, 1, 9, 1, 5, 1]
MIXED_CTX = [37, 70, 61, 1, 133, 300]


def stale(case):
    """The case with finite garbage, not NaN, in every slot no sequence owns."""
    case.k_cache.nan_to_num_(1e4)
    case.v_cache.nan_to_num_(-1e4)
    return case


def check(case, dtype, **kw):
    stale(case)
    out = paged_attention(*case.args(), backend="torch", **kw)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert not out.isnan().any(), "read a slot no sequence owns"
    ref = paged_attention(*case.args(), backend="reference")
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs err {err:.2e} > {TOLERANCE[dtype]:.0e}"
    return out


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128, 256])
def test_block_sizes(block_size):
    check(make_case(MIXED_Q, MIXED_CTX, 8, 2, 64, block_size, torch.float32, seed=block_size,
                    device=CPU), torch.float32)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2), (16, 2), (8, 1), (6, 3)],
                         ids=["mha", "gqa4", "gqa8", "mqa", "gqa2-non-pow2-heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gqa_mqa_and_dtypes(num_q_heads, num_kv_heads, dtype):
    check(make_case(MIXED_Q, MIXED_CTX, num_q_heads, num_kv_heads, 80, 16, dtype,
                    seed=num_q_heads * 10 + num_kv_heads, device=CPU), dtype)


def test_random_batches_with_parts_of_every_size(monkeypatch):
    # Small parts force many of them: sequences of one part share padding,
    # and a prefill never shares a part with a decode.
    gen = torch.Generator().manual_seed(0)
    for trial in range(6):
        monkeypatch.setattr(torch_attention, "PART_BYTES", [1 << 12, 1 << 16, 1 << 30][trial % 3])
        num_seqs = int(torch.randint(1, 12, (1,), generator=gen))
        ctx = torch.randint(1, 200, (num_seqs,), generator=gen).tolist()
        q = [1 if torch.rand(1, generator=gen) < 0.6 else int(torch.randint(1, n + 1, (1,),
                                                                             generator=gen))
             for n in ctx]
        case = make_case(q, ctx, 4, 2, 32, [8, 16, 32][trial % 3], torch.float32,
                         seed=100 + trial, device=CPU)
        check(case, torch.float32)


def test_decode_only_and_prefill_only_batches():
    check(make_case([1] * 5, [1, 17, 64, 65, 250], 8, 2, 64, 16, torch.float32, seed=1,
                    device=CPU), torch.float32)
    check(make_case([40, 3], [40, 90], 8, 2, 64, 16, torch.float32, seed=2, device=CPU),
          torch.float32)


def test_every_query_token_sees_only_its_past():
    case = stale(make_case([12], [12], 2, 2, 64, 8, torch.float32, seed=4, device=CPU))
    before = paged_attention(*case.args(), backend="torch")
    block = case.block_tables[0, 1].long()               # holds positions 8..11
    case.k_cache[block, 3] += 10.0                       # position 11
    after = paged_attention(*case.args(), backend="torch")
    assert torch.equal(before[:11], after[:11])
    assert not torch.allclose(before[11], after[11])


def test_a_plan_serves_every_layer_of_a_step():
    case = stale(make_case(MIXED_Q, MIXED_CTX, 8, 2, 64, 16, torch.float32, seed=5, device=CPU))
    plan = plan_attention(case.block_tables, case.seq_lens, case.query_start_loc, 16, 1024)
    kinds = [p.row_ok is None for p in plan.parts]
    assert kinds == sorted(kinds, reverse=True)           # decode parts first, then prefill
    for _ in range(2):  # two "layers", different caches, one plan
        case.k_cache.normal_()
        with_plan = paged_attention(*case.args(), backend="torch", plan=plan)
        assert torch.equal(with_plan, paged_attention(*case.args(), backend="torch"))


def test_a_plan_made_on_first_read_is_the_plan():
    """``AttentionPlan.on_first_read`` (what ModelRunner asks for) cuts nothing
    until ``parts`` is read, then the same parts as ``plan_attention``, once."""
    case = stale(make_case(MIXED_Q, MIXED_CTX, 8, 2, 64, 16, torch.float32, seed=8, device=CPU))
    args = (case.block_tables, case.seq_lens, case.query_start_loc, 16, 1024)
    deferred = AttentionPlan.on_first_read(*args)
    assert deferred._parts is None                       # nothing cut yet
    now = plan_attention(*args)
    parts = deferred.parts
    assert deferred.parts is parts                       # cut once
    assert len(parts) == len(now.parts) > 1
    for a, b in zip(parts, now.parts):
        for name in ("rows", "table", "visible", "q_pos", "seq_lens"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(paged_attention(*case.args(), backend="torch", plan=deferred),
                       paged_attention(*case.args(), backend="torch"))


def test_decode_parts_sliced_from_one_set_equal_parts_built_one_by_one():
    # Decode parts are slices of tensors built once for all decode sequences;
    # _part, which builds one part from scratch, is what each must equal.
    gen = torch.Generator().manual_seed(7)
    for block_size, part_bytes in [(4, 1 << 10), (16, 1 << 12), (16, 1 << 30)]:
        num_seqs = 40
        lens = torch.randint(1, 300, (num_seqs,), generator=gen)
        q_lens = torch.where(torch.rand(num_seqs, generator=gen) < 0.7, 1, lens.clamp_max(5))
        query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
        tables = torch.randint(-1, 1000, (num_seqs, -(-300 // block_size)), generator=gen)
        plan = plan_attention(tables, lens, query_start_loc, block_size, part_bytes)
        lens_host, q_lens_host = lens.tolist(), q_lens.tolist()
        order = sorted((s for s in range(num_seqs) if q_lens_host[s] == 1),
                       key=lens_host.__getitem__)
        decode_parts = [p for p in plan.parts if p.row_ok is None]
        assert len(decode_parts) > (part_bytes < 1 << 30)   # several parts, or the one
        for part in decode_parts:
            chunk, order = order[:len(part.seq_lens_host)], order[len(part.seq_lens_host):]
            one = torch_attention._part(chunk, query_start_loc[:-1], q_lens, lens, tables,
                                        block_size, 1, max(lens_host[s] for s in chunk),
                                        lens_host, q_lens_host)
            for name in ("rows", "table", "visible", "q_pos", "seq_lens"):
                assert torch.equal(getattr(part, name), getattr(one, name)), name
            assert (part.seq_lens_host, part.first_q_pos_host) == (one.seq_lens_host,
                                                                   one.first_q_pos_host)
        assert not order


def test_garbage_in_unowned_slots_changes_nothing():
    case = stale(make_case(MIXED_Q, MIXED_CTX, 4, 2, 64, 16, torch.float32, seed=6, device=CPU))
    before = paged_attention(*case.args(), backend="torch")
    owned = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    for s, n in enumerate(MIXED_CTX):
        for p in range(n):
            owned[case.block_tables[s, p // 16], p % 16] = True
    case.k_cache[~owned] = -3e4
    case.v_cache[~owned] = 5e4
    assert torch.equal(paged_attention(*case.args(), backend="torch"), before)


def test_engine_pools_start_zeroed():
    from minipaged.config import ModelConfig
    from minipaged.executor.cache_engine import CacheEngine
    model = ModelConfig(architecture="LlamaForCausalLM", num_layers=2, hidden_size=16,
                        num_heads=2, num_kv_heads=2, head_dim=8, vocab_size=10,
                        max_model_len=64, dtype=torch.float32, eos_token_id=(0,))
    cache = CacheEngine(model, 4, num_device_blocks=8, num_cpu_blocks=2, device=CPU)
    assert all(bool((t == 0).all()) for kv in cache.device_cache for t in kv)
