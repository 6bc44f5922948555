"""The Gated DeltaNet's input stage in one launch: the tree-aware causal depthwise conv over the qkv
projection, SiLU, then q and k L2-normalised (q also scaled by head_dim^-0.5) and tiled to the value
heads (v head h uses q/k head h % Hk, the GGUF's order), v as float32; and the per-head gates g, beta
(`deltanet_gates`), which the first program of each token computes, saving the step a launch per layer.

In PyTorch this is ~30 small kernels per layer (window gathers, the conv product and sum, casts, SiLU,
two norms, two repeats); at 48 DeltaNet layers that is ~1500 launches per decode or verify step. The
Triton kernel is one program per (token, head-sized channel block). A token's conv window is itself
and its kernel-1 nearest ancestors: the parent chain in a tree (parents[i] < 0: the committed prefix,
whose last inputs are the conv state's rows), the previous tokens in a run. Both forms round where the
model does (the conv sum to the activation dtype, SiLU in it), so they differ only in float32
summation order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from flashtree.kernels import triton_runs_on
from flashtree.kernels.deltanet_gates import GateInputs, gates_reference

try:  # the kernel needs triton; the reference does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None

EPS = 1e-6


def conv_qkv_reference(inputs: torch.Tensor, parents: torch.Tensor | None, conv_state: torch.Tensor,
                       conv_weight: torch.Tensor, qk_heads: int, v_heads: int, head_dim: int,
                       advance_state: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inputs [T, conv_dim] (the qkv projection, activation dtype), parents [T] int64 (None: a run, each
    token's parent the previous one), conv_state [kernel-1, conv_dim] (oldest first), conv_weight
    [conv_dim, kernel] (last tap: the token itself). Returns q, k [T, v_heads, head_dim] and v [T, v_heads,
    head_dim], float32. `advance_state` (a run only): the state then ends with the run's last inputs."""
    n, key_dim = inputs.shape[0], qk_heads * head_dim
    if parents is None:
        parents = torch.arange(-1, n - 1, device=inputs.device)
    mixed = F.silu(_conv(inputs, parents, conv_state, conv_weight))
    if advance_state:
        _advance(conv_state, inputs)
    q, k, v = mixed.split([key_dim, key_dim, v_heads * head_dim], dim=-1)
    q, k = q.reshape(n, qk_heads, head_dim).float(), k.reshape(n, qk_heads, head_dim).float()
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + EPS) * head_dim**-0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + EPS)
    repeats = v_heads // qk_heads
    return q.repeat(1, repeats, 1), k.repeat(1, repeats, 1), v.reshape(n, v_heads, head_dim).float()


def _advance(conv_state: torch.Tensor, inputs: torch.Tensor) -> None:
    """In place (a captured CUDA graph keeps reading the buffer): the state's rows shifted by the run."""
    conv_state.copy_(torch.cat([conv_state, inputs.to(conv_state.dtype)])[-conv_state.shape[0]:])


