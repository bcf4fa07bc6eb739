"""Every CUDA source of every native backend compiles with nvcc for sm_80 and sm_90a (no GPU needed), and the
just-in-time build of ``backends/_native.py`` is safe across processes.

The ``.cu`` files are torch-free by design (see backends/_native.py), so this runs where only nvcc is
installed, and a kernel that does not compile never lands.  Skipped when nvcc is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # nvcc and g++ builds, tens of seconds each

BACKENDS = Path(__file__).resolve().parents[1] / "backends"
CU_FILES = sorted(BACKENDS.rglob("*.cu"))


def _nvcc():
    found = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return found or (str(Path(home) / "bin" / "nvcc") if (Path(home) / "bin" / "nvcc").exists() else None)


def test_there_are_cuda_sources():
    assert CU_FILES, "no .cu files found under backends/"


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: str(p.relative_to(BACKENDS)))
def test_cuda_source_compiles_for_sm80_and_sm90a(cu, tmp_path, sm90a_cubin):
    """sm_80 as an object file (host code included), sm_90a as the cubin kernel_model reads (shared with
    test_kernel_model); no register spills in either."""
    sm80 = subprocess.Popen([_nvcc(), "-c", "-O3", "-std=c++17", "-gencode=arch=compute_80,code=sm_80", "-Xptxas", "-v",
                             str(cu), "-o", str(tmp_path / "80.o")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    outs = {"90a": sm90a_cubin(cu)[1]}
    outs["80"], _ = sm80.communicate(timeout=900)
    assert sm80.returncode == 0, f"nvcc sm_80 failed for {cu.name}:\n{outs['80'][-4000:]}"
    for arch, out in outs.items():
        spills = [ln for ln in out.splitlines() if "spill" in ln and not ln.strip().startswith("0 bytes")
                  and " 0 bytes spill stores, 0 bytes spill loads" not in ln]
        assert not spills, f"register spills in {cu.name} for sm_{arch}:\n" + "\n".join(spills[:5])


BINDINGS = sorted(p for p in BACKENDS.rglob("binding.cpp") if any(p.parent.glob("*.cu")))
# A CPU-only torch lacks c10's generated CUDA build macros: declare them so the binding's own code can be checked.
_STUBS = {"c10/cuda/impl/cuda_cmake_macros.h": "#define C10_CUDA_BUILD_SHARED_LIBS"}


def _cuda_include():
    homes = [os.environ.get("CUDA_HOME"), Path(_nvcc()).resolve().parents[1] if _nvcc() else None, "/usr/local/cuda",
             *sorted(Path("/usr/local").glob("cuda-*"))]
    return next((Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime_api.h").exists()),
                None)


@pytest.mark.skipif(_cuda_include() is None or shutil.which("g++") is None, reason="needs the CUDA headers and g++")
@pytest.mark.parametrize("binding", BINDINGS, ids=lambda p: str(p.relative_to(BACKENDS)))
def test_cuda_binding_compiles_against_torch_headers(binding, tmp_path):
    """The torch side of each CUDA backend (syntax and types against this torch's C++ API), without a CUDA torch."""
    from torch.utils.cpp_extension import include_paths

    cuda_include = _cuda_include()
    for name, text in _STUBS.items():
        if not any((Path(d) / name).exists() for d in (cuda_include, *include_paths())):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text("#pragma once\n" + text + "\n")
    cmd = ["g++", "-std=c++17", "-fsyntax-only", f"-I{tmp_path}", f"-I{cuda_include}",
           *(f"-I{p}" for p in include_paths()), str(binding)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{binding.name} does not compile:\n{p.stderr[-4000:]}"


# torch/library.h alone (not ATen/ATen.h): half the compile time
_TINY_OP = """
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x.mul(2); }
TORCH_LIBRARY(qlinear_build_test, m) { m.def("twice", &twice); }
"""


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ninja") is None, reason="needs g++ and ninja")
def test_concurrent_builds_do_not_race_and_a_stale_baton_does_not_hang(tmp_path):
    """Two processes building one op library into an empty cache at once both load it, built once; a build baton
    left by a killed build (torch's ``lock`` file) does not make the next process wait for it forever."""
    (tmp_path / "src").mkdir()
    src = tmp_path / "src" / "tiny.cpp"
    src.write_text(_TINY_OP)
    code = ("import sys, torch; from qlinear.backends import _native; "
            f"r = _native.build('qlinear_build_test', ({str(src)!r},)); print(r); "
            "sys.exit(0 if r is None and torch.ops.qlinear_build_test.twice(torch.ones(1)).item() == 2 else 1)")
    env = dict(os.environ, QLINEAR_CACHE=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    built = list((tmp_path / "cache" / "ext").glob("qlinear_build_test-*/*.so"))
    assert len(built) == 1
    (built[0].parent / "lock").touch()
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
