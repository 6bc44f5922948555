"""Chunked (prefill) gated delta rule on the GPU through fla-core's Triton kernels.

fla-core implements exactly this recurrence (the `gated_delta.chunked` reference: S <- exp(g) S;
u = beta (v - S^T k); S <- S + k u^T; o = S^T q) with fused chunk-parallel kernels, which a long
prompt needs: the torch reference launches ~15 kernels per 64-token chunk and layer. Our q arrives
L2-normalised and already scaled, so fla's own scaling is turned off (scale=1); q and k are passed
expanded to the value heads, so fla's grouped head mapping never applies and the GGUF's tiled order
(v head h uses q/k head h % Hk) is kept. Optional: without fla-core (or off CUDA) callers use the
torch reference.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from flashtree.kernels import fla_configs


@functools.cache
def available() -> bool:
    return importlib.util.find_spec("fla") is not None


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as `gated_delta.chunked` (q, k, v [T, H, d]; g, beta [T, H];
    state [H, dk, dv], not modified): (o [T, H, dv] float32, final state float32)."""
    _shipped_configs(q.device)  # before fla's first import, which reads the setting
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # optional: the gpu extra (fla-core)

    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                                      initial_state=state[None].float(), output_final_state=True)
    return o[0].float(), final[0].float()


@functools.cache
def _shipped_configs(device: torch.device) -> None:
    """Once per device: fla reads the launch configurations shipped for this GPU model instead of
    autotuning them (`fla_configs.use_shipped`)."""
    fla_configs.use_shipped(device)
