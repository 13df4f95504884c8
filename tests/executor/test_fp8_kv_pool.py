"""The fp8 KV pool (``kv_cache_dtype="fp8"``): the option, the pool's dtype
and size, byte-exact swaps and copies, and an engine serving from it."""

import dataclasses

import pytest
import torch

from helpers import GREEDY, drive, engine_for
from kernel_cases import DEVICE
from minipaged import SamplingParams
from minipaged.config import (
    CPU_KV_CACHE_BYTES,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    kv_bytes_per_token_of,
    resolve_kv_cache_dtype,
)
from minipaged.engine import LLMEngine
from minipaged.engine_args import EngineArgs
from minipaged.executor.cache_engine import CacheEngine, block_bytes, num_cpu_default_blocks
from minipaged.executor.pool_size import num_device_blocks_for

FP8 = torch.float8_e4m3fn
GiB = 1 << 30


def model_config(dtype=torch.bfloat16, kv_cache_dtype=None, **kw) -> ModelConfig:
    """Llama-like shapes, small: 2 layers, 2 KV heads of 64 (512 B a token in fp8)."""
    shape = dict(architecture="LlamaForCausalLM", num_layers=2, hidden_size=256, num_heads=4,
                 num_kv_heads=2, head_dim=64, vocab_size=100, max_model_len=128, dtype=dtype,
                 eos_token_id=(), kv_cache_dtype=kv_cache_dtype)
    return ModelConfig(**{**shape, **kw})


# -- the option ------------------------------------------------------------------------------

def test_the_option_and_its_aliases():
    assert CacheConfig().kv_cache_dtype == EngineArgs().kv_cache_dtype == "auto"
    assert EngineArgs(kv_cache_dtype="fp8").cache_config().kv_cache_dtype == "fp8"
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == FP8
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == FP8
    for bad in ("fp16", "fp8_e5m2", "int8", "FP8"):
        for build in (CacheConfig, EngineArgs):
            with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', "
                                                 r"'fp8', 'fp8_e4m3'\)"):
                build(kv_cache_dtype=bad)
    assert "float8 e4m3" in EngineArgs.help("kv_cache_dtype")


def test_a_bad_value_fails_before_the_model_loads(model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLMEngine(str(model_dir), kv_cache_dtype="fp4", device="cpu")


def test_serve_takes_the_flag():
    from minipaged.server.cli import engine_args, engine_kwargs, parse_args

    args = parse_args(["some-model", "--kv-cache-dtype", "fp8"])
    assert engine_args(args).kv_cache_dtype == "fp8"
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"      # what LLM(...) is given
    assert engine_args(parse_args(["some-model"])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):                              # argparse's choices
        parse_args(["some-model", "--kv-cache-dtype", "fp16"])


# -- the pool's dtype and size -------------------------------------------------------------

def test_the_kv_dtype_is_what_the_pool_sizing_counts():
    bf16, fp32 = model_config(torch.bfloat16), model_config(torch.float32)
    fp8 = model_config(torch.bfloat16, FP8)
    assert bf16.kv_dtype == torch.bfloat16 and fp8.kv_dtype == FP8 and fp8.dtype == torch.bfloat16
    assert fp8.kv_bytes_per_token == 2 * 2 * 2 * 64 == bf16.kv_bytes_per_token // 2
    assert fp32.kv_bytes_per_token == 4 * fp8.kv_bytes_per_token
    assert model_config(torch.float32, FP8).kv_bytes_per_token == fp8.kv_bytes_per_token
    hf = type("HF", (), dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             hidden_size=256))()
    assert kv_bytes_per_token_of(hf, "float8") == fp8.kv_bytes_per_token
    for block_size in (1, 16, 256):
        assert block_bytes(bf16, block_size) == 2 * block_bytes(fp8, block_size)
        assert block_bytes(fp32, block_size) == 4 * block_bytes(fp8, block_size)


