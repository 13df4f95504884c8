"""GGUF checkpoints: llama.cpp's one-file format loaded as the Hugging Face model it came from.

Tiny random transformers models are written here as GGUF files the way
llama.cpp's converter writes them (its tensor names and metadata keys, q/k
rows of LLaMA and Mistral reordered, 2-D weights quantized, norms kept in
F32). The reference is the same transformers model with every weight
replaced by ``dequantize(quantize(w))``: minipaged on the file must give its
logits (within 1e-4, float32) and its greedy tokens.

Errors (architecture, tensor type, rope scaling, a folder of two files, a
missing file) come before any model memory is allocated; loading holds one
dequantized tensor at a time. The real SmolLM2-135M-Instruct file
(``smollm2_*`` fixtures) checks the config against transformers' and the
logits against transformers' own dequantized copy.
"""

import copy
import os
import re
import weakref

import numpy as np
import pytest
import torch
import transformers

# Not on every machine (the GPU machine lacks them): skip, do not fail collecting.
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from transformers.convert_slow_tokenizer import bytes_to_unicode

from helpers import our_last_logits, write_tiny_gguf
from minipaged import LLM, SamplingParams
from minipaged.models import gguf as mp_gguf
from minipaged.models import loader
from minipaged.models.gguf import gguf_hf_config, gguf_weight_readers, open_gguf
from minipaged.models.hub import resolve_model
from tiny_models import hf_last_logits, randomize_biases, randomize_norms

VOCAB = 256
# quantization="none": these tests compare with transformers on the weights the
# file dequantizes to (tests/quantization covers the kept-quantized default).
ENGINE = {"dtype": "float32", "device": "cpu", "attention_backend": "torch",
          "num_gpu_blocks_override": 32, "max_model_len": 128, "quantization": "none"}
PROMPTS = [[1, 17, 200, 3, 45, 99, 7], list(range(10, 50))]
NEW_TOKENS = 8

# Architecture -> (transformers classes, whether llama.cpp reorders q/k rows). The test's
# own knowledge of llama.cpp's converter, kept apart from minipaged's table.
ARCHES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, True),
          "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, True),
          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, False),
          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, False),
          "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, False),
          "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, False)}
GEMMA = ("gemma2", "gemma3")

# Hugging Face's per-layer module names -> llama.cpp's (convert_hf_to_gguf's tensor map).
LAYER_TENSORS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                 "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Gemma's four norms a layer (llama.cpp's ffn_norm is the one before its MLP).
GEMMA_LAYER_TENSORS = {**LAYER_TENSORS, "post_attention_layernorm": "post_attention_norm",
                       "pre_feedforward_layernorm": "ffn_norm",
                       "post_feedforward_layernorm": "post_ffw_norm"}
TOP_TENSORS = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


# -- writing GGUF files as llama.cpp does ------------------------------------------------

