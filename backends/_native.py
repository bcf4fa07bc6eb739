"""Just-in-time builds of the native backends, shared by all of them.

Each native backend keeps its sources beside its Python (torch-free ``.cu``/``.cpp`` kernels plus one
small binding that registers ``TORCH_LIBRARY_IMPL(qlinear, <device>, ...)`` implementations of ops
declared in :mod:`qlinear.ops`).  :func:`build` compiles them on first use with
``torch.utils.cpp_extension.load`` (ninja) into a cache folder keyed by a hash of the sources, flags
and torch version, under an exclusive file lock so concurrent processes build once and never load a
half-written library.  A failed build is not an error: the backend reports the reason through the
registry (``Kernel.available``) and the registry falls back to another kernel.

Cache folder: ``$QLINEAR_CACHE/ext`` (default ``~/.cache/qlinear/ext``).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch

__all__ = ["OPENMP", "build", "build_cuda_backend", "cache_dir", "cuda_arch_flags", "cuda_toolchain_problem", "sm_count"]

SHARED_HEADERS = Path(__file__).parent / "_cuda"  # device helpers every CUDA backend includes
SHARED_CPU_HEADERS = Path(__file__).parent / "_shared"  # torch-free helpers the CPU backends include (rotation.h)
# at::parallel_for is an inline OpenMP loop in the ATen headers: without these flags a CPU extension runs it on one
# thread.
OPENMP = ("-fopenmp",)


def cache_dir() -> Path:
    """Folder of the built extensions."""
    root = os.environ.get("QLINEAR_CACHE") or Path.home() / ".cache" / "qlinear"
    return Path(root) / "ext"


def cuda_arch_flags() -> list[str]:
    """nvcc ``-gencode`` flags for every visible GPU of compute capability 8.0 or newer (sm_90 becomes sm_90a,
    for wgmma/setmaxnreg)."""
    flags = set()
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        if major < 8:  # every CUDA kernel here needs sm_80+ (bf16 mma, cp.async); older GPUs fall back
            continue
        arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        flags.add(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return sorted(flags)


def cuda_toolchain_problem() -> Optional[str]:
    """Why CUDA extensions cannot be built here (None if they can)."""
    if torch.version.cuda is None:
        return "this torch is a CPU-only build"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "nvcc not found (install the CUDA toolkit and set CUDA_HOME)"
    return None


@functools.lru_cache(maxsize=None)
def build(name: str, sources: tuple[str, ...], cflags: tuple[str, ...] = (), cuda_cflags: tuple[str, ...] = (),
          ldflags: tuple[str, ...] = ()) -> Optional[str]:
    """Build (once per process, cached on disk under a hash of the sources, the headers beside them, the shared
    CUDA and CPU headers, the flags and the torch version) and load the op library ``name`` from ``sources``.

    Returns None on success (the ops are registered with torch), else the reason it failed, one line.
    """
    if shutil.which("ninja") is None:
        return "ninja not found (pip install ninja)"
    digest = hashlib.sha256()
    headers = sorted({h for src in sources for h in Path(src).parent.iterdir() if h.suffix in (".h", ".cuh")})
    for src in (*sources, *headers, *sorted(SHARED_HEADERS.iterdir()), *sorted(SHARED_CPU_HEADERS.iterdir())):
        digest.update(Path(src).read_bytes())
    digest.update(repr((cflags, cuda_cflags, ldflags, torch.__version__)).encode())
    folder = cache_dir() / f"{name}-{digest.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # torch's own build baton: a build killed midway leaves it, and torch would wait for it forever; while we hold
        # the lock nobody else is building here
        (folder / "lock").unlink(missing_ok=True)
        try:
            from torch.utils.cpp_extension import load

            load(name=name, sources=list(sources), extra_cflags=list(cflags), extra_cuda_cflags=list(cuda_cflags),
                 extra_ldflags=list(ldflags), build_directory=str(folder), is_python_module=False, verbose=False)
        except Exception as e:  # compiler errors arrive as RuntimeError/OSError/CalledProcessError
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            return f"building {name} failed: {lines[-1] if lines else type(e).__name__} (log in {folder})"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return None


def sources_in(folder: Path, suffixes: Sequence[str]) -> tuple[str, ...]:
    """The source files of ``folder`` with one of ``suffixes``, sorted (the build's input list)."""
    return tuple(sorted(str(p) for p in folder.iterdir() if p.suffix in suffixes))


def build_cuda_backend(name: str, folder: Path) -> Optional[str]:
    """Build the CUDA backend in ``folder`` (its ``.cu`` and ``.cpp`` files) as op library ``name`` for the visible
    GPUs.  Returns None once it is loaded, else why it cannot be (no CUDA toolchain or GPU, or a failed build)."""
    why = cuda_toolchain_problem()
    if why is not None:
        return why
    return build(name, sources_in(folder, (".cu", ".cpp")), cflags=("-O3", "-std=c++17"),
                 cuda_cflags=("-O3", "-std=c++17", *cuda_arch_flags()))


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (launch plans size their grids by it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x Ŵᵀ + b`` by ``F.linear`` (cuBLAS on a GPU) with a dequantized ``w`` ``[N, K]`` of ``x``'s dtype: the
    large-batch path of the CUDA backends (their dequantize kernel, then one dense GEMM)."""
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
