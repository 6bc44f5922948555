#!/usr/bin/env python3
"""Compile every Triton kernel the GPU path launches, for sm_90 (H200), on a machine without a GPU: the
entry points run on small CPU tensors with each launch intercepted and compiled instead of run (down to
SASS with the ptxas/cuobjdump bundled in the triton wheel). Catches what Triton's interpreter accepts and
the compiler does not (it did: `shift: tl.constexpr` reassigned in a static loop), and reports registers,
stack (spills) and the width of the global loads of each compiled variant. Static facts, not timings.

    python3 scripts/compile_kernels_offline.py [--only quant_matmul,tree_attention,...]

Figures for the device come from the device's triton (3.6 on the H200 machine; `pip install triton==3.6.0`
in a separate environment): another version picks other layouts (the 27B TQ3_0 decode launch's chunk loop
compiled to 771 instructions a warp under 3.6 and to 1147, with spills and 2-byte shared stores, under 3.9).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

TARGET = GPUTarget("cuda", 90, 32)
DEVICE_TRITON = "3.6"  # the H200 device machine's triton (its image: torch 2.11 + CUDA 13, triton 3.6)
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
          torch.bool: "i1"}
OPTIONS = ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion")
results: dict[tuple, dict] = {}


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type argument {value!r}")


def _compile_launch(fn: JITFunction, args: tuple, kwargs: dict) -> None:
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    names = [p.name for p in fn.params]
    bound = dict(zip(names, args)) | kwargs
    constexprs, signature, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = bound.setdefault(p.name, p.default)
        # as the JIT specializes a launch: ints equal to 1 become constants, and pointers and ints that are
        # multiples of 16 are marked so (vectorized loads depend on it), except where the kernel opts out
        free = p.do_not_specialize
        if p.is_constexpr or (type(value) is int and value == 1 and not free):
            constexprs[p.name] = value
            signature[p.name] = "constexpr"
            continue
        signature[p.name] = _type_of(value)
        aligned = value.data_ptr() % 16 == 0 if isinstance(value, torch.Tensor) else \
            type(value) is int and value % 16 == 0 and not free
        if aligned and not p.do_not_specialize_on_alignment:
            attrs[(i,)] = [["tt.divisibility", 16]]
    # a floating-point pointer's element type is part of the variant (a float32 query tile compiles to other code
    # than a bf16 one: the 27B verify's TQ3_0 tile spilled 536 bytes a thread instead of 112, 2026-12-05)
    pointers = tuple((f"*{name}", kind) for name, kind in signature.items() if kind in ("*fp32", "*fp16", "*bf16"))
    key = (fn.__name__, tuple(sorted((k, str(v)) for k, v in constexprs.items())) + pointers,
           tuple(sorted(options.items())))
    if key in results:
        return
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                                options=options)
        results[key] = _machine_code_facts(kernel.asm["cubin"])
    except Exception as exc:  # noqa: BLE001 - reported, the rest goes on
        results[key] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"}


def _machine_code_facts(cubin: bytes) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(cubin)
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([str(TOOLS / "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    code = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line).split(";")[0] for line in sass.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    loads = collections.Counter(word for line in code for word in line.split() if word.startswith("LDG"))
    shared = sum(1 for line in code for word in line.split() if word.startswith(("LDS", "STS", "BAR")))
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return {"regs": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None,
            "instructions": len(code), "global loads": dict(loads), "shared and barriers": shared,
            "main loop": _main_loop(sass), "loop barriers": _loop_barriers(sass)}


def _main_loop(sass: str) -> int | None:
    """Instructions in the largest loop body (a branch back to an earlier address; SASS instructions
    are 16 bytes), i.e. what one step of a kernel's K loop issues per warp; None without a loop."""
    span = _main_loop_span(sass)
    return (span[1] - span[0]) // 16 + 1 if span else None


def _main_loop_span(sass: str) -> tuple[int, int] | None:
    """(first, last) instruction address of the largest loop body, None without a loop."""
    spans = [(int(target, 16), int(here, 16))
             for here, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?P\d\s+)?BRA\s+0x([0-9a-f]+)", sass)
             if int(target, 16) < int(here, 16)]
    return max(spans, key=lambda span: span[1] - span[0], default=None)


