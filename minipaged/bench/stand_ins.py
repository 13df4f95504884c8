"""Stand-ins for a real checkpoint: a Llama-style tokenizer and a model that costs nothing.

Nothing here downloads anything. The pieces let the host-overhead benchmark and
the detokenizer tests run with the tokenizer behaviour of a real Llama 2 /
TinyLlama model (SentencePiece-style BPE with byte fallback, a ``▁`` marking
each word start, ``<s>`` prepended) on any machine:

* ``llama_style_tokenizer(vocab_size)``: a BPE tokenizer trained in a few
  milliseconds on ``CORPUS``, laid out like Llama 2's ``tokenizer.json``.
* ``StandInModel``: the model interface of ``minipaged.models`` with a forward
  that is one tiny embedding lookup, so that a benchmark times the host loop
  rather than the GPU.
* ``tiny_llama_dir(path)``: a random one-layer ``LlamaForCausalLM`` checkpoint
  plus that tokenizer, loadable by ``minipaged.LLM``.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # transformers is imported only when a tokenizer is built
    from transformers import PreTrainedTokenizerFast

SPACE = "\u2581"  # "▁", SentencePiece's word-start marker
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2, as in Llama 2
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))  # ids 3..258
NUM_FIXED = len(SPECIAL_TOKENS) + len(BYTE_TOKENS)  # 259: ids before the learned ones

# The training text. Written for this module; plain English so that the merges
# look like a real tokenizer's ("▁the", "ing", ...). Changing it changes every
# id the tokenizer produces, so treat it as frozen.
CORPUS = """\
The capital of France is Paris, and the capital of Italy is Rome. A train \
between the two cities takes most of a day, and the view from the window \
changes from fields and rivers to mountains covered in snow.
When the weather is warm, people sit outside, drink coffee and talk about the \
news of the day. In the evening the streets are quieter, the shops close one \
after another, and the lights of the houses come on along the hills.
A serving engine keeps many requests in flight at the same time. Each request \
has a prompt and a growing list of generated tokens, and at every step the \
scheduler decides which requests run, which ones wait, and which ones must give \
their memory back so that the others can continue.
The memory that holds the keys and values of the attention layers is split \
into blocks of the same size. A sequence owns a table of blocks rather than \
one long region, so that nothing is reserved before it is needed and the \
space that a finished request leaves behind can be given to the next one \
straight away.
Reading a book by the fire on a cold night is one of the simple pleasures of \
winter. The story moves slowly at first, then faster, until the reader forgets \
the time and looks up to find that the fire has burned down to a few red coals.
She walked to the market on Saturday morning to buy bread, cheese, apples and \
a bunch of flowers for the table. The baker asked whether she wanted the usual \
loaf, and she said that today she would try something different.
Scientists measure what they can and estimate the rest. A good experiment is \
simple to describe, hard to fool, and gives the same answer when another \
person repeats it in another place with other instruments.
"""


def _normalize(text: str) -> str:
    # What the tokenizer's normalizer does to each input: one ▁ in front, and
    # every space becomes ▁.
    return SPACE + text.replace(" ", SPACE)


def _alphabet(size: int) -> list[str]:
    """The ``size`` most frequent characters of the normalized corpus, ties by code point.

    Chosen here rather than by ``BpeTrainer(limit_alphabet=...)``, which breaks
    ties between equally frequent characters in hash order (not reproducible).
    """
    counts = Counter(ch for line in CORPUS.splitlines() for ch in _normalize(line))
    ranked = sorted(counts, key=lambda ch: (-counts[ch], ord(ch)))
    return ranked[:size]


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> str:
    """The serialized ``tokenizers.Tokenizer`` for ``vocab_size`` (cached: callers
    build fresh objects from the string, so none of them share state)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    learned = vocab_size - NUM_FIXED
    if learned < 2:
        raise ValueError(f"vocab_size must be at least {NUM_FIXED + 2} (3 special tokens, 256 "
                         f"byte tokens, then learned ones), got {vocab_size}")
    # Half of the learned ids go to single characters, the rest to merges;
    # characters left out are spelled with byte tokens, as rare ones are in Llama.
    alphabet = _alphabet(max(2, learned // 2))

    # Train on words: Metaspace splits at every ▁ so no merge crosses a word
    # start, as with SentencePiece. The served tokenizer has no pre-tokenizer
    # (like Llama 2), and the BPE merges then never cross a ▁ because none was learned.
    # Characters outside the alphabet are dropped from the training words, which
    # skews the merge counts a little but never makes a merge wrong. Training is
    # deterministic: merges of equal count are ordered by their pieces' ids.
    trainee = Tokenizer(models.BPE())
    trainee.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always",
                                                     split=True)
    trainer = trainers.BpeTrainer(vocab_size=learned, show_progress=False, special_tokens=[],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    trainee.train_from_iterator(CORPUS.splitlines(), trainer)
    trained = json.loads(trainee.to_str())["model"]
    if len(trained["vocab"]) != learned:
        raise ValueError(f"the built-in corpus yields at most {NUM_FIXED + len(trained['vocab'])} "
                         f"tokens, {vocab_size} asked")

    # Llama's id layout: specials, the 256 byte tokens, then the learned pieces.
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + BYTE_TOKENS)}
    for tok, i in trained["vocab"].items():
        vocab[tok] = NUM_FIXED + i
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE),
                                           normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", 1)])
    # Only the three specials are "added" (matched before BPE, dropped by
    # skip_special_tokens); byte tokens are ordinary vocabulary, as in Llama.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size() == vocab_size
    return tok.to_str()


