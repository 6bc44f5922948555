"""The target/draft step machinery the decoding loops (engine/decode.py) run on: cache creation, one
decode or verify step, the commit of an accepted path, prompt prefill, samplers, prompt scoring and
context sizing, with decode/verify steps replayed from CUDA graphs where possible."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from flashtree.drafting.ddtree import build_chain
from flashtree.drafting.proposer import Proposer
from flashtree.engine.adaptive import SpeculationHistory
from flashtree.engine.config import (MESSAGE_START_TOKENS, GenerationConfig, GenerationStats, cache_rows,
                                    prefill_chunk_ends)
from flashtree.engine.cuda_graphs import GraphedForward
from flashtree.engine.output import TokenLogprob, token_logprobs
from flashtree.engine.prefix_cache import PrefixCache
from flashtree.engine.sampling import Sampler
from flashtree.errors import FlashtreeError
from flashtree.formats.chat_template import ChatTemplate
from flashtree.formats.gguf_file import GGUFFile
from flashtree.formats.tokenizer import Tokenizer
from flashtree.models.dflash import DFlashDraft
from flashtree.models.qwen35 import Qwen35Model
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.models.step import Step

SCORE_CHUNK = 128  # prompt tokens per pass when scoring a prompt: [128, vocab] float32 logits (127 MB at 248K)
PROGRESS_MIN_TOKENS = 8192  # prompts this long show a prefill progress bar where the CLI asks for one
# where the steps are graphed, a short prefill chunk runs as runs of at most 32 tokens, each one chain verify
# padded to the next of these rows and the commit of its tokens (both replayed from CUDA graphs). On the H200 at
# the 27B shape (2026-12-02, docs/PREFIX_CACHE.md): 1 token 6.8 ms (the decode step), 8 11.0, 16 14.5, 23 17.6,
# 32 21.1 ms, while one chain of 48 or 64 rows (two launches of every matmul) took 45-48 ms, an eager forward
# ~60 ms of launches whatever its length, and the power-of-two runs this replaced one whole forward each
CHAIN_ROWS = (4, 8, 16, 24, 32)
GRAPHED_CHUNK = 2 * CHAIN_ROWS[-1]  # two runs; a third would cost what one eager forward does


@dataclass
class Target:
    path: Path
    gguf: GGUFFile
    config: Qwen35Config
    model: Qwen35Model
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None


class ModelRunner:
    """A loaded target (and optionally a draft) and its steps: what the decoding loops run on."""

    def __init__(self, target: Target, draft: DFlashDraft | Proposer | None = None, *, use_cuda_graphs: bool = True,
                 prefill_progress: bool = False, prefix_cache: PrefixCache | None = None):
        self.target = target
        self.draft = draft
        self.prefix_cache = prefix_cache  # a flashtree.engine.prefix_cache.PrefixCache reuses prompt prefixes across requests
        self.use_cuda_graphs = use_cuda_graphs  # decode and verify steps replay CUDA graphs (single-device CUDA targets)
        self._graphs = None  # the GraphedForward, made on first use
        self._kept_cache = None  # (options, cache): reused across requests so captured graphs stay valid
        # step times and policy state the adaptive budget hands on, per mode and budget: a chain step and a tree
        # step of one budget cost and accept differently
        self._speculation: dict[tuple[str, int], SpeculationHistory] = {}
        self.prefill_progress = prefill_progress  # a progress bar (stderr) for prompts of PROGRESS_MIN_TOKENS and more

    def speculation(self, config: GenerationConfig) -> SpeculationHistory:
        """What earlier requests of `config`'s mode and budget learnt (engine/adaptive.py)."""
        return self._speculation.setdefault((config.mode, config.budget), SpeculationHistory())

    @property
    def tokenizer(self) -> Tokenizer:
        return self.target.tokenizer

    @functools.cached_property
    def message_starts(self) -> frozenset[int]:
        """Ids of the message-header tokens the tokenizer has (MESSAGE_START_TOKENS): prefill chunks end before them."""
        ids = (self.tokenizer.token_id(t) for t in MESSAGE_START_TOKENS)
        return frozenset(i for i in ids if i is not None)

    def chunk_ends(self, start: int, token_ids: Sequence[int], chunk: int) -> list[int]:
        """Where the prefill chunks over `token_ids`, the tokens after position `start`, end (`prefill_chunk_ends`)."""
        return prefill_chunk_ends(start, token_ids, chunk, self.message_starts)

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

    def step_feeding(self, token: int, cache, proposer) -> torch.Tensor:
        """One decode step of a speculative request (an AR step the adaptive policy chose): its captured
        features go to `proposer` as a prefill chunk's do, so the draft's context keeps every committed
        position. Returns the step's logits [1, vocab]."""
        position = cache.length
        result = self.step_forward(torch.tensor([token]), cache, capture=proposer.capture_layers)
        proposer.commit(result.features, torch.tensor([position], device=result.features.device))
        return result.logits

    def commit_step(self, cache, accepted: list[int], proposer, features: torch.Tensor,
                    next_bonus: int | None = None) -> None:
        """Keep the accepted nodes (root first) of the last verify, and give the proposer their features.
        A draft on a device of its own is given them first and starts on the block after `next_bonus`,
        so both devices work while the target commits."""
        runner = self.graph_runner()
        if runner is not None:
            return runner.commit(cache, accepted, proposer)  # the features: the verify graph's own buffer
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

    def prefill(self, cache, token_ids: list[int], chunk: int, capture: Sequence[int] = (),
                on_features: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                after_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run `token_ids`, the tokens after the `cache.length` already in the cache, in chunks that end at
        absolute multiples of `chunk` and before message headers (`chunk_ends`): a prefill resumed at a
        restored prefix runs the chunks, and so the shapes, of an unbroken one. Returns the last position's logits. Each chunk's
        captured features go to `on_features(features, positions)` as soon as they exist, so nothing grows
        with the prompt but the KV cache (a 256K prompt's features would be ~12 GiB at the 27B shape);
        `after_chunk(cache length)` runs after each chunk (the prefix cache's snapshots)."""
        start = cache.length
        with self.prefill_bar(len(token_ids)) as bar:
            for end in self.chunk_ends(start, token_ids, chunk):
                piece = token_ids[cache.length - start : end - start]
                logits = self.prefill_chunk(cache, piece, capture, on_features)
                if after_chunk is not None:
                    after_chunk(end)
                bar.update(len(piece))
        return logits

    def prefill_chunk(self, cache, token_ids: list[int], capture: Sequence[int] = (),
                      on_features: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
        """One prefill forward over `token_ids`; returns the last position's logits. A short chunk replays
        captured steps instead, in runs of at most CHAIN_ROWS[-1] tokens (`_graphed_run`)."""
        if self.graph_runner() is None or len(token_ids) > GRAPHED_CHUNK:
            return self._eager_run(cache, token_ids, capture, on_features)
        run = CHAIN_ROWS[-1]
        for start in range(0, len(token_ids), run):
            logits = self._graphed_run(cache, token_ids[start : start + run], capture, on_features)
        return logits

    def _graphed_run(self, cache, token_ids: list[int], capture: Sequence[int],
                     on_features: Callable[[torch.Tensor, torch.Tensor], None] | None) -> torch.Tensor:
        """One token: the decode step; more: a chain verify padded to `chain_rows` and the commit of its tokens;
        an eager forward where the padding would pass the end of the cache."""
        rows = chain_rows(len(token_ids), cache.capacity - cache.length)
        if rows is None:
            return self._eager_run(cache, token_ids, capture, on_features)
        first, tokens, runner = cache.length, torch.tensor(token_ids), self.graph_runner()
        if rows == 1:
            result = runner.forward(tokens, cache, capture=capture)
        else:
            result = runner.forward(tokens, cache, build_chain(token_ids[0], tokens[1:], len(token_ids) - 1), capture,
                                    pad_to=rows)
            runner.commit(cache, list(range(len(token_ids))))
        return self._hand_on(result, first, cache, on_features)

    def _eager_run(self, cache, token_ids: list[int], capture: Sequence[int],
                   on_features: Callable[[torch.Tensor, torch.Tensor], None] | None) -> torch.Tensor:
        first = cache.length
        result = self.target.model.forward(torch.tensor(token_ids), cache, capture=capture, last_only=True)
        return self._hand_on(result, first, cache, on_features)

    @staticmethod
    def _hand_on(result, first: int, cache, on_features) -> torch.Tensor:
        """The run's features (positions `first` to the cache's end) to `on_features`; its last logits back."""
        if on_features is not None:
            on_features(result.features, torch.arange(first, cache.length, device=result.features.device))
        return result.logits[-1]

    def prefill_bar(self, tokens: int):
        """A tqdm bar over `tokens` prompt tokens (stderr, gone when closed), drawn only when the CLI asked
        for progress (`prefill_progress`) and the prompt is long."""
        return tqdm(total=tokens, desc="prefill", unit="tok", unit_scale=True, leave=False,
                    disable=not self.prefill_progress or tokens < PROGRESS_MIN_TOKENS)

    def sampler(self, prompt_ids: list[int], config: GenerationConfig) -> Sampler:
        model = self.target.model
        return Sampler(config.sampling, prompt_ids, model.config.vocab_size, model.device)


def chain_rows(n: int, room: int) -> int | None:
    """The rows a graphed prefill run of n tokens replays: 1 (the decode step) for one token, else the smallest
    of CHAIN_ROWS that holds it and fits the `room` rows left in the cache; None: an eager forward (a run longer
    than CHAIN_ROWS[-1], or no room for the padding at the very end of the context)."""
    if n == 1:
        return 1
    return next((rows for rows in CHAIN_ROWS if n <= rows <= room), None)
