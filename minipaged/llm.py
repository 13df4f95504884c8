"""LLM: the offline batch API (vLLM's ``LLM`` / ``generate``)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence as Seq
from typing import Any

from .engine import LLMEngine
from .engine_args import EngineArgs
from .input_processor import InputProcessor
from .outputs import RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams
from .tool_calling import load_chat_template

PromptType = str | dict[str, Any]


class LLM:
    """Load a Hugging Face checkpoint and generate from batches of prompts.

    ``model`` is a checkpoint directory, a GGUF file (or a directory holding
    one ``.gguf`` and no ``config.json``; dequantized at load,
    ``minipaged.models.gguf``) or a Hugging Face Hub id such as
    ``"Qwen/Qwen2.5-0.5B"``, fetched into (or, with ``HF_HUB_OFFLINE=1``, only
    read from) the Hub cache (``minipaged.models.hub``). Architectures:
    LLaMA, Mistral, Qwen2 and OPT (GGUF: LLaMA, Mistral and Qwen2).

    The keyword arguments are the engine's options: the fields of
    ``EngineArgs`` (``minipaged.engine_args``), with vLLM's names and
    meanings where vLLM has the option.
    Each field's help text documents the option and its default
    (``EngineArgs.help("block_size")``, or ``python -m minipaged serve
    --help``). An unknown keyword raises ``TypeError``, a bad value a
    ``ValueError`` naming the option.
    """

    def __init__(self, model: str | os.PathLike, **engine_args: Any):
        self.engine = LLMEngine(model, **engine_args)
        self._counter = 0

    # help() and inspect.signature list the options, with their defaults.
    __init__.__signature__ = EngineArgs.signature_of(__init__)

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (idempotent)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def input_processor(self) -> InputProcessor:
        """The engine's input processor: the tokenizer, the chat template, the checks."""
        return self.engine.input_processor

    def get_tokenizer(self):
        return self.input_processor.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without ``sampling_params``: the checkpoint's
        ``generation_config.json`` settings where it has them, else the defaults."""
        return self.input_processor.default_sampling_params()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one ``RequestOutput`` per prompt, in order.

        ``prompts``: a string, a ``{"prompt": "..."}`` or
        ``{"prompt_token_ids": [...]}`` dict, or a list of these.
        ``sampling_params``: one for all prompts or a list, one each; None
        takes the checkpoint's ``generation_config.json`` defaults.
        ``priority``: one int per prompt, for ``scheduling_policy="priority"``
        (lower first); None gives every prompt 0.
        Every prompt is validated before any is queued, so a bad one changes nothing.
        With ``SamplingParams(prompt_logprobs=k)`` each output's ``prompt_logprobs``
        holds the whole prompt's (``RequestOutput``; such a request computes its
        whole prompt, without prefix-cache hits).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority: got {len(priorities)} for {len(prompts)} prompts")
        parsed = [self._parse(p) for p in prompts]
        # Check (and tokenize) all first: a bad prompt leaves nothing half-queued.
        inputs = self.input_processor
        for rank in priorities:
            inputs.validate_priority(rank)
        for p in {id(p): p for p in params}.values():   # once per SamplingParams object
            inputs.validate_params(p)
        token_ids = [inputs.validate_prompt(text, ids) for text, ids in parsed]

        # Final-only outputs: no step builds an output that nobody reads. The
        # caller's SamplingParams are left as they were.
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                 for p in params}
        params = [final[id(p)] for p in params]
        ids_in_order = []
        for (text, _), ids, p, rank in zip(parsed, token_ids, params, priorities):
            request_id = str(self._counter)
            self._counter += 1
            self.engine.add_request(request_id, text, p, prompt_token_ids=ids, priority=rank)
            ids_in_order.append(request_id)
        return self._run(ids_in_order, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}`` dicts) or
        to a list of them; one ``RequestOutput`` per conversation, in order.

        The prompt is the chat template (``chat_template``, a file or the
        template's text, else the tokenizer's) with the assistant's turn opened
        (``InputProcessor.render_chat``, the server's code), or the module's
        plain default when there is none. ``tools`` (OpenAI's tool definitions)
        are shown to the model through the template, as vLLM's ``LLM.chat``
        does; the text that comes back is not parsed: read calls out of it
        with a parser of ``minipaged.tool_calling`` (``HermesToolParser().parse``).
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        template = None if chat_template is None else load_chat_template(chat_template)
        prompts = [self.input_processor.render_chat(c, tools, template) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _parse(prompt: PromptType) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], None
        raise ValueError(f"prompts: each must be a str or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="requests", unit="req", disable=not use_tqdm)
        start, tokens = time.perf_counter(), 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
        except BaseException:
            for rid in request_ids:  # leave the engine usable
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]
