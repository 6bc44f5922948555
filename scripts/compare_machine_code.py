#!/usr/bin/env python3
"""Whether the CUDA C kernels a model launches by default compile to the same machine code as at another commit (no
GPU needed: NVRTC for sm_90 and the cuobjdump bundled in the triton wheel). For a change that should leave the
default launches alone when no GPU is at hand to test it: each default instance of the tensor-core matmuls at the
27B shapes (float32 and bf16 activations, the fused gate + up's GLU instances, qmh's x conversions), the cluster add +
RMSNorm and the DeltaNet tree kernel, compiled from REV's source file and from the working tree's, instruction by
instruction (addresses and encodings left out).

    python3 scripts/compare_machine_code.py [--base REV]

The tree kernel's machine code varies between two compiles of the same source (4 of its 12 instances, NVRTC 13,
2026-12-06): an instance whose working-tree source compiles differently twice is reported as varying, not compared.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402

from flashtree.kernels import gated_delta_cuda, rms_norm  # noqa: E402
from flashtree.kernels.quant_matmul import mma  # noqa: E402
from flashtree.nvrtc import compile_cubin  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
# the 27B's fragment-ordered matrices (Q4_K_M): fused gate + up, qkvz, q + gate, k/v, down, out, the LM head
SHAPES = {(QType.Q4_K, 34816, 5120), (QType.Q4_K, 16480, 5120), (QType.Q4_K, 12288, 5120), (QType.Q4_K, 1024, 5120),
          (QType.Q4_K, 5120, 17408), (QType.Q6_K, 5120, 17408), (QType.Q4_K, 5120, 6144), (QType.Q6_K, 248320, 5120),
          (QType.Q6_K, 1024, 5120)}
GLU_SHAPES = {(QType.Q4_K, 34816, 5120)}


def instructions(source: str, name: str) -> list[str]:
    """The SASS of function `name` of `source` for sm_90, one instruction a line, without addresses or encodings."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(compile_cubin(source, "sm_90"))
        sass = subprocess.run([str(CUOBJDUMP), "-sass", "-fun", name, str(path)], capture_output=True, text=True,
                              check=True).stdout
    return [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line).split(";")[0].strip() for line in sass.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]


def at(rev: str, path: Path) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path.relative_to(ROOT)}"], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD", help="the commit to compare with (default HEAD)")
    args = parser.parse_args()
    # the cluster helpers, put before mma.cu and add_rms_norm.cu since the twenty-ninth session (inside them before)
    has_helpers = subprocess.run(["git", "cat-file", "-e", f"{args.base}:src/flashtree/kernels/cluster.cuh"], cwd=ROOT,
                                 capture_output=True).returncode == 0
    helpers = at(args.base, Path(mma.cuda_functions.__file__).with_name("cluster.cuh")) if has_helpers else ""
    old_mma = helpers + "\n" + at(args.base, mma._SOURCE) if helpers else at(args.base, mma._SOURCE)
    pairs = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, wrapper in mma.instances_for(SHAPES, 132, dtype, glu_shapes=GLU_SHAPES):
            pairs.append((name, old_mma + wrapper, mma.source() + wrapper))
    old_norm = at(args.base, rms_norm._CLUSTER_SOURCE)
    pairs.append(("add_rms_norm_f32", (helpers + "\n" if helpers else "") + old_norm, rms_norm.cluster_source()))
    old_tree = at(args.base, gated_delta_cuda.SOURCE)
    for dk in gated_delta_cuda.HEAD_DIMS:
        for nodes in gated_delta_cuda.NODE_TILES:
            wrapper = gated_delta_cuda.wrapper(dk, nodes)
            pairs.append((gated_delta_cuda.instance(dk, nodes), old_tree + wrapper, gated_delta_cuda.source(dk, nodes)))
    differing, varying = [], []
    for name, old, new in pairs:
        mine = instructions(new, name)
        if mine != instructions(new, name):
            varying.append(name)
        elif instructions(old, name) != mine:
            differing.append(name)
    same = len(pairs) - len(differing) - len(varying)
    print(f"{same} of {len(pairs)} default instances compile to {args.base}'s machine code; {len(differing)} differ, "
          f"{len(varying)} vary between two compiles of the same source (not compared)")
    for name in differing:
        print(f"  differs: {name}")
    for name in varying:
        print(f"  varies: {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
