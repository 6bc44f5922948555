"""Gated full attention of qwen35 (every `full_attention_interval`-th layer).

attn_q rows hold, per head, [query (head_dim) ; output gate (head_dim)]; q and k get a per-head
RMSNorm, then NeoX RoPE on the first `rope_dim` dims; the attention output is multiplied by
sigmoid(gate) before attn_output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtree.engine.cache import AttentionKV
from flashtree.formats.gguf_file import GGUFFile
from flashtree.models.layers import Linear, apply_rope, load_weight, rms_norm, rope_tables
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.models.step import Step


class GatedAttention:
    def __init__(self, config: Qwen35Config, q: Linear, k: Linear, v: Linear, out: Linear, q_norm, k_norm):
        self.config = config
        self.q, self.k, self.v, self.out = q, k, v, out
        self.q_norm, self.k_norm = q_norm, k_norm

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
        qg = self.q(x).view(n, c.num_heads, 2, c.head_dim)
        q, gate = qg[:, :, 0], qg[:, :, 1].reshape(n, -1)
        q = rms_norm(q, self.q_norm, c.rms_eps)
        k = rms_norm(self.k(x).view(n, c.num_kv_heads, c.head_dim), self.k_norm, c.rms_eps)
        v = self.v(x).view(n, c.num_kv_heads, c.head_dim)
        cos, sin = rope_tables(step.positions, c.rope_dim, c.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        end = step.start + n
        kv.k[:, step.start : end] = k.transpose(0, 1).to(kv.k.dtype)
        kv.v[:, step.start : end] = v.transpose(0, 1).to(kv.v.dtype)
        keys, values = kv.k[:, :end], kv.v[:, :end]
        mask = torch.cat([torch.ones(n, step.start, dtype=torch.bool, device=x.device), step.visible], dim=1)
        out = self._attend(q.transpose(0, 1), keys, values, mask)  # [heads, n, hd]
        out = out.transpose(0, 1).reshape(n, -1) * torch.sigmoid(gate.float()).to(x.dtype)
        return self.out(out)

    def _attend(self, q, keys, values, mask):
        group = self.config.num_heads // self.config.num_kv_heads
        keys = keys.to(q.dtype).repeat_interleave(group, dim=0)
        values = values.to(q.dtype).repeat_interleave(group, dim=0)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.config.attention_scale)
