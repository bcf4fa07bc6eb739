"""Incoherence processing: a randomized Hadamard rotation of a layer's input side, shared by every format.

A rotated layer stores ``W' = W·Rᵀ`` quantized, with ``R = blockdiag(H_b, ..., H_b)·D`` orthogonal: ``D`` a diagonal of
random signs, ``H_b`` the orthonormal Hadamard matrix of order ``b`` (the block size).  Since ``R`` is orthogonal,
``y = W·x = W'·(R·x)``: the layer applies ``R`` to its input at run time.  Outliers of a row of ``W`` spread over the
whole block and group scales tighten (QuIP, Chee et al. 2023, §4 "incoherence processing"; QuIP#, Tseng et al. 2024,
§3 "randomized Hadamard transform"; QuaRot, Ashkboos et al. 2024, §3).  Calibration Hessians are rotated the same way,
``H' = R·XᵀX·Rᵀ``, so error feedback and the mixed format's sensitivities work on the rotated problem.

Hadamard orders.  ``b = p·2^a``: a Paley matrix of order ``p`` Kronecker a Sylvester matrix of order ``2^a``, applied
as a mixed-radix fast Walsh-Hadamard transform (:func:`rotate`, ``O(b·(p + 64·log_64 2^a))``): Paley I gives ``p = q + 1`` for a
prime ``q ≡ 3 (mod 4)``, Paley II ``p = 2(q + 1)`` for a prime ``q ≡ 1 (mod 4)`` (Paley 1933).  With ``p ≤ 256`` this
covers SmolLM2's ``K = 576 = 36·16`` and ``1536 = 12·128`` and Llama's ``4096``; where no such order divides ``K``
(Llama's ``11008 = 43·256``) the block is the largest order that does (256 there), so the rotation mixes inputs within
blocks of that size only.  :func:`block_size` is this rule; a layer stores its block size and seed (the ``rotation``
buffer, 64 bits) and refuses to load under a config that would rotate differently.

Signs.  ``D[k] = ±1`` from a 32-bit integer hash of ``(seed, k)`` (Wellons' "lowbias32"), the same on every device
and easy to compute inside a kernel instead of reading it from memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

import torch

ROTATIONS = ("none", "hadamard")
MAX_PALEY = 256  # largest dense (Paley) factor p of a block: the dense part costs p multiply-adds per input
MIN_BLOCK = 8  # a block smaller than this barely mixes anything: such layers are refused, not silently weakened
_MASK = 0xFFFFFFFF


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


@functools.lru_cache(maxsize=None)
def _conference(p: int) -> Optional[tuple[torch.Tensor, int]]:
    """``(C, kind)``: Paley's conference matrix ``C`` ``[q + 1, q + 1]`` int64 (zero diagonal, ±1 elsewhere) behind
    the Hadamard matrix of order ``p`` (:func:`_paley`), and its construction: 1 (``q = p − 1`` prime ``≡ 3 mod 4``,
    ``C`` skew) or 2 (``q = p/2 − 1`` prime ``≡ 1 mod 4``, ``C`` symmetric); None if neither applies.  Paley I is
    preferred when both do (e.g. ``p = 12``)."""
    for q, kind in ((p - 1, 1), (p // 2 - 1, 2)):
        if kind == 2 and p % 2:
            continue
        if not _is_prime(q) or q % 4 != (3 if kind == 1 else 1):
            continue
        squares = {(i * i) % q for i in range(1, q)}
        # device="cpu" here and in every cached builder: not the ambient default device, which transformers sets to
        # meta while it builds a model (a cached meta tensor would reach every later layer of this order)
        chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.int64, device="cpu")
        idx = torch.arange(q, device="cpu")
        c = torch.zeros(q + 1, q + 1, dtype=torch.int64, device="cpu")
        c[0, 1:] = 1
        c[1:, 0] = -1 if kind == 1 else 1
        c[1:, 1:] = chi[(idx[None, :] - idx[:, None]) % q]  # Jacobsthal matrix Q[i, j] = χ(j − i)
        return c, kind
    return None


@functools.lru_cache(maxsize=None)
def _paley(p: int) -> Optional[torch.Tensor]:
    """The ±1 Hadamard matrix ``[p, p]`` int64 of Paley's construction of order ``p`` from :func:`_conference`'s
    ``C``: ``I + C`` (Paley I) or ``C ⊗ [[1, 1], [1, −1]] + I ⊗ [[1, −1], [−1, −1]]`` (Paley II); None if it has
    none."""
    cc = _conference(p)
    if cc is None:
        return None
    c, kind = cc
    eye = torch.eye(c.shape[0], dtype=torch.int64, device="cpu")
    if kind == 1:
        return eye + c
    return (torch.kron(c, torch.tensor([[1, 1], [1, -1]], device="cpu"))
            + torch.kron(eye, torch.tensor([[1, -1], [-1, -1]], device="cpu")))


def _split(block: int) -> Optional[tuple[int, int]]:
    """``(p, 2^a)`` with ``block = p·2^a``: ``p = 1`` for a power of two, else the smallest Paley order ``p ≤
    MAX_PALEY`` (odd part times the fewest twos); None if neither exists."""
    odd = block
    while odd % 2 == 0:
        odd //= 2
    if odd == 1:
        return 1, block
    p = odd * 4
    while p <= min(block, MAX_PALEY):
        if block % p == 0 and _paley(p) is not None:
            return p, block // p
        p *= 2
    return None


@functools.lru_cache(maxsize=None)
def block_size(in_features: int, requested: int = 0) -> int:
    """The Hadamard block size of a layer with ``in_features`` inputs: ``requested`` if given (it must divide
    ``in_features`` and be ``2^a`` or ``p·2^a`` with a Paley order ``p ≤ 256``), else (``0``) the largest such order
    dividing ``in_features``.

    Raises:
        ValueError: ``requested`` does not divide ``in_features``, has no construction here or is below 8, or no
            block of at least 8 divides ``in_features`` (e.g. an odd one): rotate that layer with another block or
            leave it unrotated (``rotation="none"`` for it in ``per_module``).
    """
    if requested:
        if in_features % requested or _split(requested) is None:
            raise ValueError(f"rotation_block={requested} does not fit in_features={in_features}: it must divide it and "
                             f"be a power of two or p·2^a with a Paley order p <= {MAX_PALEY} (e.g. 12, 20, 36)")
        if requested < MIN_BLOCK:
            raise ValueError(f"rotation_block={requested} is below the smallest block, {MIN_BLOCK}: request a larger "
                             f"one dividing in_features={in_features}, or 0 for the largest")
        block = requested
    else:
        block = max(b for b in range(1, in_features + 1) if in_features % b == 0 and _split(b) is not None)
    if block < MIN_BLOCK:
        raise ValueError(f"no Hadamard block of at least {MIN_BLOCK} divides in_features={in_features}; leave this "
                         f"layer unrotated (rotation='none' for it in per_module)")
    return block


def validate(cfg) -> None:
    """ValueError for a config's rotation fields out of range (called by every format config)."""
    if cfg.rotation not in ROTATIONS:
        raise ValueError(f"rotation must be one of {ROTATIONS}, got {cfg.rotation!r}")
    if not 0 <= cfg.rotation_seed < 2 ** 31:
        raise ValueError(f"rotation_seed must be in [0, 2^31), got {cfg.rotation_seed}")
    if cfg.rotation_block < 0:
        raise ValueError(f"rotation_block must be >= 0 (0: the largest that fits each layer), got {cfg.rotation_block}")
    if cfg.rotation == "none" and (cfg.rotation_seed or cfg.rotation_block):
        raise ValueError("rotation_seed and rotation_block are options of rotation='hadamard'")


