"""The offline stand-ins: a Llama 2-style tokenizer, a free model, a tiny checkpoint."""

import json

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.bench.stand_ins import (
    BYTE_TOKEN_IDS,
    StandInModel,
    _tokenizer_json,
    llama_style_tokenizer,
    rare_bytes_bias,
)
from minipaged.sampling.sampler import apply_filters

TEXTS = ["The capital is Paris", "Hello", "two  spaces\nand a newline", " a leading space",
         "a , b . c", "Digits 0123456789 and symbols #$%&*"]
NON_ASCII = "naïve café, 東京, emoji 🙂"


@pytest.fixture(scope="module")
def tok():
    return llama_style_tokenizer()


def merges(tokenizer):
    return json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]


# -- tokenizer --------------------------------------------------------------------

@pytest.mark.parametrize("vocab_size", [261, 320, 512, 851])
def test_vocab_has_exactly_the_asked_size(vocab_size):
    tok = llama_style_tokenizer(vocab_size)
    assert len(tok) == tok.vocab_size == vocab_size
    assert sorted(tok.get_vocab().values()) == list(range(vocab_size))


@pytest.mark.parametrize("vocab_size", [260, 852])
def test_sizes_out_of_range_are_refused(vocab_size):
    with pytest.raises(ValueError, match="vocab_size|at most"):
        llama_style_tokenizer(vocab_size)


def test_llama_id_layout(tok):
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    byte_ids = tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    assert byte_ids == list(range(3, 259))
    # Byte tokens are plain vocabulary: skip_special_tokens keeps them.
    assert tok.decode([75], skip_special_tokens=True) == "H"  # <0x48>


def test_bos_first_and_ascii_round_trip(tok):
    assert tok("Hello").input_ids[0] == 1
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids[0] == 1 and 1 not in ids[1:]
        assert tok.decode(ids[1:], skip_special_tokens=True) == text
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok("Hello").input_ids) == "<s> Hello"  # as Llama 2 decodes with its BOS


def test_non_ascii_round_trips_through_byte_tokens(tok):
    ids = tok(NON_ASCII).input_ids
    pieces = tok.convert_ids_to_tokens(ids)
    assert "<0xE6>" in pieces and "<0xF0>" in pieces  # 東 and 🙂 spelled in UTF-8 bytes
    assert tok.unk_token_id not in ids
    assert tok.decode(ids[1:], skip_special_tokens=True) == NON_ASCII


def test_words_merge_into_pieces_with_a_word_start_marker(tok):
    pieces = tok.convert_ids_to_tokens(tok("the cat is in the house").input_ids)
    assert "▁the" in pieces and "▁is" in pieces
    assert all("▁" not in p[1:] for p in pieces)  # no piece crosses a word start


def test_continuation_decoded_alone_loses_its_leading_space(tok):
    # The SentencePiece behaviour the detokenizer must handle: the decoder
    # strips one leading space, so tokens decoded apart from their context
    # lose the space that separates them from it.
    prompt = tok("The capital is").input_ids
    full = tok("The capital is Paris").input_ids
    assert full[:len(prompt)] == prompt
    continuation = full[len(prompt):]
    assert tok.decode(continuation) == "Paris"
    assert tok.decode(full[1:]) == "The capital is Paris"
    # Decoding with the context and taking the difference keeps the space.
    assert tok.decode(full[1:])[len(tok.decode(prompt[1:])):] == " Paris"


def test_incomplete_utf8_decodes_to_replacement_characters(tok):
    ids = tok("東京", add_special_tokens=False).input_ids  # ▁ then 6 byte tokens
    assert tok.decode(ids) == "東京"
    assert tok.decode(ids[:4]) == "東"
    # One byte short of 京: the whole run of byte tokens fails to decode, so
    # even the complete 東 before it comes out as U+FFFD (one per byte).
    assert tok.decode(ids[:-1]) == "\ufffd" * 5


def test_builds_are_deterministic_and_not_shared():
    first = llama_style_tokenizer(400)
    _tokenizer_json.cache_clear()
    second = llama_style_tokenizer(400)
    assert first.get_vocab() == second.get_vocab()
    assert merges(first) == merges(second)
    assert first is not second
    first.add_tokens(["<extra>"])
    assert len(first) == 401 and len(llama_style_tokenizer(400)) == 400


