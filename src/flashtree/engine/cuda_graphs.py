"""CUDA graphs for the target's decode and verify forwards.

A 64-layer hybrid forward is about a thousand small kernels; launched one by one from Python the
step is bound by launch overhead, not by reading the weights. Here each step shape is captured once
and replayed:

- key = (tokens per step, run or tree, captured layers, cache rows read). Trees are padded to the
  request's budget + 1 with nodes that see only themselves and that no node sees, so every verify of
  a request has one shape; the rows read are rounded up to a bucket, so one graph serves many
  consecutive lengths (attention masks the rows past the committed length plus the new tokens).
- Inputs go into one static int64 buffer (tokens, positions, parents, start, visibility), copied in
  one transfer; the graph unpacks it, so per step there is one copy, one replay and the caller's one
  read of the result.
- A graph is captured the first time its key is met, right after an eager run of the same static
  function on the same inputs: that run is the warm-up and yields the step's result, and capturing
  records kernels without running them, so the cache is advanced exactly once.
Graphs hold the addresses of one cache's tensors; the engine reuses its cache across requests so
that they stay valid (`Engine.new_cache`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from flashtree.models.qwen35 import ForwardOutput
from flashtree.models.step import Step

MIN_BUCKET = 256  # cache rows: the smallest read window; past it, an eighth of the next power of two


def bucket_rows(needed: int, capacity: int) -> int:
    """Rows attention reads for `needed` live rows: rounded up by less than a quarter (or MIN_BUCKET),
    within capacity, so a long generation captures a few graphs per doubling of its length."""
    granule = max(MIN_BUCKET, (1 << max(needed - 1, 1).bit_length()) // 8)
    return min(capacity, -(-needed // granule) * granule)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    packed: torch.Tensor  # device int64 [4T + 1 + T*T] static input
    host: torch.Tensor  # pinned twin of `packed`
    output: ForwardOutput | None = None
    pending: dict | None = None  # the DeltaNet tree scratch tensors the graph writes


class GraphedForward:
    """`forward(tokens, cache, tree=None, capture=(), pad_to=None)` with the result of
    `Qwen35Model.forward`, replaying a CUDA graph per step shape."""

    def __init__(self, model, capture_graphs: bool | None = None):
        """`capture_graphs` False runs the same static, padded step eagerly (how the CPU tests check it)."""
        self.model = model
        self.capture_graphs = model.device.type == "cuda" if capture_graphs is None else capture_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None
        self.cache = None

    def forward(self, tokens: torch.Tensor, cache, tree=None, capture=(), pad_to: int | None = None) -> ForwardOutput:
        """`tokens` on the host; `tree` a spec.ddtree.DraftTree whose tokens they are, or None for a run."""
        if cache is not self.cache:  # captured addresses belong to one cache
            self.release()
            self.cache = cache
        self.model._check_tokens(tokens)
        n = tokens.shape[0]
        size = max(pad_to or n, n) if tree is not None else n
        cache.reserve(size)
        key = (size, tree is not None, tuple(capture), bucket_rows(cache.length + size, cache.capacity))
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = _Graph(None, *self._buffers(size))
        self._fill(entry.host, tokens, cache.length, tree, size)
        entry.packed.copy_(entry.host, non_blocking=True)
        if not self.capture_graphs:
            result, pending = self._run(key, entry.packed, cache), dict(cache.pending)
        elif entry.graph is None:
            result = self._run(key, entry.packed, cache)  # the warm-up is this step's real work
            pending = dict(cache.pending)
            entry.graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(entry.graph, pool=self.pool):  # records only: nothing runs twice
                    entry.output = self._run(key, entry.packed, cache)
            except RuntimeError as exc:  # an op that cannot be captured: keep going eagerly, say so once
                print(f"flashtree: CUDA graph capture failed ({str(exc).splitlines()[0]}); "
                      "running the static steps eagerly", file=sys.stderr)
                self.capture_graphs = False
                del self.graphs[key]
            else:
                entry.pending = dict(cache.pending)
        else:
            entry.graph.replay()
            result, pending = entry.output, entry.pending
        cache.pending.clear()
        cache.pending.update(pending)
        if tree is None:
            cache.length += n
        return ForwardOutput(result.logits[:n], None if result.features is None else result.features[:n])

    def release(self) -> None:
        """Drop every graph and the cache they were captured on."""
        self.graphs.clear()
        self.cache = None

    def _buffers(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = 4 * size + 1 + size * size
        device = self.model.device
        host = torch.zeros(length, dtype=torch.long)
        return torch.zeros(length, dtype=torch.long, device=device), host.pin_memory() if self.capture_graphs else host

    @staticmethod
    def _fill(host: torch.Tensor, tokens: torch.Tensor, start: int, tree, size: int) -> None:
        n = tokens.shape[0]
        host.zero_()
        host[:n] = tokens
        visible = host[4 * size + 1 :].view(size, size)
        if tree is None:
            host[size : 2 * size] = torch.arange(start, start + size)
            host[2 * size : 3 * size] = torch.arange(-1, size - 1)
            visible.copy_(torch.ones(size, size, dtype=torch.long).tril())
        else:
            host[size : 2 * size] = start
            host[size : size + n] += tree.depths
            host[2 * size : 3 * size] = -1  # padding nodes hang off the committed prefix
            host[2 * size : 2 * size + n] = tree.parents
            visible.copy_(torch.eye(size, dtype=torch.long))
            visible[:n, :n] = tree.ancestor_mask()
        host[3 * size] = start
        host[3 * size + 1 : 4 * size + 1] = torch.arange(start, start + size)

    def _run(self, key: tuple, packed: torch.Tensor, cache) -> ForwardOutput:
        size, is_tree, capture, kv_end = key
        tokens, positions, parents = packed[:size], packed[size : 2 * size], packed[2 * size : 3 * size]
        start_t, slots = packed[3 * size : 3 * size + 1], packed[3 * size + 1 : 4 * size + 1]
        visible = packed[4 * size + 1 :].view(size, size).bool()
        step = Step(positions, 0, visible, parents if is_tree else None, slots, kv_end, start_t)
        with torch.inference_mode():
            return self.model.run(tokens, cache, step, capture)