def params(cfg, in_features: int) -> Optional[tuple[int, int]]:
    """``(seed, block)`` of a layer of config ``cfg`` with ``in_features`` inputs, or None if it is not rotated."""
    if cfg.rotation == "none":
        return None
    return cfg.rotation_seed, block_size(in_features, cfg.rotation_block)


@functools.lru_cache(maxsize=256)
def unrotated(cfg):
    """``cfg`` without its rotation: what the format's own quantizer, dequantizer and every kernel see."""
    return dataclasses.replace(cfg, rotation="none", rotation_seed=0, rotation_block=0)


def specs(cfg) -> dict:
    """The ``rotation`` buffer's spec (int32 ``[2]``: seed, block size) of a rotated config, else ``{}``."""
    return {} if cfg.rotation == "none" else {"rotation": ((2,), torch.int32)}


def record(cfg, in_features: int) -> dict[str, torch.Tensor]:
    """The ``rotation`` buffer's value for a layer (``{}`` if not rotated), on torch's default device."""
    p = params(cfg, in_features)
    return {} if p is None else {"rotation": torch.tensor(p, dtype=torch.int32)}


def check_record(stored: torch.Tensor, cfg, in_features: int) -> None:
    """ValueError unless a layer's stored ``rotation`` buffer is the seed and block its config rotates with."""
    want = params(cfg, in_features)
    got = tuple(int(v) for v in stored.cpu())
    if got != want:
        raise ValueError(f"the layer's stored rotation (seed, block) = {got} differs from (seed, block) = {want} of "
                         f"its config ({in_features} inputs): the checkpoint was quantized with another rotation "
                         f"config, or it is damaged")


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    # (h·c) mod 2^32 for h < 2^32 without int64 overflow: multiply by c's 16-bit halves
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _MASK


