"""From what a user gives to what the engine queues: ``InputProcessor``, and
chat rendering (``render_chat``, shared by ``LLM.chat`` and the server).

``InputProcessor`` owns the model's tokenizer (``load_tokenizer``), the end
tokens (worked out once: ``eos_token_id`` and ``extra_eos_token_ids``, which
the output processor stops on and structured outputs end with), the checks a
request passes before anything is queued (``validate_prompt``,
``validate_params``, ``validate_priority``: a ``ValueError`` naming the field),
the compiled grammars (``compile_grammar``, cached per text), a new
request's beam state and grammar matcher, and the text of token ids
(``decode``, ``token_text``, with the same decoder as the incremental
detokenizer). ``LLMEngine`` builds one (``engine.input_processor``) and
``add_request`` goes through ``process``; ``LLM``, ``AsyncLLMEngine`` and the
server ask it too, so a refused request is refused before it reaches the
engine's queues, with the engine's own words.

Chat: a tokenizer that has a chat template renders the messages with it
(``apply_chat_template(..., add_generation_prompt=True)``), as vLLM does.
A tokenizer without one (a base model, the tests' character tokenizer) gets
this plain default, one line per message, then the assistant's turn::

    <|system|>You are terse.
    <|user|>Hi
    <|assistant|>

i.e. ``"<|{role}|>{content}\\n"`` per message, then ``"<|assistant|>"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .models.gguf import gguf_tokenizer, is_gguf
from .models.loader import load_generation_config
from .postprocess.detokenizer import Decode, decoder_for
from .sampling.beam_search import BeamState
from .sampling.structured_output import GrammarCompilerCache
from .sampling_params import SamplingParams
from .tool_calling import template_for_tools, validate_tools

if TYPE_CHECKING:
    from .config import ModelConfig, SchedulerConfig

# -- chat ------------------------------------------------------------------------------------

def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as the chat template reads them, or a ``ValueError`` naming
    the bad one.

    Each becomes ``{"role", "content"}`` (content parts joined into their
    text; a missing or null content, as an assistant turn that only calls
    tools has, becomes ""), plus what tool calling adds: an assistant's
    ``tool_calls`` (each call's ``arguments``, a JSON string over the API,
    parsed into an object, as templates write them with ``tojson``) and a
    tool result's ``tool_call_id`` and ``name``. Any role is passed on, as
    vLLM passes it: the template decides what a role means."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    return [_clean_message(i, m) for i, m in enumerate(messages)]


def _clean_message(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
        raise ValueError(f"messages[{i}] must be a dict with a non-empty string 'role'")
    content = m.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):  # OpenAI's content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content
                          if isinstance(p, dict) and p.get("type") == "text")
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or text parts")
    clean: dict[str, Any] = {"role": m["role"], "content": content}
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key} must be a string")
            clean[key] = m[key]
    if m.get("tool_calls"):
        clean["tool_calls"] = [_clean_tool_call(f"messages[{i}].tool_calls[{j}]", call)
                               for j, call in enumerate(m["tool_calls"])]
    return clean


def _clean_tool_call(where: str, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where} must be {{'id', 'type': 'function', 'function': "
                         f"{{'name', 'arguments'}}}}")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"{where}.function.arguments must be a JSON object's text, got "
                             f"{arguments!r}") from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


def default_template(messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                     continue_final_message: bool = False) -> str:
    """The plain template of this module's docstring (the assistant's turn
    opened unless ``add_generation_prompt`` is false; with
    ``continue_final_message``, ending right after the last message's text)."""
    lines = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
    if continue_final_message:
        return lines[:-1]
    return lines + "<|assistant|>" if add_generation_prompt else lines


