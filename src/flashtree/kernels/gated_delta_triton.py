"""Fused Triton kernels for the gated delta rule at decode time (float32 state and math).

Same math and shapes as `gated_delta` (q, k, v: [T, H, d]; g, beta: [T, H]; state: [H, dk, dv]);
q and k may also carry Hk heads with H % Hk == 0, value head h then using q/k head h % Hk (the
tiling `torch.repeat` gives), so the caller need not expand them. Both kernels run one program per
(value head, BLOCK_V-wide tile of value columns): the delta rule never mixes value columns, so a
program needs only S0[:, tile] (dk x BLOCK_V) and the whole of q/k for its head.

- `recurrent_step`: T >= 1 tokens in sequence (decode: T = 1). The state tile lives in registers across the
  token loop and is written back in place, so one launch replaces the per-token torch ops and a captured
  CUDA graph keeps reading the same buffer.
- `fold_path`: the state after a verified tree's accepted path in one product, from the verify's own per-node
  u and Gamma (`tree_verify_with_fold`): S = exp(Gamma_leaf) S0 + sum over the path of exp(Gamma_leaf - Gamma_j)
  k_j u_j^T (`gated_delta.fold`, the CPU's commit): no token loop, the path's rows read in place, its length on
  the device.
- `fold_layers`: `fold_path` for every DeltaNet layer of a device in one launch, from the verify's u, Gamma and k
  left in `FoldBuffers` that outlive it, through a table of their addresses (`FoldTables`, built once).
- `tree_verify`: outputs of every node of a draft tree (T <= 64; parents[i] < i, -1 = attached to
  the current state), each node seeing the state reached along its own root-to-node path; the
  state is only read. It is the `ancestor_chunk` (WY) form evaluated in one program:
    1. ancestor mask and Gamma_i (sum of g over ancestors-or-self) by chasing parent pointers, all nodes at
       once (tree-depth iterations, each a [T] gather from `parents` / `g` held in registers);
    2. K S0 (T x BLOCK_V) and K K^T (T x T) with tl.dot over dk chunks;
    3. A = strict-ancestor-masked beta_i exp(Gamma_i - Gamma_j) k_i.k_j, right-hand side
       beta (V - exp(Gamma) K S0), and (I + A) U = rhs by substitution a depth level at a time
       (parents come before children, so A is strictly lower triangular);
    4. Q S0 and Q K^T (a second pass over dk: fewer live registers during the solve), then
       O = exp(Gamma) Q S0 + (ancestor-masked exp(Gamma_i - Gamma_j) q_i.k_j) U with one tl.dot.
  No per-node state is ever materialised (U is T x BLOCK_V), so nothing but q/k/v/g/beta/S0 is read.

Without CUDA (and without TRITON_INTERPRET=1) both functions fall back to their torch references,
which have the same signatures and in-place semantics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import address_table, gated_delta, gated_delta_cuda, triton_runs_on

try:  # the kernels need triton; the references and the fallback do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None

MAX_TREE_NODES = 64
# rows of `FoldBuffers`: the default budget's tree (22 nodes and the root) and one more; a larger verify leaves
# its rows in tensors of its own and its commit takes a launch a layer (`fold_path`, `shift_window`), so that the
# buffers, kept for the cache's life, hold 104 MB at the 27B shape (u, Gamma, k and the conv inputs) instead of 139
# at 32 rows: memory that a 24 GiB card at 262K tokens does not have to spare (issue #20)
FOLD_ROWS = 24
_H200_SMS = 132


# ---------------------------------------------------------------------------------------------
# torch references (same signatures)

def ancestors_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """Inclusive ancestor matrix [T, T] (bool): row i is True at i and at every ancestor of i."""
    for i, p in enumerate(parents.tolist()):
        if p >= i or p < -1:
            raise FlashtreeError(f"parents[{i}] = {p}: a parent must come before its child (or be -1)")
    return gated_delta.ancestor_matrix(parents)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat(1, heads // x.shape[1], 1)


def recurrent_step_reference(q, k, v, g, beta, state):
    """`gated_delta.recurrent`, with `state` updated in place. Returns o [T, H, dv] (float32)."""
    _check(q, k, v, g, beta, state)
    h = v.shape[1]
    o, final = gated_delta.recurrent(_expand_heads(q, h), _expand_heads(k, h), v, g, beta, state)
    state.copy_(final)
    return o


def tree_verify_reference(q, k, v, g, beta, state, parents):
    """`gated_delta.ancestor_chunk` with the ancestor mask built from `parents`; state untouched."""
    _check(q, k, v, g, beta, state, parents)
    return _ancestor_chunk(q, k, v, g, beta, state, parents)[0]


def _ancestor_chunk(q, k, v, g, beta, state, parents):
    h = v.shape[1]
    return gated_delta.ancestor_chunk(_expand_heads(q, h), _expand_heads(k, h), v, g, beta, state,
                                      ancestors_from_parents(parents))


# ---------------------------------------------------------------------------------------------
# checks and dispatch

def _check(q, k, v, g, beta, state, parents=None) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3:
        raise FlashtreeError(f"q, k must be [T, Hk, dk] and v [T, H, dv]; got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    t, hk, dk = q.shape
    _, h, dv = v.shape
    if v.shape[0] != t or h % hk:
        raise FlashtreeError(f"v {tuple(v.shape)} does not fit q {tuple(q.shape)} "
                             "(same T; value heads a multiple of q/k heads)")
    if g.shape != (t, h) or beta.shape != (t, h):
        raise FlashtreeError(f"g and beta must be [T, H] = [{t}, {h}]; got {tuple(g.shape)}, {tuple(beta.shape)}")
    if state.shape != (h, dk, dv) or state.dtype != torch.float32:
        raise FlashtreeError(f"state must be float32 [H, dk, dv] = [{h}, {dk}, {dv}]; "
                             f"got {state.dtype} {tuple(state.shape)}")
    if parents is not None:
        if parents.shape != (t,) or parents.dtype not in (torch.int64, torch.int32):
            raise FlashtreeError(f"parents must be int64 [T] = [{t}]; got {parents.dtype} {tuple(parents.shape)}")
        if t > MAX_TREE_NODES:
            raise FlashtreeError(f"tree_verify handles at most {MAX_TREE_NODES} nodes, got {t}")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _pow2_dims(dk: int, dv: int) -> None:
    for name, d in (("dk", dk), ("dv", dv)):
        if d < 16 or d & (d - 1):
            raise FlashtreeError(f"{name} = {d}: the Triton kernels need a power of two >= 16")


def _default_block_v(heads: int, dv: int) -> int:
    # two or more programs per SM when there are enough columns; 16 is the tl.dot minimum
    block = 32 if heads * dv // 32 >= 2 * _H200_SMS else 16
    return min(block, dv)


# ---------------------------------------------------------------------------------------------
# public API

def recurrent_step(q, k, v, g, beta, state, block_v: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """T >= 1 tokens in sequence: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q.

    q, k [T, Hk, dk]; v [T, H, dv]; g, beta [T, H]; state float32 [H, dk, dv], updated in place
    (any strides). Returns o [T, H, dv] float32.
    """
    _check(q, k, v, g, beta, state)
    if triton is None or not triton_runs_on(state.device):
        return recurrent_step_reference(q, k, v, g, beta, state)
    q, k, v, out = _prepared(q, k, v)
    _, hk, dk = q.shape
    t, h, dv = out.shape
    if t == 0:
        return out
    block_v = _block_v(block_v, h, dv)
    _recurrent_kernel[(h, dv // block_v)](q, k, v, g, beta, state, out, t, hk, *_strides(q, k, v, g, beta, state, out),
                                          DK=dk, BLOCK_V=block_v, num_warps=num_warps)
    return out


@dataclass
class FoldBuffers:
    """Where a verify of up to FOLD_ROWS nodes leaves what the commit of its accepted path folds into one layer's
    state (u, Gamma and k of each node, float32), in buffers that outlive the verify: their addresses go into a
    `FoldTables` once, so that one launch commits every layer, graphed or not."""

    u: torch.Tensor  # [FOLD_ROWS, H, dv]
    gamma: torch.Tensor  # [FOLD_ROWS, H]
    k: torch.Tensor  # [FOLD_ROWS, Hk, dk]
    # [FOLD_ROWS, conv_dim]: the nodes' conv inputs (the conv window's dtype), which the tree's conv launch copies
    # here so that the commit shifts every layer's window in one launch (`commit_rows.shift_windows_together`)
    conv: torch.Tensor | None = None

    @classmethod
    def allocate(cls, heads: int, dv: int, k_heads: int, dk: int, device,
                 conv_like: torch.Tensor | None = None) -> "FoldBuffers":
        """`conv_like`: the layer's conv window [K-1, conv_dim], whose width and dtype the `conv` rows take."""
        f32 = torch.float32
        conv = None if conv_like is None else torch.zeros(FOLD_ROWS, conv_like.shape[1], dtype=conv_like.dtype,
                                                          device=device)
        return cls(torch.zeros(FOLD_ROWS, heads, dv, dtype=f32, device=device),
                   torch.zeros(FOLD_ROWS, heads, dtype=f32, device=device),
                   torch.zeros(FOLD_ROWS, k_heads, dk, dtype=f32, device=device), conv)

    def takes(self, nodes: int) -> bool:
        return nodes <= self.u.shape[0]


