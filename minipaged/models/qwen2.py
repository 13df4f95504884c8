"""Qwen2 and Qwen2.5 on the paged KV cache: the LLaMA network with biases on
the q, k and v projections (none on o_proj, none in the MLP).

Hugging Face names the modules as in LLaMA, so ``LlamaForCausalLM``'s loading
rules apply unchanged. Qwen2's optional sliding-window attention applies to
the layers ``layer_types`` lists as sliding (``config.layer_windows``).
"""

from __future__ import annotations

from typing import Any

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with q/k/v biases; the same shapes and methods."""

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        # Qwen2 configs carry no attention_bias key: the biases are the architecture's.
        return True, False
