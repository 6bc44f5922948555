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
that they stay valid (`ModelRunner.new_cache`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from flashtree.drafting.ddtree import topk_table
from flashtree.kernels import on_device
from flashtree.kernels.tree_build import build_tree, walk_tree
from flashtree.models.qwen35 import ForwardOutput
from flashtree.models.step import Step, padded_offsets

MIN_BUCKET = 256  # cache rows: the smallest read window; past it, an eighth of the next power of two


def bucket_rows(needed: int, capacity: int) -> int:
    """Rows attention reads for `needed` live rows: rounded up by less than a quarter (or MIN_BUCKET),
    within capacity, so a long generation captures a few graphs per doubling of its length."""
    granule = max(MIN_BUCKET, (1 << max(needed - 1, 1).bit_length()) // 8)
    return min(capacity, -(-needed // granule) * granule)


@dataclass
class _Entry:
    packed: torch.Tensor  # device int64 static input
    host: torch.Tensor  # its (pinned) host twin
    graph: torch.cuda.CUDAGraph | None = None
    output: object = None  # what the captured function returned: the graph's output buffers


class CapturedSteps:
    """Static functions of one packed int64 input, captured per key and replayed (CUDA), or run
    eagerly on the same static inputs (`capture_graphs` False: the CPU tests, or after a failed capture)."""

    captures = 0  # keys met for the first time, in every instance (each a capture on CUDA): the adaptive
    # budget leaves the steps they fell in untimed

    def __init__(self, device: torch.device, capture_graphs: bool | None = None):
        self.device = device
        self.capture_graphs = device.type == "cuda" if capture_graphs is None else capture_graphs
        self.entries: dict[tuple, _Entry] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None

    def run(self, key: tuple, length: int, fill, fn, idempotent: bool = False):
        """`fill(host)` writes this call's inputs into a zeroed int64 [length] host buffer; `fn(packed)`
        is the static function of its device copy (same key -> same shapes and addresses). An
        `idempotent` function (one that changes no state it reads) returns the graph's own output
        buffers from its first call on, so later graphs may capture them as inputs."""
        entry = self.entries.get(key)
        if entry is None:
            CapturedSteps.captures += 1
            host = torch.zeros(length, dtype=torch.long)
            entry = self.entries[key] = _Entry(torch.zeros(length, dtype=torch.long, device=self.device),
                                               host.pin_memory() if self.capture_graphs else host)
        entry.host.zero_()
        fill(entry.host)
        entry.packed.copy_(entry.host, non_blocking=True)
        if not self.capture_graphs:
            return fn(entry.packed)
        if entry.graph is not None:
            entry.graph.replay()
            return entry.output
        result = fn(entry.packed)  # the warm-up is this call's real work
        # the warm-up's freed blocks stay cached outside the graphs' pool, and the allocator cannot hand them back
        # while a capture records (no cudaFree then), so they go back to the driver first. Not enough on its own:
        # under a 23 GiB cap at 262K tokens the budget-22 capture still ran out of memory with 0.73 GiB reserved
        # and unallocated (2026-12-02, docs/LONG_CONTEXT.md)
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):  # records only: nothing runs twice
                entry.output = fn(entry.packed)
            entry.graph = graph
            if idempotent:
                graph.replay()
                return entry.output
        except RuntimeError as exc:  # an op that cannot be captured: keep going eagerly, say so once
            print(f"flashtree: CUDA graph capture failed ({str(exc).splitlines()[0]}); "
                  "running the static steps eagerly", file=sys.stderr)
            self.entries.clear()
            self.capture_graphs = False
        return result

    def clear(self) -> None:
        """Drop every graph. Their memory pool dies with the last of them and cannot be reopened
        (the allocator asserts), so later captures get a fresh pool."""
        self.entries.clear()
        if self.capture_graphs:
            self.pool = torch.cuda.graph_pool_handle()


class GraphedForward:
    """`forward(tokens, cache, tree=None, capture=(), pad_to=None)` with the result of
    `Qwen35Model.forward`, replaying a CUDA graph per step shape."""

    def __init__(self, model, capture_graphs: bool | None = None):
        """`capture_graphs` False runs the same static, padded step eagerly (how the CPU tests check it)."""
        self.model = model
        self.steps = CapturedSteps(model.device, capture_graphs)
        self.cache = None
        self.verify_key = None  # the shape of the last verify: the commit graph reads its outputs
        # and its features, all of the padded tree's rows: a commit graph captures this tensor, and must not
        # keep the bounds of one request's slice of it (a chain of 16 nodes, then a tree of 23 on the same
        # graphs: index out of bounds, 2026-12-01)
        self.verify_features = None
        self.proposer = None  # the draft proposer kept across requests (engine/decode.py)
        self._launched = None  # (arguments, cache, proposer, result buffer) of the step `launch_ahead` started

    def forward(self, tokens: torch.Tensor, cache, tree=None, capture=(), pad_to: int | None = None) -> ForwardOutput:
        """`tokens` on the host; `tree` a drafting.ddtree.DraftTree whose tokens they are, or None for a run."""
        if cache is not self.cache:  # captured addresses belong to one cache
            self.release()
            self.cache = cache
        self.model._check_tokens(tokens)
        n = tokens.shape[0]
        size = max(pad_to or n, n) if tree is not None else n
        cache.reserve(size)
        key = (size, tree is not None, tuple(capture), bucket_rows(cache.length + size, cache.capacity))
        start = cache.length
        # a tree verify only writes scratch rows: replaying it is harmless, and its outputs (logits,
        # features, DeltaNet scratch) stay the graph's buffers, which the commit graphs then read
        with on_device(self.model.device):
            result, pending = self.steps.run(key, 4 * size + 1 + size * size,
                                             lambda host: self._fill(host, tokens, start, tree, size),
                                             lambda packed: self._run(key, packed, cache), idempotent=tree is not None)
        if tree is not None:
            self.verify_key, self.verify_features = key, result.features
        cache.pending.clear()
        cache.pending.update(pending)
        if tree is None:
            cache.length += n
        return ForwardOutput(result.logits[:n], None if result.features is None else result.features[:n])

    def commit(self, cache, path: list[int], proposer=None) -> None:
        """`Qwen35Model.commit` of the last verify's accepted `path`, plus the proposer's commit of
        their features, as one graph per verify shape: the path is padded to the verify's rows with the
        root, its length on the device (a graph per path length would be up to 64 captures per shape).
        `proposer` None: the target's commit alone (a prefill chunk, whose caller hands the features on)."""
        n, start, features = len(path), cache.length, self.verify_features
        rows = self.verify_key[0]  # the longest path a verify of this shape can accept
        static_draft = getattr(proposer, "steps", None) is not None
        key = ("commit", self.verify_key, id(proposer) if static_draft else None)

        def run(packed: torch.Tensor) -> None:
            nodes, start_t, count_t = packed[:rows], packed[rows : rows + 1], packed[rows + 2 : rows + 3]
            self.model.run_commit(cache, nodes, start_t, count_t)
            if static_draft:  # padding rows repeat the root's features, position and slot
                offsets = padded_offsets(rows, count_t, nodes.device)
                proposer.commit_static(features[nodes], start_t + offsets, packed[rows + 1 : rows + 2], offsets)

        def fill(host: torch.Tensor) -> None:
            host[:n] = torch.tensor(path)  # and the root (node 0) after them
            host[rows] = start
            host[rows + 1] = proposer.cache.count if static_draft else 0
            host[rows + 2] = n

        with torch.inference_mode(), on_device(self.model.device):
            self.steps.run(key, rows + 3, fill, run)
        cache.pending.clear()
        cache.length += n
        if static_draft:
            proposer.cache.count += n
        elif proposer is not None:
            proposer.commit(features[torch.tensor(path, device=features.device)],
                            torch.arange(start, start + n, device=features.device))

    def speculative_step(self, cache, proposer, bonus: int, mode: str, nodes: int, topk: int) -> list[int]:
        """One whole greedy speculative step as one graph: the draft's block after `bonus`, its tree of `nodes`
        nodes (a chain of the rank-0 tokens, or the DDTree of the top-`topk` table), the target's verify, the
        greedy walk and the commit of the accepted path (target cache and draft context). The host sends four
        numbers and reads back `walk_tree`'s result [count, next bonus, path, path tokens]: the step's only
        wait. The path is committed before the host sees it, so a step whose tokens end the output commits
        past the end (the prefix cache then stores only the prompt's snapshots). A step `launch_ahead` started
        with the same arguments is waited for instead of run again."""
        arguments = (id(cache), id(proposer), bonus, mode, nodes, topk)
        launched, self._launched = self._launched, None
        if launched is not None and launched[0] != arguments:
            self._finish(*launched)  # never asked for (the loop changed its budget): its commit still counts
            launched = None
        if launched is None:
            launched = (arguments, cache, proposer, self._launch(cache, proposer, bonus, mode, nodes, topk))
        return self._finish(*launched)

    def launch_ahead(self, cache, proposer, bonus: int, mode: str, nodes: int, topk: int) -> None:
        """Start the `speculative_step` of these arguments now, without waiting for it, so that the host
        streams the last step's tokens while the device runs the next one; `speculative_step` with the same
        arguments (or `settle`) waits for it."""
        self.settle()
        result = self._launch(cache, proposer, bonus, mode, nodes, topk)
        self._launched = ((id(cache), id(proposer), bonus, mode, nodes, topk), cache, proposer, result)

    def settle(self) -> None:
        """Wait for a step `launch_ahead` started and count its commit (a request that ended before asking for
        it: the cache is then past the output, as after a path that crosses the end)."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._finish(*launched)

    def _launch(self, cache, proposer, bonus: int, mode: str, nodes: int, topk: int) -> torch.Tensor:
        if cache is not self.cache:
            self.release()
            self.cache = cache
        size = nodes + 1
        cache.reserve(size)
        draft_rows = bucket_rows(max(proposer.cache.length, 1), proposer.cache.max_context)
        verify_rows = bucket_rows(cache.length + size, cache.capacity)
        key = ("speculative", mode, size, topk, draft_rows, verify_rows, id(proposer))
        inputs = torch.tensor([bonus, cache.length, proposer.cache.length, proposer.cache.count])

        def run(packed: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return self._speculative_step(packed, cache, proposer, mode, nodes, topk, draft_rows, verify_rows)

        with on_device(self.model.device):
            return self.steps.run(key, len(inputs), lambda host: host.copy_(inputs), run)

    @staticmethod
    def _finish(_arguments: tuple, cache, proposer, result: torch.Tensor) -> list[int]:
        values = result.tolist()  # the step's one wait
        cache.pending.clear()  # the graph committed the scratch its verify wrote
        cache.length += values[0]
        proposer.cache.count += values[0]
        return values

    def _speculative_step(self, packed: torch.Tensor, cache, proposer, mode: str, nodes: int, topk: int,
                          draft_rows: int, verify_rows: int) -> torch.Tensor:
        """The static function of `speculative_step`: packed = [bonus, committed length, draft context length,
        draft positions appended so far]."""
        size, start = nodes + 1, packed[1:2]
        draft_logits = proposer.static_block(packed[:3], draft_rows)
        if mode == "chain":  # the rank-0 token of each row, as drafting.ddtree.build_chain takes it
            ids = draft_logits.argmax(-1, keepdim=True)
            logprobs = torch.zeros(ids.shape, device=ids.device)
        else:
            logprobs, ids = topk_table(draft_logits, min(topk, draft_logits.shape[-1]))
        tokens, parents, depths, visible = build_tree(packed[:1], logprobs, ids, nodes, size)
        slots = start + torch.arange(size, device=start.device)
        step = Step(start + depths, 0, visible, parents, slots, verify_rows, start)
        output = self.model.run(tokens, cache, step, proposer.capture_layers)
        result = walk_tree(tokens, parents, output.logits.argmax(-1))
        count, path = result[:1], result[2 : 2 + size]
        self.model.run_commit(cache, path, start, count)
        offsets = padded_offsets(size, count, path.device)
        proposer.commit_static(output.features[path], start + offsets, packed[3:4], offsets)
        return result

    def release(self) -> None:
        """Drop every graph and the cache they were captured on (after waiting for a step launched ahead)."""
        self.settle()
        self.steps.clear()
        self.cache = None

    @staticmethod
    def _fill(host: torch.Tensor, tokens: torch.Tensor, start: int, tree, size: int) -> None:
        n = tokens.shape[0]
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

    def _run(self, key: tuple, packed: torch.Tensor, cache) -> tuple[ForwardOutput, dict]:
        size, is_tree, capture, kv_end = key
        tokens, positions, parents = packed[:size], packed[size : 2 * size], packed[2 * size : 3 * size]
        start_t, slots = packed[3 * size : 3 * size + 1], packed[3 * size + 1 : 4 * size + 1]
        visible = packed[4 * size + 1 :].view(size, size).bool()
        step = Step(positions, 0, visible, parents if is_tree else None, slots, kv_end, start_t)
        with torch.inference_mode():
            output = self.model.run(tokens, cache, step, capture)
        return output, dict(cache.pending)  # the DeltaNet tree scratch this step wrote