def _loop_barriers(sass: str) -> int | None:
    """CTA barriers (BAR.SYNC) one step of the largest loop waits at: with a loop's dependent steps, what its
    time follows more than its instruction count (the quantized decode's chunks, LONG_CONTEXT.md)."""
    span = _main_loop_span(sass)
    if span is None:
        return None
    return sum(1 for here in re.findall(r"/\*([0-9a-f]{4,})\*/\s+BAR\.SYNC", sass)
               if span[0] <= int(here, 16) <= span[1])


def _intercept() -> None:
    """Launches compile instead of running; every kernel module believes it runs on a GPU."""
    JITFunction.__getitem__ = lambda self, grid: (lambda *a, **k: _compile_launch(self, a, dict(k)))
    import flashtree.kernels as kernels

    kernels.triton_runs_on = lambda device: True
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("flashtree.") and hasattr(module, "triton_runs_on"):
            module.triton_runs_on = lambda device: True


def quant_matmul() -> None:
    from flashtree.formats.quants import GGML_QUANT_SIZES
    from flashtree.kernels.quant_matmul import KERNELS, QuantWeight

    n, k = 256, 1024
    for qtype in KERNELS:
        block, size = GGML_QUANT_SIZES[qtype]
        weight = QuantWeight.from_gguf_bytes(torch.zeros(n * (k // block) * size, dtype=torch.uint8), qtype, (n, k))
        module = KERNELS[qtype].load()
        for m in (1, 23, 64, 512):  # decode, verify, the largest skinny, a prefill chunk (dense path)
            module.matmul(torch.zeros(m, k, dtype=torch.bfloat16), weight.fields(), n, k)


# H200 SXM: 132 SMs at up to 1.98 GHz, each issuing at most 4 warp-instructions per cycle (one per
# scheduler); read bandwidth measured 4.15 TB/s (h200-ceilings.md)
H200_WARP_ISSUE_PER_S = 132 * 4 * 1.98e9
H200_READ_BYTES_PER_S = 4.15e12
DECODE_SHAPES = ((17408, 5120), (5120, 17408))  # the 27B FFN matrices: gate/up, down
decode_steps: dict[tuple, tuple[str, int, int]] = {}  # result key -> (type, shape, weight bytes per warp per step)


def decode_issue_bound() -> None:
    """The 1-row (decode) launches of the Triton kernels at the 27B FFN shapes with the H200 defaults: each
    K-loop step reads one quant block (v2: BLOCK_K values) of each of the program's BLOCK_N rows, so the
    main loop's instruction count per weight byte bounds the kernel by issue rate alone."""
    from flashtree.formats.quants import GGML_QUANT_SIZES, QType
    from flashtree.kernels.quant_matmul import KERNELS, QuantWeight, _launch

    _launch._sm_count = lambda device: 132
    for qtype in KERNELS:
        block, size = GGML_QUANT_SIZES[qtype]
        module = KERNELS[qtype].load()
        for n, k in DECODE_SHAPES:
            weight = QuantWeight.from_gguf_bytes(torch.zeros(n * (k // block) * size, dtype=torch.uint8), qtype, (n, k))
            before = set(results)
            module.matmul(torch.zeros(1, k, dtype=torch.bfloat16), weight.fields(), n, k)
            for key in set(results) - before:
                setting = dict(key[1]) | dict(key[2])
                if "BLOCK_N" in setting:  # a weight tile: v1 steps one block per row, v2 BLOCK_K values
                    values = int(setting.get("BLOCK_K", block))
                    per_warp = int(setting["BLOCK_N"]) * size * values // block // int(setting["num_warps"])
                    decode_steps[key] = (QType(qtype).name, f"{n}x{k}", per_warp)


def _varying_pointers() -> set[tuple[str, str]]:
    """(kernel, pointer) pairs whose element type differs between a kernel's compiled variants: the only pointer
    types worth printing beside a variant's constexprs."""
    kinds = collections.defaultdict(set)
    for name, constexprs, _ in results:
        for k, v in constexprs:
            if k[0] == "*":
                kinds[name, k].add(v)
    return {pair for pair, seen in kinds.items() if len(seen) > 1}


def _print_issue_bound() -> None:
    if not decode_steps:
        return
    print("\ndecode (M=1) kernels: main-loop instructions per weight byte; issue-rate bound on the H200 "
          f"({H200_WARP_ISSUE_PER_S / 1e12:.3f} T warp-instr/s vs {H200_READ_BYTES_PER_S / 1e12:.2f} TB/s read)")
    print(f"{'type':<7} {'shape':<11} {'kernel':<14} {'loop instr':>10} {'bytes/warp':>10} {'instr/byte':>10} "
          f"{'issue/read time':>15} {'max % of roofline':>17}")
    for key, (qtype, shape, per_warp) in sorted(decode_steps.items(), key=lambda item: item[1]):
        loop = results[key].get("main loop")
        if loop is None:
            print(f"{qtype:<7} {shape:<11} {key[0]:<14} {'no loop':>10}")
            continue
        ratio = (loop / per_warp) * H200_READ_BYTES_PER_S / H200_WARP_ISSUE_PER_S
        print(f"{qtype:<7} {shape:<11} {key[0]:<14} {loop:>10} {per_warp:>10} {loop / per_warp:>10.3f} "
              f"{ratio:>15.2f} {min(100.0, 100 / ratio):>16.0f}%")


MMA_SHAPES = ((17408, 5120), (5120, 17408), (248320, 5120))
GLU_SHAPES = ((34816, 5120),)  # the fused gate + up, with and without its GLU epilogue
mma_steps: dict[tuple, tuple] = {}


def mma() -> None:
    """The tensor-core Q4_K/Q6_K CUDA kernels (NVRTC, no GPU needed; needs cuda-python and NVRTC) as the
    defaults launch them at the 27B shapes: registers, spills, and the main loop's instructions per weight
    byte (the loop is unrolled by two super-blocks; a warp reads `rt` 16x256 tiles per super-block)."""
    from flashtree.formats.quants import GGML_QUANT_SIZES
    from flashtree.kernels.quant_matmul import mma as kernels

    try:
        kernels.compile_cubin('extern "C" __global__ void probe() {}', "sm_90")
    except Exception as e:  # noqa: BLE001 - no cuda-python or no libnvrtc here: nothing to compile with
        print(f"mma: skipped, NVRTC unavailable ({str(e).splitlines()[0]})")
        return
    shapes = [(n, k, False) for n, k in MMA_SHAPES + GLU_SHAPES] + [(n, k, True) for n, k in GLU_SHAPES]
    for qtype in kernels.MMA_TYPES:
        tile_bytes = 16 * GGML_QUANT_SIZES[qtype][1]
        for n, k, glu in shapes:
            if n == 248320 and qtype.name != "Q6_K":
                continue
            for m, dtype in itertools.product((1, 8, 16, 23, 32), (torch.float32, torch.bfloat16)):
                # float32 x and out: a bf16 model's activations (docs/FIDELITY.md); bf16: the draft's and the sweeps'
                c = kernels.choose_config(qtype, m, n, k, 132)
                c = kernels.glu_config(c) if glu else c
                tg = kernels.token_groups(m)
                kernel = kernels.kernel_for(qtype, tg, n, k)
                name = kernels._instance(qtype, c, tg, kernel, dtype, dtype, glu)
                key = (name, (("rows", m),), (("shape", f"{n}x{k}"),))
                if key in results:  # qmh's x is prep_x's float16 either way: one instance per out type
                    continue
                try:
                    wrapper = kernels._wrapper(name, qtype, c, tg, kernel, dtype, dtype, glu)
                    cubin = kernels.compile_cubin(kernels.source() + wrapper, "sm_90")
                    results[key] = _machine_code_facts(cubin)
                except Exception as e:  # noqa: BLE001 - report and go on
                    results[key] = {"error": str(e).splitlines()[-1]}
                    continue
                mma_steps[key] = (qtype.name, f"{n}x{k}", m, 2 * c.rt * tile_bytes)


def _print_mma_bound() -> None:
    if not mma_steps:
        return
    print("\ntensor-core kernels: main-loop instructions per weight byte; issue-rate bound on the H200 "
          f"({H200_WARP_ISSUE_PER_S / 1e12:.3f} T warp-instr/s vs {H200_READ_BYTES_PER_S / 1e12:.2f} TB/s read)")
    print(f"{'type':<5} {'shape':<12} {'rows':>4} {'kernel':<24} {'regs':>4} {'stack':>5} {'loop instr':>10} "
          f"{'bytes/warp':>10} {'instr/byte':>10} {'max % of roofline':>17}")
    for key, (qtype, shape, m, per_warp) in sorted(mma_steps.items(), key=lambda item: item[1]):
        facts = results[key]
        loop = facts.get("main loop")
        ratio = (loop / per_warp) * H200_READ_BYTES_PER_S / H200_WARP_ISSUE_PER_S if loop else float("nan")
        print(f"{qtype:<5} {shape:<12} {m:>4} {key[0]:<24} {facts['regs']:>4} {facts['stack']:>5} {loop or 0:>10} "
              f"{per_warp:>10} {(loop or 0) / per_warp:>10.3f} {min(100.0, 100 / ratio):>16.0f}%")


SWAPPED_DECODES = ({"block_m": 8, "num_warps": 1}, {"block_m": 8, "num_warps": 2}, {"block_m": 8, "num_warps": 4},
                   {"block_m": 8, "num_warps": 4, "tq3_pairs": True},
                   {"block_m": 8, "num_warps": 4, "tq3_pairs": True, "fields_ahead": False},
                   {"block_m": 8, "num_warps": 2, "tq3_pairs": True, "fields_ahead": False},
                   {"block_m": 8, "num_warps": 1, "max_registers": 168},
                   {"block_m": 8, "num_warps": 2, "max_registers": 96},
                   {"block_m": 8, "num_warps": 2, "tq3_pairs": True, "fields_ahead": True})


def tree_attention() -> None:
    from flashtree.kernels.kv_quant import kv_type
    from flashtree.kernels.tree_attention import tree_attention as attend

    for cache in ("f16", "q8_0", "q4_0", "tq3_0"):
        caches = [kv_type(cache).quantize(torch.zeros(4, 64, 256)) for _ in range(2)]
        for n in (1, 23):
            attend(torch.zeros(24, n, 256, dtype=torch.bfloat16), *caches, cache, cache, torch.tensor([8]),
                   torch.ones(n, n, dtype=torch.bool), torch.arange(n), 8 + n, 0.0625)
        if cache == "f16":  # the output gate at the store, one split and several
            for split in (1, 4):
                attend(torch.zeros(24, 1, 256, dtype=torch.bfloat16), *caches, cache, cache, torch.tensor([8]),
                       torch.ones(1, 1, dtype=torch.bool), torch.arange(1), 9, 0.0625, split=split,
                       gate=torch.zeros(1, 24, 2, 256, dtype=torch.bfloat16)[:, :, 1],
                       q_norm=(torch.ones(256), 1e-6, torch.zeros(1, 64), torch.zeros(1, 64)))
        if cache != "f16":  # a verify's rows past its 128-row tile in a 16-row tile of their own (`tail`)
            attend(torch.zeros(24, 23, 256, dtype=torch.bfloat16), *caches, cache, cache, torch.tensor([8]),
                   torch.ones(23, 23, dtype=torch.bool), torch.arange(23), 31, 0.0625, tail=True, split=4)
        if cache in ("q8_0", "tq3_0"):  # the sweep's 1-2 warp decode candidates, and with the MMAs' sides swapped
            for warps in (1, 2):
                attend(torch.zeros(24, 1, 256, dtype=torch.bfloat16), *caches, cache, cache, torch.tensor([8]),
                       torch.ones(1, 1, dtype=torch.bool), torch.arange(1), 9, 0.0625, num_warps=warps,
                       max_registers=255)
            for launch in SWAPPED_DECODES:
                attend(torch.zeros(24, 1, 256, dtype=torch.bfloat16), *caches, cache, cache, torch.tensor([8]),
                       torch.ones(1, 1, dtype=torch.bool), torch.arange(1), 9, 0.0625, swap=True, **launch)
        if cache == "tq3_0":  # a bf16 model's verify: its float32 rotated query and gate, bf16 operands (#19 design D)
            for tail, pairs in ((False, None), (True, None), (True, True)):  # pairs: the sweep's "tile pairs"
                attend(torch.zeros(24, 23, 256), *caches, cache, cache, torch.tensor([8]),
                       torch.ones(23, 23, dtype=torch.bool), torch.arange(23), 31, 0.0625, split=4, tail=tail,
                       gate=torch.zeros(23, 24, 2, 256)[:, :, 1], unrotate_values=True, operands=torch.bfloat16,
                       tq3_pairs=pairs)
        if cache == "tq3_0":  # the values rotated back and gated in the combine
            attend(torch.zeros(24, 1, 256, dtype=torch.bfloat16), *caches, cache, cache, torch.tensor([8]),
                   torch.ones(1, 1, dtype=torch.bool), torch.arange(1), 9, 0.0625, split=4,
                   gate=torch.zeros(1, 24, 2, 256, dtype=torch.bfloat16)[:, :, 1], unrotate_values=True)
            # the sweep's TQ3_0 candidates: the float32 decode, the pairs in 32-row chunks on 8 warps, on 1 warp
            for launch in ({"tq3_pairs": False}, {"block_rows": 32, "num_warps": 8, "max_registers": 255},
                           {"num_warps": 1, "max_registers": 255, "fields_ahead": False}):
                attend(torch.zeros(24, 1, 256, dtype=torch.bfloat16), *caches, cache, cache, torch.tensor([8]),
                       torch.ones(1, 1, dtype=torch.bool), torch.arange(1), 9, 0.0625, **launch)
    _tree_attention_model_path()
    _draft_block_attention()


def _draft_block_attention() -> None:
    """As the 27B draft's block pass launches it (`dflash.BlockRows`): 16 queries of 40 heads over 10 bf16
    KV heads of 128, the query's norm and RoPE at the load, over 1K and 4K context rows."""
    from flashtree.kernels.tree_attention import tree_attention as attend

    for rows in (1040, 4112):
        caches = [torch.zeros(10, rows, 128, dtype=torch.bfloat16) for _ in range(2)]
        attend(torch.zeros(16, 40, 128, dtype=torch.bfloat16).transpose(0, 1), *caches, "bf16", "bf16",
               torch.tensor([rows - 16]), torch.ones(16, 16, dtype=torch.bool), torch.arange(16), rows, 128 ** -0.5,
               q_norm=(torch.ones(128), 1e-6, torch.zeros(16, 128), torch.zeros(16, 128)))


def _tree_attention_model_path() -> None:
    """As attention.py launches it over an f16 cache (q's norm and RoPE at the load, the gate at the store),
    with the default splits at the verify / decode shapes, and the compare sweep's candidate launches
    (benchmarks/sweep_tree_attention.py --compare)."""
    from flashtree.kernels.tree_attention import tree_attention as attend

    caches = [torch.zeros(4, 8300, 256, dtype=torch.float16) for _ in range(2)]
    candidates = ({}, {"operands": torch.float16}, {"num_stages": 2}, {"block_rows": 32},
                  {"block_rows": 64, "num_stages": 2}, {"block_rows": 64, "num_stages": 1},
                  {"block_m": 32, "block_rows": 32}, {"block_m": 128, "num_warps": 8}, {"block_m": 64, "num_warps": 8},
                  {"block_m": 32, "num_warps": 8})
    for n, committed in ((23, 1024), (23, 8192), (1, 1024), (65, 8192)):
        for launch in candidates if n > 1 else ({}, {"block_rows": 16}, {"block_rows": 64}):
            attend(torch.zeros(n, 24, 2, 256, dtype=torch.bfloat16)[:, :, 0].transpose(0, 1), *caches, "f16", "f16",
                   torch.tensor([committed]), torch.ones(n, n, dtype=torch.bool), torch.arange(n), committed + n,
                   0.0625, gate=torch.zeros(n, 24, 2, 256, dtype=torch.bfloat16)[:, :, 1],
                   q_norm=(torch.ones(256), 1e-6, torch.zeros(n, 64), torch.zeros(n, 64)), **launch)


def kv_dequant() -> None:
    from flashtree.kernels.kv_dequant import dequantize_kv
    from flashtree.kernels.kv_quant import kv_type

    for cache in ("q8_0", "q4_0", "tq3_0"):
        dequantize_kv(kv_type(cache).quantize(torch.zeros(4, 64, 256)), cache, torch.bfloat16)


def kv_write() -> None:
    from flashtree.kernels.kv_quant import kv_type
    from flashtree.kernels.kv_write import write_kv

    for cache in ("q8_0", "q4_0", "tq3_0"):  # a layer's keys (normed and roped in the launch) and values
        t = kv_type(cache)
        rows = torch.zeros(23, 4, 2, 256, dtype=torch.bfloat16)
        write_kv(rows[:, :, 0], rows[:, :, 1], t.allocate(4, 64, 256, "cpu"), t.allocate(4, 64, 256, "cpu"),
                 torch.arange(23), t, t, k_norm=(torch.ones(256), 1e-6, torch.zeros(23, 64), torch.zeros(23, 64)))


def norms_and_conv() -> None:
    from flashtree.kernels.deltanet_conv import conv_qkv
    from flashtree.kernels.deltanet_gates import GateInputs
    from flashtree.kernels.rms_norm import gated_rms_norm, rms_norm

    for rows in (1, 23):
        rms_norm(torch.zeros(rows, 5120, dtype=torch.bfloat16), torch.ones(5120), 1e-6)
        gated_rms_norm(torch.zeros(rows, 48, 128, dtype=torch.bfloat16), torch.ones(128), 1e-6,
                       torch.zeros(rows, 48, 128, dtype=torch.bfloat16), torch.bfloat16)
        conv_dim = 2 * 16 * 128 + 48 * 128  # the 27B DeltaNet: 16 q/k heads, 48 value heads of 128
        ba = torch.zeros(rows, 96, dtype=torch.bfloat16)
        conv_qkv(torch.zeros(rows, conv_dim, dtype=torch.bfloat16), torch.arange(rows) - 1,
                 torch.zeros(3, conv_dim, dtype=torch.bfloat16), torch.zeros(conv_dim, 4), 16, 48, 128,
                 GateInputs(ba[:, :48], ba[:, 48:], torch.zeros(48), torch.zeros(48)))


def fusion() -> None:
    """The small kernels of the fused decode step, at the 27B shapes (1 and 23 rows)."""
    from flashtree.kernels.activations import gated_heads, interleaved_silu_mul, silu_mul
    from flashtree.kernels.deltanet_conv import conv_qkv
    from flashtree.kernels.deltanet_gates import GateInputs
    from flashtree.kernels.qk_norm_rope import norm_rope_into_cache, qk_norm_rope, rope_tables
    from flashtree.kernels.rms_norm import add_rms_norm

    bf16 = torch.bfloat16
    conv_dim = 2 * 16 * 128 + 48 * 128
    for rows in (1, 23):
        ba = torch.zeros(rows, 96, dtype=bf16)
        qg = torch.zeros(rows, 24, 2, 256, dtype=bf16)
        qk_norm_rope(qg[:, :, 0], torch.ones(256), 1e-6, torch.zeros(rows, 64), torch.zeros(rows, 64))
        rope_tables(torch.arange(rows), 64, 1e7)
        kv = torch.zeros(rows, 2, 4, 256, dtype=bf16)
        norm_rope_into_cache(kv[:, 0], kv[:, 1], torch.ones(256), 1e-6, torch.zeros(rows, 64), torch.zeros(rows, 64),
                             torch.zeros(4, 1024, 256, dtype=bf16), torch.zeros(4, 1024, 256, dtype=bf16),
                             torch.arange(rows))
        gated_heads(torch.zeros(24, rows, 256, dtype=bf16), qg[:, :, 1])
        gate_up = torch.zeros(rows, 2 * 17408, dtype=bf16)
        silu_mul(gate_up[:, :17408], gate_up[:, 17408:])
        interleaved_silu_mul(gate_up)  # a fused gate + up's dense prefill rows (GluLinear)
        add_rms_norm(torch.zeros(rows, 5120, dtype=bf16), torch.zeros(rows, 5120, dtype=bf16), torch.ones(5120), 1e-6)
        conv_qkv(torch.zeros(rows, conv_dim, dtype=bf16), None, torch.zeros(3, conv_dim), torch.zeros(conv_dim, 4),
                 16, 48, 128, GateInputs(ba[:, :48], ba[:, 48:], torch.zeros(48), torch.zeros(48)), advance_state=True)


def draft() -> None:
    """The DFlash draft's context append and graph-ready block pass at the 27B draft's geometry: hidden 5120,
    32 query and 8 KV heads of 128 (its q/k norm + RoPE and K/V write variants differ from the target's heads
    of 256 with 64 rotated dims). Layer count and MLP width pick no variant, so they are kept small; the
    weights are left uninitialized (nothing runs)."""
    from flashtree.models.dflash import DFlashDraft, DraftConfig

    config = DraftConfig.from_json({
        "hidden_size": 5120, "intermediate_size": 1024, "num_hidden_layers": 1, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e7, "block_size": 16,
        "vocab_size": 16, "num_target_layers": 4, "dflash_config": {"mask_token_id": 0, "target_layer_ids": [1]}})
    with torch.device("meta"):
        model = DFlashDraft(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    cache = model.new_cache(1024)
    model.append_context(cache, torch.zeros(23, config.feature_size, dtype=torch.bfloat16), torch.arange(23))
    model.forward_block(cache, torch.zeros(16, 5120, dtype=torch.bfloat16), torch.tensor([23]), 256, torch.tensor([23]))


def gated_delta() -> None:
    from flashtree.kernels import gated_delta_triton

    for n in (1, 4, 23, 64):
        q, k = torch.zeros(n, 16, 128), torch.zeros(n, 16, 128)
        v, g, beta, state = torch.zeros(n, 48, 128), torch.zeros(n, 48), torch.zeros(n, 48), torch.zeros(48, 128, 128)
        if n < 64:
            gated_delta_triton.recurrent_step(q, k, v, g, beta, state)
        _, u, gamma = gated_delta_triton.tree_verify_with_fold(q, k, v, g, beta, state, torch.arange(n) - 1)
        gated_delta_triton.fold_path(k, u, gamma, state, torch.arange(n), torch.tensor([n]))  # a commit
        if n > gated_delta_triton.FOLD_ROWS:
            continue
        into = gated_delta_triton.FoldBuffers.allocate(48, 128, 16, 128, "cpu")  # the engine's: all layers at once
        gated_delta_triton.tree_verify_with_fold(q, k, v, g, beta, state, torch.arange(n) - 1, into=into)
        tables = gated_delta_triton.FoldTables.of([state, state.clone()], [into, into])
        for block_v, block_k, warps in ((32, 16, 4), (64, 32, 4), (32, 32, 4), (64, 16, 4), (128, 16, 8)):
            gated_delta_triton.fold_layers(tables, torch.arange(n), torch.tensor([n]), block_v, block_k, warps)


def commit_rows() -> None:
    """The commit's row moves at the 27B shape: one K or V cache (bf16 rows of 256; TQ3_0's 112 bytes) and all 32
    of a device through their table, a path of 23 rows; the 48 conv windows shifted from their kept inputs, which
    the tree's conv launch copies."""
    from flashtree.kernels.commit_rows import RowTable, WindowTable, move_rows, move_rows_together, shift_windows_together
    from flashtree.kernels.deltanet_conv import conv_qkv
    from flashtree.kernels.deltanet_gates import GateInputs

    rows = torch.arange(23)
    for dtype, width in ((torch.bfloat16, 256), (torch.uint8, 112)):
        caches = [torch.zeros(4, 64, width, dtype=dtype) for _ in range(2)]
        move_rows(caches[0], rows, rows)
        move_rows_together(RowTable.group(caches)[0], rows, rows)
    conv_dim = 2 * 16 * 128 + 48 * 128
    windows, kept = [torch.zeros(3, conv_dim) for _ in range(2)], [torch.zeros(24, conv_dim) for _ in range(2)]
    shift_windows_together(WindowTable.of(windows, kept), rows, torch.tensor([4]))
    ba = torch.zeros(23, 96)
    conv_qkv(torch.zeros(23, conv_dim), rows - 1, windows[0], torch.zeros(conv_dim, 4), 16, 48, 128,
             GateInputs(ba[:, :48], ba[:, 48:], torch.zeros(48), torch.zeros(48)), keep_inputs=kept[0])


def host_rows() -> None:
    """The token embedding's rows gathered from pinned host memory: a Q4_K row of 5120 values (720 words), 23 ids."""
    from flashtree.kernels.host_rows import gather_rows

    gather_rows(torch.zeros(64, 2880, dtype=torch.uint8), torch.arange(23))


def deltanet_tree() -> None:
    """The DeltaNet tree verify in CUDA C (kernels/deltanet_tree.cu, NVRTC like `mma`): every node tile at each key
    width it has instances for, on 4 warps and on 8 (FLASHTREE_TREE_EIGHT_WARPS=1)."""
    from flashtree.kernels import gated_delta_cuda
    from flashtree.nvrtc import compile_cubin

    for dk, nodes, warps in itertools.product(gated_delta_cuda.HEAD_DIMS, gated_delta_cuda.NODE_TILES, (4, 8)):
        key = (gated_delta_cuda.instance(dk, nodes, warps=warps),
               (("shared", gated_delta_cuda.shared_bytes(dk, nodes)),), ())
        try:
            results[key] = _machine_code_facts(compile_cubin(gated_delta_cuda.source(dk, nodes, warps=warps), "sm_90"))
        except Exception as e:  # noqa: BLE001 - no NVRTC here, or the source does not compile: report and go on
            results[key] = {"error": str(e).splitlines()[-1]}


def block32() -> None:
    """The 32-value block types' tensor-core kernel (kernels/quant_matmul/block32_mma.cu, NVRTC like `mma`) as its
    defaults launch at the 27B FFN shapes: registers, spills, and the main loop's instructions per weight byte (the
    loop is unrolled by two 128-value chunks; a warp reads `rt` 16-row tiles of each)."""
    from flashtree.formats.quants import GGML_QUANT_SIZES
    from flashtree.kernels.quant_matmul import block32_mma, mma as kernels

    try:
        kernels.compile_cubin('extern "C" __global__ void probe() {}', "sm_90")
    except Exception as e:  # noqa: BLE001 - no cuda-python or no libnvrtc here: nothing to compile with
        print(f"block32: skipped, NVRTC unavailable ({str(e).splitlines()[0]})")
        return
    for qtype in block32_mma.TYPES:
        block, size = GGML_QUANT_SIZES[qtype]
        for (n, k), m in itertools.product(((17408, 5120), (5120, 17408)), (1, 8, 16, 23, 32)):
            c, tg = block32_mma.choose_config(qtype, m, n, k, 132), kernels.token_groups(m) or 1
            name = block32_mma._instance(qtype, c, tg, torch.float32)
            key = (name, (("rows", m),), (("shape", f"{n}x{k}"),))
            try:
                source = block32_mma.source() + block32_mma._wrapper(name, qtype, c, tg, torch.float32)
                results[key] = _machine_code_facts(kernels.compile_cubin(source, "sm_90"))
            except Exception as e:  # noqa: BLE001 - report and go on
                results[key] = {"error": str(e).splitlines()[-1]}
                continue
            mma_steps[key] = (qtype.name, f"{n}x{k}", m, 2 * c.rt * 16 * block32_mma.CHUNK * size // block)


def topk_logprobs() -> None:
    """The draft's [15, 248320] float32 logits of the 27B (and a bf16 row set), the tree's top 8."""
    from flashtree.kernels.topk_logprobs import topk_logprobs as top

    for dtype in (torch.float32, torch.bfloat16):
        top(torch.zeros(15, 248320, dtype=dtype), 8, kernel=True)


PARTS = {"quant_matmul": quant_matmul, "decode_issue_bound": decode_issue_bound, "mma": mma,
         "tree_attention": tree_attention,
         "kv_dequant": kv_dequant, "kv_write": kv_write,
         "norms_and_conv": norms_and_conv, "fusion": fusion, "draft": draft, "gated_delta": gated_delta,
         "commit_rows": commit_rows, "host_rows": host_rows, "deltanet_tree": deltanet_tree,
         "topk_logprobs": topk_logprobs, "block32": block32}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(PARTS))
    args = parser.parse_args()
    if not triton.__version__.startswith(DEVICE_TRITON):
        print(f"note: triton {triton.__version__} here, {DEVICE_TRITON} on the device: its layouts and counts may differ")
    _intercept()
    for part in args.only.split(","):
        try:
            PARTS[part]()
        except Exception:  # noqa: BLE001 - an entry point that needs more than a launch: say so, go on
            traceback.print_exc()
    failed = 0
    varying = _varying_pointers()
    for (name, constexprs, options), facts in sorted(results.items()):
        setting = " ".join(f"{k}={v}" for k, v in constexprs if k != "K" and (k[0] != "*" or (name, k) in varying)) \
            + " " + " ".join(f"{k}={v}" for k, v in options)
        if "error" in facts:
            failed += 1
            print(f"FAIL {name:<26} {setting}\n     {facts['error']}")
        else:
            print(f"ok   {name:<26} regs {facts['regs']:>3} stack {facts['stack']:>4} instr {facts['instructions']:>5}  "
                  f"loop {facts['main loop'] or '-'} (bar {facts['loop barriers'] or 0})  "
                  f"shared+bar {facts['shared and barriers']}  "
                  f"loads {facts['global loads']}  {setting}")
    print(f"{len(results)} kernel variants compiled for sm_90, {failed} failed")
    _print_issue_bound()
    _print_mma_bound()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
