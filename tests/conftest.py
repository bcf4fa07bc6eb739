import os

import pytest
from typing import Callable

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("QLINEAR_BACKEND", None)


# fixture -> marker: tests using the CUDA host emulator or the aarch64 harness under qemu
_FIXTURE_MARKS = {"emulator": "emulation", "dequant_emulator": "emulation", "harness": "qemu"}


# The longest test files, longest first (seconds on 2 cores, 2026-11-26): pytest-xdist's workers (``-n``, README)
# take whole files (``--dist loadfile``) in this order, so that none ends on a long file while the others idle
_FIRST = ("test_real_model.py",       # 630
          "test_native_build.py",     # 370
          "test_tensor_parallel.py",  # 160
          "test_kernel_model.py")     # 120


def pytest_configure(config):
    """Under pytest-xdist, each worker's torch takes its share of the cores (two workers each using every core
    would oversubscribe them), and files are handed out in collection order (xdist would otherwise sort them by
    their number of tests, and start the long files of few tests last)."""
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip without a CUDA GPU; tests using the emulator or the qemu harness get their marker; ``qemu``,
    ``emulation`` and ``real_model`` tests are also ``slow`` (markers are declared in pyproject.toml); the files of
    ``_FIRST`` go first."""
    rank = {name: i for i, name in enumerate(_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(_FIRST)))  # stable: the order within files is kept
    no_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        for fixture, mark in _FIXTURE_MARKS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(getattr(pytest.mark, mark))
        if no_gpu is not None and "gpu" in item.keywords:
            item.add_marker(no_gpu)
        if any(m in item.keywords for m in ("qemu", "emulation", "real_model")):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def cpu_kernel(backend: str, format: str, fn, **fields):
    """A test :class:`qlinear.backends.Kernel` for the CPU device type: each capability not given in ``fields`` is ANY."""
    from qlinear.backends import ANY, CAPABILITIES, Kernel

    return Kernel(backend=backend, format=format, fn=fn, **({c: ANY for c in CAPABILITIES} | {"devices": frozenset({"cpu"})}
                                                            | fields))


def _spec_call(backend: str):
    """``(x [M, K], buffers in the kernel's layout, bias, cfg, N, K) -> y``: the kernel's executable PyTorch spec, run
    with the launch plan of a 4-SM GPU (QUICK: fp16 fragments)."""
    from qlinear.backends import async_dequant, cuda_lut, quick

    return {
        "cuda_lut": lambda x, b, bias, cfg, N, K: cuda_lut.spec(x, b, bias, cfg, N, K,
                                                                cuda_lut.plan(x.shape[0], N, K, 4, cfg.bits)),
        "quick": lambda x, b, bias, cfg, N, K: quick.spec(x, b, bias, cfg, N, K, torch.float16),
        "quick_free": lambda x, b, bias, cfg, N, K: quick.spec(x, b, bias, cfg, N, K, torch.float16),
        "async_dequant": lambda x, b, bias, cfg, N, K: async_dequant.spec(
            x, b, bias, cfg, N, K, async_dequant.plan(x.shape[0], N, K, async_dequant.num_words(b, cfg), 4)),
    }[backend]


def spec_kernel_fixture(backend: str):
    """A fixture registering ``backend``'s executable spec as a CPU kernel named ``<backend>_spec`` at the highest
    priority, with the real kernel's layout, ``supports``, batch range and act_order handling: the layout machinery
    (load, save, move, compile) runs on the CPU as it would on a GPU.  Like the GPU kernels that take ``perm``, it
    gathers an act_order layer's x itself; ``k.gathered`` counts those calls."""

    @pytest.fixture
    def spec_kernel():
        from qlinear import backends

        real = next(k for k in backends.kernels() if k.backend == backend)
        spec = _spec_call(backend)

        def fn(x, bufs, bias, cfg, N, K):
            if "perm" in bufs:
                x = x.index_select(-1, bufs["perm"])
                k.gathered.append(1)
            return spec(x.reshape(-1, K), bufs, bias, cfg, N, K).to(x.dtype).reshape(*x.shape[:-1], N)

        k = backends.register(cpu_kernel(f"{backend}_spec", real.format, fn, priority=100, max_batch=real.max_batch,
                                         supports=real.supports, layout=real.layout, gathers_perm=real.gathers_perm))
        object.__setattr__(k, "gathered", [])
        yield k
        backends._KERNELS.remove(k)

    return spec_kernel


def int8_activation_bound(w: torch.Tensor, x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``[M, N]`` float64 bound on ``|y − x Wᵀ|`` of a CPU kernel with int8 activations per ``block`` inputs (Arm paper
    §4; the Arm and x86 backends per 32, the x86 mixed GEMV per 16) for dense ``w`` ``[N, K]`` and ``x`` ``[M, K]``:
    each input moves by at most half a step ``amax_h / 254`` of its block ``h``, plus fp32 rounding:
    ``Σ_h (amax_h / 254)·Σ_{k∈h} |w_k| + 1e-5·Σ_k |w_k x_k| + 1e-6``."""
    M, K = x.shape
    amax = x.double().abs().view(M, K // block, block).amax(-1)  # [M, H]
    wabs = w.double().abs().view(w.shape[0], K // block, block).sum(-1)  # [N, H]
    return (amax / 254) @ wabs.T + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6


def assert_fused_rotation(backend: str, cls, opts: dict, spec: Callable, K: int = 192, N: int = 40, block: int = 0
                          ) -> None:
    """A rotated layer on a CPU kernel that ``fuses_rotation`` (issue 27): the kernel, not the op, transforms x (and
    gathers an act_order layer's ``perm`` after that); its
    output is its spec's on the transformed input (up to two int8 steps per row, where the two transforms' rounding
    moves a code), and within the int8-activation bound of ``(R·x)·Ŵ'ᵀ`` where
    ``Ŵ'`` is the stored (rotated) weight by :func:`dense64` and ``R`` the dense :func:`rotation64`.  ``spec(x,
    layer)`` runs the backend's spec on the layer's held buffers; ``block``: the layer's ``rotation_block`` (0: the
    default for ``K``)."""
    from qlinear.formats import get_format, rotation

    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N)
    hessian = random_hessian(K) if opts.get("act_order") else None  # a real act_order permutation
    layer = cls.from_linear(lin, {**opts, "rotation": "hadamard", "rotation_seed": 9, "rotation_block": block}, hessian,
                            backend=backend)
    block = rotation.block_size(K, block)
    x = torch.randn(37, K)  # more rows than the native transform takes at once (32)
    x[0, :32] *= 20  # a large block: what the rotation spreads before int8 quantization
    call = layer._call(x.device, x.dtype, 37)
    assert call.kernel.backend == backend and call.fused == {"rotation": (9, block)}
    assert not call.gather  # an act_order layer's perm too is applied inside the op, after the rotation
    y = layer(x)
    want = spec(x, layer)
    canon = {k: v for k, v in layer.canonical().items() if k != "rotation"}
    w = dense64(cls.format, canon, rotation.unrotated(layer.config), N, K)
    xr = x.double() @ rotation64(9, block, K).T
    # the kernel's R·x and the spec's (PyTorch's) round apart by an ulp, which moves an int8 code by one step where a
    # value sits on a rounding boundary: the spec's output within two such steps (of the row's largest block)
    step = xr.abs().view(x.shape[0], K // 32, 32).amax(-1).amax(-1) / 127
    flips = 2 * step[:, None] * w.abs().amax(1)[None, :]
    assert ((y.double() - want.double()).abs() <= 1e-5 * float(want.abs().max()) + flips).all()
    err = y.double() - (xr @ w.T + lin.bias.double())
    assert (err.abs() <= int8_activation_bound(w, xr.float()) + 1e-5 * y.double().abs()).all()
    # Ŵ in the layer's input basis (the backward's weight, from the held layout where it has a dequantize), bit for
    # bit the format's, and Ŵ'·R by float64
    assert torch.equal(layer.dequantize(), get_format(cls.format).dequantize(layer.canonical(), layer.config, N, K))
    assert torch.allclose(layer.dequantize().double(), w @ rotation64(9, block, K), atol=1e-6)


def tiny_llama(seed: int = 0):
    """A randomly initialised 2-layer Llama (hidden 64, vocab 128; 14 Linear layers), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def random_hessian(K: int, n: int = 4096, seed: int = 0) -> torch.Tensor:
    """A random positive-definite XᵀX/n with unequal channel scales, like real activations."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, K, generator=g) * (torch.rand(K, generator=g) * 3 + 0.1)
    X = X + 0.5 * torch.randn(n, 1, generator=g)  # correlated channels
    return X.T @ X / n


def dense64(fmt: str, b: dict, cfg, N: int, K: int) -> torch.Tensor:
    """Ŵ ``[N, K]`` float64 from canonical buffers ``b``, by each format's documented formula, written here apart from
    the formats' own ``dequantize`` (only the bit unpacking is shared): BCQ's uniform storage ``s·(q − z)`` and free α
    ``Σ α_i (2·bit_i − 1) + c`` (stored position j is input perm[j]); codebook ``scale · codebook[book][code]``;
    mixed ``s·(q − z)`` with second-order scales ``scale_zero + scale_scale · code`` plus the CSR outliers.  A rotated
    layer's (``rotation`` buffer) stored weight is ``W·Rᵀ``: Ŵ is that times :func:`rotation64`."""
    b = {k: v.cpu() for k, v in b.items()}
    if "rotation" in b:
        seed, block = b.pop("rotation").tolist()
        return _dense64(fmt, b, cfg, N, K) @ rotation64(seed, block, K)
    return _dense64(fmt, b, cfg, N, K)


