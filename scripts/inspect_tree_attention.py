#!/usr/bin/env python3
"""Compile kernels/tree_attention.py's kernel for sm_90 without a GPU and report what the machine code
costs: registers and stack per thread (spills), and how many global loads, local spills and shared
memory reads the SASS holds. Static counts, not timings: use it to see whether a change removes spills
or loads before spending device time (the sweep, scripts/sweep_tree_attention.py, measures).

    python3 scripts/inspect_tree_attention.py [--caches f16,q8_0,q4_0,tq3_0] [--block-m 64]
        [--block-rows 16] [--warps 4] [--stages 3] [--blockwise]

Needs a triton wheel with its bundled NVIDIA tools (ptxas, cuobjdump), as pip installs it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from flashtree.kernels import tree_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256  # the Qwen3.6-27B attention layer
SASS_COUNTS = {"global loads": r"\bLDG\b", "local stores (spills)": r"\bSTL\b", "local loads": r"\bLDL\b",
               "shared loads": r"\bLDS\b", "tensor-core ops": r"HGMMA|HMMA"}


def compile_kernel(cache: str, args) -> bytes:
    float_cache = cache in ("f16", "bf16")
    cache_ptr = {"f16": "*fp16", "bf16": "*bf16"}.get(cache, "*u8")
    signature = {"q_ptr": "*bf16", "k_ptr": cache_ptr, "v_ptr": cache_ptr, "start_ptr": "*i64", "vis_ptr": "*u8",
                 "pos_ptr": "*i64", "out_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32",
                 "stride_qh": "i32", "stride_qt": "i32", "stride_kh": "i64", "stride_kr": "i32", "stride_vh": "i64",
                 "stride_vr": "i32", "T": "i32", "kv_end": "i32", "heads": "i32", "scale_log2": "fp32", "window": "i32"}
    constants = dict(G=HEADS // KV_HEADS, D=HEAD_DIM, KIND_K=tree_attention.KV_KINDS[cache],
                     KIND_V=tree_attention.KV_KINDS[cache], OP=tl.bfloat16, PRECISION=None, HAS_WINDOW=False,
                     BLOCK_M=args.block_m, BLOCK_N=args.block_rows, SPLITS=2, BLOCKWISE=args.blockwise and not float_cache,
                     FIXED_TRIPS=False, TRIPS=0)
    signature.update(dict.fromkeys(constants, "constexpr"))
    kernel = triton.compile(ASTSource(fn=tree_attention._tree_attention_kernel, signature=signature, constexprs=constants),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=args.warps, num_stages=args.stages))
    return kernel.asm["cubin"]


def report(cubin: bytes) -> dict:
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        Path(path).write_bytes(cubin)
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    code = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    result = {"registers": int(regs.group(1)) if regs else None, "stack bytes": int(stack.group(1)) if stack else None,
              "instructions": len(code)}
    result.update({name: sum(1 for line in code if re.search(pattern, line)) for name, pattern in SASS_COUNTS.items()})
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--caches", default="f16,q8_0,q4_0,tq3_0")
    parser.add_argument("--block-m", type=int, default=64)
    parser.add_argument("--block-rows", type=int, default=16)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--blockwise", action="store_true", help="decode quantized rows block by block")
    args = parser.parse_args()
    print(f"tree_attention for sm_90, {HEADS} heads / {KV_HEADS} KV heads / head_dim {HEAD_DIM}, BLOCK_M {args.block_m}, "
          f"BLOCK_N {args.block_rows}, {args.warps} warps, {args.stages} stages, blockwise {args.blockwise} (static counts)")
    rows = {cache: report(compile_kernel(cache, args)) for cache in args.caches.split(",")}
    names = list(next(iter(rows.values())))
    print(f"{'cache':<8}" + "".join(f"{name:>24}" for name in names))
    for cache, values in rows.items():
        print(f"{cache:<8}" + "".join(f"{values[name]!s:>24}" for name in names))


if __name__ == "__main__":
    main()
