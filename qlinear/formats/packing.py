"""Bit packing shared by every format and backend.

Codes of ``bits`` bits (1..16) are packed into int32 words along the last dimension as one
little-endian bit stream: bit ``t`` of code ``j`` is bit ``(bits·j + t) % 32`` of word
``(bits·j + t) // 32``.  For widths dividing 32 (1, 2, 4, 8, 16) no code straddles two words; 3-bit
codes straddle words as in GPTQ's 3-bit checkpoints (ten codes and a split one per word).  The
stream is padded with zero bits to whole words, so ``unpack(pack(c, b), b, c.shape[-1])`` returns ``c``
exactly.

``pack_planes`` stores codes as bit-planes instead: plane ``i`` holds bit ``i`` of every code, 32
consecutive codes per int32 word.  This is the BCQ storage of LUT-GEMM (Park et al., "LUT-GEMM",
§3.1), where plane ``i`` is the sign vector b_i.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

__all__ = ["pack", "unpack", "unpack_u8", "pack_planes", "unpack_planes", "packed_len"]


def _check_bits(bits: int) -> int:
    if not 1 <= bits <= 16:
        raise ValueError(f"pack/unpack need bits in 1..16, got {bits}")
    return bits


def packed_len(n: int, bits: int) -> int:
    """Number of int32 words that hold ``n`` codes of ``bits`` bits."""
    _check_bits(bits)
    return -(-n * bits // 32)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    # Values are in [0, 2**32); int32 storage reinterprets the top bit as the sign.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., n]`` (values in ``[0, 2**bits)``) into int32 ``[..., ceil(n*bits/32)]``.

    Raises:
        ValueError: unsupported ``bits`` or a code outside ``[0, 2**bits)``.
        TypeError: ``codes`` is not an integer tensor.
    """
    _check_bits(bits)
    if codes.is_floating_point() or codes.is_complex():
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for bits={bits}")
    n = codes.shape[-1]
    if bits <= 8 and 8 % bits == 0 and sys.byteorder == "little":  # 8/bits codes per byte of the stream
        per, w = 8 // bits, packed_len(n, bits)
        c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 4 * w * per - n)).reshape(*codes.shape[:-1], 4 * w, per)
        stream = c[..., 0].clone()
        for j in range(1, per):  # ORs of strided views: a sum over the last dimension of size `per` is 3-6x slower
            stream |= c[..., j] << (j * bits)
        return _words(stream)
    if _byte_groups(bits):  # eight codes fill ``bits`` whole bytes of the stream
        m, w = -(-n // 8), packed_len(n, bits)
        c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 8 * m - n)).reshape(*codes.shape[:-1], m, 8)
        group = torch.zeros(*c.shape[:-1], bits, dtype=torch.uint8, device=c.device)
        for j, (lo, s) in enumerate(_code_bytes(bits)):  # code j: bits s.. of byte lo, its top bits in byte lo + 1
            group[..., lo] |= c[..., j] << s
            if s + bits > 8:
                group[..., lo + 1] |= c[..., j] >> (8 - s)
        stream = torch.nn.functional.pad(group.reshape(*c.shape[:-2], m * bits), (0, max(0, 4 * w - m * bits)))
        return _words(stream[..., :4 * w])
    c = codes.to(torch.int64)
    if 32 % bits == 0:  # whole codes per word: one shift-and-sum
        per = 32 // bits
        c = torch.nn.functional.pad(c, (0, packed_len(n, bits) * per - n)).reshape(*c.shape[:-1], packed_len(n, bits),
                                                                                    per)
        return _to_int32((c << (torch.arange(per, device=c.device) * bits)).sum(-1))
    stream = (c.unsqueeze(-1) >> torch.arange(bits, device=c.device)) & 1          # [..., n, bits]
    stream = stream.reshape(*c.shape[:-1], n * bits)
    stream = torch.nn.functional.pad(stream, (0, packed_len(n, bits) * 32 - n * bits))
    return _to_int32((stream.reshape(*c.shape[:-1], packed_len(n, bits), 32)
                      << torch.arange(32, device=c.device)).sum(-1))


