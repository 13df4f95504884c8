"""The runner's inputs: built batch-wide, with each block table mirrored
incrementally; checked against a from-scratch construction."""

import random

import numpy as np
import torch

from minipaged.core.block_table import BlockTable
from minipaged.core.sequence import Sequence
from minipaged.executor.model_runner import ModelRunner, ScheduledSequence, _TableMirror


def test_a_mirror_follows_every_change_the_block_manager_makes():
    """Growth, copy-on-write, a new list, and speculative decoding's rollback
    (blocks dropped from the end, then, before the runner looks again, others
    appended in their place: only the table's shrunk_to mark tells)."""
    rng = random.Random(0)
    table = BlockTable(4)
    mirror = _TableMirror(table.blocks)
    for _ in range(3000):
        op = rng.random()
        blocks = table.blocks
        if op < 0.4:
            blocks.extend(rng.randrange(1000) for _ in range(rng.randint(1, 3)))  # growth
        elif op < 0.6 and blocks:
            blocks[-1] = rng.randrange(1000)                                    # copy-on-write
        elif op < 0.85 and blocks:
            table.drop_blocks_after(rng.randrange(len(blocks)))                  # rollback
            if rng.random() < 0.7:                                              # regrown at once
                blocks.extend(rng.randrange(1000) for _ in range(rng.randint(1, 3)))
        else:
            table.blocks = [rng.randrange(1000) for _ in range(rng.randint(0, 40))]  # swap...
        shrunk_to, table.shrunk_to = table.shrunk_to, None
        if mirror.source is not table.blocks:
            mirror = _TableMirror(table.blocks)
        assert mirror.sync(table.blocks, shrunk_to).tolist() == table.blocks


class _Cache:
    block_size = 4
    device_cache = []


def test_prepare_matches_a_per_token_construction():
    runner = ModelRunner(torch.nn.Identity(), _Cache(), torch.device("cpu"), "torch")
    rng = random.Random(1)
    seqs = []
    for i in range(6):
        seq = Sequence(i, [rng.randrange(100) for _ in range(rng.randint(1, 30))], 4)
        for _ in range(rng.randint(0, 5)):
            seq.append_token(rng.randrange(100))
        seq.num_computed_tokens = rng.randint(0, seq.get_len() - 1)
        seq.block_table.blocks = rng.sample(range(200), -(-seq.get_len() // 4))
        seq.block_table.num_tokens = seq.get_len()
        seqs.append(seq)
    batch = [ScheduledSequence(s, rng.randint(1, s.get_len() - s.num_computed_tokens))
             for s in seqs]
    for step in range(3):
        inp = runner.prepare(batch)
        ids, pos, slots = [], [], []
        for item in batch:
            s, start = item.seq, item.seq.num_computed_tokens
            for p in range(start, start + item.num_new_tokens):
                ids.append(s.token_ids[p])
                pos.append(p)
                slots.append(s.block_table.slot(p))
        assert inp.input_ids.tolist() == ids
        assert inp.positions.tolist() == pos
        assert inp.meta.slot_mapping.tolist() == slots
        ends = [it.seq.num_computed_tokens + it.num_new_tokens for it in batch]
        assert inp.meta.seq_lens.tolist() == ends
        assert inp.last_token_index.tolist() == list(np.cumsum([it.num_new_tokens
                                                                for it in batch]) - 1)
        for row, item in zip(inp.meta.block_tables.tolist(), batch):
            n = len(item.seq.block_table.blocks)
            assert row[:n] == item.seq.block_table.blocks
        # Next step: each sequence decodes one token; some blocks change as the manager would.
        for item in batch:
            s = item.seq
            s.num_computed_tokens += item.num_new_tokens
            if s.num_computed_tokens < s.get_len():
                item.num_new_tokens = s.get_len() - s.num_computed_tokens
                continue
            s.append_token(rng.randrange(100))
            if s.get_len() > s.block_table.capacity:
                s.block_table.blocks.append(rng.randrange(200, 300))
            elif rng.random() < 0.3:
                s.block_table.blocks[-1] = rng.randrange(300, 400)   # copy-on-write
            s.block_table.num_tokens = s.get_len()
            item.num_new_tokens = 1