def test_saved_tokenizer_loads_back_with_the_same_behaviour(tok, stand_in_llama_dir):
    from transformers import AutoTokenizer
    loaded = AutoTokenizer.from_pretrained(str(stand_in_llama_dir))
    assert len(loaded) == 320 and loaded.eos_token_id == 2
    for text in TEXTS + [NON_ASCII]:
        ids = tok(text).input_ids
        assert loaded(text).input_ids == ids
        assert loaded.decode(ids[2:], skip_special_tokens=True) == tok.decode(ids[2:])


# -- model ------------------------------------------------------------------------

def test_stand_in_model_shapes_and_dtypes():
    model = StandInModel(320)
    ids = torch.tensor([1, 5, 300, 7])
    hidden = model(ids, torch.arange(4), kv_caches=None, meta=None)
    assert hidden.shape == (4, 8)
    logits = model.compute_logits(hidden[[1, 3]])
    assert logits.shape == (2, 320) and logits.dtype == torch.float32
    half = StandInModel(320).to(torch.bfloat16)
    assert half.compute_logits(half(ids, None, None, None)).dtype == torch.float32
    assert torch.equal(StandInModel(320, seed=0).head, model.head)
    assert not torch.equal(StandInModel(320, seed=1).head, model.head)


def test_stand_in_distribution_is_neither_flat_nor_one_hot():
    vocab = 320
    model = StandInModel(vocab)
    logits = model.compute_logits(model(torch.arange(vocab), None, None, None))
    n = logits.shape[0]
    probs = apply_filters(logits, torch.ones(n), torch.full((n,), vocab), torch.full((n,), 0.9),
                          torch.zeros(n))
    kept = (probs > 0).sum(dim=-1)
    assert kept.min() >= 10 and kept.float().median() < 0.6 * vocab  # top_p 0.9 keeps many, not all
    best = torch.softmax(logits, dim=-1).max(dim=-1).values
    assert best.max() < 0.9 and best.min() > 5 / vocab


def test_rare_bytes_bias_makes_byte_tokens_rare():
    """Without the bias most of top-p's mass is on byte tokens (256 of the
    320); with it, about one draw in 500 is one, and the learned pieces
    share the rest."""
    vocab = 320
    byte_ids = list(BYTE_TOKEN_IDS)
    tok = llama_style_tokenizer(vocab)
    assert tok.convert_ids_to_tokens([byte_ids[0], byte_ids[-1]]) == ["<0x00>", "<0xFF>"]
    masses = []
    for bias in (None, rare_bytes_bias(vocab)):
        model = StandInModel(vocab, logit_bias=bias)
        logits = model.compute_logits(model(torch.arange(vocab), None, None, None))
        n = logits.shape[0]
        probs = apply_filters(logits, torch.ones(n), torch.full((n,), vocab),
                              torch.full((n,), 0.9), torch.zeros(n))
        probs = probs / probs.sum(dim=-1, keepdim=True)
        masses.append(probs[:, byte_ids].sum(dim=-1).mean().item())
    assert masses[0] > 0.5 and masses[1] < 0.01


# -- the tiny checkpoint through the engine ----------------------------------------

def test_tiny_llama_dir_serves_with_minipaged(stand_in_llama_dir):
    config = json.loads((stand_in_llama_dir / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (1, 2, 320)
    # 64 blocks of 16 hold 1024 tokens: less than the 2048 positions, so cap the length.
    llm = LLM(str(stand_in_llama_dir), device="cpu", attention_backend="torch",
              num_gpu_blocks_override=64, max_model_len=256)
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].prompt_token_ids == llama_style_tokenizer()("Hello").input_ids
    assert len(out[0].outputs[0].token_ids) == 4

    # The stand-in model drops into the engine in place of the real one.
    llm.engine.runner.model = StandInModel(320)
    outs = llm.generate(["The capital is", "Hello"],
                        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, ignore_eos=True,
                                       seed=3), use_tqdm=False)
    for o in outs:
        tokens = o.outputs[0].token_ids
        assert len(tokens) == 16 and len(set(tokens)) > 4
