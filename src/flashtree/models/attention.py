"""Gated full attention of qwen35 (every `full_attention_interval`-th layer).

attn_q rows hold, per head, [query (head_dim) ; output gate (head_dim)]; q and k get a per-head
RMSNorm, then NeoX RoPE on the first `rope_dim` dims; the attention output is multiplied by
sigmoid(gate) before attn_output.

KV rows are stored in the cache's KV types (quantized on write). With TQ3_0 keys the query is rotated
into the cache's rotated domain; with TQ3_0 values the attention output is rotated back. A window W > 0
limits each query at position p to keys at positions > p - W (applied to every forward, prefill
included, so speculative decoding stays equal to windowed autoregressive decoding); it changes output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from flashtree.models.cache import AttentionKV
from flashtree.formats.gguf_file import GGUFFile
from flashtree.kernels import triton_runs_on
from flashtree.kernels.activations import gated_heads
from flashtree.kernels.kv_dequant import dequantize_kv
from flashtree.kernels.kv_quant import FloatKV, rotate, unrotate
from flashtree.kernels.qk_norm_rope import qk_norm_rope
from flashtree.kernels.tree_attention import MAX_TREE_QUERIES, tree_attention
from flashtree.models.layers import Linear, Projections, load_weight
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.models.step import Step


class GatedAttention:
    def __init__(self, config: Qwen35Config, q: Linear, k: Linear, v: Linear, out: Linear, q_norm, k_norm):
        self.config = config
        self.inputs = Projections.separate([q, k, v])  # one matmul once `fuse`d
        self.out = out
        self.q_norm, self.k_norm = q_norm, k_norm

    def fuse(self) -> None:
        self.inputs = self.inputs.fused()

    @classmethod
    def load(cls, gguf: GGUFFile, prefix: str, config: Qwen35Config, dtype, device) -> "GatedAttention":
        c, hd = config, config.head_dim
        return cls(
            c,
            Linear.load(gguf, f"{prefix}.attn_q.weight", 2 * c.num_heads * hd, c.hidden_size, dtype, device),
            Linear.load(gguf, f"{prefix}.attn_k.weight", c.num_kv_heads * hd, c.hidden_size, dtype, device),
            Linear.load(gguf, f"{prefix}.attn_v.weight", c.num_kv_heads * hd, c.hidden_size, dtype, device),
            Linear.load(gguf, f"{prefix}.attn_output.weight", c.hidden_size, c.num_heads * hd, dtype, device),
            load_weight(gguf, f"{prefix}.attn_q_norm.weight", (hd,), torch.float32, device),
            load_weight(gguf, f"{prefix}.attn_k_norm.weight", (hd,), torch.float32, device),
        )

    def __call__(self, x: torch.Tensor, step: Step, kv: AttentionKV) -> torch.Tensor:
        c = self.config
        n = x.shape[0]
        qg, k, v = self.inputs(x)
        qg = qg.reshape(n, c.num_heads, 2, c.head_dim)
        q, gate = qg[:, :, 0], qg[:, :, 1]
        cos, sin = step.rope(c.rope_dim, c.rope_theta)
        q = qk_norm_rope(q, self.q_norm, c.rms_eps, cos, sin)
        k = qk_norm_rope(k.reshape(n, c.num_kv_heads, c.head_dim), self.k_norm, c.rms_eps, cos, sin)
        v = v.reshape(n, c.num_kv_heads, c.head_dim)

        kv.k.index_copy_(1, step.slots, kv.type_k.quantize(k.transpose(0, 1)))
        kv.v.index_copy_(1, step.slots, kv.type_v.quantize(v.transpose(0, 1)))
        q = q.transpose(0, 1)
        if kv.type_k.rotated:  # R orthogonal: (Rq).(Rk) = q.k, so K is used as stored
            q = rotate(q)
        if _reads_cache_in_place(step, kv, q):
            out = tree_attention(q, kv.k, kv.v, kv.type_k, kv.type_v, step.start_tensor(), step.visible,
                                 step.positions, step.kv_end, c.attention_scale, kv.window)
        else:
            lo = step.first_row(kv.window)
            keys = dequantize_kv(kv.k[:, lo : step.kv_end], kv.type_k, q.dtype)  # rotated domain for TQ3_0
            values = dequantize_kv(kv.v[:, lo : step.kv_end], kv.type_v, q.dtype)
            out = self._attend(q, keys, values, step, lo, kv.window)  # [heads, n, hd]
        if kv.type_v.rotated:  # softmax(.) @ (R v) = R (softmax(.) @ v): rotate the output back
            out = unrotate(out)
        return self.out(gated_heads(out, gate))

    def _attend(self, q, keys, values, step: Step, lo: int, window: int):
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if _plain_prefill(step, lo, window, q, keys, values):
            # a prompt chunk after the whole cache: causal aligned to the last key, which the fused flash
            # kernel takes without a [T, kv] mask, and K/V shared by each query group instead of copied:
            # at 256K context those copies would be ~6 GB per layer
            return F.scaled_dot_product_attention(q[None], keys[None], values[None],
                                                  attn_mask=causal_lower_right(q.shape[1], keys.shape[1]),
                                                  scale=self.config.attention_scale, enable_gqa=True)[0]
        # repeat_interleave copies K/V per query group; the broadcast-view variant saves that memory but
        # changed bf16 results on CUDA beyond the test tolerance (2026-11-29) and waits for a GPU check.
        group = self.config.num_heads // self.config.num_kv_heads
        keys = keys.repeat_interleave(group, dim=0)
        values = values.repeat_interleave(group, dim=0)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=step.attention_mask(lo, window),
                                              scale=self.config.attention_scale)


def _reads_cache_in_place(step: Step, kv: AttentionKV, q) -> bool:
    """The Triton kernel reads the cache as stored for every graphed step (its masks and padding are the
    kernel's) and for short eager runs over a quantized cache. Longer chunks are dequantized once
    (`dequantize_kv`) into SDPA's flash kernel: at hundreds of queries the tree kernel is ~10x slower."""
    if not triton_runs_on(q.device) or q.shape[1] > MAX_TREE_QUERIES:
        return False
    return step.graphed or not (isinstance(kv.type_k, FloatKV) and isinstance(kv.type_v, FloatKV))


def _plain_prefill(step: Step, lo: int, window: int, q, keys, values) -> bool:
    """A run of several new tokens that sees every committed row (no tree, window or graph padding), on
    the CPU or where CUDA's flash kernel takes it: elsewhere (float32, old GPUs) PyTorch would build the
    lower-right mask and, with grouped K/V, fall back to materialising every attention score."""
    if not (q.shape[1] > 1 and not step.is_tree and not step.graphed and lo == 0 and window == 0 and _SDPA_GQA):
        return False
    if q.device.type != "cuda":
        return True
    params = torch.backends.cuda.SDPAParams(q[None], keys[None], values[None], None, 0.0, False, True)
    return torch.backends.cuda.can_use_flash_attention(params, False)


# torch >= 2.5 takes grouped K/V in scaled_dot_product_attention (enable_gqa); older torch copies them
_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)
