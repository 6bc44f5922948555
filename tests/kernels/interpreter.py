"""Run a module of Triton kernel cases under the CPU interpreter, in a subprocess: TRITON_INTERPRET must
be set before triton is imported, and other test modules of the same run must not see it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_cases(module: str) -> dict:
    """`python -m module` with TRITON_INTERPRET=1; returns the JSON it prints (case id -> value)."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    done = subprocess.run([sys.executable, "-m", module], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)
