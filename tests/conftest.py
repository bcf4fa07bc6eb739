import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("QLINEAR_BACKEND", None)


# fixture -> marker: tests using the CUDA host emulator or the aarch64 harness under qemu
_FIXTURE_MARKS = {"emulator": "emulation", "harness": "qemu"}


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip without a CUDA GPU; tests using the emulator or the qemu harness get their marker; ``qemu``,
    ``emulation`` and ``real_model`` tests are also ``slow`` (markers are declared in pyproject.toml)."""
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


def random_hessian(K: int, n: int = 4096, seed: int = 0) -> torch.Tensor:
    """A random positive-definite XᵀX/n with unequal channel scales, like real activations."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, K, generator=g) * (torch.rand(K, generator=g) * 3 + 0.1)
    X = X + 0.5 * torch.randn(n, 1, generator=g)  # correlated channels
    return X.T @ X / n


def ref64(mod, x: torch.Tensor) -> torch.Tensor:
    """``x Ŵᵀ + b`` of a QuantLinear in float64 on CPU (the ground truth every kernel test compares with)."""
    w = mod.dequantize(torch.float64).cpu()
    y = x.double().cpu() @ w.T
    return y if mod.bias is None else y + mod.bias.double().cpu()


@pytest.fixture
def without_dispatch_table(monkeypatch):
    """Kernel tests pick kernels by priority, not by the GPU's measured dispatch table, which may route a tested
    shape to another kernel (the table itself is tested in test_dispatch.py)."""
    from qlinear.backends import dispatch

    monkeypatch.setattr(dispatch, "_device_name", lambda device: None)


def poison_cuda_allocator() -> None:
    """Fill freed CUDA allocator memory with NaN so an output element a kernel forgets to write shows up."""
    t = torch.full((64 << 20,), float("nan"), device="cuda")
    del t


@pytest.fixture
def counting_layout():
    """A CPU kernel (priority 100) with a layout that counts its repacks and unrepacks: ``{"repack": n, "unrepack": n}``
    (BCQ layers; the kernel computes through the reference backend)."""
    from qlinear import backends
    from qlinear.backends import ANY, Kernel, Layout
    from qlinear.backends import reference
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
    k = backends.register(Kernel(backend="counting", format="bcq", fn=fn, priority=100, devices=frozenset({"cpu"}),
                                 layout=layout, dtypes=ANY, bits=ANY, group_sizes=ANY))
    yield counts
    backends._KERNELS.remove(k)
