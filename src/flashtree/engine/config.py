"""The engine's settings: everything `load_engine` takes, in one frozen object checked on construction, and
the decoding defaults that the command line, the planner and `GenerationConfig` share.

No torch here: the command line imports this module to build its parser, and `flashtree --help` must not
wait for torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from flashtree.engine.prefix_cache_flags import DEFAULT_INTERVAL, DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES
from flashtree.errors import FlashtreeError

MODES = ("ar", "chain", "ddtree")
DEFAULT_BUDGET = 22  # DDTree node budget (root not counted)
DEFAULT_TOPK = 8  # DDTree candidates per draft position
DEFAULT_DRAFT_WINDOW = 4096  # committed positions the draft attends to (its context cache size)
DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per prefill forward


def check_decoding(mode: str, budget: int, topk: int, ctx: int | None, attn_window: int) -> None:
    """The checks `EngineArgs` and `GenerationConfig` share: a known mode, a tree of at least one node and
    one candidate, a context of at least two tokens, a non-negative attention window."""
    if mode not in MODES:
        raise FlashtreeError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if budget < 1 or topk < 1:
        raise FlashtreeError(f"budget and topk must be >= 1, got budget={budget} topk={topk}")
    if ctx is not None and ctx < 2:
        raise FlashtreeError(f"ctx must be >= 2 tokens, got {ctx}")
    if attn_window < 0:
        raise FlashtreeError(f"attn_window must be >= 0 (0 = full attention), got {attn_window}")


def cache_rows(tokens: int, budget: int) -> int:
    """Cache rows for `tokens` committed tokens: they, and the scratch rows past the committed end that a
    verify writes its tree into (budget + 2). The engine sizes its cache and the planner its plan by this."""
    return tokens + budget + 2


@dataclass(frozen=True)
class EngineArgs:
    """What to load and how: the target and draft, the decoding mode, the KV cache, the placement over
    devices, the load-time memory check, and the defaults of the requests the engine answers."""

    model: str | Path | None = None  # target GGUF; None or "demo": the embedded demo pair
    draft: str | Path | None = None  # DFlash draft directory (config.json + model.safetensors)
    device: str | None = "auto"  # cpu, cuda, cuda:N; auto (or None): the first GPU, else the CPU
    spec: str | None = None  # decoding mode; None: ddtree when there is a draft, else ar
    budget: int = DEFAULT_BUDGET
    topk: int = DEFAULT_TOPK
    cache_type_k: str | None = None  # KV cache types (f16, bf16, f32, q8_0, q4_0, tq3_0); None: the model dtype
    cache_type_v: str | None = None
    attn_window: int = 0  # > 0: sliding-window attention over the last N positions (changes output)
    # placement (flashtree.parallel, docs/MULTI_GPU.md)
    gpus: int | None = None  # split the target's layers evenly over cuda:0..N-1
    layer_split: str | Sequence[float] | None = None  # layers per device, as proportions or counts
    devices: Sequence[str] | None = None  # the split's devices instead of cuda:0..N-1 (tests split over "cpu")
    draft_device: str | None = None  # the draft and its context cache on their own device
    tensor_parallel: int = 1  # > 1: shard the target over the ranks of the process group
    enforce_eager: bool = False  # no CUDA graphs
    # the memory check before loading (on CUDA), and the requests' context size
    ctx: int | None = None  # context size in tokens; None: fit each request
    gpu_memory: str | None = None  # memory per GPU to plan for, e.g. 24GiB; None: each GPU's free memory
    # the default request; None: GenerationConfig's own default
    max_new_tokens: int | None = None
    prefill_chunk: int | None = None
    skip_special_tokens: bool = True
    # reuse of earlier prompts' state across requests (engine/prefix_cache.py)
    prefix_cache: bool = False
    prefix_cache_entries: int = DEFAULT_MAX_ENTRIES
    prefix_cache_bytes: int = DEFAULT_MAX_BYTES
    prefix_cache_interval: int = DEFAULT_INTERVAL
    # output on the terminal, and how prompts are read
    progress: bool = False  # a bar while the layers load
    prefill_progress: bool = False  # a bar while a long prompt is prefilled
    parse_special: bool = False  # control-token text in prompts becomes control tokens

    def __post_init__(self) -> None:
        check_decoding(self.spec or "ar", self.budget, self.topk, self.ctx, self.attn_window)
        if self.gpus is not None and self.gpus < 1:
            raise FlashtreeError(f"gpus must be >= 1, got {self.gpus}")
        if self.tensor_parallel < 1:
            raise FlashtreeError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")

    @property
    def cache_options(self) -> dict:
        """The KV cache settings, as `GenerationConfig` takes them."""
        return {"cache_type_k": self.cache_type_k, "cache_type_v": self.cache_type_v, "attn_window": self.attn_window}
