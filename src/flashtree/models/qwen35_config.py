"""Hyper-parameters of a `qwen35` model, derived from GGUF metadata for any size (never hard-coded)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from flashtree.errors import FlashtreeError

ARCH = "qwen35"


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # trunk layers only; an MTP block after them is not part of the trunk
    num_mtp_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_theta: float
    rms_eps: float
    attention_scale: float
    recurrent_layers: tuple[bool, ...]  # True = Gated DeltaNet, False = gated full attention
    conv_kernel: int
    gdn_head_dim: int
    gdn_qk_heads: int
    gdn_v_heads: int
    context_length: int
    name: str = "qwen35"

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "conv_kernel", "gdn_head_dim", "gdn_qk_heads", "gdn_v_heads")
        for key in positive:
            if getattr(self, key) <= 0:
                raise FlashtreeError(f"model config: {key} must be positive, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            raise FlashtreeError(f"model config: head_count {self.num_heads} is not a multiple of head_count_kv {self.num_kv_heads}")
        if self.gdn_v_heads % self.gdn_qk_heads:
            raise FlashtreeError(
                f"model config: ssm.time_step_rank {self.gdn_v_heads} is not a multiple of ssm.group_count {self.gdn_qk_heads}"
            )
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise FlashtreeError(f"model config: rope.dimension_count {self.rope_dim} must be even and <= head dim {self.head_dim}")
        if len(self.recurrent_layers) != self.num_layers:
            raise FlashtreeError(
                f"model config: recurrent_layers has {len(self.recurrent_layers)} entries for {self.num_layers} layers"
            )

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_qk_heads * self.gdn_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_v_heads * self.gdn_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, rec in enumerate(self.recurrent_layers) if not rec]

    @property
    def deltanet_layers(self) -> list[int]:
        return [i for i, rec in enumerate(self.recurrent_layers) if rec]

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], vocab_size: int) -> "Qwen35Config":
        arch = meta.get("general.architecture")
        if arch != ARCH:
            raise FlashtreeError(f"unsupported architecture {arch!r}: flashtree runs {ARCH!r} models (Qwen3.5 / Qwen3.6 GGUF)")

        def key(name: str, default: Any = None) -> Any:
            full = f"{ARCH}.{name}"
            if full in meta:
                return meta[full]
            if default is None:
                raise FlashtreeError(f"metadata key {full!r} is missing; is this a complete qwen35 GGUF?")
            return default

        block_count = int(key("block_count"))
        mtp = int(key("nextn_predict_layers", 0))
        trunk = block_count - mtp
        head_dim = int(key("attention.key_length", 256))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise FlashtreeError("attention.key_length and attention.value_length differ; unsupported")
        recurrent = key("attention.recurrent_layers", [])
        if recurrent:
            recurrent = tuple(bool(x) for x in recurrent[:trunk])
        else:
            interval = int(key("full_attention_interval", 4))
            recurrent = tuple((i + 1) % interval != 0 for i in range(trunk))
        scale = meta.get(f"{ARCH}.attention.scale") or head_dim**-0.5
        return cls(
            vocab_size=vocab_size,
            hidden_size=int(key("embedding_length")),
            intermediate_size=int(key("feed_forward_length")),
            num_layers=trunk,
            num_mtp_layers=mtp,
            num_heads=int(key("attention.head_count")),
            num_kv_heads=int(key("attention.head_count_kv")),
            head_dim=head_dim,
            rope_dim=int(key("rope.dimension_count", head_dim // 4)),
            rope_theta=float(key("rope.freq_base", 1e7)),
            rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            attention_scale=float(scale),
            recurrent_layers=recurrent,
            conv_kernel=int(key("ssm.conv_kernel", 4)),
            gdn_head_dim=int(key("ssm.state_size")),
            gdn_qk_heads=int(key("ssm.group_count")),
            gdn_v_heads=int(key("ssm.time_step_rank")),
            context_length=int(key("context_length", 262144)),
            name=str(meta.get("general.name", ARCH)),
        )