def lowbias32_sign(seed: int, k: int) -> int:
    """The rotation sign of input ``k``, by Python integers: bit 31 of Wellons' lowbias32 hash (``x ^= x >> 16;
    x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16``) of ``(k + seed·0x9E3779B9) mod 2^32``."""
    x = (k + seed * 0x9E3779B9) % 2 ** 32
    x ^= x >> 16
    x = x * 0x7FEB352D % 2 ** 32
    x ^= x >> 15
    x = x * 0x846CA68B % 2 ** 32
    x ^= x >> 16
    return -1 if x >> 31 else 1


def rotation64(seed: int, block: int, K: int) -> torch.Tensor:
    """The dense orthogonal ``R = blockdiag(H_b, ...)·D`` ``[K, K]`` float64, built from its definition: ``H_b`` =
    (Paley ``H_p`` ⊗ Sylvester ``H_{b/p}``)/√b (Sylvester by ``H_2n = [[H_n, H_n], [H_n, −H_n]]``), ``D`` the
    :func:`lowbias32_sign` diagonal.  Only the choice of ``p`` and the Paley matrix come from the library (their
    Hadamard property is tested in test_rotation.py)."""
    from qlinear.formats import rotation

    p, n = rotation._split(block)
    syl = torch.ones(1, 1, dtype=torch.float64)
    while syl.shape[0] < n:
        syl = torch.cat([torch.cat([syl, syl], 1), torch.cat([syl, -syl], 1)], 0)
    hp = rotation._paley(p).double() if p > 1 else torch.ones(1, 1, dtype=torch.float64)
    hb = torch.kron(hp, syl) / block ** 0.5
    d = torch.tensor([lowbias32_sign(seed, k) for k in range(K)], dtype=torch.float64)
    return torch.block_diag(*[hb] * (K // block)) * d[None, :]


def _dense64(fmt: str, b: dict, cfg, N: int, K: int) -> torch.Tensor:
    from qlinear.formats.packing import unpack, unpack_planes

    g = K if getattr(cfg, "group_size", 0) == -1 else cfg.group_size
    col_group = torch.arange(K) // g
    if fmt == "bcq":
        if "qweight" in b:
            G = b["scales"].shape[1]
            q = unpack(b["qweight"], cfg.bits, K).double()
            z = (unpack(b["qzeros"], cfg.bits, N).T.double() if "qzeros" in b
                 else torch.full((N, G), (2 ** cfg.bits - 1) / 2, dtype=torch.float64))
            w = b["scales"].double()[:, col_group] * (q - z[:, col_group])
        else:
            q = unpack_planes(b["planes"], K)
            w = sum(b["alpha"][i].double()[:, col_group] * (2.0 * ((q >> i) & 1).double() - 1)
                    for i in range(cfg.bits))
            if "offset" in b:
                w = w + b["offset"].double()[:, col_group]
        if "perm" in b:
            out = torch.empty_like(w)
            out[:, b["perm"].long()] = w
            w = out
        return w
    if fmt == "codebook":
        q = unpack(b["codes"], cfg.bits, K)
        G = K // g
        book = (unpack(b["book_idx"], (cfg.books - 1).bit_length(), G)[:, col_group] if "book_idx" in b
                else torch.zeros(N, K, dtype=torch.int64))
        return b["scales"].double()[:, col_group] * b["codebooks"].double()[book, q]
    G = K // g
    sc = unpack(b["scale_codes"], cfg.scale_bits, N).double()                       # [G, N]
    per_row = torch.arange(N) // cfg.scale_group_size
    s = (b["scale_zero"].double()[:, per_row] + b["scale_scale"].double()[:, per_row] * sc).T  # [N, G]
    idx4 = b["idx4"].long().tolist()
    w = torch.zeros(N, K, dtype=torch.float64)
    for idx, bits in (([gg for gg in range(G) if gg not in idx4], 2), (idx4, 4)):
        q = unpack(b[f"qweight{bits}"], bits, len(idx) * g).double().reshape(N, len(idx), g)
        z = unpack(b[f"zeros{bits}"], bits, len(idx)).double()
        for j, gg in enumerate(idx):
            w[:, gg * g:(gg + 1) * g] = s[:, gg:gg + 1] * (q[:, j] - z[:, j:j + 1])
    rp = b["outlier_row_ptr"].long()
    for r in range(N):
        for t in range(int(rp[r]), int(rp[r + 1])):
            w[r, int(b["outlier_cols"][t])] += float(b["outlier_values"][t])
    return w


def ref64(mod, x: torch.Tensor) -> torch.Tensor:
    """``x Ŵᵀ + b`` of a QuantLinear in float64 on CPU (the ground truth every kernel test compares with), Ŵ from
    :func:`dense64` (independent of the library's dequantization)."""
    w = dense64(mod.format, mod.canonical(), mod.config, mod.out_features, mod.in_features)
    y = x.double().cpu() @ w.T
    return y if mod.bias is None else y + mod.bias.double().cpu()


NATIVE_CPU_BACKENDS = ("x86", "arm_neon")


def _without_native_cpu_kernels(mp: pytest.MonkeyPatch) -> None:
    import qlinear.backends as backends

    mp.setattr(backends, "_KERNELS", [k for k in backends._KERNELS if k.backend not in NATIVE_CPU_BACKENDS])
    mp.setattr(backends, "_REGISTERED", backends._REGISTERED + 1)  # resolutions cached before are stale


@pytest.fixture(scope="module")
def reference_on_cpu():
    """The registry without the native CPU kernels (x86, arm_neon) for a test module: module and registry mechanics
    are tested against the reference kernel's exact float math (each native kernel has its own test file, with its
    int8-activation error bound)."""
    with pytest.MonkeyPatch.context() as mp:
        _without_native_cpu_kernels(mp)
        yield


@pytest.fixture
def reference_on_cpu_here(monkeypatch):
    """:func:`reference_on_cpu` for one test."""
    _without_native_cpu_kernels(monkeypatch)


@pytest.fixture
def without_dispatch_table(monkeypatch):
    """Kernel tests pick kernels by priority, not by the GPU's measured dispatch table, which may route a tested
    shape to another kernel (the table itself is tested in test_dispatch.py)."""
    from qlinear.backends import dispatch

    monkeypatch.setattr(dispatch, "_device_name", lambda device: None)


@pytest.fixture
def posing_gpu(monkeypatch):
    """This CPU machine posing as a CUDA device of compute capability 9.0 (default dispatch table) on which every CUDA
    kernel is available: the registry's choices only, nothing runs."""
    import dataclasses

    from qlinear import backends
    from qlinear.backends import dispatch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(dispatch, "_device_name", lambda device: "Fake GPU x1")
    cuda = [k for k in backends._KERNELS if k.devices is not backends.ANY and "cuda" in k.devices]
    assert {k.backend for k in cuda} >= {"cuda_lut", "quick", "async_dequant", "cuda_codebook", "cuda_uniform"}
    monkeypatch.setattr(backends, "_KERNELS", [dataclasses.replace(k, available=None) if k in cuda else k
                                               for k in backends._KERNELS])


def poison_cuda_allocator() -> None:
    """Fill freed CUDA allocator memory with NaN so an output element a kernel forgets to write shows up."""
    t = torch.full((64 << 20,), float("nan"), device="cuda")
    del t


@pytest.fixture
def counting_layout():
    """A CPU kernel (priority 100) with a layout that counts its repacks and unrepacks: ``{"repack": n, "unrepack": n}``
    (BCQ layers; the kernel computes through the reference backend)."""
    from qlinear import backends
    from qlinear.backends import Layout, reference
    from qlinear.formats import bcq

    counts = {"repack": 0, "unrepack": 0}

    def repack(bufs, cfg, N, K):
        counts["repack"] += 1
        return {"c_" + k: v.clone() for k, v in bufs.items()}

    def unrepack(bufs, cfg, N, K):
        counts["unrepack"] += 1
        return {k[2:]: v.clone() for k, v in bufs.items()}

    def fn(x, bufs, bias, cfg, N, K):
        return reference.linear(x, {k[2:] if k.startswith("c_") else k: v for k, v in bufs.items()}, bias, cfg, N, K)

    layout = Layout("counting", names=lambda cfg: tuple("c_" + n for n in bcq.buffer_specs(32, 32, cfg)),
                    repack=repack, unrepack=unrepack)
    k = backends.register(cpu_kernel("counting", "bcq", fn, priority=100, layout=layout))
    yield counts
    backends._KERNELS.remove(k)


@pytest.fixture(scope="session")
def sm90a_cubin(tmp_path_factory) -> Callable:
    """``cu -> (cubin, nvcc output)``: ``benchmarks/kernel_model.py``'s sm_90a build (``-cubin -Xptxas -v``) of a CUDA
    source, once per test run for every pytest-xdist worker (test_native_build and test_kernel_model both need the
    LUT kernel's: ~90 s on 2 cores).  Raises RuntimeError with nvcc's output when it fails."""
    import fcntl
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernel_model as km

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "sm90a-cubins"  # the run's, shared
    root.mkdir(exist_ok=True)

    def build(cu: Path) -> tuple[Path, str]:
        work = root / cu.relative_to(Path(__file__).resolve().parents[1]).as_posix().replace("/", "-")
        with open(f"{work}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits for the first's build
            done = work / "nvcc-output.txt"
            if done.exists():
                return work / f"{cu.stem}.cubin", done.read_text()
            cubin, out = km.compile_cubin(cu, work)
            done.write_text(out)
            return cubin, out

    return build
