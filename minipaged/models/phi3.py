"""Phi-3 and Phi-4-mini on the paged KV cache: the LLaMA network with

- q, k and v stored as one ``qkv_proj`` tensor and gate and up as one
  ``gate_up_proj`` (``fused_parts`` gives the loader each part's rows, so the
  merged layers load them as they load LLaMA's separate tensors);
- a sliding window on every layer where the config sets one (Phi-3-mini-4k:
  2047 tokens);
- partial rotary (Phi-4-mini rotates 3/4 of each head) and LongRoPE scaling
  (the 128K-context models), both in ``layers.RotaryEmbedding``.
"""

from __future__ import annotations

from typing import Any

from ..config import attention_heads
from .llama import LlamaForCausalLM

_FUSED = ("qkv_proj", "gate_up_proj")


class Phi3ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose checkpoint fuses q/k/v and gate/up."""

    def fused_parts(self, name: str) -> list[tuple[int, slice]] | None:
        """``(part, rows)`` of a fused checkpoint tensor (its name is already our
        merged module's), None for any other."""
        module = name.split(".")[-2] if name.count(".") else ""
        if module not in _FUSED:
            return None
        sizes = self._part_sizes(self.config, module)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [(i, slice(start, start + n)) for i, (start, n) in enumerate(zip(starts, sizes))]

    @staticmethod
    def _part_sizes(config: Any, module: str) -> list[int]:
        if module == "gate_up_proj":
            return [config.intermediate_size] * 2
        heads, kv_heads, d = attention_heads(config)
        return [heads * d, kv_heads * d, kv_heads * d]
