"""Checks for the exercises of chapter 07 (prefix caching).

The truth comes from the package itself: ``LLM`` with ``enable_prefix_caching=True`` on a
tiny random model (``bookutils.tiny_llama``, the torch attention backend, a pool big enough
that nothing is evicted) for the hits of a second call, and ``BlockSpaceManager`` driven
as chapter 07's ``serve_in`` drives it for the block ids of a replayed history. While the
student's function runs, what would hand it that truth is switched off (``checks.refusing``):
the engine's step and the block manager's prefix lookup and admission (exercises 1 and 2),
and the block manager and the allocator's pool, cache and evictor (exercise 3); a call to
one raises ``RuntimeError`` saying so. The truth is computed after, with them back on.
Exercise 4's policy (fewest hits first) has no class in the package: its truth is this
module's ``_FewestHitsFirst``, and the block manager's ``check_invariants`` with the
student's evictor in its device pool.
"""

from __future__ import annotations

import functools
import itertools
import random

from . import refusing

_MANAGER = "minipaged.core.block_manager:BlockSpaceManager."
_ALLOCATOR = "minipaged.core.allocator:BlockAllocator."

# The functions each exercise switches off while the student's function runs:
# "module:qualified name".
ANSWERS = {
    # Serving the prompts (LLM.generate runs the step), or admitting them into a caching
    # block manager by hand, reads the hits off num_cached_tokens.
    1: ["minipaged.engine:LLMEngine.step", _MANAGER + "allocate", _MANAGER + "_cached_prefix",
        _MANAGER + "cache_full_blocks"],
    2: ["minipaged.engine:LLMEngine.step", _MANAGER + "allocate", _MANAGER + "_cached_prefix",
        _MANAGER + "cache_full_blocks"],
    # The replay is the manager's serve_in and free; under them the allocator hands out
    # free blocks before evicting (allocate_many), releases into the evictor (free) and
    # keeps the cache (register, take_cached): the order the exercise asks for.
    3: [_MANAGER + "allocate", _MANAGER + "free", _MANAGER + "cache_full_blocks",
        _MANAGER + "_cached_prefix", _ALLOCATOR + "allocate_many", _ALLOCATOR + "free",
        _ALLOCATOR + "register", _ALLOCATOR + "take_cached"],
    # No package class evicts the fewest hits first (the allocator's LRUEvictor is
    # another policy, which a student may build on): nothing to switch off.
    4: [],
}



@functools.lru_cache(maxsize=1)
def _model_dir() -> str:
    from bookutils import tiny_llama

    return tiny_llama(seed=0)


def _llm(block_size: int = 16):
    from minipaged import LLM

    return LLM(_model_dir(), device="cpu", attention_backend="torch", swap_space=0, seed=0,
               block_size=block_size, num_gpu_blocks_override=8192 // block_size,
               max_model_len=1024, max_num_batched_tokens=16384, enable_prefix_caching=True)


