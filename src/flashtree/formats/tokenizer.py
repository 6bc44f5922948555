"""Byte-level BPE tokenizer built from the `tokenizer.ggml.*` keys of a GGUF file.

The Rust `tokenizers` library does the encoding; this module only translates the GGUF description
(tokens, token types, merges, pre-tokenizer name) into a `tokenizers.Tokenizer` the way llama.cpp
and transformers' Qwen tokenizer interpret it, plus an incremental detokenizer for streaming.
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

from flashtree.errors import FlashtreeError
from flashtree.formats.chat_template import CHATML_TEMPLATE, ChatTemplate

# GGUF token types used here (llama.cpp also has 2 unknown, 5 unused, 6 byte; those are plain vocab entries).
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# Pre-tokenizer split regexes by GGUF `tokenizer.ggml.pre` name. qwen35 adds \p{M} (combining marks)
# to the letter classes so that e.g. Devanagari vowel signs stay inside their word.
QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_REGEXES = {"qwen35": QWEN35_REGEX, "qwen2": QWEN2_REGEX}

# Stand-ins for control-token text in user data while a chat template renders it: characters of the
# Supplementary Private Use Area-A, those a request does not use itself.
_STAND_IN_RANGE = range(0xF0000, 0xFFFFE)
_STAND_IN_PATTERN = re.compile("[\U000F0000-\U000FFFFD]")

# Most code points NFC composes into one (e.g. U+1F86 from alpha and three accents).
NFC_MAX_COMPOSED = 4

# Tokens that end a generation besides the declared EOS (llama.cpp's end-of-generation set for Qwen).
EOG_TOKEN_NAMES = ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
)  # fmt: skip


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the other bytes are
    shifted to code points >= 256 so every byte has a visible, non-space character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}


def _token_bytes(token: str) -> bytes:
    """Raw bytes a vocab entry stands for; entries outside the byte alphabet (special tokens with
    spaces, placeholders) stand for their own UTF-8, as the tokenizers ByteLevel decoder does."""
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


@dataclass(frozen=True)
class TokenizerSpec:
    """Exactly what a GGUF stores under `tokenizer.ggml.*` plus `tokenizer.chat_template`."""

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_token_id: int | None
    bos_token_id: int | None
    padding_token_id: int | None
    add_bos_token: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, object]) -> TokenizerSpec:
        """Read the spec from GGUF metadata (key -> Python value, arrays as lists)."""

        m: Mapping[str, Any] = meta  # values are whatever the GGUF reader produced, of any type in a corrupt file

        def opt_int(key: str) -> int | None:
            value = m.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise FlashtreeError(f"metadata key {key} must be an integer, got {type(value).__name__}")
            return value

        def items(key: str, kind: type, default: list | None = None) -> list:
            value = m.get(key, default)
            if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
                raise FlashtreeError(f"metadata key {key} must be a list of {kind.__name__}s")
            return value

        if "tokenizer.ggml.model" not in m or "tokenizer.ggml.tokens" not in m:
            raise FlashtreeError("GGUF has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        tokens = items("tokenizer.ggml.tokens", str)
        template = m.get("tokenizer.chat_template")
        return cls(
            model=str(m["tokenizer.ggml.model"]),
            # llama.cpp treats a missing pre-tokenizer name as "default"
            pre=str(m.get("tokenizer.ggml.pre", "default")),
            tokens=tokens,
            token_types=items("tokenizer.ggml.token_type", int, [NORMAL] * len(tokens)),
            merges=items("tokenizer.ggml.merges", str, []),
            eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
            bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
            padding_token_id=opt_int("tokenizer.ggml.padding_token_id"),
            add_bos_token=bool(m.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=None if template is None else str(template),
        )

    def to_metadata(self) -> dict[str, object]:
        """Inverse of `from_metadata`; ids that are None are left out, as GGUF writers do."""
        meta: dict[str, object] = {
            "tokenizer.ggml.model": self.model,
            "tokenizer.ggml.pre": self.pre,
            "tokenizer.ggml.tokens": list(self.tokens),
            "tokenizer.ggml.token_type": list(self.token_types),
            "tokenizer.ggml.merges": list(self.merges),
            "tokenizer.ggml.add_bos_token": self.add_bos_token,
        }
        for key, value in (
            ("tokenizer.ggml.eos_token_id", self.eos_token_id),
            ("tokenizer.ggml.bos_token_id", self.bos_token_id),
            ("tokenizer.ggml.padding_token_id", self.padding_token_id),
            ("tokenizer.chat_template", self.chat_template),
        ):
            if value is not None:
                meta[key] = value
        return meta


def _split_merges(merges: Sequence[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    pairs = []
    for i, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise FlashtreeError(f"tokenizer merge {i} {merge!r} is not of the form 'left right'")
        left, right = parts
        for piece in (left, right, left + right):
            if piece not in vocab:
                raise FlashtreeError(f"tokenizer merge {i} {merge!r} uses {piece!r}, which is not in the vocabulary")
        pairs.append((left, right))
    return pairs


def _pre_tokenizer(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass(frozen=True)
class RenderedChat:
    """A rendered prompt whose user text has control-token text as stand-in characters (`restore` maps them back)."""

    escaped: str
    restore: dict[int, str]

    @property
    def text(self) -> str:
        return self.escaped.translate(self.restore)


class Tokenizer:
    """Encoder/decoder for a GGUF `gpt2` (byte-level BPE) vocabulary."""

    def __init__(self, spec: TokenizerSpec):
        if spec.model != "gpt2":
            raise FlashtreeError(f"tokenizer model {spec.model!r} is not supported (only 'gpt2' byte-level BPE)")
        if not spec.tokens:
            raise FlashtreeError("tokenizer has no tokens")
        if len(spec.token_types) != len(spec.tokens):
            raise FlashtreeError(
                f"tokenizer has {len(spec.tokens)} tokens but {len(spec.token_types)} token types"
            )
        vocab = {token: i for i, token in enumerate(spec.tokens)}
        if len(vocab) != len(spec.tokens):
            raise FlashtreeError("tokenizer vocabulary contains duplicate tokens")
        for name, value in (
            ("eos_token_id", spec.eos_token_id),
            ("bos_token_id", spec.bos_token_id),
            ("padding_token_id", spec.padding_token_id),
        ):
            if value is not None and not 0 <= value < len(spec.tokens):
                raise FlashtreeError(f"tokenizer {name} {value} is outside the vocabulary (size {len(spec.tokens)})")
        regex = PRE_TOKENIZER_REGEXES.get(spec.pre)
        if regex is None:
            warnings.warn(
                f"pre-tokenizer {spec.pre!r} is not known; splitting text with the qwen35 rules", stacklevel=2
            )
            regex = QWEN35_REGEX

        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=_split_merges(spec.merges, vocab)))
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = _pre_tokenizer(regex)
        backend.decoder = decoders.ByteLevel()
        # Both kinds are matched as whole tokens before BPE, like llama.cpp. CONTROL tokens are
        # "special" (skipped on decode, and plain text when allow_special=False); USER_DEFINED ones
        # (Qwen's <think>, <tool_call>, ...) always match and are kept on decode, as in transformers.
        backend.add_tokens(
            [
                AddedToken(token, special=kind == CONTROL, normalized=False)
                for token, kind in zip(spec.tokens, spec.token_types)
                if kind in (CONTROL, USER_DEFINED)
            ]
        )
        self.spec = spec
        self.backend = backend
        self.vocab_size = len(spec.tokens)
        self.eos_ids = frozenset(
            ([] if spec.eos_token_id is None else [spec.eos_token_id])
            + [vocab[name] for name in EOG_TOKEN_NAMES if name in vocab]
        )
        self._control_ids = frozenset(i for i, kind in enumerate(spec.token_types) if kind == CONTROL)
        # Longest first, so that a control token that starts with another one is matched whole, as the backend does.
        control_texts = sorted((spec.tokens[i] for i in self._control_ids), key=len, reverse=True)
        self._control_pattern = re.compile(f"({'|'.join(map(re.escape, control_texts))})") if control_texts else None
        self._token_bytes = [_token_bytes(t) for t in spec.tokens]  # what streaming emits per token
        # One token never covers more bytes than this: bounds the token count from below by the text's length.
        self.max_token_bytes = max(map(len, self._token_bytes))
        # `encode_special_tokens` is state on the shared backend, so toggling it must be atomic.
        self._lock = threading.Lock()

    def token_id(self, text: str) -> int | None:
        """Id of a vocabulary entry spelled exactly `text` (special tokens are spelled as their text)."""
        return self.backend.token_to_id(text)

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids for `text`; with allow_special=False, control-token text (e.g. a user typing
        "<|im_end|>") is encoded as ordinary characters. BOS is never added: Qwen's add_bos_token is false
        and prompts come from the chat template."""
        [ids] = self._encode_all([text], allow_special)
        return ids

    def _encode_all(self, texts: list[str], allow_special: bool) -> list[list[int]]:
        # The batch call without offsets: faster, and (for long texts) holds the GIL much shorter than encode().
        with self._lock:
            self.backend.encode_special_tokens = not allow_special
            return [encoding.ids for encoding in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def min_tokens(self, text: str) -> int:
        """A lower bound of len(encode(text)) without encoding it: NFC normalization composes at most 4 code
        points into one, and a token covers at most `max_token_bytes` characters."""
        return -(-len(text) // (NFC_MAX_COMPOSED * self.max_token_bytes))

    def render_chat(self, template: ChatTemplate, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, parse_special: bool = False, **kwargs: Any) -> RenderedChat:
        """The prompt `template` renders, with control-token text in messages, tools and kwargs (a user typing
        "<|im_end|>") swapped for stand-ins, so that `encode_rendered` makes control tokens only of the
        template's own text and a message cannot open a turn of its own. `parse_special`: the old behaviour,
        it can."""
        if parse_special or self._control_pattern is None:
            return RenderedChat(template.render(messages, tools, add_generation_prompt, **kwargs), {})
        stand_ins = self._stand_ins([messages, tools, kwargs, template.source])
        escape = {token: chr(code) for token, code in stand_ins.items()}
        rendered = template.render(self._escaped(messages, escape), self._escaped(tools, escape),
                                   add_generation_prompt, **self._escaped(kwargs, escape))
        return RenderedChat(rendered, {code: token for token, code in stand_ins.items()})

    def encode_rendered(self, chat: RenderedChat) -> list[int]:
        """Token ids of a `render_chat` prompt: its control tokens, and its other text (user text restored) plain."""
        if self._control_pattern is None:
            return self.encode(chat.text)
        # Split at the template's control tokens: texts at even indexes, tokens at odd ones.
        pieces = self._control_pattern.split(chat.escaped)
        ids: list[int] = []
        for index, piece_ids in enumerate(self._encode_all([p.translate(chat.restore) for p in pieces[::2]], False)):
            ids += piece_ids
            if 2 * index + 1 < len(pieces):
                ids.append(self.backend.token_to_id(pieces[2 * index + 1]))
        return ids

    def encode_chat(self, template: ChatTemplate, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, parse_special: bool = False,
                    **kwargs: Any) -> tuple[str, list[int]]:
        """The prompt text and token ids of `render_chat`."""
        chat = self.render_chat(template, messages, tools, add_generation_prompt, parse_special, **kwargs)
        return chat.text, self.encode_rendered(chat)

    def _stand_ins(self, data: Any) -> dict[str, int]:
        """A code point for each control token that occurs nowhere in `data` (strings, lists, dicts)."""
        used = {ord(c) for text in _strings(data) for c in _STAND_IN_PATTERN.findall(text)}
        tokens = [self.spec.tokens[i] for i in sorted(self._control_ids)]
        codes = list(itertools.islice((code for code in _STAND_IN_RANGE if code not in used), len(tokens)))
        if len(codes) < len(tokens):
            raise FlashtreeError(f"the text uses {len(used)} of the {len(_STAND_IN_RANGE)} characters of Unicode's "
                                 f"Private Use Area-A, leaving fewer than the {len(tokens)} the prompt needs as stand-ins")
        return dict(zip(tokens, codes))

    def _escaped(self, data: Any, escape: dict[str, str]) -> Any:
        if isinstance(data, str):
            return self._control_pattern.sub(lambda match: escape[match.group()], data)
        if isinstance(data, dict):
            return {self._escaped(key, escape): self._escaped(value, escape) for key, value in data.items()}
        if isinstance(data, (list, tuple)):
            return [self._escaped(value, escape) for value in data]
        return data

    def _check_ids(self, ids: Sequence[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise FlashtreeError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        self._check_ids(ids)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def bytes_of(self, token_id: int) -> bytes:
        """The raw bytes one token contributes to the decoded text."""
        return self._token_bytes[token_id]

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


def _strings(data: Any) -> Iterable[str]:
    """Every string in `data` (nested lists and dicts, keys included)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            stack += item


class StreamDecoder:
    """Incremental detokenizer: each `push` returns only text that is complete, holding back the
    bytes of a UTF-8 character split across tokens (per-token decode would emit U+FFFD there)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip = tokenizer._control_ids if skip_special else frozenset()
        # Keeps an unfinished multi-byte sequence between calls; invalid bytes become U+FFFD, as in decode().
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        ids = list(ids) if isinstance(ids, Iterable) else [ids]  # one id may be a numpy/torch scalar
        self._tokenizer._check_ids(ids)
        data = b"".join(self._tokenizer.bytes_of(i) for i in ids if i not in self._skip)
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def train_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = QWEN_SPECIAL_TOKENS
) -> TokenizerSpec:
    """Train a small Qwen-style byte-level BPE and return it in GGUF form.

    `vocab_size` caps everything: 256 byte tokens, learned merges (fewer if the corpus runs out of
    pairs seen twice) and the special tokens, which are appended at the end as in Qwen's vocabulary.
    For tests and the demo model.
    """
    if "<|im_end|>" not in special_tokens:
        raise FlashtreeError("special_tokens must include <|im_end|> (the end-of-turn token)")
    n_learned = vocab_size - len(special_tokens)
    if n_learned < 256:
        raise FlashtreeError(f"vocab_size {vocab_size} leaves no room for the 256 byte tokens and the specials")

    backend = tokenizers.Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer(QWEN35_REGEX)
    trainer = trainers.BpeTrainer(
        vocab_size=n_learned,
        min_frequency=2,
        # every byte gets a token even if the corpus lacks it, so any text stays encodable
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer would learn merges inside special-token text (it ignores added tokens), so train on
    # the pieces between them, which is what encoding will feed to BPE.
    specials = re.compile("|".join(re.escape(t) for t in special_tokens))
    backend.train_from_iterator((piece for text in texts for piece in specials.split(text)), trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    # Same rule as llama.cpp's converter: <|...|> names are CONTROL, other added tokens USER_DEFINED.
    special_types = [CONTROL if t.startswith("<|") and t.endswith("|>") else USER_DEFINED for t in special_tokens]
    tokens += special_tokens
    return TokenizerSpec(
        model="gpt2",
        pre="qwen35",
        tokens=tokens,
        token_types=[NORMAL] * (len(tokens) - len(special_tokens)) + special_types,
        merges=merges,
        eos_token_id=tokens.index("<|im_end|>"),
        bos_token_id=tokens.index("<|endoftext|>") if "<|endoftext|>" in tokens else None,
        padding_token_id=tokens.index("<|endoftext|>") if "<|endoftext|>" in tokens else None,
        add_bos_token=False,
        chat_template=CHATML_TEMPLATE,
    )


def pad_vocab(spec: TokenizerSpec, vocab_size: int) -> TokenizerSpec:
    """Fill ids past the real tokens with [PAD<i>] placeholders of type UNUSED, as the GGUF converter
    does for Qwen's padded vocabulary (a draft can use the first one as its mask token)."""
    extra = range(len(spec.tokens), vocab_size)
    return replace(spec, tokens=spec.tokens + [f"[PAD{i}]" for i in extra],
                   token_types=spec.token_types + [UNUSED] * len(extra))
