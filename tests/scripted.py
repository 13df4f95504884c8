"""A model whose next token is written in advance, for tests that need exact outputs."""

import torch
from torch import nn


class ScriptedModel(nn.Module):
    """Same interface as ``minipaged.models``; the token after position ``p`` is
    ``script[p + 1]`` (the last script token once past the end), so greedy
    decoding of ``script[:k]`` returns ``script[k:]``.

    Swap it in with ``llm.engine.runner.model = ScriptedModel(...)``.
    """

    def __init__(self, script: list[int], vocab_size: int, margin: float = 20.0):
        super().__init__()
        self.script = torch.tensor(script)
        self.vocab_size = vocab_size
        self.margin = margin

    def forward(self, input_ids, positions, kv_caches, meta):
        return positions.float()[:, None]                       # [T, 1]: each token's position

    def compute_logits(self, hidden):
        pos = hidden[:, 0].long() + 1
        nxt = self.script[pos.clamp(max=len(self.script) - 1)]
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        logits[torch.arange(hidden.shape[0]), nxt] = self.margin
        return logits
