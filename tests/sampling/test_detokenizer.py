"""Incremental detokenization against a full decode, on a Llama-style
(SentencePiece, byte-fallback) tokenizer and a character-level one."""

import random

import pytest

from minipaged.bench.stand_ins import CORPUS, llama_style_tokenizer
from minipaged.postprocess.detokenizer import IncrementalDetokenizer, decoder_for
from tiny_models import save_tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "naïve café, 東京 and an emoji 🙂 in one line",
    "  two leading spaces, then\nnew lines\n\nand tabs\tinside",
    "Ünïcödé ẞ ΑΒΓ абв 𝔘𝔫𝔦 — “quotes” ‘and’ …",
]


@pytest.fixture(scope="module")
def llama_tok():
    return llama_style_tokenizer(320)


def stream(tok, prompt_ids, output_ids, skip=True):
    det = IncrementalDetokenizer(decoder_for(tok, skip), prompt_ids)
    pieces = [det.step(t) for t in output_ids]
    return pieces, det


def full_continuation(tok, prompt_ids, output_ids, skip=True):
    """The text the output adds to the prompt, by decoding everything at once."""
    whole = tok.decode(prompt_ids + output_ids, skip_special_tokens=skip)
    return whole[len(tok.decode(prompt_ids, skip_special_tokens=skip)):]


def test_sentencepiece_output_keeps_its_leading_space(llama_tok):
    ids = llama_tok("The capital of France is Paris.").input_ids
    prompt_ids = llama_tok("The capital of France is").input_ids
    assert ids[:len(prompt_ids)] == prompt_ids
    out = ids[len(prompt_ids):]
    # Decoding the output alone loses the space SentencePiece marks with "▁".
    assert llama_tok.decode(out, skip_special_tokens=True) == "Paris."
    pieces, _ = stream(llama_tok, prompt_ids, out)
    assert "".join(pieces) == " Paris."


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split", [0.2, 0.5, 0.8])
def test_incremental_text_equals_a_full_decode(llama_tok, text, split):
    ids = llama_tok(text).input_ids
    cut = max(1, int(len(ids) * split))
    prompt_ids, out = ids[:cut], ids[cut:]
    pieces, det = stream(llama_tok, prompt_ids, out)
    assert "".join(pieces) + det.flush() == full_continuation(llama_tok, prompt_ids, out)
    assert not any("\ufffd" in p for p in pieces), "a half character was handed out"


def test_random_corpus_text_and_a_bounded_window(llama_tok):
    rng = random.Random(0)
    words = CORPUS.split() + ["東京", "café", "🙂", "naïve", "ẞ"]
    text = " ".join(rng.choice(words) for _ in range(600))
    ids = llama_tok(text).input_ids
    prompt_ids, out = ids[:20], ids[20:]
    assert len(out) > 1000
    det = IncrementalDetokenizer(decoder_for(llama_tok, True), prompt_ids)
    pieces, longest = [], 0
    for t in out:
        pieces.append(det.step(t))
        longest = max(longest, len(det.window))
    assert "".join(pieces) == full_continuation(llama_tok, prompt_ids, out)
    # Each step decodes a window of a few tokens, however long the output:
    # the cost per token does not grow with the output length.
    assert longest <= 16


def test_an_incomplete_character_waits_then_flushes(llama_tok):
    prompt_ids = llama_tok("A city:").input_ids
    city = llama_tok.encode("東京", add_special_tokens=False)
    assert len(city) >= 6                                   # byte-fallback tokens, 3 per character
    pieces, det = stream(llama_tok, prompt_ids, city[:-1])
    assert "".join(pieces) == " 東"                         # "京" lacks its last byte
    assert det.flush() == full_continuation(llama_tok, prompt_ids, city[:-1])[len(" 東"):]


def test_fork_and_peek_leave_the_parent_alone(llama_tok):
    ids = llama_tok("The view from the window changes").input_ids
    prompt_ids, out = ids[:4], ids[4:]
    _, det = stream(llama_tok, prompt_ids, out[:3])
    state = (list(det.window), det.read)
    child = det.fork()
    peeked = det.peek(out[3])
    assert (list(det.window), det.read) == state
    assert child.step(out[3]) == peeked
    assert (list(det.window), det.read) == state


def test_special_tokens_are_skipped_or_kept(llama_tok):
    prompt_ids = llama_tok("Hello").input_ids
    world = llama_tok.encode(" world", add_special_tokens=False)
    out = world + [llama_tok.eos_token_id] + world
    kept, _ = stream(llama_tok, prompt_ids, out, skip=False)
    skipped, _ = stream(llama_tok, prompt_ids, out, skip=True)
    assert "".join(skipped) == full_continuation(llama_tok, prompt_ids, out, skip=True)
    assert "</s>" in "".join(kept) and "</s>" not in "".join(skipped)


