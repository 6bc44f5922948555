"""Prefix cache across requests for the hybrid target (see docs/PREFIX_CACHE.md).

Chat clients resend the whole conversation every turn. Attention KV rows can be cut at any position,
but Gated DeltaNet conv + recurrent state cannot: the state after token L is only known if it was
saved exactly when the cache held L tokens. So an entry is a *snapshot at an exact length*:

    tokens[:L]  ->  attention rows [0, L)  +  DeltaNet state after L tokens  (+ draft context after L)

and a request reuses the longest entry whose tokens are a strict prefix of its prompt (at least one
token is always prefilled: its logits start generation). There is no "longest common prefix" reuse
of a longer entry: a prompt that leaves a cached sequence mid-way falls back to the longest entry
that ends at or before the divergence (the seed's bug was restoring the longer entry's state).

Snapshots are taken at every multiple of `interval` inside the prompt (prefill chunks end there),
before the last `boundaries` message headers of the prompt (`<|im_start|>`: chat templates re-render
the previous generation prompt and answer differently, e.g. without the `<think>` block, so the
last position every later turn shares is the start of the previous assistant header), at the end of
the prompt and at the end of the generated answer (whatever was committed, also when the request
was cancelled). The attention rows of a request are copied once, at its end: rows below
the committed length never change afterwards, so every snapshot of the request shares that copy.
Entries are evicted least-recently-used beyond `max_entries` or `max_bytes`; with `offload` (the
default on CUDA) snapshots live in host RAM.

Spec modes: the draft's context cache (K/V of projected target features of committed positions) is
snapshotted with the target state, so a restored speculative run proposes exactly as an unbroken
one would. Entries made by autoregressive requests hold no draft state and serve only AR requests.

Cache fields are handled generically (every tensor field of the attention and DeltaNet state
objects; the attention position dimension is the one sized like the cache capacity), so quantized
KV layouts need no change here as long as rows below the committed length are final.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from flashtree.engine.prefix_cache_flags import DEFAULT_INTERVAL, DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES
from flashtree.errors import FlashtreeError
from flashtree.models.dflash import DraftContextCache

BOUNDARY_TOKENS = ("<|im_start|>",)


# --------------------------------------------------------------------------------------------
# generic state copies
# --------------------------------------------------------------------------------------------


def _tensor_fields(obj) -> dict[str, torch.Tensor]:
    if dataclasses.is_dataclass(obj):
        items = ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    else:
        items = vars(obj).items()
    return {name: value for name, value in items if isinstance(value, torch.Tensor)}


def _position_dim(t: torch.Tensor, capacity: int) -> int | None:
    """The dimension indexed by cache position: sized like the capacity, dim 1 ([heads, pos, dim]) first."""
    dims = [d for d in range(t.dim()) if t.shape[d] == capacity]
    if not dims:
        return None
    return 1 if 1 in dims else dims[0]


def _signature(cache) -> tuple:
    """What a snapshot must share with the cache it is restored into: per layer, every field's dtype and
    shape (the position dimension left out) and every non-tensor field (KV types, attention window)."""
    parts = []
    for kind, states in (("attention", cache.attention), ("deltanet", cache.deltanet)):
        for index, state in sorted(states.items()):
            items = (((f.name, getattr(state, f.name)) for f in dataclasses.fields(state))
                     if dataclasses.is_dataclass(state) else sorted(vars(state).items()))
            for name, value in items:
                if isinstance(value, torch.Tensor):
                    dim = _position_dim(value, cache.capacity) if kind == "attention" else None
                    shape = tuple(-1 if d == dim else n for d, n in enumerate(value.shape))
                    parts.append((kind, index, name, str(value.dtype), shape))
                else:
                    parts.append((kind, index, name, repr(value)))
    return tuple(parts)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _store(t: torch.Tensor, host: bool) -> torch.Tensor:
    """A snapshot copy of `t`: on the device, or in host RAM. From a GPU the host copy goes to pinned
    memory without blocking: stream order runs it before any later kernel changes `t`, and the host
    never reads it (restores copy it back in the same order), so the request's prefill does not wait."""
    if not host:
        return t.clone()
    if not t.is_cuda:
        return t.to("cpu", copy=True)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _load(dst: torch.Tensor, saved: torch.Tensor) -> None:
    """Restore a `_store` copy into `dst` (asynchronously from pinned host memory: stream-ordered)."""
    dst.copy_(saved, non_blocking=saved.device.type == "cpu" and dst.is_cuda and saved.is_pinned())


