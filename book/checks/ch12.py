"""Checks for the exercises of chapter 12 (structured output).

The truth comes from xgrammar itself, as minipaged uses it: a ``GrammarMatcher`` over a
small vocabulary given as strings (``TokenizerInfo`` of a raw vocabulary, token 0 the stop
token), filling its bitmask (exercise 1) and accepting tokens (exercise 2); and
``xgrammar.apply_token_bitmask_inplace`` on zero logits for what a bitmask allows
(exercise 3). While the student's function runs, what would answer the exercise is
switched off (``checks.refusing``): for exercises 1 and 2, xgrammar's compiler, its matchers
and its testing helpers, and minipaged's wrappers of them; for exercise 2 also the
``regex`` package, whose partial matching tells whether text can still become a match;
for exercise 3, xgrammar's bitmask kernels and converters and minipaged's ``mask_logits``.
A call to one raises ``RuntimeError`` saying so.
"""

from __future__ import annotations

import random
import string

from . import refusing

STOP = "<eos>"

# A grammar compiled and matched: xgrammar's Python entry points (its C++ core is reached
# only through them) and minipaged's wrappers of them.
_MATCHING = ["xgrammar.compiler:GrammarCompiler.compile_grammar",
             "xgrammar.compiler:GrammarCompiler.compile_regex",
             "xgrammar.compiler:GrammarCompiler.compile_json_schema",
             "xgrammar.compiler:GrammarCompiler.compile_lark",
             "xgrammar.compiler:GrammarCompiler.compile_structural_tag",
             "xgrammar.matcher:GrammarMatcher.__init__",
             "xgrammar.matcher:GrammarMatcher.accept_token",
             "xgrammar.matcher:GrammarMatcher.accept_string",
             "xgrammar.matcher:GrammarMatcher.fill_next_token_bitmask",
             "xgrammar.matcher:GrammarMatcher.is_terminated",
             "xgrammar.testing:_get_matcher_from_grammar",
             "xgrammar.testing:_get_matcher_from_grammar_and_tokenizer_info",
             "xgrammar.testing:_is_grammar_accept_string",
             "minipaged.sampling.structured_output:GrammarCompilerCache.compile",
             "minipaged.sampling.structured_output:GrammarCompilerCache._compile",
             "minipaged.sampling.structured_output:GrammarCompilerCache.matcher"]

# The functions each exercise switches off while the student's function runs:
# "module:qualified name".
ANSWERS = {
    1: _MATCHING,
    # and the regex package's partial matching: every call of it compiles its pattern
    # through regex._main._compile (Python's re has no partial matching)
    2: _MATCHING + ["regex._main:fullmatch", "regex._main:match", "regex._main:_compile"],
    # a bitmask unpacked: the dispatcher, its kernels that are Python functions (the CUDA
    # one is a compiled extension, and it does not import without a GPU), the converters
    3: ["xgrammar.matcher:apply_token_bitmask_inplace",
        "xgrammar.kernels.apply_token_bitmask_inplace_cpu:apply_token_bitmask_inplace_cpu",
        "xgrammar.kernels.apply_token_bitmask_inplace_torch:apply_token_bitmask_inplace_torch",
        "xgrammar.kernels.apply_token_bitmask_inplace_torch:"
        "apply_token_bitmask_inplace_kernel_no_indices_torch",
        "xgrammar.kernels.apply_token_bitmask_inplace_torch:"
        "apply_token_bitmask_inplace_kernel_indices_torch",
        "xgrammar.kernels.apply_token_bitmask_inplace_torch_compile:"
        "apply_token_bitmask_inplace_torch_compile",
        "xgrammar.kernels.apply_token_bitmask_inplace_triton:apply_token_bitmask_inplace_triton",
        "xgrammar.testing:bitmask_to_bool_mask",
        "xgrammar.testing:_get_masked_tokens_from_bitmask",
        "minipaged.sampling.structured_output:mask_logits"],
}