@functools.lru_cache(maxsize=64)
def _signs(seed: int, in_features: int, device: torch.device) -> torch.Tensor:
    h = (torch.arange(in_features, dtype=torch.int64, device=device) + (seed * 0x9E3779B9)) & _MASK
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    h = h ^ (h >> 16)
    return (1 - 2 * (h >> 31)).to(torch.float32)


def signs(seed: int, in_features: int, device=None) -> torch.Tensor:
    """``D``'s diagonal: float32 ``[in_features]`` of ±1, bit 31 of ``lowbias32((k + seed·0x9E3779B9) mod 2^32)``
    (−1 where set).  Cached per (seed, size, device): do not modify the result."""
    return _signs(seed, in_features, torch.device(device) if device is not None else torch.get_default_device())


RADIX = 64  # largest Sylvester factor of one stage of the transform


def _radices(block: int) -> tuple[int, ...]:
    """The factors of ``H_b`` = ``H_p ⊗ H_{f1} ⊗ H_{f2} ⊗ ...``: the Paley order ``p`` (if any), then the Sylvester
    order ``2^a`` cut into as few powers of two ``≤ RADIX`` as possible, as equal as possible."""
    p, n = _split(block)
    a = n.bit_length() - 1
    stages = -(-a // (RADIX.bit_length() - 1))
    sizes = [a // stages + (i < a % stages) for i in range(stages)]
    return ((p,) if p > 1 else ()) + tuple(1 << e for e in sizes)


@functools.lru_cache(maxsize=64)
def _factor(f: int, paley: bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The orthonormal ``[f, f]`` Hadamard factor (Paley's of order ``f``, or Sylvester's), scaled by 1/√f."""
    if paley:
        h = _paley(f).to(torch.float64)
    else:
        h = torch.ones(1, 1, dtype=torch.float64, device="cpu")
        while h.shape[0] < f:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(f)).to(device=device, dtype=dtype)


def rotate(t: torch.Tensor, seed: int, block: int, inverse: bool = False) -> torch.Tensor:
    """``t·Rᵀ`` (each row ``v`` of ``t`` becomes ``R·v``), or with ``inverse`` ``t·R`` (``Rᵀ·v``).

    ``t`` is ``[..., K]`` of any float dtype; the transform runs in float32 (float64 input: float64) and returns
    ``t``'s dtype.  A mixed-radix fast Hadamard transform: ``H_b`` is the Kronecker product of the Paley factor and
    Sylvester factors of order ``≤ 64`` (:func:`_radices`), each applied as one matmul along its own axis of the block
    viewed as ``[p, f1, f2, ...]``: ``O(K·Σ f_i)`` work in a handful of ops (a radix-2 butterfly would take
    ``log2 b`` ops, each dearer than the arithmetic at decoding batch sizes).
    """
    K = t.shape[-1]
    work = torch.float64 if t.dtype == torch.float64 else torch.float32
    d = signs(seed, K, t.device).to(work)
    x = t.to(work)
    if not inverse:
        x = x * d
    lead = x.shape[:-1]
    radices = _radices(block)
    paley = _split(block)[0] > 1
    for i in reversed(range(len(radices))):  # last axis first: one plain GEMM; then the others, batched
        f = radices[i]
        h = _factor(f, paley and i == 0, work, t.device)
        h = h.T if inverse else h
        after = math.prod(radices[i + 1:])
        x = x.reshape(-1, f) @ h.T if after == 1 else torch.matmul(h, x.reshape(-1, f, after))
    x = x.reshape(*lead, K)
    if inverse:
        x = x * d
    return x.to(t.dtype)


def rotate_hessian(hessian: torch.Tensor, seed: int, block: int) -> torch.Tensor:
    """``R·H·Rᵀ`` of a symmetric ``[K, K]`` Hessian (XᵀX of the unrotated inputs), in float64 (or its own dtype if
    wider); the Hessian of the rotated inputs ``R·x``."""
    h = hessian.to(torch.float64) if hessian.dtype != torch.float64 else hessian
    return rotate(rotate(h, seed, block).T, seed, block)


_last: tuple = ()  # (x, its version counter, seed, block, R·x) of the latest online rotation
_device_transforms: dict[str, Callable] = {}  # device type -> a native rotate_input (register_device_transform)


def register_device_transform(device_type: str, transform: Callable) -> None:
    """Have :func:`rotate_input` try ``transform(x, seed, block)`` first for inputs on ``device_type`` (a backend's
    native kernel, e.g. ``"cuda"``: ``backends/_cuda/rotate.cu``): it returns ``R·x`` in ``x``'s dtype and shape, or
    None where it does not take ``x`` (then :func:`rotate` runs).  A later registration replaces an earlier one."""
    _device_transforms[device_type] = transform


def rotate_input(x: torch.Tensor, seed: int, block: int) -> torch.Tensor:
    """The run-time transform ``x·Rᵀ`` of a layer's input ``[..., K]`` (same dtype): the device's registered native
    transform where it takes ``x`` (:func:`register_device_transform`), else :func:`rotate`.  Layers that read the
    same tensor one after the other (q/k/v, gate/up) share one transform: the latest result is reused while ``x`` is
    the same tensor object, unmodified (its version counter unchanged; on the CPU also its values, since writes
    through ``.data`` or ``.numpy()`` keep the counter) and the rotation the same.  Inference-mode tensors have no
    version counter: they are transformed per layer."""
    global _last
    key = None if x.is_inference() else x._version
    if key is not None and _last and _last[0] is x and _last[1] == key and _last[2:4] == (seed, block) and (
            _last[5] is None or torch.equal(_last[5], x)):  # a CPU compare needs no device sync
        return _last[4]
    native = _device_transforms.get(x.device.type)
    out = native(x, seed, block) if native is not None else None
    if out is None:
        out = rotate(x, seed, block)
    _last = (x, key, seed, block, out, x.clone() if x.device.type == "cpu" else None) if key is not None else ()
    return out


def rotated_problem(weight: torch.Tensor, cfg, hessian: Optional[torch.Tensor] = None):
    """``(W·Rᵀ float32, R·H·Rᵀ or None, cfg unrotated)`` for a rotated ``cfg``; the inputs unchanged otherwise."""
    p = params(cfg, weight.shape[1])
    if p is None:
        return weight, hessian, cfg
    h = None if hessian is None else rotate_hessian(hessian, *p).to(hessian.dtype)
    return rotate(weight.detach().float(), *p), h, unrotated(cfg)


def rotates(quantize: Callable) -> Callable:
    """Decorator of a format's ``quantize(weight, cfg, hessian=None, **kw)``: for a rotated config, quantize
    ``W·Rᵀ`` (and ``R·H·Rᵀ``) with the config unrotated, then add the ``rotation`` buffer."""

    @functools.wraps(quantize)
    def run(weight, cfg, hessian=None, **kwargs):
        if cfg.rotation == "none":
            return quantize(weight, cfg, hessian, **kwargs)
        cfg.check_shape(*weight.shape)
        w, h, plain = rotated_problem(weight, cfg, hessian)
        return {**quantize(w, plain, h, **kwargs), **record(cfg, weight.shape[1])}

    return run


def unrotates(dequantize: Callable) -> Callable:
    """Decorator of a format's ``dequantize(buffers, cfg, N, K)``: for a rotated config, ``Ŵ'·R`` (the weight in
    the layer's input basis) from the buffers without ``rotation``."""

    @functools.wraps(dequantize)
    def run(buffers, cfg, out_features, in_features):
        p = params(cfg, in_features)
        if p is None:
            return dequantize(buffers, cfg, out_features, in_features)
        w = dequantize({k: v for k, v in buffers.items() if k != "rotation"}, unrotated(cfg), out_features, in_features)
        return rotate(w, *p, inverse=True)

    return run