@dataclass
class _Rows:
    """Attention rows [0, rows) of one request's sequence, shared by all its snapshots. Rows below `base`
    are those of the entry the request restored (`parent`), so a turn copies only what it added."""

    layers: dict[int, dict[str, tuple[int | None, torch.Tensor]]]  # layer -> field -> (position dim, copy)
    rows: int
    nbytes: int  # of this segment's own copies
    base: int = 0
    parent: "_Rows | None" = None

    def chain(self):
        segment = self
        while segment is not None:
            yield segment
            segment = segment.parent


def _copy_rows(cache, rows: int, host: bool, parent: _Rows | None = None, base: int = 0) -> _Rows:
    layers, total = {}, 0
    for index, kv in cache.attention.items():
        saved = {}
        for name, t in _tensor_fields(kv).items():
            dim = _position_dim(t, cache.capacity)
            copy = _store(t.narrow(dim, base, rows - base) if dim is not None else t, host)
            saved[name] = (dim, copy)
            total += _nbytes(copy)
        layers[index] = saved
    return _Rows(layers, rows, total, base, parent if base > 0 else None)


def _restore_rows(cache, saved: _Rows, length: int) -> None:
    if saved.parent is not None:
        _restore_rows(cache, saved.parent, min(length, saved.base))
    for index, kv in cache.attention.items():
        fields = _tensor_fields(kv)
        for name, (dim, copy) in saved.layers[index].items():
            dst = fields[name]
            if dim is None:
                _load(dst, copy)
            elif length > saved.base:
                _load(dst.narrow(dim, saved.base, length - saved.base), copy.narrow(dim, 0, length - saved.base))


def _copy_recurrent(cache, host: bool) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {name: _store(t, host) for name, t in _tensor_fields(state).items()}
            for i, state in cache.deltanet.items()}


def _restore_recurrent(cache, saved: dict[int, dict[str, torch.Tensor]]) -> None:
    for i, state in cache.deltanet.items():
        fields = _tensor_fields(state)
        for name, t in saved[i].items():
            _load(fields[name], t)