def _hits(llm, prompts: list[list[int]]) -> list[int]:
    from minipaged import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], one, use_tqdm=False)
    return [o.num_cached_tokens for o in outs]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def check_exercise_1(student_fn, seed: int = 71) -> None:
    """``student_fn(first, prompts, block_size) -> list[int]``: the tokens each of
    ``prompts`` finds in the cache when a fresh engine serves ``first`` in one call, then
    ``prompts`` together in a second call. Compared with ``LLM``'s ``num_cached_tokens``."""
    rng = random.Random(seed)
    cases = []
    for block_size in (16, 8):
        first = _ids(rng, rng.randint(60, 130))
        changed = list(first)
        changed[rng.randrange(20, 50)] = 2                     # an id _ids never draws
        cut = (len(first) // block_size) * block_size
        prompts = [first + _ids(rng, 30), first[:cut], first[:cut + 1], list(first),
                   first[:rng.randint(5, len(first))], changed, _ids(rng, 40),
                   first[:block_size] + _ids(rng, 50)]
        cases.append((first, prompts, block_size))
    with refusing(1, ANSWERS):
        answers = [student_fn(list(first), [list(p) for p in prompts], block_size)
                   for first, prompts, block_size in cases]
    for (first, prompts, block_size), got in zip(cases, answers):
        assert isinstance(got, (list, tuple)) and len(got) == len(prompts), (
            f"exercise 1: expected a list of {len(prompts)} hit counts, got {got!r}")
        got = [int(x) for x in got]
        llm = _llm(block_size)
        _hits(llm, [first])
        truth = _hits(llm, prompts)
        for i, (prompt, t, g) in enumerate(zip(prompts, truth, got)):
            shared = next((n for n, (a, b) in enumerate(zip(prompt, first)) if a != b),
                          min(len(prompt), len(first)))
            assert g == t, (
                f"exercise 1: block_size={block_size}, first call a {len(first)}-token prompt; "
                f"second call's prompt {i} has {len(prompt)} tokens, its first {shared} equal "
                f"to the first prompt's: the engine found {t} tokens in the cache, your "
                f"function says {g} (all answers: engine {truth}, yours {got})")
    print("exercise 1 -> ok")


def check_exercise_2(student_fn, seed: int = 72) -> None:
    """``student_fn(prefix_len, suffix_len, block_size) -> int``: the tokens a request of
    a shared ``prefix_len``-token prefix followed by ``suffix_len`` tokens of its own finds
    in the cache, in a second call after a first call of requests with the same prefix.
    Compared with ``LLM``'s ``num_cached_tokens``."""
    rng = random.Random(seed)
    cases = [(341, 30, 16), (341, 25, 32), (341, 40, 8), (80, 20, 16), (64, 0, 16), (64, 1, 16),
             (65, 0, 16), (rng.randint(40, 300), 0, 32),
             (rng.randint(40, 300), rng.randint(1, 40), 8)]
    with refusing(2, ANSWERS):
        answers = [student_fn(*case) for case in cases]
    for (prefix_len, suffix_len, block_size), got in zip(cases, answers):
        assert isinstance(got, int), f"exercise 2: expected a number of tokens, got {got!r}"
        prefix = _ids(rng, prefix_len)
        llm = _llm(block_size)
        _hits(llm, [prefix + _ids(rng, rng.randint(20, 40)) for _ in range(2)])
        truth = _hits(llm, [prefix + _ids(rng, suffix_len)])[0]
        assert got == truth, (
            f"exercise 2: a {prefix_len}-token prefix, {suffix_len} tokens of its own, "
            f"block_size={block_size}: the engine found {truth} tokens in the cache, your "
            f"function says {got}")
    print("exercise 2 -> ok")


def _manager(num_blocks: int, block_size: int, evictor=None):
    """A caching manager of ``num_blocks`` device blocks, ``watermark=0.0``; ``evictor``:
    a class for its device pool's evictor (None: the allocator's default, LRU)."""
    from minipaged.core.allocator import BlockAllocator
    from minipaged.core.block_manager import BlockSpaceManager

    manager = BlockSpaceManager(block_size, num_device_blocks=num_blocks, watermark=0.0,
                                enable_caching=True)
    if evictor is not None:   # the same pool, made with the given evictor
        manager.device_pool = BlockAllocator(num_blocks, block_size, "device",
                                             enable_caching=True, evictor=evictor)
    return manager


def _replay(num_blocks: int, block_size: int, events, ids=None, evictor=None):
    """Chapter 07's ``serve_in`` and ``manager.free`` on a fresh manager (``evictor``:
    as in ``_manager``), its invariants checked after each. Returns (hit tokens, block
    table) per serve, and the events that fit the pool (a serve that does not fit, and
    frees of names not held, are dropped)."""
    from minipaged.core.block_manager import NoFreeBlocksError
    from minipaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

    ids = ids or itertools.count()
    manager = _manager(num_blocks, block_size, evictor)
    held, results, kept = {}, [], []
    for event in events:
        if event[0] == "free":
            if event[1] in held:
                manager.free(held.pop(event[1]))
                manager.check_invariants()
                kept.append(event)
            continue
        _, name, tokens = event
        if name in held:
            continue
        seq = Sequence(next(ids), list(tokens), block_size)
        group = SequenceGroup(name, [seq])
        try:
            manager.allocate(group)
        except NoFreeBlocksError:
            continue
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = len(tokens)
        manager.cache_full_blocks(seq)
        manager.check_invariants()
        held[name] = seq
        results.append((group.num_cached_tokens, list(seq.block_table.blocks)))
        kept.append(event)
    return results, kept


def _events(rng: random.Random, block_size: int, num: int):
    bases = [_ids(rng, rng.randint(2, 5) * block_size + rng.randrange(block_size))
             for _ in range(3)]
    events, live = [], []
    for i in range(num):
        if live and rng.random() < 0.45:
            name = live.pop(rng.randrange(len(live)))
            events.append(("free", name))
            continue
        base = rng.choice(bases)
        cut = rng.randint(1, len(base))
        tokens = base[:cut] + _ids(rng, rng.randint(0, 2 * block_size))
        if rng.random() < 0.2:
            tokens = list(base)                          # the same prompt again
        name = f"r{i}"
        events.append(("serve", name, tokens))
        live.append(name)
    return events


def check_exercise_3(student_fn, seed: int = 73) -> None:
    """``student_fn(num_blocks, block_size, events) -> list[tuple[int, list[int]]]``: replay
    ``("serve", name, tokens)`` (admit, compute the whole prompt, cache its full blocks) and
    ``("free", name)`` on an empty pool; for each serve, the tokens it found in the cache
    and its block table. Compared with ``BlockSpaceManager``."""
    rng = random.Random(seed)
    cases = []
    for num_blocks, block_size, num in ((10, 16, 20), (12, 8, 24), (6, 4, 30)):
        events = _events(rng, block_size, num)
        _, kept = _replay(num_blocks, block_size, events)    # only what fits the pool
        cases.append((num_blocks, block_size, kept))
    with refusing(3, ANSWERS):
        answers = [student_fn(num_blocks, block_size,
                              [tuple(e[:2]) + tuple(list(x) for x in e[2:]) for e in events])
                   for num_blocks, block_size, events in cases]
    for (num_blocks, block_size, events), got in zip(cases, answers):
        assert isinstance(got, (list, tuple)), (
            f"exercise 3: expected a list of (hit_tokens, blocks) per serve, got {got!r}")
        got = [(int(h), [int(b) for b in blocks]) for h, blocks in got]
        truth, _ = _replay(num_blocks, block_size, events)
        assert len(got) == len(truth), (
            f"exercise 3: {len(truth)} serves among the events, your function answered {len(got)}")
        serves = [e for e in events if e[0] == "serve"]
        for k, (t, g) in enumerate(zip(truth, got)):
            if t != g:
                done = events[:events.index(serves[k])]
                history = ", ".join(
                    f"{e[0]} {e[1]}" + (f" ({len(e[2])} tokens)" if e[0] == "serve" else "")
                    for e in done[-6:])
                raise AssertionError(
                    f"exercise 3: {num_blocks} blocks of {block_size} tokens; serve {k} "
                    f"({serves[k][1]}, {len(serves[k][2])} tokens, after ...{history}): the block "
                    f"manager gives {t[0]} tokens hit and blocks {t[1]}, your function says "
                    f"{g[0]} and {g[1]}")
    print("exercise 3 -> ok")


class _FewestHitsFirst:
    """Exercise 4's policy, the reference: the block with the fewest hits (``remove``
    calls since it last left by ``pop``, or since its first ``add``) goes first; among
    those, the one added longest ago. O(n) per ``pop``: a check needs no speed."""

    def __init__(self) -> None:
        self._hits: dict[int, int] = {}    # block -> hits, kept while its contents live
        self._added: dict[int, int] = {}   # evictable block -> when it was added
        self._clock = itertools.count()

    def _order(self, block: int) -> tuple[int, int]:
        return self._hits.get(block, 0), self._added[block]

    def add(self, block: int) -> None:
        self._added[block] = next(self._clock)

    def remove(self, block: int) -> None:
        del self._added[block]
        self._hits[block] = self._hits.get(block, 0) + 1

    def pop(self) -> int:
        block = min(self._added, key=self._order)
        del self._added[block]
        self._hits.pop(block, None)         # new contents start with no hits
        return block

    def __len__(self) -> int:
        return len(self._added)

    def __iter__(self):
        return iter(sorted(self._added, key=self._order))


def _compare(student, rng: random.Random, num_blocks: int, num: int) -> None:
    """Make ``num`` random calls an allocator could make, on ``student`` (an evictor) and
    on the reference, over the block ids ``0 .. num_blocks - 1``: ``add`` of a block not
    in it, ``remove`` of one in it, ``pop`` when it is not empty. After each, the victim,
    the length and the eviction order must agree."""
    reference, done = _FewestHitsFirst(), []
    for k in range(num):
        inside = sorted(reference._added)
        outside = sorted(set(range(num_blocks)) - set(inside))
        r = rng.random()
        if outside and (not inside or r < 0.45):
            op = ("add", rng.choice(outside))
        elif r < 0.75:
            op = ("remove", rng.choice(inside))
        else:
            op = ("pop",)
        if op[0] == "pop":
            want, got = reference.pop(), student.pop()
            step = f"pop() -> {want}"
        else:
            getattr(reference, op[0])(op[1])
            getattr(student, op[0])(op[1])
            want = got = None
            step = f"{op[0]}({op[1]})"
        w = (want, len(reference), list(reference))
        g = (got, len(student), list(student))
        if g != w:
            raise AssertionError(
                f"exercise 4: blocks 0..{num_blocks - 1}, call {k}: {step} (after "
                f"...{', '.join(done[-8:]) or 'nothing'}): the reference"
                + (f" evicts {want}," if op[0] == "pop" else "") + f" keeps {w[1]} blocks, "
                f"in eviction order {w[2]}; yours" + (f" evicts {got}," if op[0] == "pop" else "")
                + f" keeps {g[1]}, in the order {g[2]}")
        done.append(step)


def check_exercise_4(student_cls, seed: int = 74) -> None:
    """``student_cls()``: an evictor (``add``, ``remove``, ``pop``, ``__len__``, ``__iter__``
    as in ``minipaged.core.allocator.Evictor``) that evicts the block with the fewest hits
    first, ties by age. Driven with random operations and compared with the reference
    (same victims, lengths and eviction orders); then used as the evictor of a caching
    block manager replaying serves and frees: the same hits and block tables as with the
    reference, and the manager's invariants after every event."""
    rng = random.Random(seed)
    with refusing(4, ANSWERS):
        for num_blocks in (4, 8, 12):
            _compare(student_cls(), rng, num_blocks, 300)
    for num_blocks, block_size, num in ((10, 16, 40), (10, 8, 60), (16, 4, 60)):
        events = _events(rng, block_size, num)
        truth, kept = _replay(num_blocks, block_size, events, evictor=_FewestHitsFirst)
        try:
            got, _ = _replay(num_blocks, block_size, kept, evictor=student_cls)
        except (AssertionError, RuntimeError) as e:
            raise AssertionError(f"exercise 4: a block manager of {num_blocks} blocks with "
                                 f"your evictor in its pool broke: {e}") from e
        if got != truth:
            k = next(k for k, (g, t) in enumerate(zip(got, truth)) if g != t)
            raise AssertionError(
                f"exercise 4: a block manager of {num_blocks} blocks of {block_size} tokens, "
                f"replaying serves and frees: serve {k} hits {truth[k][0]} tokens in blocks "
                f"{truth[k][1]} with the reference evictor, {got[k][0]} in {got[k][1]} with yours")
    print("exercise 4 -> ok")
