"""From scheduled sequences to input tensors to logits.

For each scheduled sequence the runner feeds its not-yet-computed tokens
(the whole prompt at prefill, a chunk of it, or the one newest token at
decode) and builds the attention metadata that says where their K/V go
(``slot_mapping``) and which cached blocks they read (``block_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .cache_engine import CacheEngine
from .models.layers import AttentionMetadata
from .sequence import Sequence


@dataclass
class ScheduledSequence:
    """``num_new_tokens`` tokens of ``seq``, starting at ``seq.num_computed_tokens``.

    ``is_prefill``: the tokens are (part of) a prompt, or a recomputation, rather
    than the one newest token of a decode.
    """

    seq: Sequence
    num_new_tokens: int
    is_prefill: bool = False


@dataclass
class ModelInput:
    input_ids: torch.Tensor      # [T]
    positions: torch.Tensor      # [T]
    meta: AttentionMetadata
    last_token_index: torch.Tensor  # [S]: row of each sequence's last new token


class ModelRunner:
    def __init__(self, model: nn.Module, cache: CacheEngine, device: torch.device,
                 attention_backend: str):
        self.model = model
        self.cache = cache
        self.device = device
        self.backend = attention_backend
        self.block_size = cache.block_size

    def prepare(self, batch: list[ScheduledSequence]) -> ModelInput:
        """Flatten the batch's new tokens and describe where they live in the cache."""
        if not batch:
            raise ValueError("cannot run an empty batch")
        bs = self.block_size
        ids, positions, slots, q_lens, seq_lens, tables = [], [], [], [], [], []
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            if n < 1 or end > seq.get_len():
                raise ValueError(f"sequence {seq.seq_id}: cannot compute tokens {start}..{end - 1} "
                                 f"of {seq.get_len()}")
            if seq.block_table.num_tokens < end:
                raise ValueError(f"sequence {seq.seq_id}: block table covers "
                                 f"{seq.block_table.num_tokens} tokens, {end} needed")
            pos = np.arange(start, end)
            blocks = np.asarray(seq.block_table.blocks, dtype=np.int64)
            ids.append(np.asarray(seq.token_ids_between(start, end), dtype=np.int64))
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            q_lens.append(n)
            seq_lens.append(end)
            tables.append(blocks)
        max_blocks = max(len(t) for t in tables)
        table = np.zeros((len(batch), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        q_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        dev = self.device

        def to_dev(a, dtype):
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype)

        meta = AttentionMetadata(
            slot_mapping=to_dev(np.concatenate(slots), torch.int64),
            block_tables=to_dev(table, torch.int32),
            seq_lens=to_dev(np.asarray(seq_lens), torch.int32),
            query_start_loc=to_dev(q_start, torch.int32),
            max_query_len=max(q_lens), max_seq_len=max(seq_lens), backend=self.backend)
        return ModelInput(
            input_ids=to_dev(np.concatenate(ids), torch.long),
            positions=to_dev(np.concatenate(positions), torch.long),
            meta=meta,
            last_token_index=to_dev(q_start[1:] - 1, torch.long))

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        """Run the model; returns fp32 logits ``[S, vocab]`` of each sequence's last new token."""
        inp = self.prepare(batch)
        hidden = self.model(inp.input_ids, inp.positions, self.cache.device_cache, inp.meta)
        return self.model.compute_logits(hidden[inp.last_token_index])
