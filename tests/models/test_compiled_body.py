"""The compiled model body (``models/compiled.py``, ``enforce_eager=False`` on a
CPU) against transformers, and its two opaque ops against their eager calls.

One engine is compiled for the module (a compile takes 10 to 40 s on two
cores): Gemma 2's shape, whose layers alternate a sliding window and the
whole context with soft-capped scores, so the window and the cap travel
through the attention op, in a batch with a prompt longer than the window.
"""

import contextlib

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from minipaged import LLM, SamplingParams
from minipaged.models.compiled import attention, can_compile
from minipaged.models.cpu_linear import PackedLinear, can_pack
from tiny_models import WINDOW, edit_config, hf_greedy, random_prompts, save

CPU = torch.device("cpu")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2-compiled")
    hf = save("gemma2", path)
    llm = LLM(str(path), device="cpu", attention_backend="torch", dtype="float32",
              enforce_eager=False, num_gpu_blocks_override=64, swap_space=0.01,
              max_num_batched_tokens=40)
    return llm, hf


def test_compiled_body_greedy_equals_transformers(gemma2, monkeypatch):
    llm, hf = gemma2
    # Serving must not recompile: the start-up graph takes every batch.
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    runner = llm.engine.executor.runner
    assert runner.compiled is not None and runner.compile_seconds > 0
    # Prompts shorter and longer than the window; 40 tokens a step chunk the
    # longest prompt, so prefill, chunked prefill, mixed and decode steps all
    # run the one compiled graph.
    prompts = random_prompts(5, [3, WINDOW + 9, 2 * WINDOW + 5])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    compiled = runner.compiled
    batch_graph, batch_steps = compiled._batch_decode, []
    monkeypatch.setattr(compiled, "_batch_decode",
                        lambda *args: batch_steps.append(args[0].shape[0]) or batch_graph(*args))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, NEW_TOKENS)
    # Pure-decode steps of the batch (once the prompts are in) run the batch decode graph.
    assert len(batch_steps) >= NEW_TOKENS // 2 and set(batch_steps) <= {2, 3, 4, 5}
    # One user alone: its decode steps run the decode graph (store and
    # attention traced in, the window and the cap among them), built at
    # start-up on a one-block table and never traced again (the recompile
    # check above) as the table grows.
    graph, decode_steps = compiled._decode, []
    monkeypatch.setattr(compiled, "_decode",
                        lambda *args: decode_steps.append(args[5].shape) or graph(*args))
    alone = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
    assert list(alone.outputs[0].token_ids) == hf_greedy(hf, prompts[1], NEW_TOKENS)
    # Every step after the prompt's (and that one too when the prefix cache
    # holds all of the prompt but its last token: one new token is one new token).
    assert len(decode_steps) >= NEW_TOKENS - 1
    assert {shape[0] for shape in decode_steps} == {1}
    assert llm.engine.stats.used_blocks == 0


def test_the_decode_graph_refuses_a_pool_it_was_not_built_for(gemma2):
    # It runs without guards, so nothing else would notice another pool's shapes.
    runner = gemma2[0].engine.executor.runner
    assert {"_decode", "_batch_decode"} <= runner.compiled._traced   # built at start-up
    other_pool = [(k.clone(), v.clone()) for k, v in runner.cache.device_cache]
    with pytest.raises(RuntimeError, match="another KV cache pool"):
        runner.compiled._run_decode("_decode", None, None, other_pool, None)


def test_two_compiled_engines_of_one_shape_keep_their_own_settings(tmp_path):
    # The compiled call skips its guards on the model's parameters, so one
    # engine's graph must never serve another: the same shapes, another
    # constant the graph bakes in (RMSNorm's epsilon), other tokens.
    prompt = random_prompts(8, [6])[0]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got, want = [], []
    for eps in (1e-6, 0.5):
        path = tmp_path / f"eps-{eps}"
        save("llama-mha-d16", path)
        edit_config(path, rms_norm_eps=eps)
        llm = LLM(str(path), device="cpu", attention_backend="torch", dtype="float32",
                  enforce_eager=False, num_gpu_blocks_override=32, swap_space=0.01)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        got.append(list(out.outputs[0].token_ids))
        want.append(hf_greedy(AutoModelForCausalLM.from_pretrained(path).eval(), prompt,
                              NEW_TOKENS))
    assert got == want and want[0] != want[1]


def test_attention_op_refuses_to_run_outside_a_compiled_forward():
    q = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="inside a compiled forward"):
        attention(q, q, q, 0, 1.0, 0, 0.0)


def test_compiling_only_where_it_serves():
    assert can_compile(CPU, "torch", 1)
    assert not can_compile(CPU, "torch", 2)         # parallel ranks run eagerly
    assert not can_compile(CPU, "reference", 1)     # the definitions stay eager
    assert not can_compile(torch.device("meta"), "torch", 1)


