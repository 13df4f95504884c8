"""warm_up_kernels launches each kernel variant the engine can pick, once.

On a CPU the kernels run under the interpreter (nothing is compiled there),
so this checks what is launched, with which constexprs, not compile times."""

import importlib

import pytest
import torch

from kernel_cases import DEVICE, LaunchSpy
from minipaged.kernels import paged_decode
from minipaged.kernels.paged_decode import possible_num_splits
from minipaged.kernels.warmup import warm_up_kernels

pytestmark = pytest.mark.cuda  # gpu_check runs these on the GPU

KERNELS = {  # module, kernel attribute
    "store_kv": ("minipaged.kernels.store_kv_triton", "_store_kv_kernel"),
    "copy_blocks": ("minipaged.kernels.copy_blocks_triton", "_copy_blocks_kernel"),
    "prefill": ("minipaged.kernels.attention_triton", "_prefill_kernel"),
    "decode": ("minipaged.kernels.paged_decode", "_decode_split_kernel"),
    "merge": ("minipaged.kernels.paged_decode", "_decode_merge_kernel"),
}


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch from here on: ``(name, grid, args, kwargs)``."""
    log = []
    for name, (module, attr) in KERNELS.items():
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, attr, LaunchSpy(getattr(mod, attr), name, log))
    return log


def constexprs(launches, kernel, key):
    """The distinct values of constexpr ``key`` over the launches of ``kernel``."""
    return sorted({kwargs[key] for name, _, _, kwargs in launches if name == kernel})


def test_warm_up_launches_every_variant_it_reports(launches):
    splits = [1, 2, 4]
    done = warm_up_kernels(head_dim=16, num_q_heads=4, num_kv_heads=2, block_size=8,
                           dtype=torch.float32, device=DEVICE, max_num_seqs=4,
                           split_counts=splits)
    # 2 and 4 splits run one compiled kernel (the count is its grid's third
    # dimension): launched once, at 2.
    assert done == ["store_kv", "copy_blocks", "prefill", "decode(splits=1)", "decode(splits=2)"]
    assert {name for name, *_ in launches} == {"store_kv", "copy_blocks", "prefill", "decode",
                                               "merge"}
    assert constexprs(launches, "decode", "WRITE_PARTS") == [False, True]
    assert sorted({grid[2] for name, grid, _, _ in launches if name == "decode"}) == [1, 2]
    # Launched with the engine's shape, so with the constexprs serving will use.
    assert constexprs(launches, "prefill", "HEAD_DIM") == [16]
    assert constexprs(launches, "prefill", "BLOCK_SIZE") == [8]
    assert constexprs(launches, "decode", "GROUP") == [2]


def test_default_split_counts_are_what_decode_can_choose(launches):
    done = warm_up_kernels(head_dim=16, num_q_heads=2, num_kv_heads=1, block_size=16,
                           dtype=torch.float32, device=DEVICE, max_num_seqs=3,
                           max_seq_len=1024)
    possible = possible_num_splits(1, 3, DEVICE, max_seq_len=1024)
    assert possible[0] == 1 and possible == [1 << i for i in range(len(possible))]
    assert len(possible) > 2                              # 1, 2, 4, ... : 1 and 2 compile them all
    assert done[3:] == ["decode(splits=1)", "decode(splits=2)"]
    assert constexprs(launches, "decode", "WRITE_PARTS") == [False, True]
    for num_seqs in (1, 2, 3):
        for max_len in (1, 300, 600, 1024):
            assert paged_decode.choose_num_splits(num_seqs, 1, max_len, DEVICE) in possible