def test_the_same_bytes_hold_2x_the_blocks_of_bf16_and_4x_of_fp32():
    bf16, fp32 = model_config(torch.bfloat16), model_config(torch.float32)
    fp8 = model_config(torch.bfloat16, FP8)
    cache, sched = CacheConfig(block_size=16), SchedulerConfig()
    # The CPU device pool: CPU_KV_CACHE_BYTES (1 GiB) of KV.
    cpu = torch.device("cpu")
    blocks = {name: num_device_blocks_for(None, mc, cache, sched, cpu, "torch")
              for name, mc in (("bf16", bf16), ("fp32", fp32), ("fp8", fp8))}
    assert blocks["fp8"] == CPU_KV_CACHE_BYTES // (16 * 512) == 2 * blocks["bf16"]
    assert blocks["fp8"] == 4 * blocks["fp32"]
    assert num_cpu_default_blocks(fp8, 16) == blocks["fp8"]
    # The swap pool: swap_space GiB of blocks (Executor.determine_num_blocks).
    for swap_space in (0.25, 4.0):
        swap = {name: int(swap_space * GiB) // block_bytes(mc, 16)
                for name, mc in (("bf16", bf16), ("fp32", fp32), ("fp8", fp8))}
        assert swap["fp8"] == 2 * swap["bf16"] == 4 * swap["fp32"]


def test_the_pools_hold_fp8():
    mc = model_config(torch.float32, FP8)
    cache = CacheEngine(mc, 4, num_device_blocks=6, num_cpu_blocks=5, device=DEVICE,
                        copy_backend="torch")
    for k, v in cache.device_cache + cache.cpu_cache:
        assert k.dtype == v.dtype == FP8 and k.element_size() == 1
    k, _ = cache.device_cache[0]
    assert k.shape == (7, 4, 2, 64)                             # + the scratch block
    assert int(k.view(torch.uint8).max()) == 0                  # zeroed: +0.0
    per_layer = sum(t.numel() for t in cache.device_cache[0])
    assert per_layer * mc.num_layers == 7 * block_bytes(mc, 4)


# -- swaps and copies move bytes -------------------------------------------------------------

@pytest.mark.parametrize("copy_backend", ["triton", "torch"])
def test_swaps_and_copies_move_fp8_blocks_byte_for_byte(copy_backend):
    """Every byte value (NaN codes included) survives: the moves never go
    through a float conversion."""
    gen = torch.Generator().manual_seed(3)
    mc = model_config(torch.float16, FP8, num_layers=3, num_kv_heads=1, head_dim=32)
    cache = CacheEngine(mc, 4, num_device_blocks=6, num_cpu_blocks=4, device=DEVICE,
                        copy_backend=copy_backend)

    def device_bytes():
        return [(k.view(torch.uint8).clone(), v.view(torch.uint8).clone())
                for k, v in cache.device_cache]

    for k, v in cache.device_cache:
        for t in (k, v):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8,
                                                    generator=gen))
    before = device_bytes()
    cache.copy([(0, 3), (2, 5)])
    after = device_bytes()
    for (k0, v0), (k1, v1) in zip(before, after):
        for src, dst in ((0, 3), (2, 5)):
            assert torch.equal(k1[dst], k0[src]) and torch.equal(v1[dst], v0[src])
        for b in (0, 1, 2, 4, 6):                               # the others, scratch included
            assert torch.equal(k1[b], k0[b]) and torch.equal(v1[b], v0[b])

    cache.swap_out([(1, 0), (4, 2)])
    for (k0, v0), (ck, cv) in zip(after, cache.cpu_cache):
        assert torch.equal(ck.view(torch.uint8)[0], k0[1].cpu())
        assert torch.equal(cv.view(torch.uint8)[2], v0[4].cpu())
    cache.swap_in([(0, 2), (2, 1)])
    for (k0, v0), (k2, v2) in zip(after, device_bytes()):
        assert torch.equal(k2[2], k0[1]) and torch.equal(v2[1], v0[4])


# -- an engine serving from an fp8 pool --------------------------------------------------------

PROMPTS = ["the quick brown fox", "paged attention", "hello, world", "a"]


def serve(engine, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, logprobs=3, prompt_logprobs=3, **GREEDY)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    return drive(engine)


def serve_sampled(engine, max_tokens=16):
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                      seed=i, ignore_eos=True))
    return drive(engine)


