"""The one `generate` entry point used by the CLI, the server and the benchmarks."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from flashtree.engine.config import GenerationConfig, GenerationResult, GenerationStats, cache_rows
from flashtree.engine.cuda_graphs import GraphedForward
from flashtree.engine.decode import autoregressive, speculative
from flashtree.engine.output import OutputTracker, TokenLogprob, token_logprobs
from flashtree.engine.sampling import Sampler
from flashtree.errors import FlashtreeError
from flashtree.models.step import Step

SCORE_CHUNK = 128  # prompt tokens per pass when scoring a prompt: [128, vocab] float32 logits (127 MB at 248K)
PROGRESS_MIN_TOKENS = 8192  # prompts this long show a prefill progress bar where the CLI asks for one


class Engine:
    """A loaded target (and optionally a draft), and what the decoding loops (engine/decode.py) run on."""

    def __init__(self, target, draft=None, default_config: GenerationConfig | None = None, *,
                 draft_path: Path | None = None, use_cuda_graphs: bool = True, prefill_progress: bool = False,
                 parse_special: bool = False, prefix_cache=None):
        self.target = target
        self.draft = draft
        self.draft_path = draft_path  # the directory the draft was loaded from, for reports (None: no file, or no draft)
        self.default_config = default_config or GenerationConfig(mode="ddtree" if draft is not None else "ar")
        self.prefix_cache = prefix_cache  # a flashtree.engine.prefix_cache.PrefixCache reuses prompt prefixes across requests
        self.use_cuda_graphs = use_cuda_graphs  # decode and verify steps replay CUDA graphs (single-device CUDA targets)
        self._graphs = None  # the GraphedForward, made on first use
        self._kept_cache = None  # (options, cache): reused across requests so captured graphs stay valid
        self.prefill_progress = prefill_progress  # a progress bar (stderr) for prompts of PROGRESS_MIN_TOKENS and more
        self.parse_special = parse_special  # control-token text in prompts and messages becomes control tokens (forgeable turns)

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
        room = self.new_token_room(len(prompt_ids), config)
        out = OutputTracker(self.tokenizer, eos, config.stop, room, on_text, cancelled, on_logprobs,
                            skip_special=config.skip_special_tokens)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        scored = None if config.prompt_logprobs is None else self.score_prompt(list(prompt_ids), config)
        started = time.perf_counter()
        if not out.done:
            if config.mode == "ar":
                autoregressive(self, list(prompt_ids), config, out, stats, started)
            else:
                speculative(self, list(prompt_ids), config, out, stats, started)
            if self.prefix_cache is not None:  # after a normal return only: the prefill of this call opened it
                self.prefix_cache.finish(list(prompt_ids) + out.token_ids)
        stats.total_s = time.perf_counter() - started
        stats.new_tokens = len(out.token_ids)
        return GenerationResult(out.token_ids, out.text, out.finish_reason, stats, out.stop_string,
                                out.logprobs if config.logprobs is not None else None, scored)

    @torch.inference_mode()
    def score_prompt(self, prompt_ids: list[int], config: GenerationConfig) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability given the tokens before it (and the `config.prompt_logprobs`
        most likely there): a pass of its own over the prompt, in chunks small enough that their full
        logits stay a few hundred MB, into a cache of its own."""
        cache = self.new_cache(len(prompt_ids), config)  # sized as the generation's: a kept (graphed) cache serves both
        model, rows = self.target.model, SCORE_CHUNK
        entries: list[TokenLogprob | None] = [None]
        for start in range(0, len(prompt_ids) - 1, rows):
            piece = prompt_ids[start : start + rows]
            logits = model.forward(torch.tensor(piece, dtype=torch.long), cache).logits
            following = prompt_ids[start + 1 : start + 1 + len(piece)]
            entries += token_logprobs(logits[: len(following)], following, config.prompt_logprobs)
        return entries

    def new_token_room(self, prompt_len: int, config: GenerationConfig) -> int:
        """New tokens this request may generate: max_new_tokens, capped by the context (--ctx or the model's)."""
        limit = config.ctx or self.target.config.context_length
        if prompt_len >= limit:
            raise FlashtreeError(f"the prompt has {prompt_len} tokens but the context holds {limit}; "
                                 "shorten the prompt or raise --ctx")
        return min(config.max_new_tokens, limit - prompt_len)

    def context_size(self, prompt_len: int, config: GenerationConfig) -> int:
        """Cache rows: prompt + new tokens + tree scratch rows past the committed end."""
        return cache_rows(prompt_len + self.new_token_room(prompt_len, config), config.budget)

    def new_cache(self, prompt_len: int, config: GenerationConfig):
        """The target cache for one request: sized by `context_size`, KV types and window from `config`.
        With CUDA graphs the previous request's cache is reset and reused when it is large enough."""
        size = self.context_size(prompt_len, config)
        options = (config.cache_type_k, config.cache_type_v, config.attn_window)
        if self.graph_runner() is not None and self._kept_cache is not None:
            kept_options, cache = self._kept_cache
            if kept_options == options and cache.capacity >= size:
                cache.reset()
                return cache
        if self._graphs is not None:  # free the old cache and its graphs before allocating the new one
            self._kept_cache = None
            self._graphs.release()
        cache = self.target.model.new_cache(size, *options)
        if self.graph_runner() is not None:
            self._kept_cache = (options, cache)
        return cache

    def graph_runner(self):
        """The CUDA graph runner of decode/verify steps, or None (CPU, a layer split, or turned off)."""
        if self._graphs is None:
            model = self.target.model
            if not self.use_cuda_graphs or model.device.type != "cuda" or model.boundaries:
                return None
            self._graphs = GraphedForward(model)
        return self._graphs

    def step_forward(self, tokens: torch.Tensor, cache, tree=None, capture=(), pad_to: int | None = None):
        """One decode step (`tree` None) or one tree verify of the target, replayed from a CUDA graph
        where possible; a verify is padded to `pad_to` nodes so that every step of a request has one shape."""
        runner = self.graph_runner()
        if runner is not None:
            return runner.forward(tokens, cache, tree, capture, pad_to)
        model = self.target.model
        step = None
        if tree is not None:
            dev = model.device
            step = Step.tree(cache.length, tree.parents.to(dev), tree.depths.to(dev), tree.ancestor_mask().to(dev))
        return model.forward(tokens, cache, step=step, capture=capture)

    def commit_step(self, cache, accepted: list[int], proposer, features: torch.Tensor,
                    next_bonus: int | None = None) -> None:
        """Keep the accepted nodes (root first) of the last verify, and give the proposer their features.
        A draft on a device of its own is given them first and starts on the block after `next_bonus`,
        so both devices work while the target commits."""
        runner = self.graph_runner()
        if runner is not None:
            return runner.commit(cache, accepted, proposer, features)
        model = self.target.model
        path = torch.tensor(accepted, device=model.device)
        positions = torch.arange(cache.length, cache.length + len(accepted), device=model.device)
        proposer.commit(features[path], positions)
        if next_bonus is not None and getattr(proposer, "overlaps", False):
            proposer.prefetch(next_bonus, cache.length + len(accepted))
        model.commit(cache, path)

    def prefill_prompt(self, cache, prompt_ids: list[int], config: GenerationConfig, proposer=None,
                       stats: GenerationStats | None = None) -> torch.Tensor:
        """Fill the fresh `cache` with the prompt (through the prefix cache when there is one; `stats` gets
        how many prompt tokens it restored) and start `proposer` on it; returns the last position's logits."""
        if self.prefix_cache is not None:
            return self.prefix_cache.prefill(self, cache, prompt_ids, config, proposer, stats)
        if proposer is None:
            return self.prefill(cache, prompt_ids, config.prefill_chunk)
        proposer.start()
        return self.prefill(cache, prompt_ids, config.prefill_chunk, proposer.capture_layers, proposer.commit)

    def prefill(self, cache, prompt_ids: list[int], chunk: int, capture: Sequence[int] = (),
                on_features: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Run the prompt in chunks; returns the last position's logits. Each chunk's captured features go
        to `on_features(features, positions)` as soon as they exist, so nothing grows with the prompt but
        the KV cache (a 256K prompt's features would be ~12 GiB at the 27B shape)."""
        model = self.target.model
        with self.prefill_bar(len(prompt_ids)) as bar:
            for start in range(0, len(prompt_ids), chunk):
                piece = torch.tensor(prompt_ids[start : start + chunk], dtype=torch.long)
                first = cache.length
                result = model.forward(piece, cache, capture=capture, last_only=True)
                if on_features is not None:
                    on_features(result.features, torch.arange(first, cache.length, device=result.features.device))
                bar.update(piece.shape[0])
        return result.logits[-1]

    def prefill_bar(self, tokens: int):
        """A tqdm bar over `tokens` prompt tokens (stderr, gone when closed), drawn only when the CLI asked
        for progress (`prefill_progress`) and the prompt is long."""
        return tqdm(total=tokens, desc="prefill", unit="tok", unit_scale=True, leave=False,
                    disable=not self.prefill_progress or tokens < PROGRESS_MIN_TOKENS)

    def sampler(self, prompt_ids: list[int], config: GenerationConfig) -> Sampler:
        model = self.target.model
        return Sampler(config.sampling, prompt_ids, model.config.vocab_size, model.device)