def llama_style_tokenizer(vocab_size: int = 320,
                          save_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A Llama 2-style tokenizer with exactly ``vocab_size`` tokens, built offline.

    Layout and pipeline follow Llama 2 / TinyLlama's ``tokenizer.json``: ids 0-2
    are ``<unk> <s> </s>``, ids 3-258 the byte tokens ``<0x00>``..``<0xFF>``
    (so any text encodes, spelling unknown characters byte by byte), then the
    BPE pieces learned from ``CORPUS``. The normalizer prepends ``▁`` and turns
    spaces into ``▁``; the decoder undoes that and strips one leading space,
    so decoding a slice of ids that starts at a word loses that word's space.
    Encoding prepends ``<s>``. Half of the learned ids are single characters
    (the corpus's most frequent), half merges; a character outside that
    alphabet is spelled in byte tokens. Sizes from 261 to 851 (where the
    corpus runs out of merges) work; others raise ``ValueError``.

    Each call returns a new ``PreTrainedTokenizerFast`` (the trained tokenizer
    is cached per size, so calls after the first take about a millisecond);
    with ``save_dir`` it is also saved there with ``save_pretrained``.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_tokenizer_json(vocab_size))
    # clean_up_tokenization_spaces=False, as Llama's config says: the default
    # cleanup of some transformers versions would turn "a , b" into "a, b".
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", clean_up_tokenization_spaces=False,
                                  model_max_length=2048)
    if save_dir is not None:
        tok.save_pretrained(str(save_dir))
    return tok


class StandInModel(nn.Module):
    """Stands in for a real model so that a benchmark measures the host loop.

    Same interface as ``minipaged.models`` (``forward(input_ids [T], positions
    [T], kv_caches, meta) -> hidden [T, H]`` and ``compute_logits(hidden [S, H])
    -> fp32 [S, vocab]``), but the forward is one lookup in a ``[vocab, hidden]``
    table and the logits one ``[S, hidden] @ [hidden, vocab]`` product: with a
    forward that costs almost nothing, the time of an engine step is the
    scheduling, input preparation, sampling, detokenization and stop checks
    around it. Positions, KV cache and metadata are ignored (the cache is
    never written), so the next-token distribution depends on the last token
    only, like a fixed random bigram model.

    The logits have a standard deviation of about ``logit_std`` (default 2):
    sampling at temperature 1 with top_p 0.9 draws from dozens of tokens, and
    greedy decoding is deterministic. EOS gets no special treatment, so a
    sampled run ends on ``</s>`` now and then unless ``ignore_eos`` is set.
    ``logit_bias`` ``[vocab]`` (e.g. ``rare_bytes_bias``) is added to each row.
    """

    def __init__(self, vocab_size: int, hidden: int = 8, seed: int = 0, logit_std: float = 2.0,
                 logit_bias: torch.Tensor | None = None):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)  # its own generator: the global RNG is untouched
        self.vocab_size = vocab_size
        self.hidden_size = hidden
        # Every embedding row has norm sqrt(hidden) and the head's entries are
        # N(0, std^2 / hidden), so each row of logits is N(0, std^2) over the
        # vocabulary: equally spread whatever the last token (with raw Gaussian
        # rows, a long row gives a near one-hot distribution, a short one a flat one).
        emb = torch.randn(vocab_size, hidden, generator=gen)
        emb *= hidden ** 0.5 / emb.norm(dim=1, keepdim=True)
        head = torch.randn(hidden, vocab_size, generator=gen) * (logit_std / hidden ** 0.5)
        # Buffers, not parameters: nothing here is trained, and .to() still moves them.
        self.register_buffer("embedding", emb)
        self.register_buffer("head", head)
        self.register_buffer("logit_bias", None if logit_bias is None else logit_bias.float())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                meta) -> torch.Tensor:
        return F.embedding(input_ids, self.embedding)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden.float() @ self.head.float()
        return logits if self.logit_bias is None else logits + self.logit_bias


BYTE_TOKEN_IDS = range(3, 259)   # llama_style_tokenizer's <0x00>..<0xFF>


def rare_bytes_bias(vocab_size: int, shift: float = 6.0) -> torch.Tensor:
    """A ``logit_bias`` ``[vocab_size]`` lowering the byte tokens by ``shift``:
    top-p 0.9 then draws one about once in 500 tokens, as a model's English
    spells a rare character (without it, 40 % of the output is a byte of a
    multi-byte character: mostly replacement characters)."""
    bias = torch.zeros(vocab_size)
    bias[BYTE_TOKEN_IDS.start:min(BYTE_TOKEN_IDS.stop, vocab_size)] = -shift
    return bias


def tiny_llama_dir(path: str | Path, vocab_size: int = 320, seed: int = 0) -> Path:
    """Write a random one-layer ``LlamaForCausalLM`` checkpoint and the Llama-style
    tokenizer into ``path``; returns it as a ``Path``.

    The checkpoint is saved by ``transformers`` itself (``config.json`` and
    ``model.safetensors``), so ``minipaged.LLM(str(path), device="cpu", ...)``
    loads it as it would a downloaded model, tokenizer included. Hidden size
    16, 2 heads, intermediate size 32, 2048 positions; ``<s>`` = 1, ``</s>`` = 2.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                         pad_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):  # seeded weights without moving the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(path))
    llama_style_tokenizer(vocab_size, save_dir=path)
    return path
