"""GGUF blocks unpacked into the canonical quantized forms (``quantization.gguf_blocks``).

The reference is the ``gguf`` package's own dequantization: for every kept
type, ``unpack(raw, type, (N, K)).dequantize()`` must be the float32 array
``gguf.quants.dequantize(raw, type)`` gives, bit for bit. Q4_0, Q4_1 and Q8_0
blocks come from ``gguf.quants.quantize`` on random weights whose magnitude
varies from block to block; the installed ``gguf`` cannot quantize to Q4_K,
so its blocks are built byte by byte (random fp16 ``d``/``dmin`` of both
signs, random 6-bit scales and minimums packed the way llama.cpp packs them,
random 4-bit values).

The one allowed difference is Q4_0's sign of zero: the file's reader
computes ``d * (q - 8)``, which is ``-0.0`` for ``q == 8`` and a negative
``d``, while ``scale * q + offset`` is ``d * 8 + (-8 d) = +0.0``. Every other
value agrees in all 32 bits.
"""

import numpy as np
import pytest
import torch

from minipaged.quantization.formats import Int4Weight, Int8Weight
from minipaged.quantization.gguf_blocks import KEPT_TYPES, q4_k_scales_mins, unpack

# Not on every machine (the GPU machine lacks it): skip, do not fail collecting.
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

SHAPES_32 = [(1, 32), (3, 96), (7, 160), (45, 224)]     # K: multiples of 32
SHAPES_256 = [(1, 256), (3, 512), (13, 768)]            # K: multiples of 256


