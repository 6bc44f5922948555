"""Gated DeltaNet layer of qwen35, in the GGUF's native (tiled) value-head order.

In the GGUF, value head h reads query/key head h % Hk (the converter re-ordered HF's grouped
heads), so q/k are expanded by tiling. Every token's depthwise conv window and recurrence follow
its parent chain, which makes a plain run (parent = previous token) and a draft tree one code path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtree.engine.cache import DeltaNetState, TreeScratch
from flashtree.formats.gguf_file import GGUFFile
from flashtree.kernels import gated_delta, gated_delta_fla, gated_delta_triton, triton_runs_on
from flashtree.kernels.rms_norm import rms_norm
from flashtree.models.layers import Linear, load_weight
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.models.step import Step


class GatedDeltaNet:
    def __init__(self, config: Qwen35Config, weights: dict[str, object]):
        self.config = config
        self.qkv, self.z, self.beta, self.alpha, self.out = (
            weights["qkv"], weights["z"], weights["beta"], weights["alpha"], weights["out"])
        self.conv_weight = weights["conv"]  # [conv_dim, kernel]; the last tap multiplies the current token
        self.decay_rate = weights["a"]  # ssm_a = -exp(A_log), already negative
        self.dt_bias = weights["dt_bias"]
        self.norm = weights["norm"]

    @classmethod
    def load(cls, gguf: GGUFFile, prefix: str, config: Qwen35Config, dtype, device) -> "GatedDeltaNet":
        c, f32 = config, torch.float32
        hidden, hv = c.hidden_size, c.gdn_v_heads
        return cls(c, {
            "qkv": Linear.load(gguf, f"{prefix}.attn_qkv.weight", c.conv_dim, hidden, dtype, device),
            "z": Linear.load(gguf, f"{prefix}.attn_gate.weight", c.gdn_value_dim, hidden, dtype, device),
            "beta": Linear.load(gguf, f"{prefix}.ssm_beta.weight", hv, hidden, dtype, device),
            "alpha": Linear.load(gguf, f"{prefix}.ssm_alpha.weight", hv, hidden, dtype, device),
            "out": Linear.load(gguf, f"{prefix}.ssm_out.weight", hidden, c.gdn_value_dim, dtype, device),
            "conv": load_weight(gguf, f"{prefix}.ssm_conv1d.weight", (c.conv_dim, c.conv_kernel), f32, device),
            "a": load_weight(gguf, f"{prefix}.ssm_a", (hv,), f32, device),
            "dt_bias": load_weight(gguf, f"{prefix}.ssm_dt.bias", (hv,), f32, device),
            "norm": load_weight(gguf, f"{prefix}.ssm_norm.weight", (c.gdn_head_dim,), f32, device),
        })

    def __call__(self, x: torch.Tensor, step: Step, state: DeltaNetState) -> tuple[torch.Tensor, TreeScratch | None]:
        c = self.config
        n = x.shape[0]
        conv_inputs = self.qkv(x)
        parents = step.parents if step.is_tree else torch.arange(-1, n - 1, device=x.device)
        mixed = F.silu(self._conv(conv_inputs, parents, state.conv))
        q, k, v = mixed.split([c.gdn_key_dim, c.gdn_key_dim, c.gdn_value_dim], dim=-1)
        q, k = self._expand_qk(q.reshape(n, c.gdn_qk_heads, -1), k.reshape(n, c.gdn_qk_heads, -1))
        v = v.reshape(n, c.gdn_v_heads, c.gdn_head_dim).float()
        beta = torch.sigmoid(self.beta(x).float())
        g = self.decay_rate * F.softplus(self.alpha(x).float() + self.dt_bias)

        scratch = None
        # Triton kernels on the GPU for short runs and trees; the torch forms are the CPU reference
        fused = triton_runs_on(x.device) and n <= gated_delta_triton.MAX_TREE_NODES
        if step.is_tree:
            if fused:
                o = gated_delta_triton.tree_verify(q, k, v, g, beta, state.ssm, step.parents)
            else:
                o, _, _ = gated_delta.ancestor_chunk(q, k, v, g, beta, state.ssm, step.visible)
            scratch = TreeScratch(conv_inputs, q, k, v, g, beta)
        else:
            if fused:
                o = gated_delta_triton.recurrent_step(q, k, v, g, beta, state.ssm)  # updates the state in place
            else:
                run = gated_delta.recurrent if n == 1 else gated_delta.chunked
                if x.is_cuda and n > 1 and gated_delta_fla.available():
                    run = gated_delta_fla.chunked  # prefill: fla-core's fused chunk kernels
                o, ssm = run(q, k, v, g, beta, state.ssm)
                state.ssm.copy_(ssm)  # in place: a captured CUDA graph keeps reading these buffers
            state.conv.copy_(torch.cat([state.conv, conv_inputs.to(state.conv.dtype)])[-(c.conv_kernel - 1):])
        return self._output(o, x), scratch

    def _conv(self, inputs: torch.Tensor, parents: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
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
        return (windows.float() * self.conv_weight.t()[None]).sum(1).to(inputs.dtype)

    def _expand_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        q = q.float() * torch.rsqrt(q.float().pow(2).sum(-1, keepdim=True) + 1e-6) * c.gdn_head_dim**-0.5
        k = k.float() * torch.rsqrt(k.float().pow(2).sum(-1, keepdim=True) + 1e-6)
        repeats = c.gdn_v_heads // c.gdn_qk_heads
        return q.repeat(1, repeats, 1), k.repeat(1, repeats, 1)  # tiled: v head h uses q/k head h % Hk

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        n = x.shape[0]
        z = self.z(x).view(n, c.gdn_v_heads, c.gdn_head_dim).float()
        gated = rms_norm(o, self.norm, c.rms_eps) * F.silu(z)
        return self.out(gated.reshape(n, -1).to(x.dtype))


def commit_layers(layers: list[tuple[GatedDeltaNet, DeltaNetState, TreeScratch]], path: torch.Tensor) -> None:
    """Make each layer's state what it would be after decoding the accepted `path` of a verified tree.
    One recurrence runs over all the layers' heads stacked (layers on one device): layers are
    independent, so stacking only saves the per-layer token loops."""
    kernel = layers[0][0].config.conv_kernel
    for _, state, scratch in layers:
        state.conv.copy_(torch.cat([state.conv, scratch.conv_inputs[path].to(state.conv.dtype)])[-(kernel - 1):])
    if triton_runs_on(path.device):  # one in-place kernel launch per layer, no stacking of the 3 MiB states
        for _, state, scratch in layers:
            gated_delta_triton.recurrent_step(scratch.q[path], scratch.k[path], scratch.v[path], scratch.g[path],
                                              scratch.beta[path], state.ssm)
        return
    heads = [state.ssm.shape[0] for _, state, _ in layers]

    def stacked(name: str) -> torch.Tensor:
        return torch.cat([getattr(scratch, name)[path] for _, _, scratch in layers], dim=1)

    initial = torch.cat([state.ssm for _, state, _ in layers])
    _, final = gated_delta.recurrent(stacked("q"), stacked("k"), stacked("v"), stacked("g"), stacked("beta"), initial)
    for (_, state, _), ssm in zip(layers, final.split(heads)):
        state.ssm.copy_(ssm)
