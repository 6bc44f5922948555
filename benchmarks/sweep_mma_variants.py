#!/usr/bin/env python3
"""Time two sources of the tensor-core kernels (mma.cu) against each other on the GPU, at the 27B shapes.

    git show cfd007c:src/flashtree/kernels/quant_matmul/mma.cu > /tmp/head.cu   # the source to compare with
    python3 benchmarks/sweep_mma_variants.py --head /tmp/head.cu --candidate src/flashtree/kernels/quant_matmul/mma.cu

The head's token-column kernel (qmm) against the candidate's one-row kernel (qmv) at one row of x, the
candidate at several launch shapes (row tiles, warps, splits); each point timed the way `flashtree bench
--kernels` times one (CUDA graph, weights rotated past the L2) and checked against the float32
dequantization. The dense `dequant` kernels of both sources are timed too (prefill's path). Prints one
table; details to --out. (2026-12-01: the one-row kernel and the shared-memory dequantization came from
this; a cp.async pipeline variant of qmm measured slower than the register double buffer.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402

from flashtree.bench.kernels import rotation, time_graph  # noqa: E402
from flashtree.bench.steps import read_bandwidth  # noqa: E402
from flashtree.kernels.quant_matmul import mma, quant_matmul_reference, random_quant_weight  # noqa: E402
from flashtree import nvrtc  # noqa: E402

SHAPES = {"gate/up 17408x5120": (17408, 5120), "down 5120x17408": (5120, 17408), "lm_head 248320x5120": (248320, 5120),
          "q+gate 12288x5120": (12288, 5120), "kv 1024x5120": (1024, 5120)}
ROWS = (1,)


@dataclass(frozen=True)
class Variant:
    label: str
    source: str  # the full .cu text
    kernel: str  # qmm (token columns) or qmv (one row, sub-block columns)
    config: mma.MMAConfig

    def name(self, qtype: QType, tg: int) -> str:
        c = self.config
        return (f"v{hashlib.sha256(self.source.encode()).hexdigest()[:8]}_{self.kernel}_{qtype.name.lower()}_r{c.rt}"
                f"_t{tg}_w{c.warps}_s{c.splits}")

    def wrapper(self, qtype: QType, tg: int) -> str:
        c = self.config
        tokens = f"{tg}, " if self.kernel == "qmm" else ""
        return (f'extern "C" __global__ void __launch_bounds__({c.warps * 32}) {self.name(qtype, tg)}(const u16* x, '
                f"const unsigned char* q, const unsigned char* h, const unsigned char* s, const u16* d, u16* out, "
                f"float* part, int* tickets, int M, int N, int K) {{ {self.kernel}<{qtype.name}, {c.rt}, {tokens}"
                f"{c.warps}, {c.splits}>(x, q, h, s, d, out, part, tickets, M, N, K); }}\n")

    def smem(self, qtype: QType) -> int:
        return 0

    def groups(self, m: int) -> int:
        return mma.ONE_ROW if self.kernel == "qmv" else (m + 7) // 8


def _compile(job: tuple[str, str, str]) -> tuple[str, bytes | str]:
    name, source, arch = job
    try:
        return name, mma.compile_cubin(source, arch)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
        return name, str(e)[-2000:]


def _load(cubin: bytes, name: str, smem: int):
    driver, _ = nvrtc.bindings()
    context = nvrtc.check(driver.cuDevicePrimaryCtxRetain(nvrtc.check(driver.cuDeviceGet(0), "cuDeviceGet")), "retain")
    nvrtc.check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    module = nvrtc.check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    fn = nvrtc.check(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")
    if smem > 48 * 1024:
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        nvrtc.check(driver.cuFuncSetAttribute(fn, attr, smem), "cuFuncSetAttribute")
    return fn


def _launch(fn, grid, threads, smem, args):
    import ctypes

    driver, _ = nvrtc.bindings()
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    values = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    types = tuple(ctypes.c_void_p if isinstance(a, torch.Tensor) else ctypes.c_int for a in args)
    nvrtc.check(driver.cuLaunchKernel(fn, grid[0], grid[1], 1, threads, 1, 1, smem, stream, (values, types), 0),
               "cuLaunchKernel")


def run_matmul(fn, variant: Variant, qtype, x, raw, n, k):
    c = variant.config
    m = x.shape[0]
    p = mma.pieces_of(raw, qtype, n, k)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    partial = torch.empty(c.splits, m, n, dtype=torch.float32, device=x.device) if c.splits > 1 else out
    _launch(fn, (n // (16 * c.rt), c.splits), 32 * c.warps, variant.smem(qtype),
            [x, p["quants"], p.get("high", p["quants"]), p["scales"], p.get("d", p["scales"]), out, partial,
             mma._tickets(x.device, torch.cuda.current_stream().cuda_stream), m, n, k])
    return out


def variants_for(qtype, n, k, m, head: str, candidate: str) -> list[Variant]:
    default = mma.choose_config(qtype, m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    out = [Variant("head", head, "qmm", default), Variant("qmv", candidate, "qmv", default)]
    for rt, warps, splits in ((1, 2, 1), (1, 4, 1), (1, 8, 1), (2, 2, 1), (2, 4, 1), (1, 4, 2), (1, 4, 4)):
        c = mma.MMAConfig(rt, warps, max(splits, default.splits) if splits == 1 else splits * default.splits)
        if c != default and n % (16 * rt) == 0 and (k // 256) >= warps * c.splits:
            out.append(Variant(f"qmv r{rt}w{warps}s{c.splits}", candidate, "qmv", c))
    return out


def dequant_variants(head: str, candidate: str):
    """(label, source, warps per CTA) of the dense bf16 dequantization."""
    return [("head", head, 8), ("smem-rows", candidate, 4)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--candidate", required=True)
    parser.add_argument("--head", help="the baseline source (default: the shipped mma.cu)")
    parser.add_argument("--out", default="variants.json")
    parser.add_argument("--budget-s", type=float, default=300)
    args = parser.parse_args()
    t0 = time.time()
    # mma.cu files as NVRTC compiles them: the cluster helpers first
    head = mma.cuda_functions.with_cluster_helpers(Path(args.head)) if args.head else mma.source()
    candidate = mma.cuda_functions.with_cluster_helpers(Path(args.candidate))
    arch = mma.arch_of(torch.device("cuda"))
    plan = []
    for qtype in (QType.Q4_K, QType.Q6_K):
        for label, (n, k) in SHAPES.items():
            if label.startswith("lm_head") and qtype != QType.Q6_K:
                continue
            for m in (ROWS if not label.startswith("lm_head") else (1, 23)):
                plan.append((qtype, label, n, k, m, variants_for(qtype, n, k, m, head, candidate)))
    jobs = {}
    for qtype, _, _, _, m, vs in plan:
        for v in vs:
            tg = v.groups(m)
            jobs[v.name(qtype, tg)] = v.source + v.wrapper(qtype, tg)
    for qtype in (QType.Q4_K, QType.Q6_K):
        for label, source, _ in dequant_variants(head, candidate):
            name = f"dq_{label.replace('-', '_')}_{qtype.name.lower()}"
            jobs[name] = source + mma._dequant_wrapper(name, qtype, 0)
    with ProcessPoolExecutor() as pool:
        cubins = dict(pool.map(_compile, [(name, src, arch) for name, src in jobs.items()]))
    failed = {name: err for name, err in cubins.items() if isinstance(err, str)}
    print(f"compiled {len(cubins) - len(failed)} of {len(cubins)} in {time.time() - t0:.0f} s", flush=True)
    for name, err in list(failed.items())[:3]:
        print(f"FAILED {name}:\n{err}")
    read_bps = read_bandwidth(torch.device("cuda"))
    print(f"read bandwidth {read_bps / 1e12:.2f} TB/s", flush=True)
    results = {"read_tbs": read_bps / 1e12, "matmul": [], "dequant": []}
    _dequant_table(cubins, head, candidate, results)
    print(f"\n{'type':5} {'matrix':20} {'M':>3} " + " ".join(f"{'':>1}" for _ in ()) + "variant: us (%bw) err")
    for qtype, label, n, k, m, vs in plan:
        if time.time() - t0 > args.budget_s:
            print("budget spent", flush=True)
            break
        torch.cuda.empty_cache()
        first = random_quant_weight(qtype, n, k, "cuda", seed=0)
        weights = [first] + [random_quant_weight(qtype, n, k, "cuda", seed=i) for i in range(1, rotation(first.nbytes))]
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        ref = quant_matmul_reference(x, first).float()
        floor = first.nbytes / read_bps
        cells = []
        for v in vs:
            name = v.name(qtype, v.groups(m))
            if isinstance(cubins[name], str):
                cells.append(f"{v.label}: FAIL")
                continue
            fn = _load(cubins[name], name, v.smem(qtype))
            out = run_matmul(fn, v, qtype, x, first.raw, n, k).float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            us = time_graph([lambda w=w: run_matmul(fn, v, qtype, x, w.raw, n, k) for w in weights], replays=10) * 1e6
            results["matmul"].append({"type": qtype.name, "matrix": label, "rows": m, "variant": v.label,
                                      "config": vars(v.config), "us": us,
                                      "of_bw": floor * 1e6 / us, "err": err})
            cells.append(f"{v.label}: {us:.1f} ({100 * floor * 1e6 / us:.0f}%) {err:.0e}")
        print(f"{qtype.name:5} {label:20} {m:3d}  " + " | ".join(cells), flush=True)
        del weights, first
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


def _dequant_table(cubins, head, candidate, results) -> None:
    n, k = 17408, 5120
    for qtype in (QType.Q4_K, QType.Q6_K):
        w = random_quant_weight(qtype, n, k, "cuda", seed=0)
        ref = mma.dequantize_emulated(w.raw, qtype, n, k)
        p = mma.pieces_of(w.raw, qtype, n, k)
        first = None
        for label, _, warps in dequant_variants(head, candidate):
            name = f"dq_{label.replace('-', '_')}_{qtype.name.lower()}"
            if isinstance(cubins[name], str):
                print(f"dequant {qtype.name} {label}: FAIL")
                continue
            fn = _load(cubins[name], name, 0)
            dense = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
            tiles = (n // 16) * (k // 256)

            def call(dense=dense, fn=fn, warps=warps):
                _launch(fn, ((tiles + warps - 1) // warps, 1), 32 * warps, 0,
                        [p["quants"], p.get("high", p["quants"]), p["scales"], p.get("d", p["scales"]), dense, n, k])
            call()
            first = dense.clone() if first is None else first
            exact = torch.equal(dense, first)  # each variant against the first (head)
            err = ((dense.float() - ref).abs().max() / ref.abs().max()).item()
            us = time_graph([call], replays=10) * 1e6
            moved = w.nbytes + n * k * 2
            results["dequant"].append({"type": qtype.name, "variant": label, "us": us, "equal_to_head": exact, "err": err,
                                       "tbs": moved / us / 1e6})
            print(f"dequant {qtype.name} 17408x5120 -> bf16 {label:10}: {us:7.1f} us, {moved / us / 1e6:.2f} TB/s "
                  f"(read + write), bits equal to head's: {exact}, err vs emulation {err:.1e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
