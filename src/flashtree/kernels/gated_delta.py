"""Gated delta rule (the Gated DeltaNet recurrence), torch reference forms, all in float32.

Per head, with state S (dk x dv), log-decay g <= 0, write strength beta in (0, 1):
    S <- exp(g) S ;  u = beta (v - S^T k) ;  S <- S + k u^T ;  o = S^T q

Two exact forms share one signature style (q, k, v: [T, H, d]; g, beta: [T, H]; state: [H, dk, dv]):
- `recurrent`: the token loop, used for single-token decode and for committing an accepted path.
- `ancestor_chunk`: every token i sees the state reached along its own ancestor path, so one call
  verifies a whole draft tree (ancestors = inclusive ancestor matrix). With a lower-triangular
  matrix it is the standard chunked (WY) prefill. Unrolling the recurrence along a path gives
      Gamma_i = sum of g over ancestors-or-self of i
      (I + A) U = beta * (V - exp(Gamma) * (K S0)),  A_ij = beta_i exp(Gamma_i - Gamma_j) k_i.k_j  (j strict ancestor)
      O_i = exp(Gamma_i) S0^T q_i + sum_{j ancestor-or-self} exp(Gamma_i - Gamma_j) (q_i.k_j) U_j
  and the state at the end of a path is  exp(Gamma_leaf) S0 + sum_{j on path} exp(Gamma_leaf - Gamma_j) k_j U_j^T.
"""

from __future__ import annotations

import torch


def recurrent(q, k, v, g, beta, state):
    """Token-by-token recurrence. Returns (o [T, H, dv], final state); `state` is not modified."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state.float().clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", s, k[t])
        u = beta[t][:, None] * (v[t] - predicted)
        s = s + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """Inclusive ancestor matrix bool [T, T] of a forest given as parents (-1 = a root): [i, j] is true iff
    j is i or an ancestor of i. One vectorised step per tree level."""
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    rows = torch.arange(n, device=parents.device)
    up = parents.clone()
    while (up >= 0).any():
        live = up >= 0
        mask[rows[live], up[live]] = True
        up = torch.where(live, parents[up.clamp(min=0)], up)
    return mask


def ancestor_chunk(q, k, v, g, beta, state, ancestors):
    """All tokens of one chunk at once; `ancestors[i, j]` is True iff j is i's ancestor or i itself.

    Returns (o [T, H, dv], u [T, H, dv], gamma [T, H]); u and gamma feed `fold`.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s0 = state.float()
    n = q.shape[0]
    incl = ancestors.to(device=q.device)
    gamma = incl.float() @ g  # [T, H]
    diff = (gamma[:, None, :] - gamma[None, :, :]).permute(2, 0, 1)  # [H, T, T]
    # Masking before exp keeps non-ancestor pairs (whose difference may be large and positive) at exactly 0.
    decay = diff.masked_fill(~incl, float("-inf")).exp()
    strict = incl & ~torch.eye(n, dtype=torch.bool, device=q.device)
    kk = torch.einsum("ihd,jhd->hij", k, k)
    a = (beta.t()[:, :, None] * decay * kk).masked_fill(~strict, 0.0)
    eye = torch.eye(n, dtype=torch.float32, device=q.device)
    rhs = beta[:, :, None] * (v - gamma.exp()[:, :, None] * torch.einsum("thk,hkv->thv", k, s0))
    u = torch.linalg.solve_triangular(eye + a, rhs.transpose(0, 1), upper=False, unitriangular=True)  # [H, T, dv]
    qk = torch.einsum("ihd,jhd->hij", q, k) * decay
    out = gamma.exp()[:, :, None] * torch.einsum("thk,hkv->thv", q, s0) + torch.einsum("hij,hjv->ihv", qk, u)
    return out, u.transpose(0, 1), gamma


def fold(state, k, u, gamma, path):
    """State after the tokens `path` (indices into one `ancestor_chunk` call, root to leaf)."""
    k, u = k.float()[path], u[path]
    gamma_path = gamma[path]  # [P, H]
    weight = (gamma_path[-1][None, :] - gamma_path).exp()  # [P, H]
    update = torch.einsum("ph,phk,phv->hkv", weight, k, u)
    return gamma_path[-1].exp()[:, None, None] * state.float() + update


def chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """Causal sequence in chunks of `chunk_size` (prefill). Returns (o [T, H, dv], final state)."""
    outs = []
    s = state.float()
    for start in range(0, q.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        n = q[sl].shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        out, u, gamma = ancestor_chunk(q[sl], k[sl], v[sl], g[sl], beta[sl], s, causal)
        s = fold(s, k[sl], u, gamma, torch.arange(n, device=q.device))
        outs.append(out)
    return torch.cat(outs), s
