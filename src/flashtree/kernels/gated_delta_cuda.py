"""The DeltaNet tree verify in CUDA C (`deltanet_tree.cu`): `gated_delta_triton.tree_verify`'s math and outputs in
float32 FMA, one CTA per value head and 32 value columns, for trees of up to 32 nodes on Hopper.

Why: the Triton kernel's substitution runs a tree level a round through shared memory and a barrier (~0.84 us a
level, 36.6 us a layer on the 27B verify's 23-node trees, H200, 2026-12-05); here one warp substitutes node by node
with its column of U in registers. `gated_delta_triton._tree_verify` launches this where `takes` says so (float32
inputs with 16-byte aligned rows, dk in `HEAD_DIMS`, dv a multiple of 32, at most 32 nodes, NVRTC and sm_90+, not
FLASHTREE_TREE_CUDA=0), and the Triton kernel otherwise; both leave the same outputs (u, Gamma and k for the commit
included), so the caller does not know which ran.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from flashtree.kernels import cuda_functions
from flashtree.errors import FlashtreeError
from flashtree.kernels.cuda_functions import functions, launch, nvrtc_loads

SOURCE = Path(__file__).with_name("deltanet_tree.cu")
COLS = 32  # value columns a CTA owns (deltanet_tree.cu COLS)
WARPS = 4  # warps a CTA of the instances named without `_w8` (deltanet_tree.cu TREE_WARPS; `tree_warps`)
NODE_TILES = (8, 16, 24, 32)  # node rows an instance reserves (multiples of 8: its warps take every 4th or 8th node)
HEAD_DIMS = (32, 64, 128)  # key widths with instances (shared memory grows with dk: 128 takes 62 KB at 32 nodes)
PHASE_WORDS = 10  # words a CTA writes in the phase-clock instance (deltanet_tree.cu PHASE_WORDS): 7 SM-clock stamps,
# its SM, the global timer (ns) at the start and the end


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          state: torch.Tensor, parents: torch.Tensor) -> bool:
    """Whether the CUDA kernel runs this tree (inputs already checked by the caller)."""
    t, _, dk = q.shape
    dv = v.shape[2]
    tensors = (q, k, v, g, beta, state)
    return (q.is_cuda and _available(q.device) and 0 < t <= NODE_TILES[-1] and dk in HEAD_DIMS and dv % COLS == 0
            and all(x.dtype == torch.float32 for x in tensors) and parents.dtype == torch.int64
            and parents.is_contiguous() and _rows_aligned(q) and _rows_aligned(k) and v.stride(2) == 1
            and state.stride(2) == 1 and state.stride(1) % 4 == 0 and state.stride(0) % 4 == 0
            and state.data_ptr() % 16 == 0)


def _rows_aligned(x: torch.Tensor) -> bool:
    """Rows that the kernel reads as float4s: unit stride, 16-byte aligned starts."""
    return x.stride(2) == 1 and x.stride(0) % 4 == 0 and x.stride(1) % 4 == 0 and x.data_ptr() % 16 == 0


@functools.cache
def _available(device: torch.device) -> bool:
    # griddepcontrol and the shared-memory opt-in need sm_90 (the Triton kernel serves older GPUs)
    return (os.environ.get("FLASHTREE_TREE_CUDA", "1") != "0" and torch.cuda.get_device_capability(device)[0] >= 9
            and nvrtc_loads())


def node_tile(t: int) -> int:
    return next(tile for tile in NODE_TILES if t <= tile)


def tree_warps() -> int:
    """Warps a CTA of the tree kernel: 8, or 4 where FLASHTREE_TREE_EIGHT_WARPS=0. The same sums in the same order
    (the host build and a GPU test check the bits equal); on 8 the 24-node instance's products loop is 134
    instructions a warp against 250 (offline, sm_90), and the 27B verify's DeltaNet kernels took 0.923 ms against
    0.951 (H100, thirtieth session, `steps-ab-short` with the session's four switches; the tree sweep's phases: a
    23-node chain's CTA 14.08 -> 13.31 us, its products phase unchanged)."""
    return 8 if os.environ.get("FLASHTREE_TREE_EIGHT_WARPS", "1") == "1" else WARPS


def instance(dk: int, nodes: int, clocks: bool = False, warps: int = WARPS) -> str:
    return f"deltanet_tree_d{dk}_n{nodes}" + (f"_w{warps}" if warps != WARPS else "") + ("_clocks" if clocks else "")


def shared_bytes(dk: int, nodes: int) -> int:
    """Dynamic shared memory of an instance: deltanet_tree.cu `TreeSmem::FLOATS` floats."""
    return 4 * (2 * nodes * (dk + 4) + dk * COLS + 2 * nodes * (nodes + 1) + nodes * COLS + 5 * nodes)


_PARAMS = ("q", "k", "v", "g", "beta", "state")
_STRIDES = ("sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "sg_t", "sg_h", "sb_t", "sb_h", "ss_h", "ss_k",
            "so_t", "so_h", "su_t", "su_h", "sgm_t", "sko_t", "sko_h")


def wrapper(dk: int, nodes: int, clocks: bool = False, warps: int = WARPS) -> str:
    """The extern "C" entry of one instance: flat arguments (as `launch` passes them) into deltanet_tree.cu's
    TreeArgs; `clocks` adds the phase-clock buffer (the TREE_PHASE_CLOCKS field)."""
    inputs = ", ".join(f"const float* {p}" for p in _PARAMS)
    strides = ", ".join(f"int {s}" for s in _STRIDES)
    fields = ", ".join((*_PARAMS, "parents", "o", "u", "gamma", "k_out", "T", "HK", *_STRIDES, "store_fold", "store_k",
                        *(("clocks",) if clocks else ())))
    name = instance(dk, nodes, clocks, warps)
    return (f'\nextern "C" __global__ void __launch_bounds__({32 * warps}) {name}({inputs}, '
            f"const long long* parents, float* o, float* u, float* gamma, float* k_out, int T, int HK, {strides}, "
            f"int store_fold, int store_k{', long long* clocks' if clocks else ''}) {{\n"
            f"    TreeArgs a = {{{fields}}};\n    tree_verify<{dk}, {nodes}>(a);\n}}\n")


def source(dk: int, nodes: int, clocks: bool = False, warps: int = WARPS) -> str:
    """An instance's CUDA C; `clocks` the phase-clock one (where each CTA's time goes: `tree_verify(clocks=...)`)."""
    defines = (("#define TREE_PHASE_CLOCKS\n" if clocks else "")
               + (f"#define TREE_WARPS {warps}\n" if warps != WARPS else ""))
    return defines + SOURCE.read_text() + wrapper(dk, nodes, clocks, warps)


def cuda_jobs(device: torch.device, dk: int) -> list[tuple[str, str]]:
    """(name, CUDA C source) of every instance a model with DeltaNet key width `dk` can launch on `device`, for the
    load-time compile (engine/loader.py); none where the kernel does not run."""
    if torch.device(device).type != "cuda" or dk not in HEAD_DIMS or not _available(torch.device(device)):
        return []
    warps = tree_warps()
    return [(instance(dk, nodes, warps=warps), source(dk, nodes, warps=warps)) for nodes in NODE_TILES]


def tree_verify(q, k, v, g, beta, state, parents, out, u, gamma, k_out, store_fold: bool, store_k: bool,
                clocks: torch.Tensor | None = None) -> None:
    """One launch writing out [T, H, dv] (and with `store_fold` u [T, H, dv] and gamma [T, H]; with `store_k` the
    keys into k_out [T, Hk, dk]); the tensors as `gated_delta_triton._tree_verify` passes them, `takes` true. With
    `clocks` (int64 [dv / 32, H, PHASE_WORDS]) the phase-clock instance runs and each CTA writes its stamps there."""
    t, hk, dk = q.shape
    h, dv = v.shape[1], v.shape[2]
    nodes = node_tile(t)
    timed = clocks is not None
    if timed and (clocks.dtype != torch.int64 or tuple(clocks.shape) != (dv // COLS, h, PHASE_WORDS)
                  or not clocks.is_contiguous()):
        raise FlashtreeError(f"clocks must be a contiguous int64 [{dv // COLS}, {h}, {PHASE_WORDS}] tensor")
    warps = tree_warps()
    name = instance(dk, nodes, timed, warps)
    fn = functions(q.device).function(name, lambda: source(dk, nodes, timed, warps))
    size = shared_bytes(dk, nodes)
    cuda_functions.allow_shared(q.device, name, size)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
               g.stride(1), beta.stride(0), beta.stride(1), state.stride(0), state.stride(1), out.stride(0),
               out.stride(1), u.stride(0), u.stride(1), gamma.stride(0), k_out.stride(0), k_out.stride(1))
    launch(fn, (h, dv // COLS), 32 * warps, [q, k, v, g, beta, state, parents, out, u, gamma, k_out, t, hk, *strides,
                                           int(store_fold), int(store_k), *((clocks,) if timed else ())], q.device,
           size)
