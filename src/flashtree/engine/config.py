"""The engine's settings: everything `load_engine` takes, in one frozen object checked on construction, and
the decoding defaults that the command line, the planner and `GenerationConfig` share; and the per-request
side: `GenerationConfig` (one request's settings), `GenerationStats` and `GenerationResult` (what it gave).

No torch here: the command line imports this module to build its parser, and `flashtree --help` must not
wait for torch (the modules of `SamplingParams` and `kv_type` import it, so they are imported when used)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Sequence

from flashtree.engine.prefix_cache_flags import (DEFAULT_DEVICE_BYTES, DEFAULT_INTERVAL, DEFAULT_MAX_BYTES,
                                                DEFAULT_MAX_ENTRIES)
from flashtree.errors import FlashtreeError

if TYPE_CHECKING:
    from flashtree.engine.output import TokenLogprob
    from flashtree.engine.sampling import SamplingParams

MODES = ("ar", "chain", "ddtree")
DEFAULT_BUDGET = 22  # DDTree node budget (root not counted)
DEFAULT_TOPK = 8  # DDTree candidates per draft position
DEFAULT_DRAFT_WINDOW = 4096  # committed positions the draft attends to (its context cache size)
DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per prefill forward
# How the draft's decoder-layer matrices are held: "dense" in the compute dtype (bf16 on a GPU, f32 on the CPU),
# or "q8_0" blocks (`DFlashDraft.quantize_layers`: 1.83 GiB instead of 3.22 for the 27B draft; its `fc` and
# norms stay dense). Speculative output is the target's either way: the draft only proposes.
DENSE_DRAFT = "dense"
DRAFT_TYPES = (DENSE_DRAFT, "q8_0")
DEFAULT_DRAFT_TYPE = DENSE_DRAFT
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
# What a CUDA process holds on each GPU outside PyTorch's allocator: the CUDA context, cuBLAS workspaces,
# Triton and NVRTC modules. The planner counts it per GPU and `--gpu-memory` caps the allocator at the cap
# less this. Measured at the 27B shape on an H200 (`outside_allocator` of `flashtree bench --steps`,
# 2026-12-01): 0.68-0.77 GiB once kernels are compiled and tuned; a fresh machine's first process held
# 3.2-3.3 GiB after fla's first autotuning (docs/PERFORMANCE.md), which this does not cover.
DEFAULT_CUDA_OVERHEAD = int(0.8 * 2**30)
# What one speculative step costs in autoregressive steps (engine/adaptive.py): 1 for the verify's first node,
# plus the draft pass, commit and host work, plus each further tree node. Measured at the 27B shape on an H200
# (docs/PERFORMANCE.md): a 22-node verify costs 2.3 decode steps, draft and commit 1.4: 3.7 in all. The CPU
# demo pair is cheaper (26.3 ms against 9.3 ms for an AR step: 2.8), so these err towards AR.
DEFAULT_STEP_COST_FIXED = 1.4
DEFAULT_STEP_COST_PER_NODE = 0.06


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


def check_draft_type(draft_type: str) -> None:
    if draft_type not in DRAFT_TYPES:
        raise FlashtreeError(f"unknown draft type {draft_type!r}; choose one of {', '.join(DRAFT_TYPES)}")


def cache_rows(tokens: int, budget: int) -> int:
    """Cache rows for `tokens` committed tokens: they, and the scratch rows past the committed end that a
    verify writes its tree into (budget + 2). The engine sizes its cache and the planner its plan by this."""
    return tokens + budget + 2


# Chat templates' message headers (ChatML and the Qwen templates): a prompt's prefill chunks end before each
MESSAGE_START_TOKENS = ("<|im_start|>",)


def prefill_chunk_ends(start: int, token_ids: Sequence[int], chunk: int,
                       message_starts: Collection[int] = frozenset()) -> list[int]:
    """Where the prefill chunks over `token_ids` (positions start .. start + len) end: at absolute multiples of
    `chunk`, before every message header (a token in `message_starts`) and at the end. Each cut depends only on
    its position and the token there, so a prefill resumed at any chunk end runs, from there on, the very
    chunks (shapes and boundaries, so the bits) of an unbroken prefill of the same prompt; and the next turn
    of a chat, whose prompt repeats this one up to its last header (templates re-render the generation
    prompt), can resume at that header: the prefix cache snapshots chunk ends."""
    end = start + len(token_ids)
    cuts = {*range((start // chunk + 1) * chunk, end, chunk), end}
    if message_starts:
        cuts.update(start + i for i, token in enumerate(token_ids) if i and token in message_starts)
    return sorted(cuts)


@dataclass(frozen=True)
class StepCost:
    """A speculative step's cost in autoregressive steps, as a function of its tree budget: what the
    adaptive policy (engine/adaptive.py) weighs the tokens a step commits against."""

    fixed: float = DEFAULT_STEP_COST_FIXED  # draft pass, commit and host work of a step
    per_node: float = DEFAULT_STEP_COST_PER_NODE  # each tree node past the root, in the verify

    def __post_init__(self) -> None:
        if not (0 <= self.fixed < float("inf") and 0 <= self.per_node < float("inf")):
            raise FlashtreeError(f"step cost must be finite and >= 0, got fixed={self.fixed} per_node={self.per_node}")

    def of(self, budget: int) -> float:
        """AR steps one speculative step of `budget` nodes costs (the root's row is an AR step's work)."""
        return 1.0 + self.fixed + self.per_node * budget


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
    draft_type: str = DEFAULT_DRAFT_TYPE  # the draft's layer matrices: dense or q8_0 (DRAFT_TYPES)
    enforce_eager: bool = False  # no CUDA graphs
    # the memory check before loading (on CUDA), and the requests' context size
    ctx: int | None = None  # context size in tokens; None: fit each request
    gpu_memory: str | None = None  # memory per GPU, e.g. 24GiB: planned for and held to; None: each GPU's free memory
    cuda_overhead: int = DEFAULT_CUDA_OVERHEAD  # bytes per GPU outside PyTorch's allocator (context, libraries)
    # the default request; None: GenerationConfig's own default
    max_new_tokens: int | None = None
    prefill_chunk: int | None = None
    adaptive: bool | None = None  # speculation shrinks its tree or steps as AR while it does not pay
    step_cost: StepCost | None = None  # what the adaptive policy takes a speculative step to cost
    skip_special_tokens: bool = True
    # reuse of earlier prompts' state across requests (engine/prefix_cache.py)
    prefix_cache: bool = False
    prefix_cache_entries: int = DEFAULT_MAX_ENTRIES
    prefix_cache_bytes: int = DEFAULT_MAX_BYTES
    prefix_cache_device_bytes: int = DEFAULT_DEVICE_BYTES
    prefix_cache_interval: int = DEFAULT_INTERVAL
    # output on the terminal, and how prompts are read
    progress: bool = False  # a bar while the layers load
    prefill_progress: bool = False  # a bar while a long prompt is prefilled
    parse_special: bool = False  # control-token text in prompts becomes control tokens

    def __post_init__(self) -> None:
        check_decoding(self.spec or "ar", self.budget, self.topk, self.ctx, self.attn_window)
        check_draft_type(self.draft_type)
        if self.gpus is not None and self.gpus < 1:
            raise FlashtreeError(f"gpus must be >= 1, got {self.gpus}")
        if self.tensor_parallel < 1:
            raise FlashtreeError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.cuda_overhead < 0:
            raise FlashtreeError(f"cuda_overhead must be >= 0 bytes, got {self.cuda_overhead}")

    @property
    def cache_options(self) -> dict:
        """The KV cache settings, as `GenerationConfig` takes them."""
        return {"cache_type_k": self.cache_type_k, "cache_type_v": self.cache_type_v, "attn_window": self.attn_window}


def _greedy() -> SamplingParams:
    """`GenerationConfig`'s default sampling: greedy."""
    from flashtree.engine.sampling import SamplingParams  # torch: not at import (see above)

    return SamplingParams()


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    mode: str = "ar"
    budget: int = DEFAULT_BUDGET  # DDTree node budget (root not counted)
    topk: int = DEFAULT_TOPK  # candidates per draft position for the tree
    draft_window: int = DEFAULT_DRAFT_WINDOW
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # extra end-of-generation ids (vLLM's stop_token_ids)
    ignore_eos: bool = False
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    ctx: int | None = None  # context size in tokens (prompt + generated); None = fit the request
    cache_type_k: str | None = None  # KV cache type (f16, bf16, f32, q8_0, q4_0, tq3_0); None = model dtype
    cache_type_v: str | None = None
    attn_window: int = 0  # > 0: sliding-window attention over the last N positions (changes output)
    logprobs: int | None = None  # None: off; k >= 0: each token's log-probability and the k most likely there
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (one more pass over the prompt)
    sampling: SamplingParams = field(default_factory=_greedy)  # greedy by default
    skip_special_tokens: bool = True  # control tokens (<|im_start|>...) left out of the text, not the ids (vLLM's)
    # speculative modes: a smaller tree, or AR steps, while the acceptance measured on this request does not
    # pay for the steps' cost (engine/adaptive.py); output is the same either way
    adaptive: bool = True
    step_cost: StepCost = field(default_factory=StepCost)

    def __post_init__(self) -> None:
        check_decoding(self.mode, self.budget, self.topk, self.ctx, self.attn_window)
        if self.max_new_tokens < 0:
            raise FlashtreeError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.draft_window < 1:
            raise FlashtreeError(f"draft_window must be >= 1, got {self.draft_window}")
        if self.prefill_chunk < 1:
            raise FlashtreeError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        for name in (self.cache_type_k, self.cache_type_v):
            if name is not None:
                from flashtree.kernels.kv_quant import kv_type  # torch: not at import (see above)

                kv_type(name)  # raises with the supported choices
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise FlashtreeError(f"{name} must be from 0 to {MAX_TOP_LOGPROBS}, got {value}")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, restored from the prefix cache instead of prefilled
    new_tokens: int = 0
    steps: int = 0  # target forwards after prefill (decode steps or verify steps)
    accepted: Counter = field(default_factory=Counter)  # committed tokens per verify step -> count
    proposed: int = 0  # draft tokens offered for verification (tree nodes below the root)
    ar_fallback_steps: int = 0  # of a speculative request's steps, those the adaptive policy ran as AR steps
    # (new tokens before the change, the tree budget from there on; 0: AR steps) for each change of budget
    budget_switches: list[tuple[int, int]] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Committed tokens per target step (1.0 for autoregressive decoding)."""
        committed = sum(k * v for k, v in self.accepted.items())
        return committed / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0 without a draft)."""
        accepted = sum((k - 1) * v for k, v in self.accepted.items())
        return accepted / self.proposed if self.proposed else 0.0

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens,
            "steps": self.steps,
            "acceptance_length": round(self.acceptance_length, 4), "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_histogram": {str(k): v for k, v in sorted(self.accepted.items())},
            "ar_fallback_steps": self.ar_fallback_steps, "budget_switches": [list(s) for s in self.budget_switches],
            "prefill_s": round(self.prefill_s, 6), "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6), "overhead_s": round(max(self.decode_s - self.draft_s - self.verify_s, 0.0), 6),
            "total_s": round(self.total_s, 6), "tokens_per_s": round(self.tokens_per_s, 3),
        }


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: GenerationStats
    stop_string: str | None = None  # which stop string ended it ("stop" without one: an end-of-generation token)
    logprobs: list[TokenLogprob] | None = None  # per token of `token_ids` whose text was kept, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first has none), when asked for
