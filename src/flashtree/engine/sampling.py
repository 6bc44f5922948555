"""Turning target logits into the next token: logit bias, penalties, temperature, top-k / top-p / min-p, seeds.

Every row of logits is processed with the history of the sequence it continues, so a tree node and
the autoregressive step at the same place in the text see exactly the same distribution. That is
what makes speculative sampling lossless here: the walk samples the target at each visited node
from this distribution and follows the child carrying the sampled token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from flashtree.errors import FlashtreeError

# Below this temperature sampling is greedy: dividing logits by a smaller one overflows float32 (1e-300
# becomes 0 and the logits inf), and the distribution is one-hot to float32 precision anyway (vLLM's cut-off).
MIN_TEMPERATURE = 1e-5
# Seeds torch's generator takes (negative ones wrap around). The HTTP API takes int64 seeds, so that
# seed + i of a request's choices stays in range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below MIN_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # over prompt + generated tokens (vLLM / HF convention)
    presence_penalty: float = 0.0  # over generated tokens (OpenAI convention)
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), as OpenAI's logit_bias

    def __post_init__(self) -> None:
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise FlashtreeError(f"logit_bias entries need a token id >= 0 and a bias in [-100, 100], "
                                     f"got {token}: {bias}")
        checks = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("seed", self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, f"in [{SEED_MIN}, {SEED_MAX}]"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
        ]
        for name in (f.name for f in fields(self) if isinstance(getattr(self, f.name), float)):
            if not math.isfinite(getattr(self, name)):  # JSON bodies may spell Infinity and NaN
                raise FlashtreeError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name, ok, bounds in checks:
            if not ok:
                raise FlashtreeError(f"{name} must be {bounds}, got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class Sampler:
    """Per-request sampling state: the RNG and the token counts the penalties need."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device):
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.prompt_seen = self._counts(prompt_ids) > 0
        self.generated = torch.zeros(vocab_size, device=self.device)
        self.bias = self._bias(params.logit_bias)

    def _counts(self, ids: list[int]) -> torch.Tensor:
        counts = torch.zeros(self.vocab_size, device=self.device)
        if ids:
            counts.index_add_(0, torch.tensor(ids, device=self.device), torch.ones(len(ids), device=self.device))
        return counts

    def _bias(self, entries: tuple[tuple[int, float], ...]) -> torch.Tensor | None:
        if not entries:
            return None
        if max(token for token, _ in entries) >= self.vocab_size:
            raise FlashtreeError(f"logit_bias names a token id outside the vocabulary [0, {self.vocab_size})")
        tokens, values = zip(*entries)
        bias = torch.zeros(self.vocab_size, device=self.device)
        bias[torch.tensor(tokens, device=self.device)] = torch.tensor(values, device=self.device)
        return bias

    def record(self, token: int) -> None:
        """A token became part of the output (penalties of later positions count it). Without penalties
        nothing reads the counts: no update (on a GPU two launches a token, ~7 % of a small model's AR step)."""
        if self.params.penalized:
            self.generated[token] += 1

    def distribution(self, logits: torch.Tensor, extra_counts: torch.Tensor | None = None) -> torch.Tensor:
        """Processed logits [N, V] (greedy) or probabilities [N, V] (sampling) for rows that continue the
        recorded output plus, per row, the tokens counted in `extra_counts` [N, V]."""
        logits = logits.float()
        if self.bias is not None:
            logits = logits + self.bias
        if self.params.penalized:
            counts = self.generated.expand_as(logits)
            if extra_counts is not None:
                counts = counts + extra_counts
            logits = self._penalize(logits, counts)
        if self.params.greedy:
            return logits
        return self._probabilities(logits / self.params.temperature)

    def choose(self, dist_row: torch.Tensor) -> int:
        if self.params.greedy:
            return int(dist_row.argmax())
        return int(torch.multinomial(dist_row, 1, generator=self.generator))

    def _penalize(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.repetition_penalty != 1:
            seen = self.prompt_seen | (counts > 0)
            scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(seen, scaled, logits)
        return logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()

    def _probabilities(self, scaled: torch.Tensor) -> torch.Tensor:
        """Probabilities after top-k / min-p / top-p; a row that degenerates (a tiny repetition penalty can
        push logits to inf, and inf - inf is NaN) falls back to greedy: all its mass on the largest logit."""
        probs = self._filtered(scaled)
        total = probs.sum(-1, keepdim=True)
        usable = (total > 0) & torch.isfinite(total)  # False for NaN too
        greedy = torch.nn.functional.one_hot(scaled.nan_to_num(nan=float("-inf")).argmax(-1), scaled.shape[-1])
        return torch.where(usable, probs / total, greedy.to(probs.dtype))

    def _filtered(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.top_k:
            kth = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, 0.0)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly ahead of each token
            keep_sorted = before < p.top_p * sorted_probs.sum(-1, keepdim=True)
            keep_sorted[..., 0] = True  # the most likely token always stays: a top_p below float32's range keeps none
            keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
            probs = probs * keep
        return probs