def build_hf(arch: str, tied: bool, seed: int = 0, **overrides):
    """A tiny random transformers model: hidden 64, 2 layers, 4 query heads over 2 KV
    heads (head 16), vocabulary 256. Every 2-D weight's rows are a multiple of 32
    long, the quantization block."""
    config_cls, model_cls, _ = ARCHES[arch]
    kwargs = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 5000.0,
              "tie_word_embeddings": tied,
              # transformers' default (0.02) leaves attention almost uniform, so q/k
              # rows in the wrong order would change the logits by only ~3e-3
              "initializer_range": 0.1}
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch in GEMMA:   # a window the 40-token prompt outgrows; Gemma's heads default to 256
        kwargs.update(head_dim=16, sliding_window=16)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**kwargs, **overrides})).eval()
    if arch == "qwen2":
        randomize_biases(model)   # zero biases would hide lost or misplaced ones
    if arch in GEMMA:             # zero (1 + w) norms would hide a lost offset
        randomize_norms(model)
    model.generation_config.eos_token_id = None   # greedy runs a fixed number of tokens
    model.generation_config.pad_token_id = 0
    return model


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """llama.cpp's name for a Hugging Face tensor name."""
    if hf_name in TOP_TENSORS:
        return TOP_TENSORS[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    layer, module, kind = m.groups()
    names = GEMMA_LAYER_TENSORS if arch in GEMMA else LAYER_TENSORS
    return f"blk.{layer}.{names[module]}.{kind}"


def permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, the two rotary halves interleaved
    (rows 0, d/2, 1, d/2+1, ...). ``w``: ``[num_heads * d, ...]``, same shape back."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_metadata(writer, arch: str, config) -> None:
    """The hyperparameter keys llama.cpp writes, and a byte-level tokenizer of
    ``VOCAB`` single-byte tokens (minipaged builds the tokenizer from the file)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    rope = config.rope_parameters   # Gemma 3: one per layer kind, the file keeps the full one's
    writer.add_float32(f"{arch}.rope.freq_base", rope.get("full_attention", rope)["rope_theta"])
    writer.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    if arch in GEMMA:
        writer.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, cap, None) is not None:
            writer.add_float32(f"{arch}.{cap}", getattr(config, cap))
    spelling = bytes_to_unicode()
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [spelling[b] for b in range(VOCAB)])
    writer.add_array("tokenizer.ggml.token_type", [1] * VOCAB)   # 1: a normal token
    writer.add_array("tokenizer.ggml.scores", [0.0] * VOCAB)   # no merges to derive


def write_gguf(model, arch: str, qtype: Q, path, tensor_types: dict[str, Q] | None = None
               ) -> dict[str, torch.Tensor]:
    """Write ``model`` to ``path`` as llama.cpp does: 2-D weights as ``qtype`` (or
    ``tensor_types[hf_name]``), 1-D ones (norms, biases) as F32, q/k rows reordered
    for LLaMA and Mistral, no ``output.weight`` when the head is tied.

    Returns the reference weights, ``dequantize(quantize(w))`` under Hugging Face
    names and in Hugging Face's row order. Quantization works along rows, so
    reordering rows before or after it gives the same values. Gemma's norms
    are written as ``1 + w``, as llama.cpp's converter writes them.
    """
    config = model.config
    permuted = ARCHES[arch][2]
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, arch, config)
    reference = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            reference[name] = reference["model.embed_tokens.weight"]
            continue
        w = tensor.numpy()
        kind = (tensor_types or {}).get(name, qtype) if w.ndim == 2 else Q.F32
        reference[name] = torch.from_numpy(
            np.asarray(dequantize(quantize(w, kind), kind), dtype=np.float32).reshape(w.shape))
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            w = permute_like_llama_cpp(w, heads[proj])
        if arch in GEMMA and "norm" in proj:
            w = w + 1.0
        writer.add_tensor(gguf_name(name, arch), quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def tiny_gguf(tmp_path, arch: str = "llama", qtype: Q = Q.Q4_1, tied: bool = False,
              name: str = "model.gguf", **overrides):
    """``(path, reference transformers model)``: a tiny model written as GGUF, and
    the same model holding the weights the file dequantizes to."""
    model = build_hf(arch, tied, **overrides)
    path = tmp_path / name
    reference = write_gguf(model, arch, qtype, path)
    model.load_state_dict(reference)
    return path, model


def reference_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens by the definition: the argmax of a full forward pass, token by
    token (a tenth of ``generate``'s time on a model this small)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_same_as_reference(llm: LLM, reference) -> None:
    """Last-token logits within 1e-4 for every prompt (prefill), and the greedy
    tokens of the first (decode from the KV cache)."""
    for prompt in PROMPTS:
        err = (our_last_logits(llm, prompt) - hf_last_logits(reference, prompt)).abs().max().item()
        assert err < 1e-4, f"prompt of {len(prompt)} tokens: logits differ by {err:.1e}"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference_greedy(reference, PROMPTS[0], NEW_TOKENS)
    assert llm.engine.stats.used_blocks == 0


def quantized_types(path) -> set[str]:
    return {t.tensor_type.name for t in open_gguf(path).tensors if len(t.shape) == 2}


# -- every tensor type, every architecture ------------------------------------------------

@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_1], ids=lambda q: q.name)
def test_dequantize_tensor_equals_the_gguf_package_bit_for_bit(tmp_path, qtype):
    # Q4_0, Q4_1 and Q8_0 are unpacked by minipaged itself (whole tensors in torch);
    # Q5_1 goes through gguf.quants. Rows of 96 (3 blocks) and an odd row count.
    rng = np.random.default_rng(int(qtype))
    weight = (rng.standard_normal((7, 96)) * rng.uniform(0.01, 3)).astype(np.float32)
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", quantize(weight, qtype), raw_dtype=qtype)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                  writer.write_tensors_to_file, writer.close):
        write()
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    ours = mp_gguf.dequantize_tensor(tensor)
    assert ours.dtype == torch.float32 and ours.shape == (7, 96)
    assert torch.equal(ours, torch.from_numpy(dequantize(tensor.data, qtype).reshape(7, 96)))


def test_the_faster_reader_reads_what_the_gguf_package_reads(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_types={"attn_q": Q.Q4_1})
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
    assert type(ours) is not gguf.GGUFReader and isinstance(ours, gguf.GGUFReader)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types
        assert ours.fields[name].contents() == field.contents(), name
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type) == (b.name, b.tensor_type)
        assert a.shape.tolist() == b.shape.tolist()
        assert np.array_equal(a.data, b.data)


def test_transformers_reads_through_the_shared_reader_only_inside_the_block(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_types={"attn_q": Q.Q4_1})
    real = gguf.GGUFReader
    with mp_gguf.transformers_reads_through_open_gguf():
        assert gguf.GGUFReader(str(path)) is open_gguf(path)
        config = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    assert gguf.GGUFReader is real
    assert config.num_hidden_layers == gguf_hf_config(path).num_hidden_layers
    with pytest.raises(RuntimeError), mp_gguf.transformers_reads_through_open_gguf():
        raise RuntimeError("an error inside the block")
    assert gguf.GGUFReader is real     # restored on the way out of an error too


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0],
                         ids=lambda q: q.name)
def test_each_tensor_type_matches_transformers_on_the_dequantized_weights(tmp_path, qtype):
    path, reference = tiny_gguf(tmp_path, "llama", qtype)
    assert quantized_types(path) == {qtype.name}
    assert_same_as_reference(LLM(str(path), **ENGINE), reference)


@pytest.mark.parametrize("arch, tied, qtype, overrides", [
    ("llama", True, Q.Q4_1, {}),       # no output.weight: the head is the embedding
    ("qwen2", True, Q.Q8_0, {}),       # q/k/v biases, rows in Hugging Face's order
    ("qwen2", False, Q.Q4_0, {}),
    # Mistral NeMo's shape: head_dim 32 set apart from hidden / heads (16)
    ("mistral", False, Q.Q5_1, {"head_dim": 32}),
    ("qwen3", True, Q.Q8_0, {"head_dim": 32}),   # q/k norms, rows in Hugging Face's order
    # norms stored as 1 + w; windowed and full layers; soft caps from the metadata
    ("gemma2", True, Q.Q8_0, {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    ("gemma3", True, Q.Q4_0, {}),
], ids=["llama-tied", "qwen2-tied", "qwen2-untied", "mistral-head-dim", "qwen3", "gemma2",
        "gemma3"])
def test_each_architecture_matches_transformers(tmp_path, arch, tied, qtype, overrides):
    path, reference = tiny_gguf(tmp_path, arch, qtype, tied, **overrides)
    names = {t.name for t in open_gguf(path).tensors}
    assert ("output.weight" in names) is not tied
    assert ("blk.0.attn_q.bias" in names) is (arch == "qwen2")
    assert_same_as_reference(LLM(str(path), **ENGINE), reference)


def test_a_file_mixing_types_as_llama_cpp_does(tmp_path):
    """llama.cpp's Q4 presets keep some tensors at higher precision (SmolLM2's file
    has Q8_0 and F16 ones beside Q4_1): each tensor dequantizes by its own type."""
    model = build_hf("llama", tied=False)
    mixed = {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.F16,
             "model.layers.1.self_attn.v_proj.weight": Q.Q5_0,
             "model.layers.0.mlp.down_proj.weight": Q.BF16}
    reference = write_gguf(model, "llama", Q.Q4_1, tmp_path / "mixed.gguf", mixed)
    model.load_state_dict(reference)
    assert quantized_types(tmp_path / "mixed.gguf") == {"Q4_1", "Q8_0", "F16", "Q5_0", "BF16"}
    assert_same_as_reference(LLM(str(tmp_path / "mixed.gguf"), **ENGINE), model)


def test_llama_without_undoing_the_row_order_would_differ(tmp_path, monkeypatch):
    """The parity tests above have teeth: leaving q/k in llama.cpp's order changes the logits."""
    path, reference = tiny_gguf(tmp_path, "llama", Q.F32)
    monkeypatch.setattr(mp_gguf, "unpermute_rotary_rows", lambda w, num_heads: w)
    llm = LLM(str(path), **ENGINE)
    err = (our_last_logits(llm, PROMPTS[1]) - hf_last_logits(reference, PROMPTS[1])).abs().max()
    assert err > 0.1   # measured: 2.2, against ~1e-6 with the rows put back