def _info(vocab: list[str]):
    import xgrammar as xgr

    return xgr.TokenizerInfo(list(vocab), vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])


def _allowed(matcher, vocab_size: int) -> list[int]:
    """The token ids ``matcher`` allows next, read from the bitmask it fills."""
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab_size)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return [i for i in range(vocab_size) if logits[0, i] == 0]


def _vocab(rng: random.Random, choices: list[str]) -> list[str]:
    """A stop token, every single letter the choices use, and pieces of the choices."""
    pieces = set(ch for c in choices for ch in c)
    for c in choices:
        for _ in range(3):
            i = rng.randrange(len(c))
            pieces.add(c[i:i + rng.randint(2, 4)])
    pieces.update(rng.choice(string.ascii_lowercase) * 2 for _ in range(3))
    return [STOP] + sorted(pieces)


def check_exercise_1(student_fn, seed: int = 121) -> None:
    """``student_fn(vocab, choices, generated) -> list[int]``: the ids of the tokens of
    ``vocab`` (token 0 is the stop token) allowed next, in increasing order, for a
    ``choice`` constraint over ``choices`` once ``generated`` has been written.
    Compared with xgrammar's bitmask for the same vocabulary and grammar."""
    import xgrammar as xgr

    from minipaged.sampling_params import choice_grammar

    rng = random.Random(seed)
    cases = []
    words = ["red", "green", "blue", "grey", "gold", "yes", "no", "maybe", "north", "south",
             "east", "west", "cat", "cart", "card"]
    for _ in range(8):
        choices = rng.sample(words, rng.randint(2, 4))
        vocab = _vocab(rng, choices)
        target = rng.choice(choices)
        generated = target[:rng.randint(0, len(target))]
        cases.append((vocab, choices, generated))
    cases.append((_vocab(rng, ["cat", "cart", "card"]), ["cat", "cart", "card"], "ca"))
    cases.append((_vocab(rng, ["no", "north"]), ["no", "north"], "no"))
    answers = []
    with refusing(1, ANSWERS):
        for vocab, choices, generated in cases:
            got = student_fn(list(vocab), list(choices), generated)
            assert isinstance(got, (list, tuple)), (
                f"exercise 1: expected a list of token ids, got {got!r}")
            answers.append(sorted(int(t) for t in got))
    for (vocab, choices, generated), got in zip(cases, answers):
        info = _info(vocab)
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(
            choice_grammar(choices)))
        assert matcher.accept_string(generated) if generated else True
        truth = _allowed(matcher, info.vocab_size)
        assert got == truth, (
            f"exercise 1: choices {choices}, {generated!r} written so far, vocabulary "
            f"{vocab}: xgrammar allows {[vocab[t] for t in truth]} (ids {truth}), your "
            f"function says {[vocab[t] if 0 <= t < len(vocab) else t for t in got]} (ids {got})")
    print("exercise 1 -> ok")