@pytest.mark.skipif(not can_pack(CPU, torch.float32), reason="no oneDNN CPU backend here")
def test_packed_linear_op_compiles_to_the_same_product():
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(64, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=gen))
        linear.bias.copy_(torch.randn(96, generator=gen))
    packed = PackedLinear(linear)
    compiled = torch.compile(lambda x: torch.relu(packed(x)) + 1, dynamic=True, fullgraph=True)
    # Without autograd, as the engine runs: with it, the eager oneDNN call
    # adds a bias that needs a gradient in another way, which on an AVX2 CPU
    # (a Zen 3 VM) rounds differently from the fused bias (2e-6 at 5 rows).
    with torch.no_grad():
        for rows in (2, 5):
            x = torch.randn(rows, 64, generator=gen)
            assert torch.equal(compiled(x), torch.relu(packed.multiply(x)) + 1)


def test_a_batch_runs_the_batch_decode_graph_only_when_padding_costs_little():
    from types import SimpleNamespace

    from minipaged.models.compiled import BATCH_DECODE_MAX_BYTES, batch_decode_pays

    def meta(lens, max_query_len=1):
        return SimpleNamespace(max_query_len=max_query_len, max_seq_len=max(lens),
                               seq_lens=torch.tensor(lens))

    k_cache = torch.empty(4, 16, 3, 64)   # [blocks, block_size, Hkv, D]
    assert batch_decode_pays(4, k_cache, meta([100, 90, 80, 120]))
    assert not batch_decode_pays(1, k_cache, meta([100]))               # one user's own graph
    assert not batch_decode_pays(4, k_cache, meta([1000, 10, 10, 10]))  # mostly padding
    assert not batch_decode_pays(4, k_cache, meta([100, 90, 80, 120], max_query_len=2))
    too_long = BATCH_DECODE_MAX_BYTES // (4 * 2 * 3 * 64 * 4) + 1      # keys past the cap
    assert not batch_decode_pays(4, k_cache, meta([too_long] * 4))
    assert batch_decode_pays(4, k_cache, meta([too_long - 1] * 4))


def test_a_frozen_decode_graph_equals_transformers(tmp_path, monkeypatch):
    """Where ``decode_templates_pay`` (forced here: this model's layers are too
    small to be packed), one user's decode graph is traced frozen, its GEMMs
    timed against Inductor's CPU templates; its greedy tokens stay
    transformers' in float32, and serving traces nothing more."""
    from minipaged.models import compiled as compiled_body

    monkeypatch.setattr(compiled_body, "decode_templates_pay", lambda model: True)
    save("llama-mha-d16", tmp_path)
    llm = LLM(str(tmp_path), device="cpu", attention_backend="torch", dtype="float32",
              enforce_eager=False, num_gpu_blocks_override=32, swap_space=0.01)
    compiled = llm.engine.executor.runner.compiled
    assert compiled.decode_templates and "_decode" in compiled._traced
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    graph, decode_steps = compiled._decode, []
    monkeypatch.setattr(compiled, "_decode", lambda *args: decode_steps.append(1) or graph(*args))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for prompt in random_prompts(9, [5, 21]):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, NEW_TOKENS)
    assert len(decode_steps) >= 2 * (NEW_TOKENS - 1)


@pytest.mark.skipif(not can_pack(CPU, torch.float32), reason="no oneDNN CPU backend here")
def test_packed_layers_show_a_frozen_graph_their_plain_weight():
    """Traced inside ``plain_while_tracing``, a packed layer is an ``F.linear`` of
    its weight (which a frozen graph packs for its own GEMM), elsewhere the
    opaque ``minipaged::packed_linear``."""
    from minipaged.models.cpu_linear import plain_while_tracing

    packed = PackedLinear(nn.Linear(64, 96))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes})
        return gm

    x = torch.randn(3, 64)
    for plain in (False, True):   # the flag is a global Dynamo guards on: traced anew
        with plain_while_tracing() if plain else contextlib.nullcontext():
            y = torch.compile(packed, backend=capture, fullgraph=True)(x)
        assert torch.allclose(y, packed.multiply(x), atol=1e-5)
    opaque, plain = graphs
    assert any("packed_linear" in t for t in opaque)
    assert not any("packed_linear" in t for t in plain) and any("linear" in t for t in plain)


def test_a_body_that_fails_to_compile_runs_eagerly(tmp_path, monkeypatch, caplog):
    # A compiler error at start-up (here the body graph's first call raises)
    # leaves the engine eager, with the error logged and kept, and its greedy
    # tokens still transformers'.
    from minipaged.executor import model_runner

    class Failing(model_runner.CompiledForward):
        def __call__(self, *args, **kwargs):
            raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(model_runner, "CompiledForward", Failing)
    save("llama-mha-d16", tmp_path)
    with caplog.at_level("WARNING", logger=model_runner.__name__):
        llm = LLM(str(tmp_path), device="cpu", attention_backend="torch", dtype="float32",
                  enforce_eager=False, num_gpu_blocks_override=32, swap_space=0.01)
    runner = llm.engine.executor.runner
    assert runner.compiled is None and not runner._tables
    assert runner.compile_error == "RuntimeError: no C++ compiler found"
    assert "runs eagerly" in caplog.text and "no C++ compiler found" in caplog.text
    prompt = random_prompts(8, [5])[0]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, NEW_TOKENS)
