"""Gated DeltaNet layer of qwen35, in the GGUF's native (tiled) value-head order.

In the GGUF, value head h reads query/key head h % Hk (the converter re-ordered HF's grouped
heads), so q/k are expanded by tiling. Every token's depthwise conv window and recurrence follow
its parent chain, which makes a plain run (parent = previous token) and a draft tree one code path.
"""

from __future__ import annotations

from typing import Callable

import torch

from flashtree.models.cache import DeltaNetState, TreeScratch
from flashtree.kernels.gated_delta_triton import FoldBuffers, FoldTables
from flashtree.formats.gguf_file import GGUFFile
from flashtree.kernels import gated_delta, gated_delta_fla, gated_delta_triton, triton_runs_on
from flashtree.kernels.commit_rows import WindowTable, shift_window, shift_windows_together
from flashtree.kernels.deltanet_conv import conv_qkv
from flashtree.kernels.deltanet_gates import GateInputs
from flashtree.kernels.rms_norm import gated_rms_norm
from flashtree.models.layers import Linear, Projections, load_weight
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.models.step import Step


class GatedDeltaNet:
    def __init__(self, config: Qwen35Config, weights: dict[str, object], dtype: torch.dtype | None = None):
        self.config = config
        # the model's dtype (None: the activations'). It picks the GPU recurrence's dot precision: a float32
        # model never rounds to TF32, a bf16/f16 one (float32 activations, docs/FIDELITY.md design D) may
        self.dtype = dtype
        # qkv (the conv's input), z (the output gate), beta, alpha: one matmul once `fuse`d
        self.inputs = Projections.separate([weights["qkv"], weights["z"], weights["beta"], weights["alpha"]])
        self.out = weights["out"]
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
        }, dtype)

    def fuse(self) -> None:
        self.inputs = self.inputs.fused()

    def __call__(self, x: torch.Tensor, step: Step, state: DeltaNetState,
                 fold_buffers: Callable[[int, int], FoldBuffers] | None = None
                 ) -> tuple[torch.Tensor, TreeScratch | None]:
        """`fold_buffers(k_heads, dk)`: where a GPU tree verify leaves what the commit folds (`TargetCache.fold_buffers`:
        kept across steps, so that `commit_layers` commits every layer in one launch); None: fresh tensors."""
        c = self.config
        n = x.shape[0]
        exact = (self.dtype or x.dtype) == torch.float32  # a float32 model: no TF32 dots anywhere
        conv_inputs, z, b, a = self.inputs(x)
        # Triton kernels on the GPU for short runs and trees; the torch forms are the CPU reference
        fused = triton_runs_on(x.device) and n <= gated_delta_triton.MAX_TREE_NODES
        # a GPU tree leaves what the commit needs in buffers kept with the cache (a larger tree: tensors of its own)
        into = fold_buffers(c.gdn_v_heads, c.gdn_head_dim) if step.is_tree and fused and fold_buffers else None
        into = into if into is not None and into.takes(n) else None
        # a run shifts the conv state by its inputs here (a decode token inside the conv's launch); a tree
        # leaves it to the commit of the accepted path
        q, k, v, g, beta = conv_qkv(conv_inputs, step.parents, state.conv, self.conv_weight, c.gdn_qk_heads,
                                    c.gdn_v_heads, c.gdn_head_dim, GateInputs(b, a, self.decay_rate, self.dt_bias),
                                    advance_state=not step.is_tree, keep_inputs=None if into is None else into.conv)

        scratch = None
        if step.is_tree:
            if fused:
                # a float32 model keeps float32 FMA dots (no TF32 anywhere unless asked); tf32x3 is as
                # accurate in practice (2026-12-01 sweep: 4e-7 against 2e-7) and about 1.5x faster
                precision = "ieee" if exact else "tf32x3"
                o, u, gamma = gated_delta_triton.tree_verify_with_fold(q, k, v, g, beta, state.ssm, step.parents,
                                                                       precision=precision, into=into)
                scratch = (TreeScratch(conv_inputs, k, u, gamma) if into is None
                           else TreeScratch(into.conv[:n], into.k[:n], u, gamma))
            else:
                o, u, gamma = gated_delta.ancestor_chunk(q, k, v, g, beta, state.ssm, step.visible)
                scratch = TreeScratch(conv_inputs, k, u, gamma)
        else:
            if fused:
                o = gated_delta_triton.recurrent_step(q, k, v, g, beta, state.ssm)  # updates the state in place
            else:
                run = gated_delta.recurrent if n == 1 else gated_delta.chunked
                # prefill: fla-core's fused chunk kernels, whose float32 dots are TF32: a float32 run keeps
                # the exact torch form (a float32 run must not round to TF32 anywhere)
                if x.is_cuda and n > 1 and not exact and gated_delta_fla.available():
                    run = gated_delta_fla.chunked
                o, ssm = run(q, k, v, g, beta, state.ssm)
                state.ssm.copy_(ssm)  # in place: a captured CUDA graph keeps reading these buffers
        z = z.reshape(n, c.gdn_v_heads, c.gdn_head_dim)
        return self.out(gated_rms_norm(o, self.norm, c.rms_eps, z, x.dtype).reshape(n, -1)), scratch


