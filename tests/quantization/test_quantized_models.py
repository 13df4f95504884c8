"""Models whose weights stay quantized: GGUF files kept in their blocks
(``quantization="gguf"``, the default for a ``.gguf`` model), any checkpoint
quantized to int8 at load (``"int8"``), against the same model in float32.

Error budget for "close": types converted at load (Q5_K, Q6_K, a Q4_K
embedding, int8's per-channel rows) are off by half an int8 step, and bf16
activations round everything to 8 bits, so logits of a random 2-layer model
move by a few hundredths; 0.1 of their range fails a wrong row order, a
wrong scale or a missing part, each of which moves them by their whole
size. Kept types in float32 (``quantization.exact_gemm``) are the file's
numbers in float32 arithmetic: near-exact.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from helpers import our_last_logits, write_tiny_gguf
from minipaged import LLM
from minipaged.models import gguf as mp_gguf
from minipaged.models.gguf import gguf_weight_readers, unpermute_rotary_rows
from minipaged.quantization.exact_gemm import CpuExactInt4Gemm
from minipaged.quantization.gemm import CpuInt4Gemm, FloatGemm
from minipaged.quantization.linear import QuantEmbedding, QuantLinear, resident_weight_bytes

ENGINE = {"dtype": "float32", "device": "cpu", "attention_backend": "torch",
          "num_gpu_blocks_override": 32, "max_model_len": 128}
PROMPTS = [[0, 17, 200, 3, 45, 99, 7], list(range(10, 40))]
Q4_1_FILE = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q4_1,
             "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1, "token_embd": Q.Q8_0}
# As llama.cpp's Q4_K_M mixes them: Q4_K beside Q6_K in one merged projection,
# a Q5_K down projection, an F16 output projection.
K_QUANT_FILE = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.F16,
                "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q5_K, "token_embd": Q.Q4_K}


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("q4_1") / "tiny.gguf", seed=1,
                           matrix_types=Q4_1_FILE)


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("kq") / "tiny.gguf", seed=2,
                           matrix_types=K_QUANT_FILE, hidden=256)


def assert_logits_close(quantized: LLM, reference: LLM, within: float = 0.1) -> None:
    for prompt in PROMPTS:
        ours, theirs = our_last_logits(quantized, prompt), our_last_logits(reference, prompt)
        err = (ours - theirs).abs().max().item()
        span = (theirs.max() - theirs.min()).item()
        assert err < within * span, f"logits differ by {err:.3g} (range {span:.3g})"


def greedy_tokens(llm: LLM, prompts: list[list[int]], n: int = 6) -> list[list[int]]:
    from minipaged import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def gemm_kinds(llm: LLM) -> dict[str, list[str]]:
    return {name: [type(g).__name__ for g in m.gemms]
            for name, m in llm.engine.model.named_modules() if isinstance(m, QuantLinear)}


def test_kept_types_are_the_numbers_the_file_dequantizes_to(k_quant_file, q4_1_file):
    """For Q4_0/Q4_1/Q4_K/Q8_0 the kept weight is exact: its dequantization is
    the gguf package's own dequantization of the tensor, q/k rows put back in
    Hugging Face's order as the float copy of ``quantization="none"`` has
    them. Converted types are within half an int8 step of those values."""
    seen = set()
    for path in (q4_1_file, k_quant_file):
        for name, reader in gguf_weight_readers(path):
            if reader.tensor.shape.size != 2:
                continue
            shape = tuple(int(n) for n in reversed(reader.tensor.shape.tolist()))
            floats = torch.from_numpy(np.asarray(
                dequantize(reader.tensor.data, reader.tensor.tensor_type),
                dtype=np.float32).reshape(shape))
            if reader.unpermute_heads is not None:
                floats = unpermute_rotary_rows(floats, reader.unpermute_heads)
            assert torch.equal(reader(None), floats)
            kept = reader.quantized()
            policy = mp_gguf.kept_type_policy(reader.type_name)
            seen.add((reader.type_name, policy))
            if policy == "kept":
                assert torch.equal(kept.dequantize(), floats), name
            elif policy == "converted":
                assert kept.per_channel
                assert torch.all((kept.dequantize() - floats).abs() <= kept.scale / 2 + 1e-6)
            else:
                assert torch.equal(kept, floats)
    assert {("Q4_1", "kept"), ("Q8_0", "kept"), ("Q4_K", "kept"), ("Q6_K", "converted"),
            ("Q5_K", "converted"), ("F16", "float")} <= seen


@pytest.mark.parametrize("dtype,head,layers,embed_groups,within", [
    # float32: the file's numbers in float32, the Q8_0 table's groups kept.
    ("float32", "CpuExactInt8Gemm", "CpuExactInt4Gemm", 32, 1e-4),
    # bfloat16: torch's bf16 ops, the table requantized per row for the int8 op.
    ("bfloat16", "CpuInt8Gemm", "CpuInt4Gemm", 64, 0.1)])
def test_q4_1_file_kept_quantized_serves_as_its_dequantized_copy(
        q4_1_file, dtype, head, layers, embed_groups, within):
    args = {**ENGINE, "dtype": dtype}
    with LLM(str(q4_1_file), **args) as kept, \
            LLM(str(q4_1_file), quantization="none", **args) as floats:
        assert kept.engine.engine_args.quantization == "auto"
        kinds = gemm_kinds(kept)
        assert kinds["lm_head"] == [head]                                # the tied Q8_0 table
        assert all(k == [layers] for name, k in kinds.items() if name != "lm_head")
        assert_logits_close(kept, floats, within)
        embed = kept.engine.model.model.embed_tokens
        assert isinstance(embed, QuantEmbedding) and embed.table.group_size == embed_groups
        assert kept.engine.model.lm_head.gemms[0].q is embed.q            # one table, not two
        tokens = greedy_tokens(kept, PROMPTS)
        assert all(len(t) == 6 for t in tokens)
        if dtype == "float32":
            assert tokens == greedy_tokens(floats, PROMPTS)
            assert resident_weight_bytes(kept.engine.model) < resident_weight_bytes(
                floats.engine.model) / 3
        assert kept.engine.stats.used_blocks == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_body_of_a_kept_q4_1_file_serves_as_its_eager_body(q4_1_file, monkeypatch,
                                                                     dtype):
    """The compiled body's wide graph (``models.compiled``: steps of
    ``WIDE_STEP_TOKENS`` or more, the int4 GEMMs frozen as constants and
    timed against Inductor's AMX template where it offers one) and its narrow one give
    the eager body's logits, within the bf16 rounding of the bfloat16 case,
    and its greedy tokens (this file's margins are wider than that
    rounding), one user's too (the decode graph, where float32's GEMMs run
    their one-row form inside the graph); serving compiles nothing more. The
    wide graph is forced on, so that a CPU without AMX (where autotuning
    keeps ATen's op) tests it too."""
    from minipaged.models import compiled as compiled_body
    from minipaged.models.compiled import WIDE_STEP_TOKENS
    monkeypatch.setattr(compiled_body, "wide_graph_pays", lambda model: True)
    prompts = [*PROMPTS, list(range(50, 50 + WIDE_STEP_TOKENS))]
    assert min(map(len, prompts)) < WIDE_STEP_TOKENS <= max(map(len, prompts))
    args = {**ENGINE, "dtype": dtype}
    with LLM(str(q4_1_file), enforce_eager=False, **args) as compiled, \
            LLM(str(q4_1_file), **args) as eager:
        runner = compiled.engine.executor.runner
        assert runner.compiled is not None and runner.compiled.has_wide_graph
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
        wide_calls = []
        wide = runner.compiled._wide
        monkeypatch.setattr(runner.compiled, "_wide",
                            lambda *a: wide_calls.append(a[0].shape[0]) or wide(*a))
        for prompt in prompts:
            ours, theirs = our_last_logits(compiled, prompt), our_last_logits(eager, prompt)
            span = (theirs.max() - theirs.min()).item()
            assert (ours - theirs).abs().max().item() < 0.02 * span
        assert sorted(wide_calls) == sorted(len(p) for p in prompts if len(p) >= WIDE_STEP_TOKENS)
        ours, theirs = (greedy_tokens(llm, prompts) for llm in (compiled, eager))
        assert ours == theirs and all(len(t) == 6 for t in ours)
        decode = runner.compiled._decode
        decode_calls = []
        monkeypatch.setattr(runner.compiled, "_decode",
                            lambda *a: decode_calls.append(1) or decode(*a))
        assert greedy_tokens(compiled, prompts[:1]) == theirs[:1] and len(decode_calls) == 5
        assert compiled.engine.stats.used_blocks == 0


def test_k_quants_mixed_in_one_projection_run_one_gemm_per_layout(k_quant_file):
    with LLM(str(k_quant_file), **ENGINE) as kept, \
            LLM(str(k_quant_file), quantization="none", **ENGINE) as floats:
        kinds = gemm_kinds(kept)
        layer = "model.layers.0."
        # q, k (Q4_K) cannot stack with v (Q6_K -> per-channel int8): one GEMM each.
        assert kinds[layer + "self_attn.qkv_proj"] == (["CpuExactInt4Gemm"] * 2
                                                       + ["CpuExactInt8Gemm"])
        assert kinds[layer + "self_attn.o_proj"] == ["FloatGemm"]
        assert kinds[layer + "mlp.gate_up_proj"] == ["CpuExactInt4Gemm"]  # gate and up stacked
        assert kinds[layer + "mlp.down_proj"] == ["CpuExactInt8Gemm"]
        assert_logits_close(kept, floats)


def test_int8_quantizes_any_checkpoint_at_load(model_dir):
    with LLM(str(model_dir), quantization="int8", **ENGINE) as int8, \
            LLM(str(model_dir), **ENGINE) as floats:
        kinds = gemm_kinds(int8)
        assert kinds and all(set(k) == {"CpuExactInt8Gemm"} for k in kinds.values())
        assert not any(isinstance(g, (CpuInt4Gemm, CpuExactInt4Gemm, FloatGemm))
                       for m in int8.engine.model.modules()
                       if isinstance(m, QuantLinear) for g in m.gemms)
        assert_logits_close(int8, floats)
        assert resident_weight_bytes(int8.engine.model) < resident_weight_bytes(
            floats.engine.model) / 2


def test_bad_quantization_values_are_refused(model_dir, q4_1_file):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(model_dir), quantization="int4", **ENGINE)
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(str(model_dir), quantization="gguf", **ENGINE)
    with pytest.raises(ValueError, match="quantization must be 'none' with tensor_parallel"):
        LLM(str(q4_1_file), tensor_parallel_size=2, **ENGINE)


def test_a_type_no_gemm_reads_is_refused_by_name(q4_1_file, monkeypatch):
    """The IQ family (codebook quants) is refused; stood in for here by
    refusing Q4_1, as the installed gguf package may not write IQ types."""
    real = mp_gguf.kept_type_policy
    monkeypatch.setattr(mp_gguf, "kept_type_policy",
                        lambda name: "refused" if name == "Q4_1" else real(name))
    with pytest.raises(ValueError, match="type Q4_1.*quantization='none'"):
        LLM(str(q4_1_file), **ENGINE)
    assert real("IQ4_NL") == "refused" and real("Q4_K") == "kept" and real("F16") == "float"
