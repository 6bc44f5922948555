"""Prefix cache across requests for the hybrid target (see docs/PREFIX_CACHE.md).

Chat clients resend the whole conversation every turn. Attention KV rows can be cut at any position,
but Gated DeltaNet conv + recurrent state cannot: the state after token L is only known if it was
saved exactly when the cache held L tokens. So an entry is a *snapshot at an exact length*:

    tokens[:L]  ->  attention rows [0, L)  +  DeltaNet state after L tokens  (+ draft context after L)

and a request reuses the longest entry whose tokens are a strict prefix of its prompt (at least one
token is always prefilled: its logits start generation). There is no "longest common prefix" reuse
of a longer entry: a prompt that leaves a cached sequence mid-way falls back to the longest entry
that ends at or before the divergence (the seed's bug was restoring the longer entry's state).

The cache never changes how a prompt is prefilled: `ModelRunner.prefill` runs the chunks an uncached
prefill runs (ending at absolute multiples of the chunk size and before every message header,
`<|im_start|>`), and snapshots are taken only at chunk ends, so a miss runs exactly the uncached
forwards. The policy wants snapshots at every multiple of `interval`, before the last `boundaries`
message headers of the prompt (chat templates re-render the previous generation prompt and answer
differently, e.g. without the `<think>` block, so the last position every later turn shares is the
start of the previous assistant header: a chunk end, so the next turn prefills only the answer and
its new message) and at the end of the prompt; each point inside a chunk is served by the chunk end
at or below it. Another snapshot is taken at the end of the generated answer (whatever was committed, also
when the request was cancelled): no forward is needed for it. The attention rows of a request are
copied once, at its end: rows below the committed length never change afterwards, so every snapshot
of the request shares that copy.

Snapshot copies are device-to-device clones, ordered on the stream like the kernels around them, so
the host never waits for one. They stay in device memory up to `device_bytes`; past it the least
recently used move to host RAM (pinned on CUDA, copied without blocking) and are restored from there.
Entries are evicted least-recently-used beyond `max_entries` or `max_bytes` (device and host together).

Spec modes: the draft's context cache (K/V of projected target features of committed positions) is
snapshotted with the target state, so a restored speculative run proposes exactly as an unbroken
one would. Entries made by autoregressive requests hold no draft state and serve only AR requests.

Cache fields are handled generically (every tensor field of the attention and DeltaNet state
objects; the attention position dimension is the one sized like the cache capacity), so quantized
KV layouts need no change here as long as rows below the committed length are final.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from flashtree.engine.prefix_cache_flags import (DEFAULT_DEVICE_BYTES, DEFAULT_INTERVAL, DEFAULT_MAX_BYTES,
                                                DEFAULT_MAX_ENTRIES)
from flashtree.errors import FlashtreeError
from flashtree.models.dflash import DraftContextCache



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


def _snapshot_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` on its own device. On a GPU the clone is queued on the stream like any kernel: the
    host does not wait for it, and the kernels that later change `t` run after it."""
    return t.clone()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host RAM: from a GPU into pinned memory without blocking (stream-ordered, like the snapshot
    copy; the host never reads it, restores copy it back in the same order). A CPU tensor is already there."""
    if not t.is_cuda:
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def _load(dst: torch.Tensor, saved: torch.Tensor) -> int:
    """Copy a snapshot into the cache without a host synchronisation (device to device, or from pinned host
    memory); returns the bytes copied."""
    dst.copy_(saved, non_blocking=True)
    return _nbytes(saved)


@dataclass(eq=False)
class _Copies:
    """Snapshot copies that live in one place together: device memory, or host RAM once spilled past the
    device budget (`PrefixCache.device_bytes`)."""

    tensors: dict[tuple, torch.Tensor]
    on_device: bool = True

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors.values())

    def spill(self) -> int:
        """Move the copies to host RAM; returns the bytes moved."""
        self.tensors = {key: _to_host(t) for key, t in self.tensors.items()}
        self.on_device = False
        return self.nbytes


@dataclass(eq=False)
class _Rows:
    """Attention rows [0, rows) of one request's sequence, shared by all its snapshots. Rows below `base`
    are those of the entry the request restored (`parent`), so a turn copies only what it added."""

    copies: _Copies  # (layer, field) -> rows [base, rows) of the field (the whole field if it has no position dim)
    dims: dict[tuple[int, str], int | None]  # (layer, field) -> its position dimension
    rows: int
    base: int = 0
    parent: "_Rows | None" = None

    def chain(self):
        segment = self
        while segment is not None:
            yield segment
            segment = segment.parent


def _copy_rows(cache, rows: int, parent: _Rows | None = None, base: int = 0) -> _Rows:
    copies, dims = {}, {}
    for index, kv in cache.attention.items():
        for name, t in _tensor_fields(kv).items():
            dim = dims[index, name] = _position_dim(t, cache.capacity)
            copies[index, name] = _snapshot_copy(t.narrow(dim, base, rows - base) if dim is not None else t)
    return _Rows(_Copies(copies), dims, rows, base, parent if base > 0 else None)


def _restore_rows(cache, saved: _Rows, length: int) -> int:
    """Rows [0, length) of `saved`'s chain into `cache`; returns the bytes copied."""
    copied = _restore_rows(cache, saved.parent, min(length, saved.base)) if saved.parent is not None else 0
    for index, kv in cache.attention.items():
        for name, dst in _tensor_fields(kv).items():
            dim, copy = saved.dims[index, name], saved.copies.tensors[index, name]
            if dim is None:
                copied += _load(dst, copy)
            elif length > saved.base:
                count = length - saved.base
                copied += _load(dst.narrow(dim, saved.base, count), copy.narrow(dim, 0, count))
    return copied