@pytest.mark.parametrize("shape, heads", [((64, 32), 4), ((128, 64), 2), ((64,), 4)])
def test_unpermute_undoes_llama_cpp_row_order(shape, heads):
    w = torch.randn(shape)
    permuted = torch.from_numpy(permute_like_llama_cpp(w.numpy(), heads))
    assert not torch.equal(permuted, w)
    assert torch.equal(mp_gguf.unpermute_rotary_rows(permuted, heads), w)


def test_config_from_metadata_matches_the_source_model(tmp_path):
    path, reference = tiny_gguf(tmp_path, "mistral", Q.Q8_0, head_dim=32)
    ours, theirs = gguf_hf_config(path), reference.config
    assert ours.architectures == ["MistralForCausalLM"]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "tie_word_embeddings", "sliding_window"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)   # stored as float32
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]


# -- errors, raised before any model memory is allocated ----------------------------------

@pytest.fixture
def no_weights_allowed(monkeypatch):
    """Fail the test if a model is materialized or a tensor dequantized."""
    def forbidden(*args, **kwargs):
        raise AssertionError("model memory was allocated before the error")
    monkeypatch.setattr(torch.nn.Module, "to_empty", forbidden)
    monkeypatch.setattr(mp_gguf, "dequantize_tensor", forbidden)


