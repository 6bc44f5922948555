"""The top-k of each row's log-softmax, without the log-softmax: `topk_logprobs(logits [L, V], k)` -> (log-probs
float32 [L, k] sorted descending, ids int64 [L, k]), what `torch.log_softmax(logits.float(), -1).topk(k)` gives.

Why: the draft's 27B logits ([15, 248320] float32) went through torch's log-softmax (16 MB written back) and its
radix top-k (14 launches): 0.065 + ~0.075 ms of the 0.54 ms that the tree build, walk and commit take in the
27B step graph (H200, 2026-12-05, `bench --steps --profile`), where issue #18 asks for 0.5 ms. Here the logits are
read once: each program of the first launch keeps a running max, sum of exponentials and top-k of its slice of a
row; the second merges a row's slices and takes the log-sum-exp off the k logits.

A value and its column travel as one int64 key: the float32 bits mapped to an ordered int32 in the high half, the
column reversed in the low half, so that a max picks the larger logit and, between equal logits, the lower column.
The order is the logits', which log-softmax keeps; a log-prob is logit - logsumexp, where torch computes
(logit - max) - log(sum): the two differ by float32 rounding (a few ulp). NaN logits are not handled (the draft's
nonfinite rows are counted upstream). On the CPU torch runs (the interpreter tests ask for the kernels).
"""

from __future__ import annotations

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import triton_runs_on

try:  # the kernels need triton; the reference does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None

MAX_K = 32  # the kernels' largest k (tree_build.MAX_TOPK: the ranks a tree key can name); more: torch
_BLOCK = 2048  # logits a program reads per step of its slice
_PROGRAMS = 264  # programs the first launch aims for (two an SM on the H200's 132)


def topk_logprobs(logits: torch.Tensor, k: int, kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [L, V] (float32, bf16 or f16) -> (log-probs float32 [L, k] sorted descending, ids int64 [L, k]).
    `kernel`: None runs the kernels on a GPU only (in the CPU interpreter a bitonic top-k of a 2048-logit block
    takes seconds, which the model-level interpreter tests would pay every step), True wherever Triton runs (the
    interpreter tests of this file), False never."""
    if logits.dim() != 2 or not 1 <= k <= logits.shape[-1]:
        raise FlashtreeError(f"topk_logprobs takes [L, V] logits and 1 <= k <= V, got {tuple(logits.shape)} and k={k}")
    wanted = logits.is_cuda if kernel is None else kernel
    if (not wanted or triton is None or not triton_runs_on(logits.device) or logits.stride(-1) != 1
            or k > MAX_K):
        return topk_logprobs_reference(logits, k)
    rows, vocab = logits.shape
    k_p2 = triton.next_power_of_2(k)
    splits = _splits(rows, vocab)
    span = triton.cdiv(triton.cdiv(vocab, splits), _BLOCK) * _BLOCK
    keys = torch.empty(rows, splits, k_p2, dtype=torch.int64, device=logits.device)
    maxes, sums = (torch.empty(rows, splits, dtype=torch.float32, device=logits.device) for _ in range(2))
    _slice_kernel[(rows, splits)](logits, logits.stride(0), vocab, keys, maxes, sums, SPLITS=splits, SPAN=span,
                                  BLOCK=_BLOCK, K=k_p2, num_warps=4)
    values = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    _merge_kernel[(rows,)](keys, maxes, sums, values, ids, k, SPLITS=splits, K=k_p2, num_warps=1)
    return values, ids


def topk_logprobs_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1, sorted=True)


def _splits(rows: int, vocab: int) -> int:
    """Slices of a row: a power of two (the merge's keys), enough programs to fill the GPU, each slice at least one
    block long."""
    wanted = triton.next_power_of_2(triton.cdiv(_PROGRAMS, rows))
    blocks = triton.cdiv(vocab, _BLOCK)
    return min(wanted, 1 << (blocks.bit_length() - 1))


if triton is not None:
    _LOW = tl.constexpr(0xFFFFFFFF)
    _MIN_KEY = tl.constexpr(-(2**63))

    @triton.jit
    def _keys(x, cols):
        """float32 x and int32 columns -> int64 keys ordered as (x, -column)."""
        bits = x.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits flipped
        return (ordered.to(tl.int64) << 32) | (cols.to(tl.int64) ^ _LOW)  # the column reversed: _LOW - column

    @triton.jit
    def _slice_kernel(x_ptr, stride_row, vocab, keys_ptr, max_ptr, sum_ptr, SPLITS: tl.constexpr, SPAN: tl.constexpr,
                      BLOCK: tl.constexpr, K: tl.constexpr):
        row = tl.program_id(0)
        split = tl.program_id(1)
        top = tl.full([K], _MIN_KEY, tl.int64)
        running_max = tl.full([], float("-inf"), tl.float32)
        running_sum = tl.zeros([], tl.float32)
        for start in range(0, SPAN, BLOCK):
            cols = split * SPAN + start + tl.arange(0, BLOCK)
            live = cols < vocab
            x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=live, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, 0))
            base = tl.where(new_max == float("-inf"), 0.0, new_max)  # a slice past the row: nothing to sum yet
            running_sum = running_sum * tl.exp(running_max - base) + tl.sum(tl.exp(x - base), 0)
            running_max = new_max
            block_top = tl.topk(tl.where(live, _keys(x, cols), _MIN_KEY), K)
            top = tl.topk(tl.reshape(tl.join(top, block_top), [2 * K]), K)
        out = row * SPLITS + split
        tl.store(keys_ptr + out * K + tl.arange(0, K), top)
        tl.store(max_ptr + out, running_max)
        tl.store(sum_ptr + out, running_sum)

    @triton.jit
    def _merge_kernel(keys_ptr, max_ptr, sum_ptr, values_ptr, ids_ptr, k, SPLITS: tl.constexpr, K: tl.constexpr):
        row = tl.program_id(0)
        top = tl.topk(tl.load(keys_ptr + row * SPLITS * K + tl.arange(0, SPLITS * K)), K)  # sorted descending
        maxes = tl.load(max_ptr + row * SPLITS + tl.arange(0, SPLITS))
        sums = tl.load(sum_ptr + row * SPLITS + tl.arange(0, SPLITS))
        row_max = tl.max(maxes, 0)
        logsumexp = row_max + tl.log(tl.sum(sums * tl.exp(maxes - row_max), 0))
        ordered = (top >> 32).to(tl.int32)
        logit = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        ranks = tl.arange(0, K)
        tl.store(values_ptr + row * k + ranks, logit - logsumexp, mask=ranks < k)
        tl.store(ids_ptr + row * k + ranks, (top & _LOW) ^ _LOW, mask=ranks < k)
