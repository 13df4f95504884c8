"""SamplingParams: how to pick each next token and when to stop (vLLM's names).

Every field is checked when the object is built, so a bad request is refused
before it reaches the engine, with a ``ValueError`` naming the field and the
allowed range.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

MAX_PROMPT_LOGPROBS = 20
"""The most alternatives ``prompt_logprobs`` may ask for per prompt position
(vLLM's default ``max_logprobs``)."""


class RequestOutputKind(Enum):
    """What ``LLMEngine.step`` returns for a request still running (vLLM's names).

    ``CUMULATIVE``: everything generated so far, every step. ``DELTA``: only
    what the step added (new tokens and text), for streaming. ``FINAL_ONLY``:
    nothing until the request finishes (what ``LLM.generate`` uses, so that
    no step pays for outputs nobody reads).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request generation settings.

    ``temperature=0`` is greedy (and then ``best_of`` must be 1: greedy copies
    would all be equal). ``top_k`` of 0 or -1 turns top-k off. With
    ``use_beam_search=True``, ``best_of`` (default ``n``) is the beam width and
    the best ``n`` beams are returned.

    ``output_kind``: see ``RequestOutputKind``.

    Penalties (``penalties.py``): ``presence_penalty`` and ``frequency_penalty``
    in [-2, 2] (OpenAI's, over the output so far), ``repetition_penalty`` > 0
    (vLLM's, over prompt and output; 1 is off), ``logit_bias`` a
    ``{token_id: bias}`` map with biases in [-100, 100] (OpenAI's range).

    ``structured_outputs``: a ``StructuredOutputsParams`` (JSON schema, regex,
    choice, grammar), see ``structured_output.py``.

    ``allowed_token_ids``: when given, only these token ids may be sampled
    (a non-empty list of ids; the engine checks they lie in the vocabulary).
    Sampling only, like the penalties: beam search does not read it.

    ``prompt_logprobs=k`` (0 to ``MAX_PROMPT_LOGPROBS``): the output's
    ``prompt_logprobs`` holds, for every prompt token after the first, its
    logprob and the ``k`` most likely tokens at that position, from the raw
    model logits (no penalty, bias or temperature), as vLLM returns them. A
    request that asks for them computes its whole prompt (no prefix-cache
    hits: cached positions have no logits); see ``prompt_logprobs.py``.

    Text: ``stop`` strings end a sequence once ``min_tokens`` tokens exist; the
    stop string is cut from the text unless ``include_stop_str_in_output``.
    ``skip_special_tokens`` drops special tokens (EOS, BOS...) from the text.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _stop: list[str] = field(init=False, repr=False, default_factory=list)
    _stop_hold_back: int = field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if self.top_k == 0:
            self.top_k = -1  # vLLM reads 0 as "off" too
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self._check_penalties()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            if self.use_beam_search:
                raise ValueError("structured_outputs is not supported with use_beam_search=True")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(1 << 63) <= self.seed < 1 << 64):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        self._check_prompt_logprobs()
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got "
                             f"{self.early_stopping!r}")
        if self.use_beam_search and self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 with use_beam_search, got {self.temperature}")
        if self.greedy and not self.use_beam_search and self.best_of > 1:
            raise ValueError(f"n and best_of must be 1 with greedy sampling (temperature=0), "
                             f"got n={self.n}, best_of={self.best_of}: every copy would be "
                             f"the same")
        if not self.use_beam_search and self.length_penalty != 1.0:
            raise ValueError("length_penalty applies only with use_beam_search=True")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of them, "
                             f"got {self.stop!r}")
        self._stop = stop
        self._stop_hold_back = max(map(len, stop), default=1) - 1
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids

    def _check_prompt_logprobs(self) -> None:
        k = self.prompt_logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                              or not 0 <= k <= MAX_PROMPT_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an int in [0, "
                             f"{MAX_PROMPT_LOGPROBS}], got {k!r}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        bias = self.logit_bias or {}
        if not isinstance(bias, dict) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in bias):
            raise ValueError(f"logit_bias must map token ids >= 0 to biases, got {bias!r}")
        if any(not -100.0 <= float(v) <= 100.0 for v in bias.values()):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")
        self.logit_bias = {t: float(v) for t, v in bias.items()} or None
        if self.use_beam_search and (self.logit_bias or self.repetition_penalty != 1.0 or
                                     self.frequency_penalty or self.presence_penalty):
            raise ValueError("presence_penalty, frequency_penalty, repetition_penalty and "
                             "logit_bias apply to sampling, not to use_beam_search=True")
        self._check_allowed_token_ids()

    def _check_allowed_token_ids(self) -> None:
        """``allowed_token_ids``: None, or a non-empty list of token ids >= 0 (the
        vocabulary's upper bound is the engine's to check: it knows the model)."""
        if self.allowed_token_ids is None:
            return
        ids = self.allowed_token_ids
        if (not isinstance(ids, (list, tuple)) or not ids or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids >= 0, "
                             f"got {ids!r}")
        if self.use_beam_search:
            raise ValueError("allowed_token_ids applies to sampling, not to use_beam_search=True")
        self.allowed_token_ids = sorted(set(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def stop_hold_back(self) -> int:
        """Characters a text must keep back while a stop string could still
        complete at its end: one less than the longest stop string (0 without
        any). Found once here, not per sequence and step."""
        return self._stop_hold_back


# -- structured output ---------------------------------------------------------
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint, vLLM's names: ``json`` (a JSON schema, as a dict or its
    text), ``regex``, ``choice`` (a list of strings, one of which is the
    whole answer), ``grammar`` (EBNF, GBNF style: ``root ::= ...``), or
    ``json_object=True`` (any JSON object). Exactly one must be given."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {KINDS}, got "
                             f"{given or 'none'}")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string, "
                                 f"got {value!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its "
                             f"text), got {type(self.json).__name__}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """``(kind, text)``: what a compiled grammar is cached by."""
        kind = self.kind
        if kind == "json":
            # Canonical spacing, but the schema's own key order: xgrammar writes the
            # properties in the order the schema lists them, as vLLM does.
            schema = self.json if isinstance(self.json, dict) else json.loads(self.json)
            return kind, json.dumps(schema)
        if kind == "choice":
            return "grammar", choice_grammar(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
