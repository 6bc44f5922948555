"""Every Triton kernel variant the GPU path launches compiles for sm_90 (H200), without a GPU: the
interpreter tests check values, this checks what only the compiler rejects (a constexpr reassigned in a
static loop passed the interpreter and failed on the compiler)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # compiles every kernel variant with ptxas: about a minute

ROOT = Path(__file__).resolve().parents[2]


def test_all_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").is_file():
        pytest.skip("this triton wheel has no bundled NVIDIA tools")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_kernels_offline.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    lines = done.stdout.strip().splitlines()
    assert any(line.endswith("compiled for sm_90, 0 failed") for line in lines)
    assert "Traceback" not in done.stderr  # every entry point reached its launches
    # the decode issue-bound table found each K loop in the machine code
    q4_k = [line.split() for line in lines if line.startswith("Q4_K ")]
    assert len(q4_k) == 4 and all(0.1 < float(row[5]) < 2.0 for row in q4_k), q4_k
