"""The one `generate` entry point used by the CLI, the server and the benchmarks."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from flashtree.drafting.proposer import Proposer
from flashtree.engine.adaptive import budget_ladder
from flashtree.engine.config import GenerationConfig, GenerationResult, GenerationStats
from flashtree.engine.decode import autoregressive, speculative
from flashtree.engine.output import OutputTracker, TokenLogprob
from flashtree.engine.prefix_cache import PrefixCache
from flashtree.engine.runner import ModelRunner, Target
from flashtree.errors import FlashtreeError
from flashtree.models.dflash import DFlashDraft

WARM_UP_TOKENS = 16  # per smaller budget in `Engine.warm_up`: a few verify and commit shapes of each


class Engine:
    """A loaded target (and optionally a draft) behind `generate`; its steps, which the decoding loops
    (engine/decode.py) run on, are the `runner`'s (engine/runner.py)."""

    def __init__(self, target: Target, draft: DFlashDraft | Proposer | None = None,
                 default_config: GenerationConfig | None = None, *, draft_path: Path | None = None,
                 use_cuda_graphs: bool = True, prefill_progress: bool = False, parse_special: bool = False,
                 prefix_cache: PrefixCache | None = None):
        self.runner = ModelRunner(target, draft, use_cuda_graphs=use_cuda_graphs, prefill_progress=prefill_progress,
                                  prefix_cache=prefix_cache)
        self.draft_path = draft_path  # the directory the draft was loaded from, for reports (None: no file, or no draft)
        self.default_config = default_config or GenerationConfig(mode="ddtree" if draft is not None else "ar")
        self.parse_special = parse_special  # control-token text in prompts and messages becomes control tokens (forgeable turns)

    @property
    def target(self) -> Target:
        return self.runner.target

    @target.setter
    def target(self, target: Target) -> None:
        self.runner.target = target

    @property
    def draft(self) -> DFlashDraft | Proposer | None:
        return self.runner.draft

    @draft.setter
    def draft(self, draft: DFlashDraft | Proposer | None) -> None:
        self.runner.draft = draft

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """A flashtree.engine.prefix_cache.PrefixCache reuses prompt prefixes across requests (the runner's)."""
        return self.runner.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, prefix_cache: PrefixCache | None) -> None:
        self.runner.prefix_cache = prefix_cache

    def config_for(self, **overrides) -> GenerationConfig:
        """The engine's defaults (mode, budget, ...) with per-request values on top."""
        return replace(self.default_config, **{k: v for k, v in overrides.items() if v is not None})

    def encode_prompt(self, prompt: str, raw: bool = False, system: str | None = None, **template_kwargs) -> list[int]:
        """Token ids for a user prompt: through the model's chat template unless `raw`."""
        if raw or self.target.chat_template is None:
            return self.tokenizer.encode(prompt, allow_special=self.parse_special)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.encode_messages(messages, **template_kwargs)

    def encode_messages(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Token ids of a conversation rendered with the generation prompt (plain text joined by newlines
        when the model has no chat template); control tokens only where the template puts them."""
        template = self.target.chat_template
        if template is None:
            return self.tokenizer.encode("\n".join(m["content"] for m in messages), allow_special=self.parse_special)
        _, ids = self.tokenizer.encode_chat(template, messages, parse_special=self.parse_special, **template_kwargs)
        return ids

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def warm_up(self, prompt_ids: Sequence[int], config: GenerationConfig) -> float:
        """Generate once after `prompt_ids` with `config`, and for a speculative mode a few steps at every
        budget its adaptive policy can move to: kernels compile and CUDA graphs capture for the step shapes
        a request like it meets, before any request waits on them (a rung first visited mid-request
        compiles kernels for its row count there: seconds). Returns the seconds it took."""
        began = time.perf_counter()
        self.generate(prompt_ids, config)
        if config.mode != "ar":
            for budget in budget_ladder(config.budget)[1:]:
                self.generate(prompt_ids, replace(config, budget=budget, adaptive=False, max_new_tokens=WARM_UP_TOKENS))
        return time.perf_counter() - began

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig,
                 on_text: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None,
                 on_logprobs: Callable[[list[TokenLogprob]], None] | None = None) -> GenerationResult:
        """Generate after `prompt_ids`. `on_text` receives streamed text pieces; `cancelled` is polled once
        per target step and ends generation with finish_reason "cancelled" when it returns True; with
        `config.logprobs` set, `on_logprobs` receives each piece's tokens' log-probabilities before it."""
        if not prompt_ids:
            raise FlashtreeError("the prompt is empty: give at least one token")
        if config.mode != "ar" and self.draft is None:
            raise FlashtreeError(f"mode {config.mode!r} needs a draft model: pass --draft DIR or use --spec ar")
        eos = set(config.stop_token_ids) | (set() if config.ignore_eos else set(self.tokenizer.eos_ids))
        runner = self.runner
        room = runner.new_token_room(len(prompt_ids), config)
        out = OutputTracker(self.tokenizer, eos, config.stop, room, on_text, cancelled, on_logprobs,
                            skip_special=config.skip_special_tokens)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        scored = None if config.prompt_logprobs is None else runner.score_prompt(list(prompt_ids), config)
        started = time.perf_counter()
        if not out.done:
            if config.mode == "ar":
                autoregressive(runner, list(prompt_ids), config, out, stats, started)
            else:
                speculative(runner, list(prompt_ids), config, out, stats, started)
            if self.prefix_cache is not None:  # after a normal return only: the prefill of this call opened it
                self.prefix_cache.finish(list(prompt_ids) + out.token_ids)
        stats.total_s = time.perf_counter() - started
        stats.new_tokens = len(out.token_ids)
        return GenerationResult(out.token_ids, out.text, out.finish_reason, stats, out.stop_string,
                                out.logprobs if config.logprobs is not None else None, scored)
