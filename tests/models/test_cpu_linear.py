"""Linear layers packed for oneDNN (``models/cpu_linear.py``) against ``F.linear``:
any row count, with and without a bias, merged projections, tied weights,
and the engine with and without packing."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minipaged import LLM, SamplingParams
from minipaged.models import cpu_linear
from minipaged.models.cpu_linear import PackedLinear, PackedMergedLinear, can_pack, pack_linears
from minipaged.models.layers import MergedLinear
from tiny_models import VOCAB, save

CPU = torch.device("cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if can_pack(CPU, torch.bfloat16) else [])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}

pytestmark = pytest.mark.skipif(not can_pack(CPU, torch.float32),
                                reason="this torch has no oneDNN CPU backend")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_packed_equals_plain_for_any_row_count(dtype, bias):
    gen = torch.Generator().manual_seed(int(bias))
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen))
    packed = PackedLinear(linear)
    for rows in (1, 2, 3, 7, 32, 300):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        want = F.linear(x.float(), linear.weight.float(),
                        None if linear.bias is None else linear.bias.float())
        got = packed(x)
        assert got.dtype == dtype and got.shape == (rows, 200)
        scale = want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= TOLERANCE[dtype] * scale
    x3 = torch.randn(2, 5, 96, generator=gen).to(dtype)          # leading dims kept
    assert packed(x3).shape == (2, 5, 200)


def test_one_or_two_float32_rows_take_the_plain_product():
    # Bound by reading the weight, one user's float32 product is faster
    # through F.linear on the row-major weight: the same bits as F.linear.
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(400, 700)
    packed = PackedLinear(linear)
    for shape in [(1, 400), (2, 400), (1, 1, 400), (1, 2, 400)]:
        x = torch.randn(*shape, generator=gen)
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias)), shape
    assert packed(torch.randn(0, 400).to(packed.weight.dtype)).shape == (0, 700)


def test_pack_linears_replaces_plain_and_merged_layers_only(monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_PACKED_IN_FEATURES", 0)   # every size packed here
    monkeypatch.setattr(cpu_linear, "MIN_PACKED_WEIGHT", 0)
    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.qkv = MergedLinear(16, [16, 8, 8], bias=True)
    model.head = nn.Linear(16, 50, bias=False)
    model.head.weight = model.embed.weight                        # tied
    model.norm = nn.LayerNorm(16)
    assert pack_linears(model) == 2
    assert isinstance(model.qkv, PackedLinear) and isinstance(model.head, PackedLinear)
    assert isinstance(model.norm, nn.LayerNorm)
    assert isinstance(model.qkv, PackedMergedLinear) and model.qkv.out_sizes == [16, 8, 8]
    assert model.qkv.shard_rows(1) == slice(16, 24)
    assert model.head.weight is model.embed.weight                # still one parameter
    assert pack_linears(model) == 0                               # nothing left to pack


def test_only_layers_big_enough_are_packed():
    small, wide = nn.Linear(256, 4096), nn.Linear(576, 576)
    assert not cpu_linear.worth_packing(small)    # few inputs: slower packed
    assert cpu_linear.worth_packing(wide)         # SmolLM2's o_proj
    assert not cpu_linear.worth_packing(nn.Linear(384, 384))   # too small a weight
    assert not cpu_linear.worth_packing(nn.LayerNorm(1024))


def test_engine_packs_on_cpu_unless_told_not_to(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_PACKED_IN_FEATURES", 0)   # the tiny model's layers
    monkeypatch.setattr(cpu_linear, "MIN_PACKED_WEIGHT", 0)
    save("llama-gqa-d32-tied", tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (n,), generator=gen).tolist()}
               for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for prepack in (True, False):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", prepack_weights=prepack,
                  num_gpu_blocks_override=64)
        kinds = {type(m) for m in llm.engine.model.modules()}
        plain = bool(kinds & {nn.Linear, MergedLinear})
        assert (PackedLinear in kinds, plain) == (prepack, not prepack)
        tokens[prepack] = [o.outputs[0].token_ids
                           for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[True] == tokens[False]
