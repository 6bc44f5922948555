"""Collects generated tokens and decides when generation ends: end-of-generation ids, stop strings,
max tokens. Streams text without splitting UTF-8 characters and without ever emitting text that a
stop string later turns out to cover."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from flashtree.formats.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target (its raw logits' log-softmax, before
    penalties and temperature, as vLLM reports them) and the `top` most likely tokens there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor | None, tokens: list[int], top: int | None) -> list[TokenLogprob | None]:
    """Each token's entry from its row of `logits` with the `top` most likely tokens there, or None for
    each when the request asked for no log-probabilities (`top` None)."""
    if top is None:
        return [None] * len(tokens)
    return token_logprobs(logits, tokens, top)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row i of `logits` [R, V] is the distribution `tokens[i]` was chosen from."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    if top == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = logprobs.topk(top, dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]


class OutputTracker:
    def __init__(self, tokenizer: Tokenizer, eos_ids: Iterable[int], stop: Iterable[str], max_new_tokens: int,
                 on_text: Callable[[str], None] | None = None, cancelled: Callable[[], bool] | None = None,
                 on_logprobs: Callable[[list[TokenLogprob]], None] | None = None, skip_special: bool = False):
        """`on_logprobs` (when tokens come with log-probabilities) receives, just before each `on_text`
        piece, the entries of the tokens that piece completes the text of. `skip_special`: control tokens
        add no text (they stay in `token_ids`)."""
        self.eos_ids = frozenset(eos_ids)
        self.stop = tuple(s for s in stop if s)
        self.max_new_tokens = max_new_tokens
        self.on_text = on_text
        self.cancelled = cancelled
        self.decoder = tokenizer.stream_decoder(skip_special)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string that ended generation, if one did
        self.on_logprobs = on_logprobs
        self.logprobs: list[TokenLogprob] = []  # one per kept token, when pushed with one
        self._starts: list[int] = []  # where each token's text begins in `text`
        self._logprobs_sent = 0
        self._emitted = 0
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        if max_new_tokens <= 0:
            self._finish("length", flush=False)

    def takes_without_ending(self, tokens: list[int]) -> bool:
        """Whether pushing `tokens` surely leaves generation going: no end token among them, room for all and
        more, no stop strings or cancellation to check. The speculative loop then commits a step's path before
        pushing its tokens, so the host streams text while the device commits and drafts."""
        return (self.cancelled is None and not self.stop and self.eos_ids.isdisjoint(tokens)
                and len(self.token_ids) + len(tokens) < self.max_new_tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Add one generated token (with its log-probability when asked for); True once generation is over
        (later tokens must not be pushed)."""
        if self.done:
            return True
        if self.cancelled is not None and self.cancelled():
            self._finish("cancelled", flush=False)
            return True
        if token in self.eos_ids:
            self._finish("stop", flush=True)
            return True
        self.token_ids.append(token)
        self._starts.append(len(self.text))
        if logprob is not None:
            self.logprobs.append(logprob)
        self.text += self.decoder.push(token)
        if self._cut_at_stop_string():
            self._finish("stop", flush=False)
        elif len(self.token_ids) >= self.max_new_tokens:
            self._finish("length", flush=True)
        else:
            self._emit(len(self.text) - self._holdback)
        return self.done

    def push_many(self, tokens: Iterable[int]) -> int:
        """Push tokens until done; returns how many were consumed."""
        used = 0
        for token in tokens:
            used += 1
            if self.push(token):
                break
        return used

    def _cut_at_stop_string(self) -> bool:
        hits = [(i, s) for i, s in ((self.text.find(s), s) for s in self.stop) if i >= 0]
        if not hits:
            return False
        cut, self.stop_string = min(hits)
        self.text = self.text[:cut]
        return True

    def _finish(self, reason: str, flush: bool) -> None:
        """`flush` adds bytes still held by the decoder (an incomplete character at the very end)."""
        if flush:
            self.text += self.decoder.flush()
            if self._cut_at_stop_string():
                reason = "stop"
        self.finish_reason = reason
        if self.stop_string is not None:  # tokens past the cut produced only stop-string text
            self.logprobs = self.logprobs[: bisect.bisect_left(self._starts, len(self.text))]
        self._emit(len(self.text), final=True)

    def _emit(self, upto: int, final: bool = False) -> None:
        if self.on_logprobs is not None:
            covered = len(self.logprobs) if final else min(len(self.logprobs), bisect.bisect_left(self._starts, upto))
            if covered > self._logprobs_sent:
                self.on_logprobs(self.logprobs[self._logprobs_sent : covered])
                self._logprobs_sent = covered
        if upto > self._emitted:
            if self.on_text is not None:
                self.on_text(self.text[self._emitted : upto])
            self._emitted = upto
