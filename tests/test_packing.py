import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qlinear.formats.packing import pack, pack_planes, packed_len, unpack, unpack_planes, unpack_u8


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 16), rows=st.integers(1, 5), n=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_pack_roundtrip_bit_exact(bits, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, n), generator=g)
    words = pack(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (rows, packed_len(n, bits))
    assert torch.equal(unpack(words, bits, n), codes)


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 8), rows=st.integers(1, 4), words=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_planes_roundtrip_bit_exact(bits, rows, words, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, 32 * words), generator=g)
    planes = pack_planes(codes, bits)
    assert planes.shape == (bits, rows, words) and planes.dtype == torch.int32
    assert torch.equal(unpack_planes(planes, 32 * words), codes)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), rows=st.integers(1, 4), n=st.integers(1, 100), seed=st.integers(0, 2**16),
       transposed=st.booleans())
def test_unpack_u8_is_unpack_in_bytes(bits, rows, n, seed, transposed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, n), generator=g)
    words = pack(codes, bits)
    if transposed:  # a non-contiguous view of the same words
        words = words.T.contiguous().T
    out = unpack_u8(words, bits, n)
    assert out.dtype == torch.uint8 and out.shape == (rows, n) and torch.equal(out.long(), codes)
    planes = pack_planes(codes, bits)
    assert torch.equal(unpack_planes(planes, n, torch.uint8).long(), codes)


@pytest.mark.parametrize("byteorder", ["little", "big"])
@pytest.mark.parametrize("bits", range(1, 17))
def test_unpack_on_either_byte_order_and_empty_tensors(monkeypatch, bits, byteorder):
    """The byte paths (byte table, eight codes per ``bits`` bytes, bit-plane bytes) are taken on little-endian hosts
    only; elsewhere (simulated) the shift paths give the same words and codes.  Tensors with no rows or no codes
    unpack to the right empty shapes."""
    codes = torch.randint(0, 1 << bits, (3, 45))
    with monkeypatch.context() as m:  # the bit-by-bit stream, independent of the byte order
        m.setattr(sys, "byteorder", "big")
        stream_words, stream_planes = pack(codes, bits), pack_planes(codes, bits) if bits <= 8 else None
    monkeypatch.setattr(sys, "byteorder", byteorder)
    words = pack(codes, bits)
    assert torch.equal(words, stream_words)
    assert torch.equal(unpack(words, bits, 45), codes)
    if bits <= 8:
        assert torch.equal(unpack_u8(words, bits, 45).long(), codes)
        assert torch.equal(pack_planes(codes, bits), stream_planes)
        assert torch.equal(unpack_planes(pack_planes(codes, bits), 45), codes)
        assert pack_planes(codes[:, :0], bits).shape == (bits, 3, 0)
    assert unpack(torch.zeros(0, 3, dtype=torch.int32), bits, 3 * 32 // bits).shape == (0, 3 * 32 // bits)
    assert unpack(torch.zeros(4, 0, dtype=torch.int32), bits, 0).shape == (4, 0)


def test_unpack_u8_rejects_bad_input():
    with pytest.raises(ValueError, match="1..8"):
        unpack_u8(torch.zeros(1, 1, dtype=torch.int32), 9, 1)
    with pytest.raises(TypeError, match="int32"):
        unpack_u8(torch.zeros(1, 1, dtype=torch.int64), 2, 1)
    with pytest.raises(TypeError, match="int32"):
        unpack_planes(torch.zeros(2, 1, 1, dtype=torch.int64), 32)


def test_pack_layout_little_endian():
    # code j of a row at bit offset bits*(j % per) of word j // per
    codes = torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3]])
    w = pack(codes, 2)
    assert w.shape == (1, 1)
    assert int(w) & 0xFFFFFFFF == (1 | 2 << 2 | 3 << 4 | 3 << 30)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError):
        pack(torch.tensor([4]), 2)
    with pytest.raises(ValueError):
        pack(torch.tensor([0]), 17)
    with pytest.raises(ValueError):
        pack(torch.tensor([8]), 3)
    with pytest.raises(TypeError):
        pack(torch.tensor([0.5]), 2)


@pytest.mark.parametrize("bits", range(1, 17))
def test_pack_is_one_little_endian_bit_stream(bits):
    """Every width packs as one stream (GPTQ's 3-bit checkpoints straddle words this way)."""
    codes = torch.randint(0, 1 << bits, (2, 45))
    words = pack(codes, bits)
    assert words.shape == (2, -(-45 * bits // 32))
    bit = lambda row, t: (int(words[row, t // 32]) >> (t % 32)) & 1
    for row in range(2):
        for j in (0, 10, 21, 44):
            assert sum(bit(row, bits * j + t) << t for t in range(bits)) == int(codes[row, j])
    assert torch.equal(unpack(words, bits, 45), codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_planes_through_numpy_and_through_torch_ops_are_the_same_words(monkeypatch, bits):
    """CPU tensors take numpy's packbits/unpackbits; other devices the torch ops, run here on CPU by turning the
    numpy path off."""
    import qlinear.formats.packing as packing

    codes = torch.randint(0, 1 << bits, (3, 2, 77))
    planes = pack_planes(codes, bits)
    monkeypatch.setattr(packing, "_numpy_bytes", lambda t: False)
    assert torch.equal(pack_planes(codes, bits), planes)
    assert torch.equal(unpack_planes(planes, 77), codes)
    assert torch.equal(unpack_planes(planes, 77, torch.uint8).long(), codes)
