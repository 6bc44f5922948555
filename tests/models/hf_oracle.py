"""transformers' Qwen3.5 model loaded from one of our GGUF files through the inverse of the converter.

Independent of flashtree's own code: tensors are read and dequantized by the `gguf` package, then
mapped back to HF names and conventions (norms minus the folded +1, A_log = log(-ssm_a), value
heads from the GGUF's tiled order back to HF's grouped order).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from flashtree.models.qwen35_config import Qwen35Config
from flashtree.train.convert import new_hf_model


def _tiled_to_grouped_heads(hk: int, hv: int) -> np.ndarray:
    """perm[g] = tiled index holding grouped head g (grouped g uses k head g // r; tiled t uses t % hk)."""
    r = hv // hk
    return np.array([(g % r) * hk + g // r for g in range(hv)])


def _rows(x: np.ndarray, head_perm: np.ndarray, head_dim: int) -> np.ndarray:
    idx = (head_perm[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)
    return x[idx]


def read_gguf_tensors(path) -> dict[str, np.ndarray]:
    reader = GGUFReader(path)
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
    return out


def hf_model_from_gguf(path, config: Qwen35Config):
    """transformers' Qwen3.5 holding the GGUF's weights as gguf's own dequantizer reads them, through this
    oracle's own tensor mapping (the config translation is the project's: the engine does not use it)."""
    c = config
    tensors = read_gguf_tensors(path)
    tied = "output.weight" not in tensors
    model = new_hf_model(c, tied, attn_implementation="eager").eval()
    state = _hf_state_dict(tensors, c, tied)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    if tied:
        model.tie_weights()
    return model


def _hf_state_dict(t: dict[str, np.ndarray], c: Qwen35Config, tied: bool) -> dict[str, np.ndarray]:
    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"] - 1}
    if not tied:
        sd["lm_head.weight"] = t["output.weight"]
    perm = _tiled_to_grouped_heads(c.gdn_qk_heads, c.gdn_v_heads)
    d = c.gdn_head_dim
    for i in range(c.num_layers):
        g, h = f"blk.{i}", f"model.layers.{i}"
        sd[f"{h}.input_layernorm.weight"] = t[f"{g}.attn_norm.weight"] - 1
        sd[f"{h}.post_attention_layernorm.weight"] = t[f"{g}.post_attention_norm.weight"] - 1
        for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            sd[f"{h}.mlp.{theirs}.weight"] = t[f"{g}.{ours}.weight"]
        if not c.recurrent_layers[i]:
            a = f"{h}.self_attn"
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                sd[f"{a}.{theirs}.weight"] = t[f"{g}.{ours}.weight"]
            sd[f"{a}.q_norm.weight"] = t[f"{g}.attn_q_norm.weight"] - 1
            sd[f"{a}.k_norm.weight"] = t[f"{g}.attn_k_norm.weight"] - 1
            continue
        la = f"{h}.linear_attn"
        qkv = t[f"{g}.attn_qkv.weight"]
        conv = t[f"{g}.ssm_conv1d.weight"]
        kd = c.gdn_key_dim
        sd[f"{la}.in_proj_qkv.weight"] = np.concatenate([qkv[: 2 * kd], _rows(qkv[2 * kd :], perm, d)])
        sd[f"{la}.conv1d.weight"] = np.concatenate([conv[: 2 * kd], _rows(conv[2 * kd :], perm, d)])[:, None, :]
        sd[f"{la}.in_proj_z.weight"] = _rows(t[f"{g}.attn_gate.weight"], perm, d)
        sd[f"{la}.in_proj_b.weight"] = t[f"{g}.ssm_beta.weight"][perm]
        sd[f"{la}.in_proj_a.weight"] = t[f"{g}.ssm_alpha.weight"][perm]
        sd[f"{la}.A_log"] = np.log(-t[f"{g}.ssm_a"][perm])
        sd[f"{la}.dt_bias"] = t[f"{g}.ssm_dt.bias"][perm]
        sd[f"{la}.norm.weight"] = t[f"{g}.ssm_norm.weight"]
        sd[f"{la}.out_proj.weight"] = _rows(t[f"{g}.ssm_out.weight"].T, perm, d).T.copy()
    return sd