def render_chat(tokenizer: Any, messages: Any, tools: Any = None,
                chat_template: str | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """The prompt text for ``messages``, ending where the assistant's reply starts.

    ``add_generation_prompt`` false leaves the assistant's turn unopened;
    ``continue_final_message`` (with it false) ends the prompt inside the last
    message, which the model then continues (the template's own arguments of
    those names, as vLLM passes them).
    ``chat_template`` (a template's text) replaces the tokenizer's own.
    ``tools`` (OpenAI's tool definitions, checked by
    ``tool_calling.validate_tools``) are handed to the template; one that
    never reads them is replaced by the shipped tool-aware ChatML template
    (``tool_calling.template_for_tools``)."""
    messages = validate_messages(messages)
    tools = validate_tools(tools)
    template = chat_template or (getattr(tokenizer, "chat_template", None)
                                 if tokenizer is not None else None)
    if tools:
        if tokenizer is None:
            raise ValueError("tools: a chat with tools needs the model's tokenizer")
        template = template_for_tools(template, explicit=chat_template is not None)
    if tokenizer is not None and template:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                             tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
    return default_template(messages, add_generation_prompt, continue_final_message)


# -- the tokenizer and the end tokens --------------------------------------------------------

def load_tokenizer(model_dir: Path):
    """The directory's (or GGUF file's) tokenizer, or None when it has none
    (prompts as token ids then)."""
    if is_gguf(model_dir):
        return gguf_tokenizer(model_dir)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((model_dir / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def end_tokens(tokenizer: Any, config_eos: tuple[int, ...]) -> tuple[int | None, tuple[int, ...]]:
    """``(EOS, the other end tokens)``. EOS is the tokenizer's, else the first
    end token the configs list (``config.json``'s, then
    ``generation_config.json``'s), else None; every other listed end token
    (Llama 3 lists end of text and end of turn) stops a sequence too, as a stop
    token reporting its id."""
    listed = tuple(dict.fromkeys(int(t) for t in config_eos))
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    eos = tokenizer_eos if tokenizer_eos is not None else (listed or (None,))[0]
    return eos, tuple(t for t in listed if t != eos)


# -- a request, checked ------------------------------------------------------------------------

@dataclass(frozen=True)
class ProcessedRequest:
    """A request the input processor accepted: what ``LLMEngine.add_request`` queues.

    ``prompt_token_ids`` are the prompt's ids (tokenized from ``prompt`` when it
    was given as text); ``grammar`` is ``sampling_params.structured_outputs``
    compiled (None without a constraint)."""

    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    grammar: Any = None


class InputProcessor:
    """The checks and conversions between a request as given and the engine's queue.

    Args:
        tokenizer: the model's Hugging Face tokenizer, or None (prompts as
            token ids only; no text, no structured outputs).
        model_config: the model's vocabulary size, ``max_model_len`` and the
            end tokens its ``config.json`` lists.
        scheduler_config: the budgets every request must fit (a step's tokens,
            its sequences) and the scheduling policy (priorities).
        generation_eos: the end tokens ``generation_config.json`` lists.
        generation_defaults: its sampling settings, as ``SamplingParams`` fields.

    ``from_model_dir`` loads the tokenizer and ``generation_config.json`` of a
    checkpoint. Nothing here changes after construction but the grammar
    cache, so any thread may read it.
    """

    def __init__(self, tokenizer: Any, model_config: ModelConfig,
                 scheduler_config: SchedulerConfig, generation_eos: tuple[int, ...] = (),
                 generation_defaults: dict[str, Any] | None = None):
        self._tokenizer = tokenizer
        self._vocab_size = model_config.vocab_size
        self._max_model_len = model_config.max_model_len
        self._scheduler_config = scheduler_config
        self._generation_defaults = dict(generation_defaults or {})
        self._eos, self._extra_eos = end_tokens(
            tokenizer, tuple(model_config.eos_token_id) + tuple(generation_eos))
        self._decoders: dict[bool, Decode] = {}
        if tokenizer is not None:
            self._decoders = {skip: decoder_for(tokenizer, skip) for skip in (True, False)}
        self._grammars: GrammarCompilerCache | None = None  # built at the first constraint

    @classmethod
    def from_model_dir(cls, model_dir: Path, model_config: ModelConfig,
                       scheduler_config: SchedulerConfig) -> InputProcessor:
        """The input processor of a checkpoint directory (or GGUF file): its
        tokenizer and its ``generation_config.json`` (end tokens, defaults)."""
        generation_eos, defaults = load_generation_config(model_dir)
        return cls(load_tokenizer(Path(model_dir)), model_config, scheduler_config,
                   generation_eos, defaults)

    # -- what the model and the engine's options say ---------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer, or None. The engine and its output
        processor read it; callers outside the engine should prefer
        ``tokenize``, ``decode`` and ``render_chat``."""
        return self._tokenizer

    @property
    def has_tokenizer(self) -> bool:
        """Whether text can be tokenized and decoded (else prompts are token ids)."""
        return self._tokenizer is not None

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits: every token id is below it."""
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) the engine runs."""
        return self._max_model_len

    @property
    def max_num_seqs(self) -> int:
        """The most sequences one step runs: no request may have more (``n``, ``best_of``)."""
        return self._scheduler_config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        """The tokens one step may compute (the scheduler's budget)."""
        return self._scheduler_config.token_budget

    @property
    def scheduling_policy(self) -> str:
        """``"fcfs"`` or ``"priority"``: whether requests may carry a priority."""
        return self._scheduler_config.scheduling_policy

    @property
    def eos_token_id(self) -> int | None:
        """End of sequence: the tokenizer's, else the first end token the
        configs list; it stops a sequence with ``stop_reason=None``."""
        return self._eos

    @property
    def extra_eos_token_ids(self) -> tuple[int, ...]:
        """The other end tokens the configs list: they stop a sequence as stop
        tokens (``stop_reason``: the id)."""
        return self._extra_eos

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """Every end token, EOS first: what ends a complete structured answer."""
        return ((self._eos,) if self._eos is not None else ()) + self._extra_eos

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the defaults of the checkpoint's
        ``generation_config.json`` (temperature, top-p/k, min-p, max tokens)."""
        return SamplingParams(**self._generation_defaults)

    # -- text ------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids as a prompt's are made (with the tokenizer's
        special tokens, e.g. BOS); a ``ValueError`` naming ``prompt`` without a tokenizer."""
        if self._tokenizer is None:
            raise ValueError("prompt: this model directory has no tokenizer; pass "
                             "{'prompt_token_ids': [...]} instead of text")
        return list(self._tokenizer(text).input_ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``, decoded as the engine's outputs are (the
        incremental detokenizer's ``decoder_for``: no clean-up of spaces); a
        ``ValueError`` without a tokenizer."""
        if self._tokenizer is None:
            raise ValueError("decoding needs a tokenizer; this model directory has none")
        return self._decoders[skip_special_tokens](list(token_ids))

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (how logprobs name a
        token); its id as a string when the model has no tokenizer."""
        if self._tokenizer is None:
            return str(token_id)
        return self._decoders[False]([token_id])

    def render_chat(self, messages: Any, tools: Any = None, chat_template: str | None = None,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The prompt of a conversation: the chat template (``chat_template``, else
        the tokenizer's) with the assistant's turn opened, or this module's
        plain default; with ``tools``, a template that shows them
        (``render_chat``, with its ``add_generation_prompt`` and
        ``continue_final_message``). A ``ValueError`` naming the bad message or tool."""
        return render_chat(self._tokenizer, messages, tools, chat_template,
                           add_generation_prompt, continue_final_message)

    # -- checks ----------------------------------------------------------------------------
    def validate_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        """The prompt's token ids (tokenizing a text prompt), or a ``ValueError``.

        No prompt longer than ``max_model_len`` is accepted, and the engine
        checked at construction that its pool holds one such sequence, so every
        accepted prompt can run.
        """
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt: give a text prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self._vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            # "out of vocabulary": vLLM's words for it, which clients look for
            raise ValueError(f"prompt_token_ids must lie in [0, {vocab}) (the vocabulary): "
                             f"token id {bad[0]} is out of vocabulary (of {len(bad)} such: "
                             f"{bad[:5]})")
        if len(ids) > self._max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, longer than max_model_len "
                             f"({self._max_model_len})")
        return ids

    def validate_params(self, p: SamplingParams) -> None:
        """Refuse what the engine could never schedule: every sequence of a
        request must fit one step's budgets (its beams or samples advance
        together). A structured-output constraint is compiled (and cached)."""
        self._check_params(p)

    def _check_params(self, p: SamplingParams) -> Any:
        """``validate_params``, returning the compiled grammar (None without a constraint)."""
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(p).__name__}")
        name = "beam width (best_of)" if p.use_beam_search else "best_of"
        budget = self.max_num_batched_tokens
        if p.best_of > budget:
            raise ValueError(f"{name} must be <= max_num_batched_tokens ({budget}), got "
                             f"{p.best_of}")
        grammar = self.compile_grammar(p) if p.structured_outputs is not None else None
        vocab = self._vocab_size
        for field, ids in (("logit_bias", p.logit_bias), ("stop_token_ids", p.stop_token_ids),
                           ("allowed_token_ids", p.allowed_token_ids)):
            if ids and max(ids) >= vocab:
                raise ValueError(f"{field} token ids must be < {vocab} (the vocabulary size), "
                                 f"got {max(ids)}")
        if p.best_of > self.max_num_seqs:
            raise ValueError(f"{name} must be <= max_num_seqs ({self.max_num_seqs}), got "
                             f"{p.best_of}")
        return grammar

    def validate_priority(self, priority: Any) -> None:
        """A ``ValueError`` naming ``priority`` unless it is an int, and 0 under FCFS."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        policy = self.scheduling_policy
        if priority != 0 and policy != "priority":
            raise ValueError(f"priority is {priority} but scheduling_policy is {policy!r}: "
                             "priorities need scheduling_policy='priority'")

    def compile_grammar(self, p: SamplingParams) -> Any:
        """``p.structured_outputs`` compiled by xgrammar (once per text, cached); a
        ``ValueError`` naming the field if it does not compile or there is no
        tokenizer to compile it against. A complete answer ends with an end token."""
        if self._grammars is None:
            if self._tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this model directory "
                                 "has none")
            self._grammars = GrammarCompilerCache(self._tokenizer, self._vocab_size,
                                                  list(self.end_token_ids))
        return self._grammars.compile(p.structured_outputs)

    # -- a request -------------------------------------------------------------------------
    def process(self, prompt: str | None, prompt_token_ids: list[int] | None,
                sampling_params: SamplingParams, priority: int = 0) -> ProcessedRequest:
        """Check a request and tokenize its prompt: a ``ProcessedRequest``, or the
        ``ValueError`` of the first check it fails (priority, then the sampling
        parameters, then the prompt). Changes nothing but the grammar cache."""
        self.validate_priority(priority)
        grammar = self._check_params(sampling_params)
        ids = self.validate_prompt(prompt, prompt_token_ids)
        return ProcessedRequest(prompt, ids, sampling_params, priority, grammar)

    def beam_state(self, request: ProcessedRequest) -> BeamState | None:
        """A beam-search request's search state (None for any other): its width
        and, at most, the tokens its context leaves room for."""
        p = request.sampling_params
        if not p.use_beam_search:
            return None
        room = self._max_model_len - len(request.prompt_token_ids)
        return BeamState(width=p.best_of, length_penalty=p.length_penalty,
                         early_stopping=p.early_stopping,
                         max_new_tokens=max(1, min(p.max_tokens, room)))

    def grammar_matcher(self, request: ProcessedRequest) -> Any:
        """A new ``GrammarMatcher`` for the request's first sequence (None without
        a constraint); its forks copy it."""
        if request.grammar is None:
            return None
        return GrammarCompilerCache.matcher(request.grammar)