def write_tiny_file(path, arch: str, extra=lambda writer: None, norm_dtype=np.float32) -> None:
    """A small GGUF file that is well formed apart from what the test changes."""
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, arch, build_hf("llama", tied=True).config)
    extra(writer)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(64, norm_dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_is_refused(tmp_path, no_weights_allowed):
    path = tmp_path / "gpt2.gguf"
    write_tiny_file(path, "gpt2")
    with pytest.raises(ValueError, match=re.escape(
            f"GGUF file {str(path)!r} holds architecture 'gpt2', which minipaged does not "
            f"serve; supported: gemma2, gemma3, llama, mistral, qwen2, qwen3")):
        LLM(str(path), **ENGINE)


def test_tensor_type_the_gguf_package_cannot_dequantize_is_refused(tmp_path, no_weights_allowed):
    # F64: a real GGML type that gguf.quants has no dequantizer for.
    supported = mp_gguf.dequantizable_types()
    assert "F64" not in supported and {"Q4_1", "F32"} <= supported
    path = tmp_path / "f64.gguf"
    write_tiny_file(path, "llama", norm_dtype=np.float64)
    with pytest.raises(ValueError, match=r"has tensors of type F64, which the installed gguf "
                                         r"package cannot dequantize; supported: BF16, F16, "
                                         r"F32, .*Q4_1.*Q8_0"):
        LLM(str(path), **ENGINE)


def test_rope_scaling_is_refused(tmp_path, no_weights_allowed):
    path = tmp_path / "linear-rope.gguf"
    write_tiny_file(path, "llama", lambda w: w.add_string("llama.rope.scaling.type", "linear"))
    with pytest.raises(ValueError, match="uses rope scaling 'linear', .* supported: none"):
        LLM(str(path), **ENGINE)


def test_a_file_that_is_not_gguf_is_refused(tmp_path, no_weights_allowed):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=re.escape(f"{str(path)!r} is not a readable GGUF file")):
        LLM(str(path), **ENGINE)


def test_a_missing_gguf_file(tmp_path, no_weights_allowed):
    missing = tmp_path / "x.gguf"
    with pytest.raises(ValueError, match=re.escape(
            f"model {str(missing)!r} names a GGUF file, and there is no file at {str(missing)!r}")):
        LLM(str(missing), **ENGINE)


def test_a_folder_with_two_gguf_files_names_both(tmp_path, no_weights_allowed):
    for name in ("a-Q4_1.gguf", "b-Q8_0.gguf"):
        write_tiny_file(tmp_path / name, "llama")
    with pytest.raises(ValueError, match=re.escape(
            f"model directory {str(tmp_path)!r} holds 2 GGUF files (a-Q4_1.gguf, b-Q8_0.gguf); "
            f"pass the one to load")):
        LLM(str(tmp_path), **ENGINE)


