"""Per-tensor quant types of a llama-quantize style mix (Q4_K_M) for qwen35 tensors.

Follows the stock rules: 1-D tensors, norms, conv and non-`.weight` tensors stay F32; the LM head is
Q6_K; the "attn_v-like" tensors (attn_v and the DeltaNet attn_qkv) and ffn_down get Q6_K on the
use-more-bits layers; everything else Q4_K. A K-quant needs rows that are a multiple of 256 values;
otherwise the same fallback as llama.cpp applies.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError

SCHEMES = ("f32", "f16", "bf16", "q8_0", "q4_k_m")
_FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0, QType.IQ4_XS: QType.IQ4_NL}
_UNIFORM = {"f32": QType.F32, "f16": QType.F16, "bf16": QType.BF16, "q8_0": QType.Q8_0}


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quant_types(shapes: dict[str, tuple[int, ...]], scheme: str) -> dict[str, QType]:
    if scheme not in SCHEMES:
        raise FlashtreeError(f"unknown quant scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    v_like = sorted((n for n in shapes if n.endswith((".attn_v.weight", ".attn_qkv.weight"))), key=_layer_index)
    down = sorted((n for n in shapes if n.endswith(".ffn_down.weight")), key=_layer_index)
    more_bits = {n for group in (v_like, down) for i, n in enumerate(group) if use_more_bits(i, len(group))}
    return {name: _type_for(name, shape, scheme, name in more_bits) for name, shape in shapes.items()}


def _type_for(name: str, shape: tuple[int, ...], scheme: str, more_bits: bool) -> QType:
    keep_f32 = len(shape) < 2 or not name.endswith(".weight") or "norm" in name or "ssm_conv1d" in name
    if keep_f32:
        return QType.F32
    if scheme in _UNIFORM:
        wanted = _UNIFORM[scheme]
        return wanted if wanted != QType.Q8_0 or shape[-1] % 32 == 0 else QType.F16
    wanted = QType.Q6_K if name == "output.weight" or more_bits else QType.Q4_K
    if shape[-1] % 256:
        wanted = _FALLBACK[wanted]
    return wanted if shape[-1] % 32 == 0 else QType.F16


def _layer_index(name: str) -> int:
    return int(name.split(".")[1])
