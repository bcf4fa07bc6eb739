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