def test_a_folder_with_one_gguf_file_loads_it(tmp_path):
    path, reference = tiny_gguf(tmp_path, "llama", Q.Q8_0)
    assert resolve_model(tmp_path) == path
    assert_same_as_reference(LLM(str(tmp_path), **ENGINE), reference)
    # With a config.json beside it the folder is a Hugging Face checkpoint instead.
    reference.config.save_pretrained(tmp_path)
    assert resolve_model(tmp_path) == tmp_path


# -- laziness: one dequantized tensor at a time -------------------------------------------

def test_listing_the_weights_dequantizes_nothing(tmp_path, monkeypatch):
    path, _ = tiny_gguf(tmp_path, "llama", Q.Q4_1)
    calls = []
    real = mp_gguf._dequantize_array
    monkeypatch.setattr(mp_gguf, "_dequantize_array", lambda *a: calls.append(a) or real(*a))
    readers = dict(gguf_weight_readers(path))
    assert len(readers) == 2 * 9 + 3 and calls == []
    w = readers["model.layers.1.self_attn.k_proj.weight"](None)
    assert tuple(w.shape) == (32, 64) and len(calls) == 1
    assert torch.equal(readers["model.layers.1.self_attn.k_proj.weight"]((slice(16, 32),)),
                       w[16:32])


class DequantizedTracker:
    """Wraps ``dequantize_tensor`` and every weight reader: each time a tensor is
    dequantized, every tensor dequantized or read before must be gone already."""

    def __init__(self, monkeypatch):
        self.alive: list[weakref.ref] = []
        self.count = 0
        self.kept: list[torch.Tensor] = []   # the negative check keeps them here
        real_dequantize = mp_gguf.dequantize_tensor
        real_readers = loader.gguf_weight_readers

        def dequantize_tensor(tensor):
            self.assert_none_alive()
            return self.track(real_dequantize(tensor))

        def readers(path):
            for name, read in real_readers(path):
                yield name, lambda index, read=read: self.track(read(index))

        monkeypatch.setattr(mp_gguf, "dequantize_tensor", dequantize_tensor)
        monkeypatch.setattr(loader, "gguf_weight_readers", readers)

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        self.alive.append(weakref.ref(tensor))
        self.count += 1
        return tensor

    def assert_none_alive(self) -> None:
        alive = [ref() for ref in self.alive if ref() is not None]
        assert not alive, f"{len(alive)} earlier weight(s) still alive, shapes " \
                          f"{[tuple(t.shape) for t in alive]}"


def test_loading_holds_one_dequantized_tensor_at_a_time(tmp_path, monkeypatch):
    path, reference = tiny_gguf(tmp_path, "llama", Q.Q4_1)
    tracker = DequantizedTracker(monkeypatch)
    model = loader.load_model(path, torch.float32, torch.device("cpu"))
    tracker.assert_none_alive()   # nothing left behind either
    assert tracker.count == 2 * 21   # each tensor: dequantized, then read
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


def test_the_tracker_catches_a_loader_that_keeps_tensors(tmp_path, monkeypatch):
    path, _ = tiny_gguf(tmp_path, "llama", Q.Q4_1)
    tracker = DequantizedTracker(monkeypatch)
    track = tracker.track
    monkeypatch.setattr(tracker, "track", lambda t: tracker.kept.append(t) or track(t))
    with pytest.raises(AssertionError, match="earlier weight"):
        loader.load_model(path, torch.float32, torch.device("cpu"))


# -- the real model: SmolLM2-135M-Instruct, Q4_1 ------------------------------------------

def test_smollm2_config_matches_transformers(smollm2_gguf, smollm2_hf, smollm2_llm):
    # smollm2_hf.config is AutoConfig.from_pretrained(folder, gguf_file=...)'s, loaded
    # once; smollm2_llm has parsed the file already (the parse is cached per process).
    ours, theirs = gguf_hf_config(smollm2_gguf), smollm2_hf.config
    assert ours.architectures == ["LlamaForCausalLM"]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                  "bos_token_id", "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert (ours.num_hidden_layers, ours.hidden_size, ours.num_attention_heads,
            ours.num_key_value_heads, ours.vocab_size) == (30, 576, 9, 3, 49152)