def _words(stream: torch.Tensor) -> torch.Tensor:
    """uint8 stream bytes ``[..., 4w]`` -> int32 words ``[..., w]`` (little-endian: byte k of word w is bits 8k..)."""
    if not stream.numel():
        return torch.zeros(*stream.shape[:-1], stream.shape[-1] // 4, dtype=torch.int32, device=stream.device)
    if not stream.is_contiguous() or any(st % 4 for st in stream.stride()[:-1]):  # (a size-1 dim keeps any stride)
        stream = stream.clone(memory_format=torch.contiguous_format)
    return stream.view(torch.int32)


def _byte_groups(bits: int) -> bool:
    """Whether codes of ``bits`` bits that do not divide 8 (3, 5, 6, 7) are (un)packed eight at a time through the
    ``bits`` bytes they fill, in memory order (little-endian hosts): a few tensor operations per code instead of one
    per bit."""
    return bits in (3, 5, 6, 7) and sys.byteorder == "little"


def _code_bytes(bits: int) -> list[tuple[int, int]]:
    """``(byte, shift)`` of each of the eight codes of a byte group: code j starts at bit ``shift`` of byte ``byte``
    (of the ``bits`` bytes the group fills) and continues into the next byte when ``shift + bits > 8``."""
    return [divmod(bits * j, 8) for j in range(8)]


@functools.lru_cache(maxsize=None)
def _byte_table(bits: int, device: torch.device) -> torch.Tensor:
    """uint8 ``[256, 8 // bits]``: the codes a byte holds, lowest bits first."""
    t = (torch.arange(256, dtype=torch.int32, device="cpu")[:, None]
         >> (torch.arange(8 // bits, dtype=torch.int32, device="cpu") * bits))  # not the ambient (maybe meta) device
    return (t & ((1 << bits) - 1)).to(torch.uint8).to(device)


def unpack_u8(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """:func:`unpack` into uint8 codes ``[..., n]`` for ``bits`` 1..8: the dequantization paths' form, one byte per
    code instead of eight.  Widths dividing 8 read each byte of the stream through a 256-entry table.

    Raises:
        ValueError: ``bits`` outside 1..8.  TypeError: ``words`` is not int32.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"unpack_u8 needs bits in 1..8, got {bits}")
    if words.dtype != torch.int32:
        raise TypeError(f"packed words must be int32, got {words.dtype}")
    if _byte_groups(bits):
        m, have = -(-n // 8), 4 * words.shape[-1]
        stream = words.contiguous().view(torch.uint8)
        stream = torch.nn.functional.pad(stream, (0, max(0, m * bits - have)))[..., :m * bits]
        group = stream.reshape(*words.shape[:-1], m, bits)
        codes = torch.empty(*words.shape[:-1], m, 8, dtype=torch.uint8, device=words.device)
        for j, (lo, s) in enumerate(_code_bytes(bits)):
            code = group[..., lo] >> s
            if s + bits > 8:
                code |= group[..., lo + 1] << (8 - s)
            codes[..., j] = code & ((1 << bits) - 1)
        return codes.reshape(*words.shape[:-1], 8 * m)[..., :n]
    if 8 % bits or sys.byteorder != "little":  # memory byte order is the stream's order only on little-endian hosts
        return unpack(words, bits, n).to(torch.uint8)
    stream = words.contiguous().view(torch.uint8)  # [..., 4w]: byte k holds stream bits 8k..8k+7
    if bits == 8:
        return stream[..., :n].clone()
    codes = _byte_table(bits, words.device).index_select(0, stream.reshape(-1).to(torch.int32))
    return codes.reshape(*words.shape[:-1], words.shape[-1] * 32 // bits)[..., :n]


def unpack(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: int32 ``[..., w]`` -> int64 codes ``[..., n]`` in ``[0, 2**bits)``.

    Raises:
        ValueError: ``bits`` outside 1..16.  TypeError: ``words`` is not int32.
    """
    _check_bits(bits)
    if words.dtype != torch.int32:
        raise TypeError(f"packed words must be int32, got {words.dtype}")
    if (8 % bits == 0 and sys.byteorder == "little") or _byte_groups(bits):
        return unpack_u8(words, bits, n).to(torch.int64)
    if 32 % bits == 0:
        shifts = torch.arange(32 // bits, device=words.device, dtype=torch.int32) * bits
        # int32 arithmetic shifts sign-extend; the mask keeps only the code's own bits
        codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*words.shape[:-1], words.shape[-1] * 32 // bits)[..., :n].to(torch.int64)
    stream = (words.unsqueeze(-1) >> torch.arange(32, device=words.device, dtype=torch.int32)) & 1
    stream = stream.reshape(*words.shape[:-1], words.shape[-1] * 32)[..., :n * bits].reshape(*words.shape[:-1], n, bits)
    return (stream.to(torch.int64) << torch.arange(bits, device=words.device)).sum(-1)


def pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Bit-plane packing: codes ``[N, K]`` (values in ``[0, 2**bits)``) -> int32 ``[bits, N, ceil(K/32)]``.

    Word ``w`` of plane ``i`` and row ``r`` holds bit ``i`` of codes ``r, 32w .. 32w+31``
    (input ``32w + j`` at bit ``j``).
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bit-planes support 1..8 bits, got {bits}")
    c = codes.to(torch.uint8)  # the low 8 bits, all a plane reads
    if _numpy_bytes(c):  # numpy's packbits (any nonzero byte is a 1 bit): about 5x the torch ops below
        n, c = c.shape[-1], c.numpy()
        planes = np.stack([np.packbits(c & (1 << i), axis=-1, bitorder="little") for i in range(bits)])
        pad = [(0, 0)] * (planes.ndim - 1) + [(0, 4 * packed_len(n, 1) - planes.shape[-1])]
        return _words(torch.from_numpy(np.pad(planes, pad)))
    return torch.stack([pack((c >> i) & 1, 1) for i in range(bits)])


def unpack_planes(planes: torch.Tensor, n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_planes`: int32 ``[bits, N, w]`` -> codes ``[N, n]`` of ``dtype`` (int64, or uint8 for
    the dequantization paths).  Raises TypeError for planes that are not int32."""
    if planes.dtype != torch.int32:
        raise TypeError(f"bit-planes must be int32, got {planes.dtype}")
    if _numpy_bytes(planes):
        bits = torch.from_numpy(np.unpackbits(planes.contiguous().view(torch.uint8).numpy(), axis=-1, count=n,
                                              bitorder="little"))
    else:
        bits = unpack_u8(planes, 1, n)
    codes = bits[0].clone()
    for i in range(1, planes.shape[0]):
        codes |= bits[i] << i
    return codes.to(dtype)


def _numpy_bytes(t: torch.Tensor) -> bool:
    """Whether numpy's bit (un)packing applies to ``t``: a CPU tensor on a little-endian host (the words' bytes in
    memory order are the bit stream's)."""
    return t.device.type == "cpu" and sys.byteorder == "little"
