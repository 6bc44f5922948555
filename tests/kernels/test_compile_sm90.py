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
    q4_k = [line.split() for line in lines if line.startswith("Q4_K ") and line.split()[2].startswith("_q4_k")]
    assert len(q4_k) == 2 and all(0.1 < float(row[5]) < 2.0 for row in q4_k), q4_k  # the two FFN shapes
    # the tensor-core kernels' table (where NVRTC is installed, as with the test tools): one-row instances
    # without spills, their loop found, well under 0.3 instructions per weight byte; nine shapes (Q4_K: the two FFN
    # matrices, the fused gate + up with and without its GLU epilogue; Q6_K: the same and the LM head), each with bf16
    # and float32 x and out (a bf16 model's activations, docs/FIDELITY.md)
    mma = [line.split() for line in lines if line.split()[3:4] and line.split()[3].startswith(("qmm_", "qmv_"))]
    if not any(line.startswith("mma: skipped") for line in lines):
        one_row = [row for row in mma if row[2] == "1"]
        assert sum("_xf32_of32" in row[3] for row in one_row) == 9, one_row
        assert sum(row[3].endswith("_glu") for row in one_row) == 4, one_row
        assert len(one_row) == 18 and all(row[5] == "0" and 0.05 < float(row[8]) < 0.3 for row in one_row), one_row