def random_weights(rng, n, k):
    """float32 ``[N, K]``: normal values scaled per block of 32 by 1e-4 .. 1e2,
    so the fp16 scales span many exponents."""
    w = rng.standard_normal((n, k // 32, 32))
    return (w * 10.0 ** rng.uniform(-4, 2, (n, k // 32, 1))).astype(np.float32).reshape(n, k)


def pack_q4_k_scales(scales, mins):
    """6-bit scales and minimums uint8 ``[B, 8]`` each -> Q4_K's 12 bytes ``[B, 12]``."""
    out = np.empty((scales.shape[0], 12), np.uint8)
    out[:, 0:4] = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    out[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    out[:, 8:12] = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return out


def random_fp16(rng, size):
    """fp16 ``[size, 1]`` of both signs, magnitudes 1e-5 .. 1 (subnormals included)."""
    values = rng.choice([-1.0, 1.0], size) * 10.0 ** rng.uniform(-5, 0, size)
    return values.astype(np.float16).reshape(size, 1)


def random_q4_k(rng, n, k):
    """Random valid Q4_K bytes ``[N, K / 256 * 144]`` and their scales and minimums."""
    b = n * k // 256
    scales = rng.integers(0, 64, (b, 8), dtype=np.uint8)
    mins = rng.integers(0, 64, (b, 8), dtype=np.uint8)
    blocks = np.concatenate([random_fp16(rng, b).view(np.uint8), random_fp16(rng, b).view(np.uint8),
                             pack_q4_k_scales(scales, mins),
                             rng.integers(0, 256, (b, 128), dtype=np.uint8)], axis=1)
    return blocks.reshape(n, -1), scales, mins


def raw_tensor(rng, type_name, n, k):
    """A tensor's bytes as ``GGUFReader`` hands them: uint8 ``[N, bytes_per_row]``, read-only."""
    if type_name == "Q4_K":
        raw = random_q4_k(rng, n, k)[0]
    else:
        raw = gguf.quants.quantize(random_weights(rng, n, k), Q[type_name])
    raw.setflags(write=False)
    return raw


def reference(raw, type_name, n, k):
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, Q[type_name]))).reshape(n, k)


def assert_same_bits(ours, theirs, type_name):
    """All 32 bits equal; for Q4_0 a differing pair may only be -0.0 against +0.0."""
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape
    assert torch.equal(ours, theirs)
    differ = ours.view(torch.int32) != theirs.view(torch.int32)
    if type_name == "Q4_0":
        assert (ours[differ] == 0).all() and (theirs[differ] == 0).all()
    else:
        assert not differ.any()


def test_kept_types_and_block_sizes_are_the_files():
    assert KEPT_TYPES == {"Q4_0", "Q4_1", "Q8_0", "Q4_K"}
    for type_name in KEPT_TYPES:
        weights, nbytes = gguf.GGML_QUANT_SIZES[Q[type_name]]
        w = unpack(np.zeros(3 * nbytes, np.uint8), type_name, (3, weights))
        assert w.shape == (3, weights)


@pytest.mark.parametrize("type_name,n,k",
                         [(t, n, k) for t in ("Q4_0", "Q4_1", "Q8_0") for n, k in SHAPES_32]
                         + [("Q4_K", n, k) for n, k in SHAPES_256])
def test_dequantized_is_gguf_dequantize_bit_for_bit(type_name, n, k):
    rng = np.random.default_rng([n, k, sum(map(ord, type_name))])
    raw = raw_tensor(rng, type_name, n, k)
    w = unpack(raw, type_name, (n, k))
    kind = Int8Weight if type_name == "Q8_0" else Int4Weight
    assert isinstance(w, kind) and w.group_size == 32 and w.shape == (n, k)
    assert w.q.dtype == (torch.int8 if kind is Int8Weight else torch.uint8)
    assert w.scale.dtype == torch.float32 and w.scale.shape == (n, k // 32)
    if kind is Int4Weight:
        assert w.offset.dtype == torch.float32 and w.offset.shape == (n, k // 32)
        assert int(w.q.max()) <= 15
    assert_same_bits(w.dequantize(), reference(raw, type_name, n, k), type_name)


def test_q4_0_negative_scales_differ_only_in_the_sign_of_zero():
    # Q4_0's quantizer makes d negative whenever a block's largest |w| is positive,
    # and puts q == 8 on values near zero: the one place the zero's sign differs.
    rng = np.random.default_rng(1)
    w = random_weights(rng, 4, 64)
    w[:, :16] = 0.0
    w[:, 31] = 1e3          # the largest |w|, positive: d < 0 in every first block
    raw = gguf.quants.quantize(w, Q.Q4_0)
    ours, theirs = unpack(raw, "Q4_0", (4, 64)).dequantize(), reference(raw, "Q4_0", 4, 64)
    assert torch.signbit(theirs[:, :16]).any()
    assert_same_bits(ours, theirs, "Q4_0")


def test_q4_k_scales_and_minimums_unpack_as_packed():
    rng = np.random.default_rng(2)
    raw, scales, mins = random_q4_k(rng, 5, 512)
    blocks = raw.reshape(-1, 144)
    ours = q4_k_scales_mins(torch.from_numpy(blocks[:, 4:16].copy()))
    theirs = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    for got, packed, gguf_value in zip(ours, (scales, mins), theirs):
        assert torch.equal(got, torch.from_numpy(packed))
        assert torch.equal(got, torch.from_numpy(np.array(gguf_value)))


def test_raw_bytes_flat_or_in_rows_give_the_same_weight():
    rng = np.random.default_rng(3)
    raw = raw_tensor(rng, "Q4_1", 6, 64)
    rows, flat = unpack(raw, "Q4_1", (6, 64)), unpack(raw.reshape(-1), Q.Q4_1, (6, 64))
    assert torch.equal(rows.q, flat.q) and torch.equal(rows.scale, flat.scale)
    assert torch.equal(rows.offset, flat.offset)


def test_tensors_read_back_from_a_gguf_file(tmp_path):
    # GGUFReader's tensor.data: memory-mapped, read-only, [rows, bytes per row];
    # tensor.shape lists columns first.
    rng = np.random.default_rng(4)
    raws = {t: raw_tensor(rng, t, 6, 256) for t in sorted(KEPT_TYPES)}
    writer = gguf.GGUFWriter(str(tmp_path / "w.gguf"), "llama")
    for t, raw in raws.items():
        writer.add_tensor(t, raw, raw_dtype=Q[t])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for tensor in gguf.GGUFReader(str(tmp_path / "w.gguf")).tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        assert shape == (6, 256)
        w = unpack(tensor.data, tensor.tensor_type.name, shape)
        assert_same_bits(w.dequantize(), reference(raws[tensor.name], tensor.name, 6, 256),
                         tensor.name)


@pytest.mark.parametrize("type_name", ["Q5_K", "IQ4_NL", "F16"])
def test_a_type_not_kept_is_refused_by_name(type_name):
    with pytest.raises(ValueError, match=type_name):
        unpack(np.zeros(144, np.uint8), type_name, (1, 256))


def test_bytes_that_do_not_fit_the_shape_are_refused():
    with pytest.raises(ValueError, match="Q8_0"):
        unpack(np.zeros(34, np.uint8), "Q8_0", (2, 32))
    with pytest.raises(ValueError, match="Q4_K"):
        unpack(np.zeros(144, np.uint8), "Q4_K", (8, 32))