@dataclass
class FoldTables:
    """One device's DeltaNet layers for `fold_layers`: their states and `FoldBuffers` (all of one shape), and the
    addresses of each, int64 [4, layers] on the device (state, u, Gamma, k). Build it outside CUDA graph capture;
    the tensors it lists must stay where they are (they do: the cache owns them and updates them in place)."""

    states: list[torch.Tensor]
    buffers: list[FoldBuffers]
    addresses: torch.Tensor

    @classmethod
    def of(cls, states: list[torch.Tensor], buffers: list[FoldBuffers]) -> "FoldTables":
        if not states or len(states) != len(buffers):
            raise FlashtreeError(f"fold tables need one FoldBuffers per state, got {len(states)} and {len(buffers)}")
        first, b0 = states[0], buffers[0]
        for state, b in zip(states, buffers):
            if (state.shape != first.shape or not state.is_contiguous() or state.dtype != torch.float32
                    or any(x.shape != y.shape for x, y in ((b.u, b0.u), (b.gamma, b0.gamma), (b.k, b0.k)))):
                raise FlashtreeError("fold tables need contiguous float32 states and buffers of one shape per layer")
        columns = (states, [b.u for b in buffers], [b.gamma for b in buffers], [b.k for b in buffers])
        if any(t.data_ptr() % 16 for column in columns for t in column):
            raise FlashtreeError("fold tables need 16-byte aligned tensors (whole allocations, not offset views)")
        return cls(states, buffers, address_table(*columns))