def _copy_recurrent(cache) -> dict[tuple, torch.Tensor]:
    return {("deltanet", i, name): _snapshot_copy(t)
            for i, state in cache.deltanet.items() for name, t in _tensor_fields(state).items()}


def _restore_recurrent(cache, saved: _Copies) -> int:
    """The DeltaNet state of `saved` into `cache`; returns the bytes copied."""
    return sum(_load(t, saved.tensors["deltanet", i, name])
               for i, state in cache.deltanet.items() for name, t in _tensor_fields(state).items())


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

    def snapshot(self) -> tuple[dict[tuple, torch.Tensor], dict]:
        """(copies of the valid slots, {"window", "count"})."""
        n = self.cache.length  # valid slots are always the first `length`
        c = self.cache
        copies = {("draft", "keys"): _snapshot_copy(c.keys[:, :, :n]),
                  ("draft", "values"): _snapshot_copy(c.values[:, :, :n]),
                  ("draft", "positions"): _snapshot_copy(c.positions[:n])}
        return copies, {"window": self.window, "count": c.count}

    def restore(self, saved: _Copies, meta: dict) -> int:
        """The draft context of `saved` into the proposer's (started) cache; returns the bytes copied."""
        n = saved.tensors["draft", "positions"].shape[0]
        c = self.cache
        copied = (_load(c.keys[:, :, :n], saved.tensors["draft", "keys"])
                  + _load(c.values[:, :, :n], saved.tensors["draft", "values"])
                  + _load(c.positions[:n], saved.tensors["draft", "positions"]))
        c.count = meta["count"]
        return copied


# --------------------------------------------------------------------------------------------
# entries and the cache
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Entry:
    tokens: tuple[int, ...]  # the exact sequence the state belongs to
    rows: _Rows  # attention rows (shared; at least len(tokens) rows)
    state: _Copies  # DeltaNet state after exactly len(tokens) tokens (+ the draft context then)
    draft: dict | None  # {"window", "count"} of the draft context in `state`, or None (AR-made entry)
    signature: tuple = ()  # cache layout it came from (_signature): restored only into the same layout

    @property
    def length(self) -> int:
        return len(self.tokens)

    def copies(self) -> list[_Copies]:
        """What a restore of this entry reads: its rows chain (shared with other entries) and its own state,
        last, so that the most recently used entry's state is the last thing to leave the device."""
        return [*(segment.copies for segment in self.rows.chain()), self.state]