class _DraftOps:
    """Snapshot / restore of a DFlash proposer's DraftContextCache (a ring of `max_context` slots)."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.cache = proposer.cache

    @classmethod
    def of(cls, proposer) -> "_DraftOps | None":
        return cls(proposer) if isinstance(getattr(proposer, "cache", None), DraftContextCache) else None

    @property
    def window(self) -> int:
        return self.cache.max_context

    def snapshot(self, host: bool) -> dict:
        n = self.cache.length  # valid slots are always the first `length`
        return {"window": self.window, "count": self.cache.count,
                "keys": _store(self.cache.keys[:, :, :n], host), "values": _store(self.cache.values[:, :, :n], host),
                "positions": _store(self.cache.positions[:n], host)}

    def restore(self, saved: dict) -> None:
        n = saved["positions"].shape[0]
        self.cache.reset()
        _load(self.cache.keys[:, :, :n], saved["keys"])
        _load(self.cache.values[:, :, :n], saved["values"])
        _load(self.cache.positions[:n], saved["positions"])
        self.cache.count = saved["count"]


def _draft_bytes(saved: dict | None) -> int:
    return 0 if saved is None else sum(_nbytes(saved[k]) for k in ("keys", "values", "positions"))


# --------------------------------------------------------------------------------------------
# entries and the cache
# --------------------------------------------------------------------------------------------


@dataclass
class Entry:
    tokens: tuple[int, ...]  # the exact sequence the state belongs to
    rows: _Rows  # attention rows (shared; at least len(tokens) rows)
    recurrent: dict[int, dict[str, torch.Tensor]]  # DeltaNet state after exactly len(tokens) tokens
    draft: dict | None  # draft context cache after len(tokens) tokens, or None (AR-made entry)
    signature: tuple = ()  # cache layout it came from (_signature): restored only into the same layout

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def own_bytes(self) -> int:
        return sum(_nbytes(t) for state in self.recurrent.values() for t in state.values()) + _draft_bytes(self.draft)


@dataclass
class _Pending:
    length: int
    recurrent: dict[int, dict[str, torch.Tensor]]
    draft: dict | None


@dataclass
class _Session:
    cache: object
    host: bool  # snapshots go to host RAM
    draft: _DraftOps | None
    signature: tuple
    parent: _Rows | None  # rows of the restored entry: [0, base) need no new copy
    base: int
    pending: list[_Pending] = field(default_factory=list)


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0  # prompt tokens restored instead of prefilled
    prefilled_tokens: int = 0  # prompt tokens prefilled while the cache was on
    evictions: int = 0


class PrefixCache:
    """Token-id keyed snapshots of the target (and draft context) state; one per Engine.

    Not re-entrant, like the engine: `prefill` opens a session that `finish` closes."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES,
                 interval: int = DEFAULT_INTERVAL, offload: bool | None = None, boundaries: int = 2,
                 boundary_tokens: Sequence[str] = BOUNDARY_TOKENS, max_interval_snapshots: int = 8):
        if max_entries < 1 or max_bytes < 1 or interval < 1:
            raise FlashtreeError(f"prefix cache limits must be >= 1 (entries={max_entries}, bytes={max_bytes}, "
                                 f"interval={interval})")
        self.max_entries, self.max_bytes, self.interval = max_entries, max_bytes, interval
        self.offload = offload  # None: host RAM when the model is on a GPU
        self.max_interval_snapshots = max(1, max_interval_snapshots)
        self.boundaries = boundaries  # snapshots before this many of the last message headers of a prompt
        self.boundary_tokens = tuple(boundary_tokens)
        self._boundary_ids: frozenset[int] | None = None  # resolved with the first engine's tokenizer
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # least recently used first
        self.stats = PrefixCacheStats()
        self._session: _Session | None = None
        self._lock = threading.Lock()

    # ---- bookkeeping ----

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        shared = {id(seg): seg.nbytes for e in self.entries.values() for seg in e.rows.chain()}
        return sum(shared.values()) + sum(e.own_bytes for e in self.entries.values())

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
        self._session = None

    def lookup(self, prompt_ids: Sequence[int], draft_window: int | None = None, touch: bool = True,
               signature: tuple | None = None) -> Entry | None:
        """Longest entry whose tokens are a strict prefix of `prompt_ids` (and, for a spec request,
        that holds draft state for a context window of `draft_window`; with `signature`, that was taken
        from a cache of that layout)."""
        n = len(prompt_ids)
        best = None
        with self._lock:
            for entry in self.entries.values():
                if entry.length >= n or (best is not None and entry.length <= best.length):
                    continue
                if draft_window is not None and (entry.draft is None or entry.draft["window"] != draft_window):
                    continue
                if signature is not None and entry.signature != signature:
                    continue
                if (prompt_ids[entry.length - 1] == entry.tokens[-1]  # cheap reject first
                        and tuple(prompt_ids[: entry.length]) == entry.tokens):
                    best = entry
            if best is not None and touch:
                self.entries.move_to_end(best.tokens)
        return best

    def _insert(self, entry: Entry) -> None:
        with self._lock:
            self.entries.pop(entry.tokens, None)
            self.entries[entry.tokens] = entry
            while self.entries and (len(self.entries) > self.max_entries or self._nbytes() > self.max_bytes):
                self.entries.popitem(last=False)
                self.stats.evictions += 1

    # ---- the engine's hooks ----

    def prefill(self, engine, cache, prompt_ids: list[int], config, proposer=None, stats=None) -> torch.Tensor:
        """Fill the fresh `cache` with `prompt_ids` (restoring the longest cached prefix, prefilling the
        rest in chunks that end at every snapshot point) and start `proposer` on the prompt. Returns the
        logits of the last prompt position; `stats.cached_tokens` gets the restored prefix's length."""
        model = engine.target.model
        self._session = None
        host = self.offload if self.offload is not None else model.device.type == "cuda"
        draft = _DraftOps.of(proposer) if proposer is not None else None
        if proposer is not None and draft is None:  # a proposer whose context cannot be snapshotted: no reuse
            proposer.start()
            return engine.prefill(cache, prompt_ids, config.prefill_chunk, proposer.capture_layers, proposer.commit)
        capture = proposer.capture_layers if proposer is not None else ()
        n = len(prompt_ids)
        signature = _signature(cache)
        hit = self.lookup(prompt_ids, draft.window if draft is not None else None, signature=signature)
        start, session_parent = 0, None
        if hit is not None:
            _restore_rows(cache, hit.rows, hit.length)
            session_parent = hit.rows
            _restore_recurrent(cache, hit.recurrent)
            cache.length = start = hit.length
            if draft is not None:
                draft.restore(hit.draft)
            self.stats.hits += 1
            self.stats.hit_tokens += hit.length
        else:
            self.stats.misses += 1
            if draft is not None:
                draft.cache.reset()
        self.stats.prefilled_tokens += n - start
        if stats is not None:
            stats.cached_tokens = start
        session = _Session(cache, host, draft, signature, session_parent, start)
        # at most `max_interval_snapshots` per prompt: a longer prompt gets them further apart (multiples of interval)
        every = self.interval * max(1, -(-(n - start) // (self.interval * self.max_interval_snapshots)))
        points = set(range((start // every + 1) * every, n, every))
        points.update(self._boundary_points(engine, prompt_ids, start))
        points = sorted(points | {n})
        chunk = config.prefill_chunk
        pos = start
        with engine.prefill_bar(n - start) as bar:
            for point in points:
                while pos < point:
                    end = min((pos // chunk + 1) * chunk, point)  # chunks aligned to absolute multiples of `chunk`
                    commit = proposer.commit if proposer is not None else None
                    logits = engine.prefill(cache, prompt_ids[pos:end], end - pos, capture, commit)  # one chunk
                    bar.update(end - pos)
                    pos = end
                session.pending.append(self._snapshot(session))
        self._session = session
        return logits

    def _boundary_points(self, engine, prompt_ids: Sequence[int], start: int) -> list[int]:
        if self._boundary_ids is None:
            ids = (engine.tokenizer.token_id(t) for t in self.boundary_tokens)
            self._boundary_ids = frozenset(i for i in ids if i is not None)
        found = []
        if self._boundary_ids and self.boundaries > 0:
            for pos in range(len(prompt_ids) - 1, start, -1):
                if prompt_ids[pos] in self._boundary_ids:
                    found.append(pos)
                    if len(found) == self.boundaries:
                        break
        return found

    def finish(self, token_ids: Sequence[int]) -> None:
        """After generation: `token_ids` = prompt + generated tokens (the cache holds a prefix of them).
        Snapshots the committed end and stores every snapshot of the request."""
        session, self._session = self._session, None
        if session is None:
            return
        cache = session.cache
        length = cache.length
        if length > len(token_ids):
            return  # not the state these tokens describe (should not happen): store nothing
        # a speculative request that stopped inside a verified tree leaves its scratch pending (never
        # committed): the committed state is still token_ids[:length], but the draft's context may have run
        # ahead of it, so only the prompt's snapshots (taken during prefill) are stored then
        if not cache.pending and length > session.pending[-1].length:
            session.pending.append(self._snapshot(session))
        rows = _copy_rows(cache, length, session.host, session.parent, session.base)
        for snap in session.pending:
            self._insert(Entry(tuple(token_ids[: snap.length]), rows, snap.recurrent, snap.draft, session.signature))

    def _snapshot(self, session: _Session) -> _Pending:
        return _Pending(session.cache.length, _copy_recurrent(session.cache, session.host),
                        session.draft.snapshot(session.host) if session.draft is not None else None)

    # ---- reporting ----

    def metrics(self) -> str:
        """Prometheus text exposition lines for /metrics."""
        with self._lock:
            entries, nbytes = len(self.entries), self._nbytes()
        s = self.stats
        rows = [("prefix_cache_hits_total", "counter", "Requests that restored a cached prefix.", s.hits),
                ("prefix_cache_misses_total", "counter", "Requests that found no cached prefix.", s.misses),
                ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens restored from the prefix cache.",
                 s.hit_tokens),
                ("prefix_cache_prefilled_tokens_total", "counter", "Prompt tokens prefilled with the cache on.",
                 s.prefilled_tokens),
                ("prefix_cache_evictions_total", "counter", "Prefix cache entries evicted.", s.evictions),
                ("prefix_cache_entries", "gauge", "Prefix cache entries held.", entries),
                ("prefix_cache_bytes", "gauge", "Bytes held by the prefix cache.", nbytes)]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP flashtree_{name} {help_text}", f"# TYPE flashtree_{name} {kind}",
                      f"flashtree_{name} {value}"]
        return "\n".join(lines) + "\n"
