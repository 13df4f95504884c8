"""Random paged-attention inputs: shuffled block tables, poisoned unused slots.

On CUDA the same cases run at real sizes (lengths multiplied by ``SCALE``);
on CPU the Triton interpreter runs them small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCALE = 8 if DEVICE.type == "cuda" else 1
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@dataclass
class Case:
    q: torch.Tensor            # [T, Hq, D]
    k_cache: torch.Tensor      # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32, unused entries -1
    seq_lens: torch.Tensor     # [S] int32
    query_start_loc: torch.Tensor  # [S+1] int32

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc)


def make_case(q_lens: list[int], seq_lens: list[int], num_q_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int, dtype: torch.dtype, seed: int,
              device: torch.device = DEVICE) -> Case:
    """Sequence ``s`` has ``seq_lens[s]`` tokens, the last ``q_lens[s]`` of them new.

    Physical blocks are a random permutation of a pool with spare blocks, and
    every slot no sequence owns holds NaN, so reading one poisons the output.
    """
    assert all(0 < q <= n for q, n in zip(q_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(q_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    used = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = perm[used:used + nb]
        used += nb
        block_tables[s, :nb] = ids.int()
        flat_k = torch.randn(nb * block_size, num_kv_heads, head_dim, generator=gen)
        flat_v = torch.randn(nb * block_size, num_kv_heads, head_dim, generator=gen)
        flat_k[n:] = float("nan")
        flat_v[n:] = float("nan")
        k_cache[ids] = flat_k.view(nb, block_size, num_kv_heads, head_dim)
        v_cache[ids] = flat_v.view(nb, block_size, num_kv_heads, head_dim)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return Case(q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
                block_tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                starts.to(device))


def sdpa_reference(case: Case) -> torch.Tensor:
    """``scaled_dot_product_attention`` over each sequence's K/V gathered into
    contiguous memory, causal by absolute position, in fp32."""
    from minipaged.kernels import gather_kv

    q_all = case.q.float()
    group = case.q.shape[1] // case.k_cache.shape[2]
    out = torch.empty_like(q_all)
    starts = case.query_start_loc.tolist()
    for s, n in enumerate(case.seq_lens.tolist()):
        q = q_all[starts[s]:starts[s + 1]].transpose(0, 1)                  # [Hq, q_len, D]
        k = gather_kv(case.k_cache, case.block_tables[s], n).float().transpose(0, 1)
        v = gather_kv(case.v_cache, case.block_tables[s], n).float().transpose(0, 1)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        q_len = q.shape[1]
        q_pos = torch.arange(n - q_len, n, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]    # True = attend
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out[starts[s]:starts[s + 1]] = o.transpose(0, 1)
    return out


def scaled(lengths: list[int]) -> list[int]:
    return [n * SCALE for n in lengths]


class LaunchSpy:
    """Stands in for a Triton kernel object (``kernel[grid](...)``): records
    each launch as ``(name, grid, args, kwargs)`` in ``launches`` (a list that
    several spies may share), then launches the real kernel."""

    def __init__(self, kernel, name: str = "", launches: list | None = None):
        self.kernel, self.name = kernel, name
        self.launches = [] if launches is None else launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch
