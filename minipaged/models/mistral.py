"""Mistral on the paged KV cache: the LLaMA network under another name.

Mistral 7B v0.1 attends within a 4096-token sliding window on every layer;
later versions set ``sliding_window`` to null. The window reaches the
kernels per layer (``config.layer_windows``), and since every layer has it,
the blocks behind a sequence's window go back to the pool as it grows.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` for Mistral checkpoints (same modules, same names)."""