def test_character_tokenizer(tmp_path):
    save_tokenizer(tmp_path)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    rng = random.Random(1)
    ids = [rng.randrange(3, 256) for _ in range(300)]
    pieces, _ = stream(tok, ids[:10], ids[10:])
    assert "".join(pieces) == full_continuation(tok, ids[:10], ids[10:])


@pytest.mark.parametrize("skip", [True, False])
def test_remembered_single_token_texts_equal_fresh_decodes(llama_tok, skip):
    """``decoder_for`` remembers one token's text: asked twice (the second time
    from memory), every token of the vocabulary, special ones included, decodes
    as the tokenizer decodes it; longer lists are decoded each time."""
    decode = decoder_for(llama_tok, skip)
    ids = list(range(len(llama_tok)))
    for _ in range(2):
        assert [decode([t]) for t in ids] == [llama_tok.decode([t], skip_special_tokens=skip)
                                               for t in ids]
    pair = ids[3:5]
    assert decode(pair) == decode(list(pair)) == llama_tok.decode(pair, skip_special_tokens=skip)


# -- context-free tokens: their remembered text against the window's decodes -------

@pytest.fixture(scope="module")
def byte_level_tok():
    """A GPT-2-style byte-level BPE (SmolLM2's, Qwen's kind), trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([CORPUS] + TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def window_only(decode):
    """``decode`` without its ``pieces``: every token takes the window's path."""
    return lambda ids: decode(ids)


@pytest.mark.parametrize("name", ["llama", "byte_level"])
@pytest.mark.parametrize("skip", [True, False])
def test_context_free_tokens_give_the_windows_text(request, name, skip):
    """Fresh random streams, half of them text with some ids replaced at
    random, half uniformly random ids (bytes of broken characters, special
    tokens): the text handed out step by step, flush included, is the window
    scheme's, and a full decode's on the text streams."""
    tok = request.getfixturevalue(f"{name}_tok")
    decode = decoder_for(tok, skip)
    vocab = len(tok)
    rng = random.Random()   # fresh streams each run
    words = CORPUS.split() + ["東京", "café", "🙂", "naïve"]
    for trial in range(120):
        if trial % 2:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(2, 60))]
        else:
            ids = tok.encode(" ".join(rng.choice(words) for _ in range(20)),
                             add_special_tokens=False)
            ids = [t if rng.random() > 0.1 else rng.randrange(vocab) for t in ids]
        cut = rng.randrange(1, len(ids))
        prompt_ids, out = ids[:cut], ids[cut:]
        fast = IncrementalDetokenizer(decode, prompt_ids)
        slow = IncrementalDetokenizer(window_only(decode), prompt_ids)
        fast_pieces = [fast.step(t) for t in out]
        assert fast_pieces == [slow.step(t) for t in out], (prompt_ids, out)
        assert fast.flush() == slow.flush()
    # Most of a text's tokens are context-free; a piece of a longer character is not.
    text_ids = tok.encode(" ".join(words[:40]), add_special_tokens=False)
    assert sum(decode.pieces[t] is not None for t in text_ids) > 0.7 * len(text_ids)
    broken = [t for t in range(vocab) if "\ufffd" in tok.decode([t])]
    assert len(broken) >= 64 and all(decode.pieces[t] is None for t in broken)


def test_a_settled_stream_decodes_nothing(llama_tok):
    """Once text is handed out, a context-free token's text comes from
    ``pieces``: the tokenizer is not asked again."""
    decode = decoder_for(llama_tok, True)
    calls = []

    def counting(ids):
        calls.append(list(ids))
        return decode(ids)
    counting.pieces = decode.pieces
    ids = llama_tok("the capital of the river is in the city").input_ids
    prompt_ids, out = ids[:4], ids[4:]
    # Each token's text found once, up front: all of these are context-free
    # (learned pieces; a byte token, e.g. of a capital letter, would not be).
    assert all(decode.pieces[t] is not None for t in out)
    det = IncrementalDetokenizer(counting, prompt_ids)
    first = det.step(out[0])          # the first token takes the window's path
    assert calls and first
    calls.clear()
    text = first + "".join(det.step(t) for t in out[1:])
    assert calls == []
    assert text == full_continuation(llama_tok, prompt_ids, out)