def fold_layers(tables: FoldTables, rows: torch.Tensor, count: torch.Tensor | None = None,
                block_v: int = 32, block_k: int = 64, num_warps: int = 8) -> None:
    """`fold_path` for every layer of `tables` at once (each layer's verify rows in its `FoldBuffers`): one launch
    instead of one a layer. Same arithmetic. The 27B shape's commit of a depth-5 path over 48 layers (H200,
    2026-12-05, `sweep_deltanet_tree.py --commit-only`): 130.4 us at 32 value x 64 key columns on 8 warps, 191.5 at
    32 x 16 on 4, against 284.4 us for the best of the 48 `fold_path` launches."""
    if rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32) or rows.shape[0] > MAX_TREE_NODES:
        raise FlashtreeError(f"rows must be an int64 [T] index, T <= {MAX_TREE_NODES}, got {rows.dtype} "
                             f"{tuple(rows.shape)}")
    if rows.shape[0] == 0:
        return
    state, first = tables.states[0], tables.buffers[0]
    if triton is None or not triton_runs_on(state.device):
        for ssm, b in zip(tables.states, tables.buffers):
            fold_path(b.k, b.u, b.gamma, ssm, rows, count)
        return
    h, dk, dv = state.shape
    _pow2_dims(dk, dv)
    block_v, block_k = min(block_v, dv), min(block_k, dk)
    t = rows.shape[0]
    _fold_layers_kernel[(len(tables.states) * h, dv // block_v, dk // block_k)](
        tables.addresses, rows, count if count is not None else rows, t, h, first.k.shape[1],
        first.k.stride(0), first.k.stride(1), first.u.stride(0), first.u.stride(1), first.gamma.stride(0),
        *state.stride(), BLOCK_T=max(16, triton.next_power_of_2(t)), BLOCK_V=block_v, BLOCK_K=block_k,
        HAS_COUNT=count is not None, num_warps=num_warps)


def fold_path(k, u, gamma, state, rows: torch.Tensor, count: torch.Tensor | None = None,
              block_v: int = 32, block_k: int = 16, num_warps: int = 4) -> None:
    """In place, the state after the rows `rows` (int64 [T'] <= MAX_TREE_NODES, root to leaf of one verified tree)
    of a `tree_verify_with_fold`: k [T, Hk, dk], u [T, H, dv] and gamma [T, H] as it returned them. `count`
    (int64 [1] on the device): only rows[:count] (a path padded to a fixed length, so that one CUDA graph commits
    any path of a verify; 0 leaves the state as it is). The product runs in float32 FMA (`ieee`). One program per
    (head, block_k state rows, block_v state columns): each state element is read and written once, and the 1536
    programs of a 27B layer (48 heads, 128 x 128) keep every SM busy (one per head and 32 columns, looping over the
    rows, took 10 us a layer on the H200, twenty-first session)."""
    if rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32) or rows.shape[0] > MAX_TREE_NODES:
        raise FlashtreeError(f"rows must be an int64 [T] index, T <= {MAX_TREE_NODES}, got {rows.dtype} "
                             f"{tuple(rows.shape)}")
    h, dk, dv = state.shape
    if u.dim() != 3 or u.shape[1:] != (h, dv) or gamma.shape != u.shape[:2] or k.shape[0] != u.shape[0]:
        raise FlashtreeError(f"u must be [T, {h}, {dv}] and gamma [T, {h}] beside k {tuple(k.shape)}; got u "
                             f"{tuple(u.shape)}, gamma {tuple(gamma.shape)}")
    if triton is None or not triton_runs_on(state.device):
        live = rows if count is None else rows[: int(count)]
        if len(live):
            state.copy_(gated_delta.fold(state, _expand_heads(k, h), u, gamma, live))
        return
    _pow2_dims(dk, dv)
    k, u = _last_dim_contiguous(k), u.contiguous()
    gamma = gamma.contiguous()
    t = rows.shape[0]
    if t == 0:
        return
    block_v, block_k = min(block_v, dv), min(block_k, dk)
    _fold_kernel[(h, dv // block_v, dk // block_k)](k, u, gamma, state, rows, count if count is not None else rows, t,
                                                    k.shape[1], k.stride(0), k.stride(1), u.stride(0), u.stride(1),
                                                    gamma.stride(0), *state.stride(),
                                                    BLOCK_T=max(16, triton.next_power_of_2(t)), BLOCK_V=block_v,
                                                    BLOCK_K=block_k, HAS_COUNT=count is not None, num_warps=num_warps)


def _block_v(block_v: int | None, heads: int, dv: int) -> int:
    block_v = block_v or _default_block_v(heads, dv)
    if dv % block_v:
        raise FlashtreeError(f"block_v = {block_v} must divide dv = {dv}")
    return block_v


def tree_verify(q, k, v, g, beta, state, parents, block_v: int = 32, block_k: int = 32,
                num_warps: int | None = None, precision: str = "tf32x3", num_stages: int | None = None,
                cuda: bool = True) -> torch.Tensor:
    """Outputs [T, H, dv] (float32) of every node of a draft tree of T <= 64 nodes, node i seeing the
    state reached along its root-to-node path. parents int64 [T]: parents[i] < i, -1 = child of the
    current state (values are not checked on the device: a parent >= i is treated as -1).
    `state` is only read. `precision`: tl.dot input precision ("tf32x3", tensor cores at about float32
    accuracy, or "ieee", float32 FMA). The defaults come from a sweep at the 27B shape
    (benchmarks/sweep_deltanet_tree.py, H200 2026-12-01): 32 columns and tf32x3 were each the faster choice
    (a 23-node tree 52 -> 35 and 28 us, the same error); dk 32 at a time, not 16: 40.0 -> 37.3 us on a 23-node chain,
    29.4 -> 27.0 on a bushy tree (the twenty-first session, with the fold's stores; 8 warps and 16 columns were
    slower). Where `gated_delta_cuda.takes` the tree (and `cuda`), its CUDA C kernel runs instead, in float32 FMA,
    and the launch arguments above do not apply; cuda=False keeps the Triton kernel (the sweeps time both)."""
    return _tree_verify(q, k, v, g, beta, state, parents, block_v, block_k, num_warps, precision, num_stages,
                        fold=False, cuda=cuda)[0]


def tree_verify_with_fold(q, k, v, g, beta, state, parents, block_v: int = 32, block_k: int = 32,
                          num_warps: int | None = None, precision: str = "tf32x3", num_stages: int | None = None,
                          into: FoldBuffers | None = None, cuda: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree_verify`, and what `fold_path` commits a path from: (o [T, H, dv], u [T, H, dv], gamma [T, H]), all
    float32, as `gated_delta.ancestor_chunk` returns them. `into`: the kernel writes u, Gamma and k (float32) into
    these buffers' first T rows (`fold_layers` reads them there) and returns views of them."""
    return _tree_verify(q, k, v, g, beta, state, parents, block_v, block_k, num_warps, precision, num_stages,
                        fold=True, into=into, cuda=cuda)


def _tree_verify(q, k, v, g, beta, state, parents, block_v, block_k, num_warps, precision, num_stages, fold: bool,
                 into: FoldBuffers | None = None, cuda: bool = True):
    _check(q, k, v, g, beta, state, parents)
    if triton is None or not triton_runs_on(state.device):
        o, u, gamma = _ancestor_chunk(q, k, v, g, beta, state, parents)
        return (o, u, gamma) if fold else (o,)
    q, k, v, out = _prepared(q, k, v)
    t, hk, dk = q.shape
    _, h, dv = v.shape
    if into is not None and (into.u.shape[1:] != (h, dv) or into.k.shape[1:] != (hk, dk) or t > into.u.shape[0]):
        raise FlashtreeError(f"fold buffers {tuple(into.u.shape)} / k {tuple(into.k.shape)} do not take a verify of "
                             f"{t} nodes, {h} x {dv} values and {hk} x {dk} keys")
    if into is not None:
        u, gamma, k_out = into.u[:t], into.gamma[:t], into.k
    else:
        u = torch.empty_like(out) if fold else out  # written only with STORE_FOLD
        gamma = torch.empty(t, h, dtype=torch.float32, device=out.device) if fold else out
        k_out = out  # written only with STORE_K
    if t == 0:
        return (out, u, gamma) if fold else (out,)
    parents = parents.contiguous()
    if cuda and gated_delta_cuda.takes(q, k, v, g, beta, state, parents):
        gated_delta_cuda.tree_verify(q, k, v, g, beta, state, parents, out, u, gamma, k_out, fold, into is not None)
        return (out, u, gamma) if fold else (out,)
    block_t = max(16, triton.next_power_of_2(t))
    block_v, block_k = min(block_v, dv), min(block_k, dk)
    if dv % block_v or dk % block_k:
        raise FlashtreeError(f"block_v = {block_v} must divide dv = {dv} and block_k = {block_k} dk = {dk}")
    if num_warps is None:
        # sm_90 ptxas, dk = 128: T <= 32 at 4 warps, T <= 64 at 8 warps without spills
        num_warps = 8 if block_t >= 64 else 4
    _tree_kernel[(h, dv // block_v)](q, k, v, g, beta, state, parents, out, u, gamma, k_out, t, hk,
                                     *_strides(q, k, v, g, beta, state, out), u.stride(0), u.stride(1),
                                     gamma.stride(0), k_out.stride(0), k_out.stride(1), DK=dk, BLOCK_T=block_t,
                                     BLOCK_V=block_v, BLOCK_K=block_k, PRECISION=precision, STORE_FOLD=fold,
                                     STORE_K=into is not None, num_warps=num_warps,
                                     **({} if num_stages is None else {"num_stages": num_stages}))
    return (out, u, gamma) if fold else (out,)


def _prepared(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v with unit-stride rows, and the float32 output [T, H, dv] the kernels write."""
    _pow2_dims(q.shape[-1], v.shape[-1])
    out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=v.device)
    return (*(_last_dim_contiguous(x) for x in (q, k, v)), out)


def _strides(q, k, v, g, beta, state, out) -> tuple[int, ...]:
    """The strides both kernels take, in their argument order."""
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
            state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1))


# ---------------------------------------------------------------------------------------------
# kernels

if triton is not None:

    @triton.jit
    def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, T, HK,
                          sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
                          ss_h, ss_k, ss_v, so_t, so_h,
                          DK: tl.constexpr, BLOCK_V: tl.constexpr):
        h = tl.program_id(0)
        hq = h % HK
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        dk = tl.arange(0, DK)
        s_ptrs = s_ptr + h * ss_h + dk[:, None] * ss_k + cols[None, :] * ss_v
        s = tl.load(s_ptrs)  # [DK, BLOCK_V], kept in registers over the token loop
        t = 0
        while t < T:  # a while loop: the interpreter cannot iterate range() over a runtime bound
            kt = tl.load(k_ptr + t * sk_t + hq * sk_h + dk).to(tl.float32)
            qt = tl.load(q_ptr + t * sq_t + hq * sq_h + dk).to(tl.float32)
            vt = tl.load(v_ptr + t * sv_t + h * sv_h + cols).to(tl.float32)
            gt = tl.load(g_ptr + t * sg_t + h * sg_h).to(tl.float32)
            bt = tl.load(beta_ptr + t * sb_t + h * sb_h).to(tl.float32)
            s = s * tl.exp(gt)
            predicted = tl.sum(s * kt[:, None], axis=0)
            u = bt * (vt - predicted)
            s = s + kt[:, None] * u[None, :]
            o = tl.sum(s * qt[:, None], axis=0)
            tl.store(o_ptr + t * so_t + h * so_h + cols, o)
            t += 1
        tl.store(s_ptrs, s)

    @triton.jit
    def _fold_tile(k_ptr, u_ptr, gm_ptr, s_ptr, rows_ptr, count_ptr, T, h, hq, sk_t, sk_h, su_t, su_h, sgm_t,
                   ss_h, ss_k, ss_v, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_COUNT: tl.constexpr):
        """State rows program_id(2) x columns program_id(1) of head h after the path, in place."""
        live = T
        if HAS_COUNT:  # a padded path: its live length is on the device
            live = tl.load(count_ptr)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        d = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        steps = tl.arange(0, BLOCK_T)
        used = (steps < T) & (steps < live)
        rows = tl.load(rows_ptr + steps, mask=used, other=0)
        u_all = tl.load(u_ptr + rows[:, None] * su_t + h * su_h + cols[None, :], mask=used[:, None], other=0.0)
        gamma = tl.load(gm_ptr + rows * sgm_t + h, mask=used, other=0.0)
        leaf = tl.sum(tl.where(steps == live - 1, gamma, 0.0), axis=0)  # 0 for an empty path: the state stays
        wu = tl.where(used, tl.exp(leaf - gamma), 0.0)[:, None] * u_all  # [BLOCK_T, BLOCK_V]
        kc = tl.load(k_ptr + rows[:, None] * sk_t + hq * sk_h + d[None, :], mask=used[:, None],
                     other=0.0).to(tl.float32)
        s_ptrs = s_ptr + h * ss_h + d[:, None] * ss_k + cols[None, :] * ss_v
        s = tl.exp(leaf) * tl.load(s_ptrs)  # [BLOCK_K, BLOCK_V]
        tl.store(s_ptrs, tl.dot(tl.trans(kc), wu, s, input_precision="ieee"))

    @triton.jit
    def _fold_kernel(k_ptr, u_ptr, gm_ptr, s_ptr, rows_ptr, count_ptr, T, HK,
                     sk_t, sk_h, su_t, su_h, sgm_t, ss_h, ss_k, ss_v,
                     BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, HAS_COUNT: tl.constexpr):
        h = tl.program_id(0)
        _fold_tile(k_ptr, u_ptr, gm_ptr, s_ptr, rows_ptr, count_ptr, T, h, h % HK, sk_t, sk_h, su_t, su_h, sgm_t,
                   ss_h, ss_k, ss_v, BLOCK_T, BLOCK_V, BLOCK_K, HAS_COUNT)

    @triton.jit
    def _fold_layers_kernel(addr_ptr, rows_ptr, count_ptr, T, H, HK, sk_t, sk_h, su_t, su_h, sgm_t, ss_h, ss_k, ss_v,
                            BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                            HAS_COUNT: tl.constexpr):
        # program_id(0) = layer x head; the layer's tensors from `FoldTables.addresses` (state, u, Gamma, k rows)
        layer, layers = tl.program_id(0) // H, tl.num_programs(0) // H
        h = tl.program_id(0) % H
        # 16-byte aligned (`FoldTables.of` checks): said so, the loads through them vectorize as through arguments
        s_ptr = tl.multiple_of(tl.load(addr_ptr + layer).to(tl.pointer_type(tl.float32)), 16)
        u_ptr = tl.multiple_of(tl.load(addr_ptr + layers + layer).to(tl.pointer_type(tl.float32)), 16)
        gm_ptr = tl.multiple_of(tl.load(addr_ptr + 2 * layers + layer).to(tl.pointer_type(tl.float32)), 16)
        k_ptr = tl.multiple_of(tl.load(addr_ptr + 3 * layers + layer).to(tl.pointer_type(tl.float32)), 16)
        _fold_tile(k_ptr, u_ptr, gm_ptr, s_ptr, rows_ptr, count_ptr, T, h, h % HK, sk_t, sk_h, su_t, su_h, sgm_t,
                   ss_h, ss_k, ss_v, BLOCK_T, BLOCK_V, BLOCK_K, HAS_COUNT)

    @triton.jit
    def _tree_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, p_ptr, o_ptr, u_ptr, gm_ptr, ko_ptr, T, HK,
                     sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
                     ss_h, ss_k, ss_v, so_t, so_h, su_t, su_h, sgm_t, sko_t, sko_h,
                     DK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr, STORE_FOLD: tl.constexpr, STORE_K: tl.constexpr):
        h = tl.program_id(0)
        hq = h % HK
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        rows = tl.arange(0, BLOCK_T)  # node index i
        nodes = tl.arange(0, BLOCK_T)  # node index j (the other axis of T x T tiles)
        live = rows < T

        # 1. ancestor mask (inclusive) and Gamma by chasing all parent pointers at once, the parents and g held in
        # registers (tl.gather): a level of the tree costs a shuffle, where a round of dependent loads from memory
        # took ~0.8 us (a 23-node chain: 22 rounds, ~40 % of the kernel's time, H200 2026-12-04)
        parent = tl.load(p_ptr + rows, mask=live, other=-1).to(tl.int32)
        parent = tl.where(parent < rows, parent, -1)  # guards the loop against invalid input
        g = tl.load(g_ptr + rows * sg_t + h * sg_h, mask=live, other=0.0).to(tl.float32)
        anc = rows[:, None] == nodes[None, :]
        gamma = g
        cur = parent
        depth = 0  # of the deepest node (roots at 0): the rounds step 3 needs
        while tl.max(cur, axis=0) >= 0:
            has = cur >= 0
            at = tl.where(has, cur, 0)
            anc = anc | (nodes[None, :] == cur[:, None])
            gamma += tl.where(has, tl.gather(g, at, 0), 0.0)
            nxt = tl.where(has, tl.gather(parent, at, 0), -1)
            cur = tl.where(has & (nxt < cur), nxt, -1)
            depth += 1

        # 2. K S0 [BLOCK_T, BLOCK_V] and K K^T [BLOCK_T, BLOCK_T] over dk chunks
        ks = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
        kk = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        for c in range(DK // BLOCK_K):
            d = c * BLOCK_K + tl.arange(0, BLOCK_K)
            kc = tl.load(k_ptr + rows[:, None] * sk_t + hq * sk_h + d[None, :], mask=live[:, None],
                         other=0.0).to(tl.float32)
            sc = tl.load(s_ptr + h * ss_h + d[:, None] * ss_k + cols[None, :] * ss_v)
            ks = tl.dot(kc, sc, ks, input_precision=PRECISION)
            kk = tl.dot(kc, tl.trans(kc), kk, input_precision=PRECISION)
            if STORE_K:  # the keys the commit folds with (`fold_layers`), written by one program per key head
                if (tl.program_id(1) == 0) & (h < HK):
                    tl.store(ko_ptr + rows[:, None] * sko_t + hq * sko_h + d[None, :], kc, mask=live[:, None])

        # 3. (I + A) U = beta (V - exp(Gamma) K S0), A strictly lower triangular
        beta = tl.load(beta_ptr + rows * sb_t + h * sb_h, mask=live, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * sv_t + h * sv_h + cols[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        decay = tl.where(anc, tl.exp(tl.where(anc, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
        # A links a node only to its ancestors, so the substitution runs by depth, not node by node: round r
        # (u = b - A u, one tensor-core product) makes every node of depth r final, from its ancestors' final
        # rows (the same sum as row-by-row substitution); a tree of depth D takes D rounds, not T - 1
        a = tl.where(rows[:, None] != nodes[None, :], beta[:, None] * decay * kk, 0.0)
        b = beta[:, None] * (v - tl.exp(gamma)[:, None] * ks)
        u = b
        for _ in range(depth):
            u = b - tl.dot(a, u, input_precision=PRECISION)

        # 4. O = exp(Gamma) Q S0 + (decay * Q K^T) U, Q S0 and Q K^T over dk chunks (k, S0 again: cached)
        qs = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
        qk = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        for c in range(DK // BLOCK_K):
            d = c * BLOCK_K + tl.arange(0, BLOCK_K)
            kc = tl.load(k_ptr + rows[:, None] * sk_t + hq * sk_h + d[None, :], mask=live[:, None],
                         other=0.0).to(tl.float32)
            qc = tl.load(q_ptr + rows[:, None] * sq_t + hq * sq_h + d[None, :], mask=live[:, None],
                         other=0.0).to(tl.float32)
            sc = tl.load(s_ptr + h * ss_h + d[:, None] * ss_k + cols[None, :] * ss_v)
            qs = tl.dot(qc, sc, qs, input_precision=PRECISION)
            qk = tl.dot(qc, tl.trans(kc), qk, input_precision=PRECISION)
        o = tl.exp(gamma)[:, None] * qs
        o = tl.dot(decay * qk, u, o, input_precision=PRECISION)
        tl.store(o_ptr + rows[:, None] * so_t + h * so_h + cols[None, :], o, mask=live[:, None])
        if STORE_FOLD:  # what the commit of an accepted path folds into the state (`fold_path`)
            tl.store(u_ptr + rows[:, None] * su_t + h * su_h + cols[None, :], u, mask=live[:, None])
            if tl.program_id(1) == 0:
                tl.store(gm_ptr + rows * sgm_t + h, gamma, mask=live)
