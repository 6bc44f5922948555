"""transformers `Qwen3_5ForCausalLM` <-> qwen35 GGUF tensors (both directions), for training and export.

GGUF conventions (what the llama.cpp converter writes, see qwen35-gguf-format.md):
- RMSNorm weights hold the final multiplier: HF stores w for (1 + w), GGUF stores 1 + w; the
  DeltaNet output norm (`linear_attn.norm`, a gated RMSNorm with a plain multiplier) is copied as is.
- `A_log` becomes `ssm_a = -exp(A_log)`, `dt_bias` becomes `ssm_dt.bias`, conv1d [C, 1, K] -> [C, K].
- DeltaNet value heads: HF groups the value heads of one key head together (grouped order,
  head g uses key head g // r); the GGUF stores them tiled (head t uses key head t % Hk). Every
  value-head-indexed row/column is reordered: V rows of attn_qkv and conv, attn_gate rows,
  ssm_beta / ssm_alpha rows, ssm_a, ssm_dt.bias, and the input columns of ssm_out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from flashtree.errors import FlashtreeError
from flashtree.formats.gguf_file import GGUFFile
from flashtree.models.gguf_config import read_config
from flashtree.models.layers import load_weight
from flashtree.models.qwen35_config import Qwen35Config


def grouped_to_tiled(hk: int, hv: int) -> np.ndarray:
    """order[t] = grouped head stored at tiled position t (tiled t uses key head t % hk)."""
    r = hv // hk
    return np.array([(t % hk) * r + t // hk for t in range(hv)])


def _head_rows(x: np.ndarray, order: np.ndarray, head_dim: int) -> np.ndarray:
    idx = (order[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)
    return x[idx]


def mrope_section(half: int) -> list[int]:
    a = (half + 2) // 3
    b = (half - a + 1) // 2
    return [a, b, half - a - b]


def hf_config(c: Qwen35Config, tied: bool = False, attn_implementation: str = "sdpa"):
    """The transformers text config of the same architecture as `c`."""
    Qwen3_5TextConfig = _transformers().Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_eps, linear_conv_kernel_dim=c.conv_kernel,
        linear_key_head_dim=c.gdn_head_dim, linear_value_head_dim=c.gdn_head_dim,
        linear_num_key_heads=c.gdn_qk_heads, linear_num_value_heads=c.gdn_v_heads,
        layer_types=["linear_attention" if r else "full_attention" for r in c.recurrent_layers],
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                         "partial_rotary_factor": c.rope_dim / c.head_dim,
                         "mrope_section": mrope_section(c.rope_dim // 2), "mrope_interleaved": True},
        tie_word_embeddings=tied, max_position_embeddings=c.context_length,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    config._attn_implementation = attn_implementation
    return config


def new_hf_model(c: Qwen35Config, tied: bool = False, attn_implementation: str = "sdpa"):
    Qwen3_5ForCausalLM = _transformers().Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM(hf_config(c, tied, attn_implementation)).float()


def _one_to_one_names(c: Qwen35Config, tied: bool):
    """(GGUF name, HF name, offset) of tensors that map one to one. The converter folds HF's
    zero-centred "1 + w" into every norm but the DeltaNet output norm, hence offset 1 there."""
    yield "token_embd.weight", "model.embed_tokens.weight", 0.0
    yield "output_norm.weight", "model.norm.weight", 1.0
    if not tied:
        yield "output.weight", "lm_head.weight", 0.0
    for i in range(c.num_layers):
        g, h = f"blk.{i}", f"model.layers.{i}"
        yield f"{g}.attn_norm.weight", f"{h}.input_layernorm.weight", 1.0
        yield f"{g}.post_attention_norm.weight", f"{h}.post_attention_layernorm.weight", 1.0
        for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            yield f"{g}.{ours}.weight", f"{h}.mlp.{theirs}.weight", 0.0
        if c.recurrent_layers[i]:
            yield f"{g}.ssm_norm.weight", f"{h}.linear_attn.norm.weight", 0.0
            continue
        a = f"{h}.self_attn"
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            yield f"{g}.{ours}.weight", f"{a}.{theirs}.weight", 0.0
        yield f"{g}.attn_q_norm.weight", f"{a}.q_norm.weight", 1.0
        yield f"{g}.attn_k_norm.weight", f"{a}.k_norm.weight", 1.0


def gguf_tensors_from_hf(model, c: Qwen35Config) -> dict[str, np.ndarray]:
    """HF state dict -> float32 arrays in GGUF names, layout and conventions."""
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    tied = model.config.tie_word_embeddings
    out = {ours: sd[theirs] + plus_one for ours, theirs, plus_one in _one_to_one_names(c, tied)}
    order = grouped_to_tiled(c.gdn_qk_heads, c.gdn_v_heads)
    d, kd = c.gdn_head_dim, c.gdn_key_dim
    for i in c.deltanet_layers:
        g, la = f"blk.{i}", f"model.layers.{i}.linear_attn"
        qkv = sd[f"{la}.in_proj_qkv.weight"]
        conv = sd[f"{la}.conv1d.weight"][:, 0, :]
        out[f"{g}.attn_qkv.weight"] = np.concatenate([qkv[: 2 * kd], _head_rows(qkv[2 * kd :], order, d)])
        out[f"{g}.ssm_conv1d.weight"] = np.concatenate([conv[: 2 * kd], _head_rows(conv[2 * kd :], order, d)])
        out[f"{g}.attn_gate.weight"] = _head_rows(sd[f"{la}.in_proj_z.weight"], order, d)
        out[f"{g}.ssm_beta.weight"] = sd[f"{la}.in_proj_b.weight"][order]
        out[f"{g}.ssm_alpha.weight"] = sd[f"{la}.in_proj_a.weight"][order]
        out[f"{g}.ssm_a"] = -np.exp(sd[f"{la}.A_log"][order])
        out[f"{g}.ssm_dt.bias"] = sd[f"{la}.dt_bias"][order]
        out[f"{g}.ssm_out.weight"] = _head_rows(sd[f"{la}.out_proj.weight"].T, order, d).T
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def hf_model_from_gguf(path: str | Path, device="cpu", attn_implementation: str = "sdpa"):
    """A float32 HF model holding the (dequantized) weights of a qwen35 GGUF; used to generate
    draft-training responses in batches."""
    gguf = GGUFFile(path)
    c, _ = read_config(gguf)
    t = {name: load_weight(gguf, name, tuple(info.shape), torch.float32, "cpu").numpy()
         for name, info in gguf.tensors.items() if not name.startswith("blk.") or int(name.split(".")[1]) < c.num_layers}
    tied = "output.weight" not in t
    model = new_hf_model(c, tied, attn_implementation)
    inv = np.argsort(grouped_to_tiled(c.gdn_qk_heads, c.gdn_v_heads))  # tiled -> grouped
    d, kd = c.gdn_head_dim, c.gdn_key_dim
    sd = {theirs: t[ours] - plus_one for ours, theirs, plus_one in _one_to_one_names(c, tied)}
    for i in c.deltanet_layers:
        g, la = f"blk.{i}", f"model.layers.{i}.linear_attn"
        qkv, conv = t[f"{g}.attn_qkv.weight"], t[f"{g}.ssm_conv1d.weight"]
        sd[f"{la}.in_proj_qkv.weight"] = np.concatenate([qkv[: 2 * kd], _head_rows(qkv[2 * kd :], inv, d)])
        sd[f"{la}.conv1d.weight"] = np.concatenate([conv[: 2 * kd], _head_rows(conv[2 * kd :], inv, d)])[:, None, :]
        sd[f"{la}.in_proj_z.weight"] = _head_rows(t[f"{g}.attn_gate.weight"], inv, d)
        sd[f"{la}.in_proj_b.weight"] = t[f"{g}.ssm_beta.weight"][inv]
        sd[f"{la}.in_proj_a.weight"] = t[f"{g}.ssm_alpha.weight"][inv]
        sd[f"{la}.A_log"] = np.log(-t[f"{g}.ssm_a"][inv])
        sd[f"{la}.dt_bias"] = t[f"{g}.ssm_dt.bias"][inv]
        sd[f"{la}.out_proj.weight"] = _head_rows(t[f"{g}.ssm_out.weight"].T, inv, d).T
    state = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> HF mapping incomplete: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if tied:
        model.tie_weights()
    return model.to(device).eval(), c


def _transformers():
    """Training builds the target with transformers' Qwen3.5 modules: an optional dependency."""
    try:
        import transformers
    except ModuleNotFoundError as exc:
        raise FlashtreeError("flashtree train needs transformers: pip install 'flashtree[train]'") from exc
    return transformers