@dataclass
class _Pending:
    length: int
    state: _Copies
    draft: dict | None


@dataclass
class RequestCacheStats:
    """One request's use of the cache (`PrefixCache.last_request`; `bench --multi-turn` prints it per turn)."""

    restored_tokens: int = 0
    restored_bytes: int = 0
    restore_s: float = 0.0
    snapshots: int = 0
    snapshot_bytes: int = 0  # DeltaNet (+ draft) states and the request's attention rows
    snapshot_s: float = 0.0  # during prefill and at the request's end (rows, answer-end state, spills)
    spilled_bytes: int = 0  # moved from device memory to host RAM at the request's end (the device budget)

    @property
    def copied_bytes(self) -> int:
        return self.restored_bytes + self.snapshot_bytes + self.spilled_bytes


@dataclass
class _Session:
    cache: object
    draft: _DraftOps | None
    signature: tuple
    parent: _Rows | None  # rows of the restored entry: [0, base) need no new copy
    base: int
    request: RequestCacheStats
    pending: list[_Pending] = field(default_factory=list)


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0  # prompt tokens restored instead of prefilled
    prefilled_tokens: int = 0  # prompt tokens prefilled while the cache was on
    evictions: int = 0
    spilled_bytes: int = 0  # moved from device memory to host RAM


