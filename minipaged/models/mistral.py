"""Mistral on the paged KV cache: the LLaMA network under another name.

Mistral 7B v0.1 attends within a 4096-token sliding window; later versions
set ``sliding_window`` to null. The kernels attend over the whole context, so
``ModelConfig.from_hf`` refuses a ``max_model_len`` longer than the window
(see ``config.sliding_window``): within it, full and windowed attention agree.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` for Mistral checkpoints (same modules, same names)."""