def test_an_fp8_engine_serves_and_mostly_agrees_with_the_auto_one(model_dir):
    auto = engine_for(model_dir)
    fp8 = engine_for(model_dir, kv_cache_dtype="fp8")
    assert fp8.model_config.kv_dtype == FP8 and fp8.model_config.dtype == torch.float32
    assert all(t.dtype == FP8 for kv in fp8.executor.cache.device_cache for t in kv)
    assert auto.executor.cache.device_cache[0][0].dtype == torch.float32
    # Same pool bytes per block: 4x the blocks of the fp32 one for the same memory.
    assert 4 * block_bytes(fp8.model_config, 16) == block_bytes(auto.model_config, 16)
    want, got = serve(auto), serve(fp8)
    agree = total = 0
    for rid, ref in want.items():
        a, b = ref.outputs[0], got[rid].outputs[0]
        assert len(b.token_ids) == len(a.token_ids) == 12
        assert b.token_ids[0] == a.token_ids[0], rid            # the first token: prefill
        # The first token's top logprobs (prefill logits over the fp8 cache) ...
        for tok, lp in a.logprobs[0].items():
            assert abs(b.logprobs[0][tok] - lp) < 0.05, (rid, tok)
        # ... and the prompt's (every prompt row attends over fp8 K/V).
        for pa, pb in zip(ref.prompt_logprobs[1:], got[rid].prompt_logprobs[1:]):
            for tok, lp in pa.items():
                if tok in pb:
                    assert abs(pb[tok] - lp) < 0.05, (rid, tok)
        # Decodes: the same tokens while they agree (then contexts differ).
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                break
            total += 1
            agree += abs(b.logprobs[i][x] - a.logprobs[i][x]) < 0.05
    assert total >= 0.75 * 12 * len(PROMPTS) and agree == total
    # The tiny random model's greedy text repeats one token; seeded sampling
    # (one draw per position from the same generator) gives varied tokens,
    # which stay the same where the distributions are close.
    want, got = serve_sampled(auto), serve_sampled(fp8)
    same = [x == y for rid in want for x, y in zip(want[rid].outputs[0].token_ids,
                                                    got[rid].outputs[0].token_ids)]
    assert len(set(want["r0"].outputs[0].token_ids)) > 4
    assert all(want[rid].outputs[0].token_ids[0] == got[rid].outputs[0].token_ids[0]
               for rid in want)
    assert sum(same) >= 0.75 * len(same)


def test_the_triton_backend_serves_from_an_fp8_pool_as_the_torch_one(model_dir):
    """Same bytes in the pool, so the same tokens (interpreted on a CPU: short)."""
    outs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(str(model_dir), attention_backend=backend, device=DEVICE.type,
                           dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks_override=16,
                           swap_space=0.01, max_model_len=64)
        params = SamplingParams(max_tokens=4, **GREEDY)
        engine.add_request("r", "paged attention", params)
        engine.add_request("s", "fp8", params)
        outs[backend] = {r: o.outputs[0].token_ids for r, o in drive(engine).items()}
    assert outs["triton"] == outs["torch"]


def test_model_config_replace_keeps_the_kv_dtype():
    """A pipeline stage's or a tensor-parallel rank's pool (``dataclasses.replace``)."""
    mc = dataclasses.replace(model_config(torch.bfloat16, FP8), num_layers=1, num_kv_heads=1)
    assert mc.kv_dtype == FP8 and mc.kv_bytes_per_token == 2 * 64


class ReplayByCalling:
    """Stands in for CUDA graphs on a CPU: capture calls once, replay calls again."""

    def __init__(self):
        self.replays = 0

    def capture(self, fn, batch_size):
        fn()

        def replay():
            self.replays += 1
            fn()
        return replay

    def synchronize(self):
        pass


def test_decode_graphs_capture_and_replay_over_an_fp8_pool(model_dir):
    """The graphs record the fp8 pool by address; their padding rows read the
    scratch block, zeros (+0.0) in fp8 too; replayed decodes give the eager
    engine's tokens."""
    eager = engine_for(model_dir, kv_cache_dtype="fp8", max_num_seqs=4, max_model_len=64)
    graphed = engine_for(model_dir, kv_cache_dtype="fp8", max_num_seqs=4, max_model_len=64)
    fake = ReplayByCalling()
    graphed.runner.capture_decode_graphs(4, 64, backend=fake, progress=False)
    scratch = graphed.cache.scratch_block
    params = SamplingParams(max_tokens=6, **GREEDY)
    outs = []
    for engine in (eager, graphed):
        for i, p in enumerate(PROMPTS[:3]):       # 3 sequences: bucket 4, one padding row
            engine.add_request(f"r{i}", p, params)
        outs.append({r: o.outputs[0].token_ids for r, o in drive(engine).items()})
    assert outs[0] == outs[1] and fake.replays >= 5
    for k, v in graphed.cache.device_cache:
        for t in (k, v):
            assert int(t.view(torch.uint8)[scratch].max()) == 0
