"""Log-probabilities in OpenAI's response shapes: chat's `content` items, the completions API's legacy
columns, and `echo`, whose prompt tokens lead the completion's."""

from __future__ import annotations

from dataclasses import dataclass

from flashtree.engine.output import TokenLogprob


def token_text(tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text (partial UTF-8 replaced) and its bytes, as OpenAI's logprobs give them."""
    raw = tokenizer.bytes_of(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    def item(token: int, logprob: float) -> dict:
        text, raw = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(tokenizer, entries: list[TokenLogprob], offset: int) -> dict:
    """The legacy completions shape; `offset`: characters of the completion before these tokens."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = token_text(tokenizer, e.token)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({token_text(tokenizer, t)[0]: lp for t, lp in e.top} if e.top else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


@dataclass
class Echo:
    """`echo`: the prompt leads the completion's text (and its log-probabilities, when asked for)."""

    text: str
    ids: list[int]

    def logprobs(self, tokenizer, scored: list[TokenLogprob | None]) -> dict:
        """The prompt's tokens in the legacy shape: the first has no log-probability (nothing precedes it)."""
        first = token_text(tokenizer, self.ids[0])[0]
        out = completion_logprobs(tokenizer, scored[1:], len(first))
        return {"tokens": [first, *out["tokens"]], "token_logprobs": [None, *out["token_logprobs"]],
                "top_logprobs": [None, *out["top_logprobs"]], "text_offset": [0, *out["text_offset"]]}


def joined(first: dict, then: dict) -> dict:
    """Two legacy logprobs objects one after the other (`then`'s offsets moved past `first`'s text)."""
    shift = sum(map(len, first["tokens"]))
    return {"tokens": first["tokens"] + then["tokens"], "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + then["top_logprobs"],
            "text_offset": first["text_offset"] + [shift + o for o in then["text_offset"]]}