class PrefixCache:
    """Token-id keyed snapshots of the target (and draft context) state; one per Engine.

    Not re-entrant, like the engine: `prefill` opens a session that `finish` closes. `clock` times the
    restores and snapshots (`last_request`); the default does not wait for the device, a benchmark
    passes one that does."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES,
                 interval: int = DEFAULT_INTERVAL, device_bytes: int = DEFAULT_DEVICE_BYTES, boundaries: int = 2,
                 max_interval_snapshots: int = 8, clock: Callable[[], float] = time.perf_counter):
        if max_entries < 1 or max_bytes < 1 or interval < 1 or device_bytes < 0:
            raise FlashtreeError(f"prefix cache limits must be >= 1 (entries={max_entries}, bytes={max_bytes}, "
                                 f"interval={interval}) and the device budget >= 0 (device_bytes={device_bytes})")
        self.max_entries, self.max_bytes, self.interval = max_entries, max_bytes, interval
        self.device_bytes = device_bytes
        self.max_interval_snapshots = max(1, max_interval_snapshots)
        self.boundaries = boundaries  # snapshots before this many of the last message headers of a prompt
        self.clock = clock
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # least recently used first
        self.stats = PrefixCacheStats()
        self.last_request: RequestCacheStats | None = None
        self._session: _Session | None = None
        self._lock = threading.Lock()

    # ---- bookkeeping ----

    @property
    def nbytes(self) -> int:
        """Bytes held in all, device memory and host RAM."""
        with self._lock:
            return sum(c.nbytes for c in self._copies())

    @property
    def device_nbytes(self) -> int:
        """Bytes held in device memory."""
        with self._lock:
            return sum(c.nbytes for c in self._copies() if c.on_device)

    def _copies(self) -> list[_Copies]:
        """Every stored group of copies once, least recently used first: a group shared by several entries
        (a request's rows) ranks by its most recently used entry."""
        newest: dict[int, _Copies] = {}
        for entry in self.entries.values():
            for copies in entry.copies():
                newest.pop(id(copies), None)
                newest[id(copies)] = copies
        return list(newest.values())

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
            while self.entries and (len(self.entries) > self.max_entries
                                    or sum(c.nbytes for c in self._copies()) > self.max_bytes):
                self.entries.popitem(last=False)
                self.stats.evictions += 1

    def _spill_past_device_budget(self) -> int:
        """Move the least recently used copies to host RAM until the device holds at most `device_bytes`;
        returns the bytes moved."""
        with self._lock:
            copies = self._copies()
            on_device = sum(c.nbytes for c in copies if c.on_device)
            moved = 0
            for group in copies:
                if on_device <= self.device_bytes:
                    break
                if group.on_device:
                    on_device -= group.nbytes
                    moved += group.spill()
            self.stats.spilled_bytes += moved
        return moved

    # ---- the engine's hooks ----

    def prefill(self, runner, cache, prompt_ids: list[int], config, proposer=None, stats=None) -> torch.Tensor:
        """Fill the fresh `cache` with `prompt_ids` and start `proposer` on them: restore the longest cached
        prefix, then prefill the rest with `runner.prefill` (the chunks an uncached prefill runs), taking
        snapshots at the chunk ends `_snapshot_ends` picks. Returns the logits of the last prompt position;
        `stats.cached_tokens` gets the restored prefix's length."""
        self._session = None
        chunk = config.prefill_chunk
        request = self.last_request = RequestCacheStats()
        draft = _DraftOps.of(proposer) if proposer is not None else None
        if proposer is not None:
            proposer.start()
            if draft is None:  # a proposer whose context cannot be snapshotted: no reuse
                return runner.prefill(cache, prompt_ids, chunk, proposer.capture_layers, proposer.commit)
        signature = _signature(cache)
        hit = self.lookup(prompt_ids, draft.window if draft is not None else None, signature=signature)
        start = self._restore(hit, cache, draft, request) if hit is not None else 0
        self._count(start, len(prompt_ids), stats)
        session = _Session(cache, draft, signature, hit.rows if hit is not None else None, start, request)
        snapshot_ends = self._snapshot_ends(runner, prompt_ids, start, chunk)

        def after_chunk(length: int) -> None:
            if length in snapshot_ends:
                started = self.clock()
                session.pending.append(self._snapshot(session))
                request.snapshot_s += self.clock() - started

        capture, on_features = (proposer.capture_layers, proposer.commit) if proposer is not None else ((), None)
        logits = runner.prefill(cache, prompt_ids[start:], chunk, capture, on_features, after_chunk)
        self._session = session
        return logits

    def _restore(self, hit: Entry, cache, draft: _DraftOps | None, request: RequestCacheStats) -> int:
        """`hit`'s state into `cache` (and the started draft context); returns the restored length."""
        started = self.clock()
        copied = _restore_rows(cache, hit.rows, hit.length) + _restore_recurrent(cache, hit.state)
        if draft is not None:
            copied += draft.restore(hit.state, hit.draft)
        cache.length = hit.length
        request.restore_s = self.clock() - started
        request.restored_tokens, request.restored_bytes = hit.length, copied
        return hit.length

    def _count(self, restored: int, prompt_len: int, stats) -> None:
        if restored:
            self.stats.hits += 1
            self.stats.hit_tokens += restored
        else:
            self.stats.misses += 1
        self.stats.prefilled_tokens += prompt_len - restored
        if stats is not None:
            stats.cached_tokens = restored

    def _snapshot_ends(self, runner, prompt_ids: Sequence[int], start: int, chunk: int) -> set[int]:
        """The chunk ends of this prefill to snapshot at: the prompt end, and for every point the policy
        wants (interval multiples, message headers) the chunk end at or below it. The cache never cuts a
        chunk of its own: the uncached prefill's chunks already end before every message header
        (`ModelRunner.chunk_ends`), so the headers are chunk ends, and a cut of the cache's own would be a
        forward the uncached prefill does not run (other bits)."""
        n = len(prompt_ids)
        ends = runner.chunk_ends(start, prompt_ids[start:], chunk)
        # at most `max_interval_snapshots` per prompt: a longer prompt gets them further apart (multiples of interval)
        every = self.interval * max(1, -(-(n - start) // (self.interval * self.max_interval_snapshots)))
        points = [*range((start // every + 1) * every, n, every), *self._boundary_points(runner, prompt_ids, start)]
        wanted = {n}
        for point in points:
            below = bisect.bisect_right(ends, point)
            if below:
                wanted.add(ends[below - 1])
        return wanted

    def _boundary_points(self, runner, prompt_ids: Sequence[int], start: int) -> list[int]:
        """The positions of the last `boundaries` message headers after `start`: the runner's (its chunks end
        there too, so these are snapshots of their own)."""
        headers, found = runner.message_starts, []
        if headers and self.boundaries > 0:
            for pos in range(len(prompt_ids) - 1, start, -1):
                if prompt_ids[pos] in headers:
                    found.append(pos)
                    if len(found) == self.boundaries:
                        break
        return found

    def finish(self, token_ids: Sequence[int]) -> None:
        """After generation: `token_ids` = prompt + generated tokens (the cache holds a prefix of them).
        Snapshots the committed end and stores every snapshot of the request, spilling the least recently
        used copies to host RAM past the device budget."""
        session, self._session = self._session, None
        if session is None:
            return
        cache, request = session.cache, session.request
        length, ended_inside = cache.length, cache.length > len(token_ids)
        if ended_inside:
            # a speculative step on the device commits its path before the host sees it (engine/decode.py): the
            # output ended inside it, so the state is past these tokens and only the prompt's snapshots, with
            # their rows, are stored
            length = max((snap.length for snap in session.pending), default=0)
            if length == 0:
                return
        started = self.clock()
        # a speculative request that stopped inside a verified tree leaves its scratch pending (never
        # committed): the committed state is still token_ids[:length], but the draft's context may have run
        # ahead of it, so only the prompt's snapshots (taken during prefill) are stored then
        if not ended_inside and not cache.pending and length > session.pending[-1].length:
            session.pending.append(self._snapshot(session))
        rows = _copy_rows(cache, length, session.parent, session.base)
        request.snapshot_bytes += rows.copies.nbytes
        for snap in session.pending:
            self._insert(Entry(tuple(token_ids[: snap.length]), rows, snap.state, snap.draft, session.signature))
        request.spilled_bytes = self._spill_past_device_budget()
        request.snapshot_s += self.clock() - started

    def _snapshot(self, session: _Session) -> _Pending:
        copies = _copy_recurrent(session.cache)
        meta = None
        if session.draft is not None:
            draft_copies, meta = session.draft.snapshot()
            copies.update(draft_copies)
        state = _Copies(copies)
        session.request.snapshots += 1
        session.request.snapshot_bytes += state.nbytes
        return _Pending(session.cache.length, state, meta)

    # ---- reporting ----

    def metrics(self) -> str:
        """Prometheus text exposition lines for /metrics."""
        with self._lock:
            copies = self._copies()
            entries, nbytes = len(self.entries), sum(c.nbytes for c in copies)
            device = sum(c.nbytes for c in copies if c.on_device)
        s = self.stats
        rows = [("prefix_cache_hits_total", "counter", "Requests that restored a cached prefix.", s.hits),
                ("prefix_cache_misses_total", "counter", "Requests that found no cached prefix.", s.misses),
                ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens restored from the prefix cache.",
                 s.hit_tokens),
                ("prefix_cache_prefilled_tokens_total", "counter", "Prompt tokens prefilled with the cache on.",
                 s.prefilled_tokens),
                ("prefix_cache_evictions_total", "counter", "Prefix cache entries evicted.", s.evictions),
                ("prefix_cache_spilled_bytes_total", "counter", "Bytes moved from device memory to host RAM.",
                 s.spilled_bytes),
                ("prefix_cache_entries", "gauge", "Prefix cache entries held.", entries),
                ("prefix_cache_bytes", "gauge", "Bytes held by the prefix cache.", nbytes),
                ("prefix_cache_device_bytes", "gauge", "Bytes the prefix cache holds in device memory.", device)]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP flashtree_{name} {help_text}", f"# TYPE flashtree_{name} {kind}",
                      f"flashtree_{name} {value}"]
        return "\n".join(lines) + "\n"
