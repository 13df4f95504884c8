"""Decode CUDA graphs' bookkeeping, on a CPU: a backend that "replays" by
calling the captured function stands in for ``torch.cuda.CUDAGraph``, so
the buckets, the padding, the static buffers and the eager fallbacks are
checked with the real tiny models. The last test captures real graphs and
runs only where CUDA is present."""

import inspect
import itertools

import pytest
import torch

from kernel_cases import DEVICE
from minipaged import LLM, SamplingParams
from minipaged.core.block_table import NO_SLOT
from minipaged.core.sequence import Sequence, SequenceGroup
from minipaged.engine import LLMEngine
from minipaged.executor.cuda_graphs import batch_size_buckets, use_cuda_graphs
from minipaged.executor.model_runner import ScheduledSequence
from tiny_models import VOCAB, save

pytestmark = pytest.mark.cuda  # gpu_check runs these on the GPU

GREEDY = dict(temperature=0.0, ignore_eos=True)
SENTINEL = 7.0  # what every cache slot holds before a test writes it
_seq_ids = itertools.count(10**6)


class CallingBackend:
    """Capture calls the function once; replay calls it again. Records both,
    and (through ``watch``) every forward of the model, in order."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []

    def capture(self, fn, batch_size):
        self.events.append(("capture", batch_size))
        fn()

        def replay():
            self.events.append(("replay", batch_size))
            fn()
        return replay

    def synchronize(self):
        pass

    def watch(self, model):
        model.register_forward_pre_hook(
            lambda _, args: self.events.append(("forward", args[0].shape[0])))

    def replays(self) -> list[int]:
        return [bs for kind, bs in self.events if kind == "replay"]


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-opt")
    save("opt-post-ln-proj", path)  # output width 32 != hidden 64 (project_out)
    return path


def engine_with_graphs(path, max_num_seqs=8, max_model_len=128, backend="torch",
                       graph_max_model_len=None, device="cpu"):
    # A small swap pool: nothing swaps here, and on CUDA the pool is pinned host memory.
    engine = LLMEngine(str(path), attention_backend=backend, device=device, dtype="float32",
                       num_gpu_blocks_override=64, max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, swap_space=0.01)
    for k, v in engine.cache.device_cache:
        k.fill_(SENTINEL)
        v.fill_(SENTINEL)
    fake = CallingBackend()
    fake.watch(engine.model)
    engine.runner.capture_decode_graphs(max_num_seqs, graph_max_model_len or max_model_len,
                                        backend=fake, progress=False)
    return engine, fake


def cached_prompts(engine, lengths, seed=0):
    """Sequences whose prompts are cached but for the last token (prefilled
    eagerly), each scheduled for that one token: a pure-decode batch."""
    gen = torch.Generator().manual_seed(seed)
    graphs, engine.runner.graphs = engine.runner.graphs, None
    batch = []
    for i, n in enumerate(lengths):
        seq = Sequence(next(_seq_ids), torch.randint(3, VOCAB, (n,), generator=gen).tolist(),
                       engine.cache_config.block_size)
        engine.block_manager.allocate(SequenceGroup(f"g{i}", [seq]))
        if n > 1:
            engine.runner.execute([ScheduledSequence(seq, n - 1, is_prefill=True)])
        seq.num_computed_tokens = n - 1
        batch.append(ScheduledSequence(seq, 1))
    engine.runner.graphs = graphs
    return batch


def cache_copy(engine):
    return [(k.clone(), v.clone()) for k, v in engine.cache.device_cache]


def restore(engine, saved):
    for (k, v), (k0, v0) in zip(engine.cache.device_cache, saved):
        k.copy_(k0)
        v.copy_(v0)


def eager(engine, batch):
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        return engine.runner.execute(batch)
    finally:
        engine.runner.graphs = graphs


@pytest.mark.parametrize("max_num_seqs, sizes", [
    (1, [1]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]),
    (20, [1, 2, 4, 8, 16, 24]), (256, [1, 2, 4, 8] + list(range(16, 257, 8))),
])
def test_buckets_are_1_2_4_8_then_every_8_up_to_max_num_seqs(max_num_seqs, sizes):
    assert batch_size_buckets(max_num_seqs) == sizes


def test_graphs_are_opt_in_and_only_on_cuda_with_triton(untokenized_model_dir):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_cuda_graphs(False, cuda, "triton")
    assert not use_cuda_graphs(True, cuda, "triton")
    for backend in ("torch", "reference"):
        assert not use_cuda_graphs(False, cuda, backend)
    assert not use_cuda_graphs(False, cpu, "triton")
    assert inspect.signature(LLMEngine).parameters["enforce_eager"].default is True
    # On a CPU False compiles the body instead (test_compiled_body), except
    # with the reference backend: no graphs and no compile there.
    engine = LLMEngine(str(untokenized_model_dir), attention_backend="reference", device="cpu",
                       num_gpu_blocks_override=64, enforce_eager=False, swap_space=0.01)
    assert engine.runner.graphs is None and engine.runner.compiled is None


def test_capture_warms_up_each_bucket_largest_first_and_writes_no_cache(untokenized_model_dir):
    engine, fake = engine_with_graphs(untokenized_model_dir, max_num_seqs=5)   # buckets 1, 2, 4, 8
    captures = [(i, bs) for i, (kind, bs) in enumerate(fake.events) if kind == "capture"]
    assert [bs for _, bs in captures] == [8, 4, 2, 1]
    for i, bs in captures:  # each capture right after a warm-up of its own size
        assert fake.events[i - 1] == ("forward", bs)
    for k, v in engine.cache.device_cache:  # every row was padding: slot -1
        assert (k == SENTINEL).all() and (v == SENTINEL).all()
    graphs = engine.runner.graphs
    assert graphs.block_tables.shape == (8, 128 // 16)
    assert graphs.output.shape == (8, 128) and graphs.query_start_loc.tolist() == list(range(9))


@pytest.mark.parametrize("num_seqs, bucket", [(1, 1), (3, 4), (5, 8), (8, 8)])
def test_padded_decode_matches_eager_and_writes_only_real_slots(untokenized_model_dir, num_seqs,
                                                                bucket):
    engine, fake = engine_with_graphs(untokenized_model_dir)
    batch = cached_prompts(engine, [1, 16, 17, 40, 5, 33, 2, 64][:num_seqs])
    graphs = engine.runner.graphs
    # What an earlier, bigger batch leaves in the padding rows.
    graphs.slot_mapping.fill_(3)
    graphs.seq_lens.fill_(9)
    graphs.block_tables.fill_(2)
    before = cache_copy(engine)

    logits = engine.runner.execute(batch)
    after = cache_copy(engine)
    assert fake.replays() == [bucket]
    assert logits.shape == (num_seqs, VOCAB)
    pad = slice(num_seqs, bucket)
    assert (graphs.slot_mapping[pad] == -1).all() and (graphs.seq_lens[pad] == 1).all()
    assert (graphs.block_tables[pad] == engine.cache.scratch_block).all()

    # The cache slots that changed are exactly the real rows' new-token slots.
    real_slots = sorted(engine.runner.prepare(batch).meta.slot_mapping.tolist())
    for (k, v), (k0, v0) in zip(after, before):
        for new, old in ((k, k0), (v, v0)):
            changed = (new != old).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
            assert changed == real_slots

    restore(engine, before)
    expected = eager(engine, batch)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    for (k, v), (k_e, v_e) in zip(after, engine.cache.device_cache):
        torch.testing.assert_close(k, k_e, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_e, atol=1e-5, rtol=1e-5)


def test_padding_rows_read_only_the_zeroed_scratch_block(untokenized_model_dir):
    # Padding rows must not read a block a sequence owns: their block tables
    # name only the pool's scratch block, beyond every block the allocator
    # hands out, which nothing writes and so stays zeros.
    engine = LLMEngine(str(untokenized_model_dir), attention_backend="torch", device="cpu",
                       dtype="float32", num_gpu_blocks_override=64, max_num_seqs=8,
                       max_model_len=128, swap_space=0.01)
    cache, pool = engine.cache, engine.block_manager.device_pool
    scratch = cache.scratch_block
    assert scratch == 64 and pool.num_total == 64             # the allocator's total is unchanged
    assert all(k.shape[0] == 65 and v.shape[0] == 65 for k, v in cache.device_cache)
    assert pool.num_free + pool.num_used == pool.num_total
    assert scratch not in pool.free_blocks()

    metas = []   # (block_tables, seq_lens, slot_mapping) of every forward, in order
    engine.model.register_forward_pre_hook(lambda _, args: metas.append(
        (args[3].block_tables.clone(), args[3].seq_lens.clone(), args[3].slot_mapping.clone())))
    fake = CallingBackend()
    graphs = engine.runner.capture_decode_graphs(8, 128, backend=fake, progress=False)
    assert graphs.scratch_block == scratch
    # Warm-ups and captures run padding only: every row reads the scratch block.
    for tables, lens, slots in metas:
        assert (tables == scratch).all() and (lens >= 1).all() and (slots == NO_SLOT).all()

    # A padded step after a bigger batch left real rows' values in the buffers.
    graphs.block_tables.fill_(2)
    graphs.seq_lens.fill_(9)
    graphs.slot_mapping.fill_(3)
    batch = cached_prompts(engine, [5, 40, 17])
    real = engine.runner.prepare(batch).meta
    metas.clear()
    engine.runner.execute(batch)
    assert fake.replays() == [4]
    (tables, lens, slots), = metas
    assert (tables[3] == scratch).all() and lens[3] >= 1 and slots[3] == NO_SLOT
    assert scratch not in real.block_tables.flatten().tolist()
    assert torch.equal(slots[:3], real.slot_mapping)

    # Serving through every bucket, with the pool filled up: the allocator
    # never hands the scratch block out, and nothing ever writes it.
    params = SamplingParams(max_tokens=6, **GREEDY)
    for i, n in enumerate((3, 30, 9, 60, 1, 25, 12, 44)):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=list(range(3, 3 + n)))
    while engine.has_unfinished_requests():
        engine.step()
        owned = {b for seq in engine.block_manager.sequences() for b in seq.block_table.blocks}
        assert scratch not in owned and max(owned, default=0) < scratch
    assert {1, 2, 4, 8} & set(fake.replays())
    assert pool.num_free + pool.num_used == pool.num_total
    taken = pool.allocate_many(pool.num_free)
    assert scratch not in taken and sorted(taken) == sorted(set(taken))
    for k, v in cache.device_cache:
        assert not k[scratch].any() and not v[scratch].any()


def test_prefill_mixed_and_too_big_batches_run_eagerly(untokenized_model_dir):
    engine, fake = engine_with_graphs(untokenized_model_dir, max_num_seqs=2)   # buckets 1, 2
    decodes = cached_prompts(engine, [9, 20, 3])
    prompt = Sequence(5, list(range(3, 13)), engine.cache_config.block_size)
    engine.block_manager.allocate(SequenceGroup("p", [prompt]))
    prefill = [ScheduledSequence(prompt, 10, is_prefill=True)]
    mixed = [ScheduledSequence(prompt, 4, is_prefill=True)] + decodes[:1]
    for batch in (prefill, mixed, decodes):   # decodes: 3 > the largest bucket
        before = cache_copy(engine)
        logits = engine.runner.execute(batch)
        assert fake.replays() == []
        restore(engine, before)
        torch.testing.assert_close(logits, eager(engine, batch), atol=0, rtol=0)
    engine.runner.execute(decodes[:2])
    assert fake.replays() == [2]


def test_a_block_table_wider_than_the_buffers_runs_eagerly(untokenized_model_dir):
    # Graph buffers sized for 32 tokens (2 blocks); a 40-token sequence needs 3.
    engine, fake = engine_with_graphs(untokenized_model_dir, graph_max_model_len=32)
    engine.runner.execute(cached_prompts(engine, [40]))
    assert fake.replays() == []
    engine.runner.execute(cached_prompts(engine, [20], seed=1))
    assert fake.replays() == [1]


@pytest.mark.parametrize("which", ["llama", "opt"])
def test_generate_with_graphs_gives_the_eager_tokens(untokenized_model_dir, opt_dir, which):
    path = untokenized_model_dir if which == "llama" else opt_dir
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()}
               for n in torch.randint(1, 40, (7,), generator=gen)]
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in (3, 5, 8, 12, 2, 9, 16)]
    kw = dict(attention_backend="torch", device="cpu", num_gpu_blocks_override=64,
              max_num_seqs=8, max_model_len=128, swap_space=0.01)
    expected = LLM(str(path), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), **kw)
    fake = CallingBackend()
    llm.engine.runner.capture_decode_graphs(8, 128, backend=fake, progress=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    # Requests finish at different steps: the batch shrinks through several buckets.
    assert {1, 2, 4, 8} <= set(fake.replays())
    assert llm.engine.stats.used_blocks == 0


def test_triton_decode_with_the_buckets_fixed_split_count(untokenized_model_dir):
    # The Triton interpreter on a CPU (compiled kernels where CUDA is present,
    # still through the calling backend): the split-KV decode with the split
    # count fixed per bucket, padding rows included.
    engine, fake = engine_with_graphs(untokenized_model_dir, max_num_seqs=3, max_model_len=512,
                                      backend="triton", device=DEVICE.type)
    graphs = engine.runner.graphs
    assert graphs.sizes == [1, 2, 4]
    assert all(graphs.num_kv_splits[bs] >= 1 for bs in graphs.sizes)
    if engine.device.type == "cpu":  # 4 stand-in SMs, one KV head: 2 splits of 256
        assert graphs.num_kv_splits[4] == 2
    batch = cached_prompts(engine, [30, 3, 17])
    before = cache_copy(engine)
    logits = engine.runner.execute(batch)
    assert fake.replays() == [4]
    restore(engine, before)
    torch.testing.assert_close(logits, eager(engine, batch), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a GPU")
def test_real_cuda_graphs_give_the_eager_tokens_and_logits(untokenized_model_dir):
    kw = dict(device="cuda", attention_backend="triton", dtype="float32",
              num_gpu_blocks_override=256, max_num_seqs=8, max_model_len=512,
              swap_space=0.01)  # nothing swaps: pin 10 MiB of host memory, not 4 GiB
    gen = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (n,), generator=gen).tolist()}
               for n in (1, 7, 16, 33, 120, 200)]
    params = SamplingParams(max_tokens=24, **GREEDY)
    expected = LLM(str(untokenized_model_dir), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(untokenized_model_dir), enforce_eager=False, **kw)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert graphs.num_replays > 0
    # Logits of one padded decode step (3 rows in the bucket of 4), graph vs eager.
    engine = llm.engine
    batch = cached_prompts(engine, [30, 3, 17])
    before = cache_copy(engine)
    replays = graphs.num_replays
    logits = engine.runner.execute(batch)
    assert graphs.num_replays == replays + 1
    restore(engine, before)
    torch.testing.assert_close(logits, eager(engine, batch), atol=1e-4, rtol=1e-4)
