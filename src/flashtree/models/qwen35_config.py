"""Hyper-parameters of a `qwen35` model, derived from GGUF metadata for any size (never hard-coded)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from flashtree.errors import FlashtreeError

ARCH = "qwen35"
# Sanity bounds for metadata read before any tensor is: far above any real model, far below what a corrupt
# value would make us allocate.
MAX_LAYERS = 4096
MAX_DIMENSION = 1 << 20
MAX_CONTEXT = 1 << 31


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
    def from_metadata(cls, meta: Mapping[str, Any], vocab_size: int, blocks_in_file: int | None = None) -> "Qwen35Config":
        """The config a GGUF's metadata describes; `blocks_in_file` (how many `blk.N.` layers have tensors) bounds
        block_count before anything is sized by it."""
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

        def count(name: str, default: int | None = None, low: int = 1, high: int = MAX_DIMENSION) -> int:
            value = key(name, default)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise FlashtreeError(f"metadata key {ARCH}.{name} must be an integer in [{low}, {high}], got "
                                     f"{_shown(value)}")
            return value

        def number(name: str, default: float) -> float:
            value = key(name, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise FlashtreeError(f"metadata key {ARCH}.{name} must be a positive number, got {_shown(value)}")
            return float(value)

        block_count = count("block_count", high=MAX_LAYERS)
        if blocks_in_file is not None and block_count > blocks_in_file:
            raise FlashtreeError(f"metadata key {ARCH}.block_count is {block_count} but the file has tensors for "
                                 f"{blocks_in_file} blocks")
        mtp = count("nextn_predict_layers", 0, low=0, high=block_count - 1)
        trunk = block_count - mtp
        head_dim = count("attention.key_length", 256)
        if count("attention.value_length", head_dim) != head_dim:
            raise FlashtreeError("attention.key_length and attention.value_length differ; unsupported")
        recurrent = key("attention.recurrent_layers", [])
        if not isinstance(recurrent, list):
            raise FlashtreeError(f"metadata key {ARCH}.attention.recurrent_layers must be a list, got {_shown(recurrent)}")
        if recurrent:
            recurrent = tuple(bool(x) for x in recurrent[:trunk])
        else:
            interval = count("full_attention_interval", 4)
            recurrent = tuple((i + 1) % interval != 0 for i in range(trunk))
        return cls(
            vocab_size=vocab_size,
            hidden_size=count("embedding_length"),
            intermediate_size=count("feed_forward_length"),
            num_layers=trunk,
            num_mtp_layers=mtp,
            num_heads=count("attention.head_count"),
            num_kv_heads=count("attention.head_count_kv"),
            head_dim=head_dim,
            rope_dim=count("rope.dimension_count", head_dim // 4),
            rope_theta=number("rope.freq_base", 1e7),
            rms_eps=number("attention.layer_norm_rms_epsilon", 1e-6),
            attention_scale=number("attention.scale", head_dim**-0.5),
            recurrent_layers=recurrent,
            conv_kernel=count("ssm.conv_kernel", 4),
            gdn_head_dim=count("ssm.state_size"),
            gdn_qk_heads=count("ssm.group_count"),
            gdn_v_heads=count("ssm.time_step_rank"),
            context_length=count("context_length", 262144, high=MAX_CONTEXT),
            name=str(meta.get("general.name", ARCH)),
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