def commit_layers(layers: list[tuple[GatedDeltaNet, DeltaNetState, TreeScratch]], path: torch.Tensor,
                  count: torch.Tensor | None = None, tables: FoldTables | None = None,
                  windows: WindowTable | None = None) -> None:
    """Make each layer's state what it would be after decoding the accepted `path` of a verified tree
    (`count`, int64 [1] on the device: only path[:count], a path padded to a fixed length): the conv windows
    shifted by the path's inputs, and the verify's u and gamma along the path folded into the state. With Triton:
    one launch for all the layers' windows (`shift_windows_together`) and one for their states (`fold_layers`)
    where the verify left its rows in the buffers `windows` and `tables` list (these layers' own, in order), else
    one of each a layer (`shift_window`, `fold_path`); without, the windows a layer and the states in one product
    over all the layers' heads stacked (layers on one device)."""
    if windows is not None and _kept_inputs(windows, layers):
        shift_windows_together(windows, path, count)
    else:
        for _, state, scratch in layers:
            shift_window(state.conv, scratch.conv_inputs, path, count)
    if triton_runs_on(path.device):  # in place, reading the path's rows where they are
        if tables is not None and _verified_into(tables, layers):
            gated_delta_triton.fold_layers(tables, path, count)
            return
        for _, state, scratch in layers:
            gated_delta_triton.fold_path(scratch.k, scratch.u, scratch.gamma, state.ssm, path, count)
        return
    if count is not None:
        path = path[: int(count)]
    heads = [state.ssm.shape[0] for _, state, _ in layers]

    def stacked(name: str) -> torch.Tensor:
        return torch.cat([getattr(scratch, name)[path] for _, _, scratch in layers], dim=1)

    initial = torch.cat([state.ssm for _, state, _ in layers])
    # the verify's u along the path are the recurrence's own: one batched product for the whole path, where
    # the token loop costs ~3 ms a commit on 2 CPU cores at the demo's shape (2026-12-02, docs/PERFORMANCE.md)
    final = gated_delta.fold(initial, stacked("k"), stacked("u"), stacked("gamma"), torch.arange(len(path)))
    for (_, state, _), ssm in zip(layers, final.split(heads)):
        state.ssm.copy_(ssm)


def _kept_inputs(windows: WindowTable, layers: list[tuple[GatedDeltaNet, DeltaNetState, TreeScratch]]) -> bool:
    """Whether `windows` lists exactly these layers' conv windows, in order, and each layer's last verify kept its
    inputs in the table's buffers."""
    return (len(layers) == len(windows.windows)
            and all(state.conv.data_ptr() == window.data_ptr() and scratch.conv_inputs.data_ptr() == kept.data_ptr()
                    for (_, state, scratch), window, kept in zip(layers, windows.windows, windows.inputs)))


def _verified_into(tables: FoldTables, layers: list[tuple[GatedDeltaNet, DeltaNetState, TreeScratch]]) -> bool:
    """Whether `tables` lists exactly these layers' states, in order, and each layer's last verify wrote its u into
    the table's buffers (not so after a verify too large for the tree kernel, which took the torch path)."""
    return (len(layers) == len(tables.states)
            and all(state.ssm.data_ptr() == ssm.data_ptr() and scratch.u.data_ptr() == buffers.u.data_ptr()
                    for (_, state, scratch), ssm, buffers in zip(layers, tables.states, tables.buffers)))