def check_exercise_2(student_fn, seed: int = 122) -> None:
    """``student_fn(regex, vocab, token_ids) -> tuple[int, bool]``: feeding
    ``token_ids`` one by one to a matcher of ``regex`` over ``vocab`` (token 0 the stop
    token), how many it accepts before the first it rejects (all of them if none), and
    whether the text of the accepted ones is a whole match (the stop token may come
    next). Compared with an xgrammar ``GrammarMatcher``."""
    import xgrammar as xgr

    rng = random.Random(seed)
    vocab = [STOP] + list("0123456789-:abcxyz") + ["12", "-0", "00", "ab", "9a", "2-", "x1"]
    regexes = [r"[0-9]{3}-[0-9]{2}", r"(ab|xy)+c?", r"[0-9]+:[0-9]{2}", r"x[0-9]*y",
               r"(0|[1-9][0-9]*)-[a-c]{1,3}"]
    samples = {r"[0-9]{3}-[0-9]{2}": ["123-45", "12-345", "900-0", "1234-5"],
               r"(ab|xy)+c?": ["ababc", "xyxy", "abx", "abcab"],
               r"[0-9]+:[0-9]{2}": ["12:00", "9:5", "129:0012", ":30"],
               r"x[0-9]*y": ["x12y", "xy", "x1y2", "x9ay"],
               r"(0|[1-9][0-9]*)-[a-c]{1,3}": ["0-abc", "00-a", "120-cab", "12-abcc"]}
    cases = []
    for regex in regexes:
        for text in samples[regex]:
            ids, i = [], 0
            while i < len(text):   # tokenize greedily with a random choice of piece lengths
                options = [t for t, s in enumerate(vocab) if t and text.startswith(s, i)]
                t = rng.choice(options)
                ids.append(t)
                i += len(vocab[t])
            cases.append((regex, ids))
        cases.append((regex, [rng.randrange(1, len(vocab)) for _ in range(rng.randint(1, 6))]))
    answers = []
    with refusing(2, ANSWERS):
        for regex, ids in cases:
            got = student_fn(regex, list(vocab), list(ids))
            assert isinstance(got, tuple) and len(got) == 2, (
                f"exercise 2: expected (accepted, complete), got {got!r}")
            answers.append((int(got[0]), bool(got[1])))
    info = _info(vocab)
    compiler = xgr.GrammarCompiler(info)
    for (regex, ids), got in zip(cases, answers):
        matcher = xgr.GrammarMatcher(compiler.compile_regex(regex))
        accepted = 0
        for t in ids:
            if not matcher.accept_token(t):
                break
            accepted += 1
        truth = (accepted, 0 in _allowed(matcher, info.vocab_size))
        assert got == truth, (
            f"exercise 2: regex {regex!r}, tokens {[vocab[t] for t in ids]}: the matcher "
            f"accepts {truth[0]} of them and {'can' if truth[1] else 'cannot'} stop after "
            f"them; your function says {got}")
    print("exercise 2 -> ok")


def check_exercise_3(student_fn, seed: int = 123) -> None:
    """``student_fn(bitmask, vocab_size) -> torch.Tensor``: the ``[R, vocab_size]``
    bool tensor of the tokens an xgrammar bitmask ``[R, ceil(vocab_size / 32)]`` int32
    allows. Compared with ``xgrammar.apply_token_bitmask_inplace`` on zero logits."""
    import torch
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(seed)
    cases = []
    for rows, vocab_size in [(1, 32), (2, 40), (3, 100), (4, 257), (2, 1000)]:
        words = -(-vocab_size // 32)
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen,
                                dtype=torch.int64).to(torch.int32)
        bitmask[0, 0] = -1                       # every bit set, the sign bit too
        cases.append((bitmask, vocab_size))
    answers = []
    with refusing(3, ANSWERS):
        for bitmask, vocab_size in cases:
            got = student_fn(bitmask.clone(), vocab_size)
            assert isinstance(got, torch.Tensor) and tuple(got.shape) == (bitmask.shape[0],
                                                                         vocab_size), (
                f"exercise 3: expected a [{bitmask.shape[0]}, {vocab_size}] tensor, got "
                f"{getattr(got, 'shape', got)!r}")
            answers.append(got.bool())
    for (bitmask, vocab_size), got in zip(cases, answers):
        logits = torch.zeros(bitmask.shape[0], vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        truth = logits == 0
        wrong = (got != truth).nonzero().tolist()
        assert not wrong, (
            f"exercise 3: a [{bitmask.shape[0]}, {bitmask.shape[1]}] bitmask over "
            f"{vocab_size} tokens: {len(wrong)} entries differ from xgrammar's, the first "
            f"at (row, token) {tuple(wrong[0])}: xgrammar says "
            f"{bool(truth[tuple(wrong[0])])}, yours {bool(got[tuple(wrong[0])])}")
    print("exercise 3 -> ok")