def test_smollm2_gguf_gives_the_logits_of_transformers_dequantized_copy(
        tmp_path, smollm2_gguf, smollm2_hf, smollm2_llm):
    """transformers dequantizes the file with the same gguf code and undoes the
    same row order, so its weights saved as safetensors are the ones minipaged
    reads from the file: the two engines compute bit for bit the same logits."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in smollm2_hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(smollm2_hf.config)
    config.architectures = ["LlamaForCausalLM"]   # transformers' GGUF config names none
    config.save_pretrained(tmp_path)
    del state
    from_safetensors = LLM(str(tmp_path), dtype="float32", device="cpu",
                           attention_backend="torch", num_gpu_blocks_override=16,
                           max_model_len=256)
    tokenizer = smollm2_llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    try:
        ours_gguf = our_last_logits(smollm2_llm, prompt)
        ours_hf = our_last_logits(from_safetensors, prompt)
    finally:
        from_safetensors.close()
    assert torch.equal(ours_gguf, ours_hf)
    theirs = hf_last_logits(smollm2_hf, prompt)
    err = (ours_gguf - theirs).abs().max().item()
    # transformers' forward sums in another order over 30 layers: measured 4.4e-5 here
    # (logits up to 25), so 1e-3 leaves room for other CPUs' matmul kernels.
    assert err < 1e-3, f"logits differ from transformers' by {err:.1e}"
    assert ours_gguf.argmax() == theirs.argmax()


# -- tensor parallelism: each rank reads its slice of the dequantized tensors -------------

def test_two_tensor_parallel_ranks_give_the_tokens_of_one(tmp_path):
    """Rank 1 (a spawned worker) reads the same file; q/k are sliced after their
    rows are put back, so each rank gets whole heads (one KV head each here)."""
    path, reference = tiny_gguf(tmp_path, "llama", Q.Q4_1)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=2, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert llm.engine.stats.used_blocks == 0
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == reference_greedy(reference, prompt, NEW_TOKENS)


# -- the tokenizer cache ------------------------------------------------------------------

def _read_back(path, monkeypatch, cache_dir, fresh=None):
    """``gguf_tokenizer`` twice with an empty per-process cache: the first call
    builds (``fresh`` stands in for the build when given) and writes
    ``cache_dir``; the second reads it back."""
    monkeypatch.setenv("MINIPAGED_CACHE", str(cache_dir))
    if fresh is not None:
        monkeypatch.setattr(mp_gguf, "build_gguf_tokenizer", lambda p: fresh)
    mp_gguf._tokenizer.cache_clear()
    try:
        built = mp_gguf.gguf_tokenizer(path)
        mp_gguf._tokenizer.cache_clear()
        return built, mp_gguf.gguf_tokenizer(path)
    finally:
        mp_gguf._tokenizer.cache_clear()


def test_smollm2_tokenizer_read_back_from_the_cache_equals_a_fresh_build(
        smollm2_gguf, smollm2_tokenizer, tmp_path, monkeypatch):
    from minipaged.bench.chat_prompts import CHAT_PROMPTS

    built, cached = _read_back(smollm2_gguf, monkeypatch, tmp_path, fresh=smollm2_tokenizer)
    assert built is smollm2_tokenizer and cached is not built
    assert len(list((tmp_path / "gguf-tokenizers").iterdir())) == 1
    assert type(cached) is type(built) and len(cached) == len(built)
    assert (cached.bos_token_id, cached.eos_token_id, cached.all_special_ids) == (
        built.bos_token_id, built.eos_token_id, built.all_special_ids)
    for text in CHAT_PROMPTS:
        assert cached(text).input_ids == built(text).input_ids
        chat = [{"role": "user", "content": text}]
        for generation_prompt in (True, False):
            kw = {"add_generation_prompt": generation_prompt, "tokenize": False}
            assert cached.apply_chat_template(chat, **kw) == built.apply_chat_template(chat, **kw)
    ids = list(range(0, len(built), 97)) + built.all_special_ids
    assert cached.decode(ids) == built.decode(ids)


def test_tokenizer_cache_is_rebuilt_for_a_changed_file(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    key = mp_gguf._tokenizer_cache_key(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert mp_gguf._tokenizer_cache_key(path) != key


def test_an_unwritable_tokenizer_cache_is_skipped(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    built, again = _read_back(path, monkeypatch, not_a_folder)
    assert built("Hello").input_ids == again("Hello").input_ids
    assert not_a_folder.is_file()
