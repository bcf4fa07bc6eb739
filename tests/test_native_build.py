"""Every CUDA source of every native backend compiles with nvcc for sm_80 and sm_90a (no GPU needed).

The ``.cu`` files are torch-free by design (see backends/_native.py), so this runs where only nvcc is
installed, and a kernel that does not compile never lands.  Skipped when nvcc is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
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
def test_cuda_source_compiles_for_sm80_and_sm90a(cu, tmp_path):
    procs = {arch: subprocess.Popen([_nvcc(), "-c", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                                     "-Xptxas", "-v", str(cu), "-o", str(tmp_path / f"{arch}.o")],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for arch in ("80", "90a")}
    for arch, p in procs.items():
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, f"nvcc sm_{arch} failed for {cu.name}:\n{out[-4000:]}"
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