def _conv(inputs: torch.Tensor, parents: torch.Tensor, conv_state: torch.Tensor,
          conv_weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv where each token's window is [its kernel-1 ancestors ; itself]."""
    history = conv_state.shape[0]
    buffer = torch.cat([conv_state.to(inputs.dtype), inputs])
    # previous[e] for every buffer row: state rows chain backwards, a node points at its parent
    # (or at the newest state row when its parent is the committed prefix).
    node_prev = torch.where(parents < 0, history - 1, parents + history)
    state_prev = (torch.arange(history, device=inputs.device) - 1).clamp(min=0)
    previous = torch.cat([state_prev, node_prev])
    cols = [torch.arange(history, history + inputs.shape[0], device=inputs.device)]
    for _ in range(history):
        cols.append(previous[cols[-1]])
    windows = buffer[torch.stack(cols[::-1], dim=1)]  # [T, kernel, conv_dim], oldest first
    return (windows.float() * conv_weight.t()[None]).sum(1).to(inputs.dtype)


def conv_qkv(inputs: torch.Tensor, parents: torch.Tensor | None, conv_state: torch.Tensor, conv_weight: torch.Tensor,
             qk_heads: int, v_heads: int, head_dim: int, gate_inputs: GateInputs,
             advance_state: bool = False, keep_inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(q, k, v) of `conv_qkv_reference` and (g, beta) of `gates_reference(*gate_inputs)`: the Triton kernel
    where Triton runs (a 4-tap conv, power-of-two head_dim, unit-stride gate rows), else the references.
    A decode token (one token, advance_state) also shifts the conv state inside the same launch; a longer
    run shifts it after. `keep_inputs` (contiguous [>= T, conv_dim], the conv state's dtype): its first T rows
    get the inputs (the kernel stores the rows it reads), where the commit shifts the window from."""
    n, conv_dim = inputs.shape
    if advance_state and parents is not None:
        raise ValueError("advance_state is for a run of tokens (parents None), not a tree")
    if keep_inputs is not None and (keep_inputs.shape[0] < n or keep_inputs.shape[1:] != (conv_dim,)
                                    or keep_inputs.dtype != conv_state.dtype or not keep_inputs.is_contiguous()):
        raise ValueError(f"keep_inputs {tuple(keep_inputs.shape)} {keep_inputs.dtype} does not take {n} rows of "
                         f"{conv_dim} in {conv_state.dtype}")
    b, a, decay_rate, dt_bias = gate_inputs
    if (triton is None or not triton_runs_on(inputs.device) or conv_weight.shape[1] != 4 or n == 0
            or head_dim & (head_dim - 1) or conv_dim != (2 * qk_heads + v_heads) * head_dim
            or not conv_state.is_contiguous() or b.stride(-1) != 1 or a.stride(-1) != 1
            or b.shape != (n, v_heads) or a.shape != (n, v_heads)):
        if keep_inputs is not None:
            keep_inputs[:n].copy_(inputs)
        return (*conv_qkv_reference(inputs, parents, conv_state, conv_weight, qk_heads, v_heads, head_dim,
                                    advance_state), *gates_reference(*gate_inputs))
    # rows may stride (a tree's columns of the fused input projection's output): read in place, no copy launch
    inputs = inputs if inputs.stride(1) == 1 else inputs.contiguous()
    q = torch.empty(n, v_heads, head_dim, dtype=torch.float32, device=inputs.device)
    k, v = torch.empty_like(q), torch.empty_like(q)
    g = torch.empty(n, v_heads, dtype=torch.float32, device=inputs.device)
    beta = torch.empty_like(g)
    in_kernel = advance_state and n == 1  # one program per channel block reads the window, then shifts it
    parents_arg = _no_parents(inputs.device) if parents is None else parents.to(torch.int64).contiguous()
    _conv_qkv_kernel[(n, conv_dim // head_dim)](
        inputs, parents_arg, conv_state, conv_weight.contiguous(), q, k, v, conv_dim, inputs.stride(0), head_dim**-0.5,
        EPS,
        b, a, decay_rate, dt_bias, g, beta, b.stride(0), a.stride(0), conv_state if keep_inputs is None else keep_inputs,
        HK=qk_heads, HV=v_heads, D=head_dim, HV_P2=triton.next_power_of_2(v_heads), RUN=parents is None,
        ADVANCE=in_kernel, KEEP_INPUTS=keep_inputs is not None, num_warps=4)
    if advance_state and not in_kernel:  # several programs read the state: shift it once they are done
        _advance(conv_state, inputs)
    return q, k, v, g, beta


@functools.cache
def _no_parents(device: torch.device) -> torch.Tensor:
    """The parents argument of a run (never read: RUN): an int64 pointer, so the kernel's types hold."""
    return torch.zeros(1, dtype=torch.int64, device=device)


if triton is not None:
    from flashtree.kernels.deltanet_gates import gate_values

    @triton.jit
    def _window_row(inputs_ptr, state_ptr, e, cols, conv_dim, stride_in, HISTORY: tl.constexpr):
        """Row e of [conv state (rounded to the activation dtype) ; inputs], as float32."""
        row = e.to(tl.int64) + tl.zeros_like(cols).to(tl.int64)  # the row per lane: masks stay vectors
        from_state = row < HISTORY
        state_row = tl.load(state_ptr + row * conv_dim + cols, mask=from_state, other=0.0)
        input_row = tl.load(inputs_ptr + (row - HISTORY) * stride_in + cols, mask=row >= HISTORY, other=0.0)
        state_row = state_row.to(inputs_ptr.dtype.element_ty).to(tl.float32)
        return tl.where(from_state, state_row, input_row.to(tl.float32))

    @triton.jit
    def _previous(parents_ptr, e, HISTORY: tl.constexpr, RUN: tl.constexpr):
        """The buffer row before row e in e's window (see the reference's `previous`); in a run (no
        parents) simply the row before."""
        before = tl.maximum(e - 1, 0)
        if not RUN:
            is_node = e >= HISTORY
            parent = tl.load(parents_ptr + tl.where(is_node, e - HISTORY, 0)).to(tl.int32)
            before = tl.where(is_node, tl.where(parent < 0, HISTORY - 1, parent + HISTORY), before)
        return before

    @triton.jit
    def _conv_qkv_kernel(inputs_ptr, parents_ptr, state_ptr, w_ptr, q_ptr, k_ptr, v_ptr, conv_dim, stride_in, scale, eps,
                         b_ptr, a_ptr, decay_ptr, bias_ptr, g_ptr, beta_ptr, b_stride, a_stride, keep_ptr,
                         HK: tl.constexpr, HV: tl.constexpr, D: tl.constexpr, HV_P2: tl.constexpr,
                         RUN: tl.constexpr, ADVANCE: tl.constexpr, KEEP_INPUTS: tl.constexpr):
        token = tl.program_id(0)
        block = tl.program_id(1)  # D channels: q head `block`, k head `block - HK` or v head `block - 2 HK`
        if block == 0:  # the token's gates, one value per value head
            heads = tl.arange(0, HV_P2)
            ok = heads < HV
            row = token.to(tl.int64)
            b = tl.load(b_ptr + row * b_stride + heads, mask=ok, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + row * a_stride + heads, mask=ok, other=0.0).to(tl.float32)
            g, beta = gate_values(b, a, tl.load(decay_ptr + heads, mask=ok, other=0.0),
                                  tl.load(bias_ptr + heads, mask=ok, other=0.0))
            tl.store(g_ptr + row * HV + heads, g, mask=ok)
            tl.store(beta_ptr + row * HV + heads, beta, mask=ok)
        cols = block * D + tl.arange(0, D)
        if KEEP_INPUTS:  # the token's own inputs, kept for the commit's window shift
            own = tl.load(inputs_ptr + token.to(tl.int64) * stride_in + cols)
            tl.store(keep_ptr + token.to(tl.int64) * conv_dim + cols, own.to(keep_ptr.dtype.element_ty))
        e0 = token + 3  # the token's own row in [state (3 rows) ; inputs]
        e1 = _previous(parents_ptr, e0, 3, RUN)
        e2 = _previous(parents_ptr, e1, 3, RUN)
        e3 = _previous(parents_ptr, e2, 3, RUN)
        if ADVANCE:  # one decode token: this program alone reads these channels' state, so shift it here
            s1 = tl.load(state_ptr + conv_dim + cols)
            s2 = tl.load(state_ptr + 2 * conv_dim + cols)
            newest = tl.load(inputs_ptr + cols).to(state_ptr.dtype.element_ty)
        # oldest tap first, as the reference sums
        acc = _window_row(inputs_ptr, state_ptr, e3, cols, conv_dim, stride_in, 3) * tl.load(w_ptr + cols * 4)
        acc += _window_row(inputs_ptr, state_ptr, e2, cols, conv_dim, stride_in, 3) * tl.load(w_ptr + cols * 4 + 1)
        acc += _window_row(inputs_ptr, state_ptr, e1, cols, conv_dim, stride_in, 3) * tl.load(w_ptr + cols * 4 + 2)
        acc += _window_row(inputs_ptr, state_ptr, e0, cols, conv_dim, stride_in, 3) * tl.load(w_ptr + cols * 4 + 3)
        dtype = inputs_ptr.dtype.element_ty
        x = acc.to(dtype).to(tl.float32)
        x = (x * tl.sigmoid(x)).to(dtype).to(tl.float32)  # SiLU in the activation dtype
        inv_norm = tl.rsqrt(tl.sum(x * x, axis=0) + eps)
        offs = tl.arange(0, D)
        base = token.to(tl.int64) * HV * D
        lane_block = block + tl.zeros_like(offs)  # per lane, so the store masks are vectors
        for r in tl.static_range(HV // HK):  # tiled: q/k head h serves value heads h, h + HK, ...
            tl.store(q_ptr + base + (block + r * HK) * D + offs, x * inv_norm * scale, mask=lane_block < HK)
            tl.store(k_ptr + base + (block - HK + r * HK) * D + offs, x * inv_norm,
                     mask=(lane_block >= HK) & (lane_block < 2 * HK))
        tl.store(v_ptr + base + (block - 2 * HK) * D + offs, x, mask=lane_block >= 2 * HK)
        if ADVANCE:
            tl.debug_barrier()  # the window's state rows were read above
            tl.store(state_ptr + cols, s1)
            tl.store(state_ptr + conv_dim + cols, s2)
            tl.store(state_ptr + 2 * conv_dim + cols, newest)
