"""A verified tree's accepted path committed in place, one launch per tensor.

In PyTorch a commit is a gather, a scatter (and for the conv window a cast, a concat and a copy) per
tensor: about 250 small kernels per step at the 27B shape (16 attention layers' K and V, 48 conv
windows). Here each tensor is one launch:

* `move_rows(cache, rows, source)`: cache [H, capacity, W] of any dtype (float K/V rows, or the uint8
  blocks of a quantized cache): for every head, row rows[i] gets what row source[i] held. A path's node i
  sits at tree row >= i, so a source row can be another node's destination: a program loads all its
  path rows, waits for its threads, then stores.
* `move_rows_together(table, rows, source)`: `move_rows` for every cache of a `RowTable` (same shape and
  dtype: a device's K and V caches of all attention layers) in one launch, through a device table of their
  addresses built once when the cache is allocated.
* `shift_window(window, inputs, path, count=None)`: the conv window [K-1, C] (oldest row first) becomes the
  last K-1 rows of [window; inputs[path[:count]]], cast to the window's dtype, the same wait between loads
  and stores.
* `shift_windows_together(table, path, count=None)`: `shift_window` for every (window, inputs) pair of a
  `WindowTable` (a device's DeltaNet layers, their inputs in buffers kept with the cache) in one launch.

The row indices (and `count`) are device tensors and the launch shapes depend only on their lengths, so
both can be captured in a CUDA graph, one for every path a verify of that many rows can accept (a path
padded to the verify's rows; `move_rows` pads with copies of its first move). Without Triton (CPU) the
torch forms run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import address_table, triton_runs_on

try:  # the kernels need triton; the torch forms do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None

MAX_PATH = 64  # rows one program holds: a path is at most a tree's node count (gated_delta_triton.MAX_TREE_NODES)
BLOCK_W = 256  # columns per program


def move_rows(cache: torch.Tensor, rows: torch.Tensor, source: torch.Tensor) -> None:
    """cache[:, rows[i]] = cache[:, source[i]] for every i, as if all sources were read first."""
    n = rows.shape[0]
    if cache.dim() != 3 or source.shape != (n,) or n > MAX_PATH:
        raise FlashtreeError(f"move_rows takes a [H, capacity, W] cache and two index vectors of one length "
                             f"<= {MAX_PATH}; got {tuple(cache.shape)}, {tuple(rows.shape)}, {tuple(source.shape)}")
    if n == 0:
        return
    if triton is None or not triton_runs_on(cache.device) or cache.stride(2) != 1:
        cache.index_copy_(1, rows, cache.index_select(1, source))
        return
    heads, _, width = cache.shape
    _move_rows_kernel[(heads, triton.cdiv(width, BLOCK_W))](
        cache, rows, source, n, width, cache.stride(0), cache.stride(1),
        BLOCK_N=max(2, triton.next_power_of_2(n)), BLOCK_W=min(BLOCK_W, triton.next_power_of_2(width)))


@dataclass
class RowTable:
    """Caches of one shape, dtype and strides whose rows a commit moves together, and their addresses (int64 [n] on
    their device). Built outside CUDA graph capture; the caches must stay where they are (a cache is allocated once
    and updated in place)."""

    caches: list[torch.Tensor]
    addresses: torch.Tensor

    @classmethod
    def group(cls, caches: list[torch.Tensor]) -> list["RowTable"]:
        """One table per (device, dtype, shape, strides) among `caches` (K and V of different KV types differ)."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for cache in caches:
            if cache.dim() != 3 or cache.data_ptr() % 16:
                raise FlashtreeError(f"row tables take 16-byte aligned [H, capacity, W] caches, got "
                                     f"{tuple(cache.shape)} at an offset of {cache.data_ptr() % 16} bytes")
            groups.setdefault((cache.device, cache.dtype, tuple(cache.shape), cache.stride()), []).append(cache)
        return [cls(members, address_table(members)[0]) for members in groups.values()]


def move_rows_together(table: RowTable, rows: torch.Tensor, source: torch.Tensor) -> None:
    """`move_rows(cache, rows, source)` for every cache of `table`, in one launch where Triton runs."""
    first = table.caches[0]
    n = rows.shape[0]
    if source.shape != (n,) or rows.dim() != 1 or n > MAX_PATH:
        raise FlashtreeError(f"move_rows_together takes two index vectors of one length <= {MAX_PATH}; got "
                             f"{tuple(rows.shape)}, {tuple(source.shape)}")
    if n == 0:
        return
    if triton is None or not triton_runs_on(first.device) or first.stride(2) != 1:
        for cache in table.caches:
            move_rows(cache, rows, source)
        return
    heads, _, width = first.shape
    _move_rows_together_kernel[(len(table.caches) * heads, triton.cdiv(width, BLOCK_W))](
        table.addresses, first, rows, source, n, heads, width, first.stride(0), first.stride(1),
        BLOCK_N=max(2, triton.next_power_of_2(n)), BLOCK_W=min(BLOCK_W, triton.next_power_of_2(width)))


@dataclass
class WindowTable:
    """Conv windows [K-1, C] and the [R, C] input rows each is shifted from (all pairs of one shape and dtype), and
    their addresses (int64 [2, n] on the device: windows, inputs). Built outside CUDA graph capture, of tensors
    that stay where they are."""

    windows: list[torch.Tensor]
    inputs: list[torch.Tensor]
    addresses: torch.Tensor

    @classmethod
    def of(cls, windows: list[torch.Tensor], inputs: list[torch.Tensor]) -> "WindowTable":
        w0, i0 = windows[0], inputs[0]
        if (len(windows) != len(inputs) or w0.dim() != 2 or i0.dim() != 2 or w0.shape[1] != i0.shape[1]
                or any(w.shape != w0.shape or w.dtype != w0.dtype or not w.is_contiguous() for w in windows)
                or any(x.shape != i0.shape or x.dtype != w0.dtype or not x.is_contiguous() for x in inputs)
                or any(t.data_ptr() % 16 for t in (*windows, *inputs))):
            raise FlashtreeError("a window table takes one contiguous, 16-byte aligned [R, C] input buffer per "
                                 "[K-1, C] window, all of one shape and the windows' dtype")
        return cls(windows, inputs, address_table(windows, inputs))


def shift_windows_together(table: WindowTable, path: torch.Tensor, count: torch.Tensor | None = None) -> None:
    """`shift_window(window, inputs, path, count)` for every pair of `table`, in one launch where Triton runs."""
    window, inputs = table.windows[0], table.inputs[0]
    if path.dim() != 1 or path.shape[0] > inputs.shape[0]:
        raise FlashtreeError(f"shift_windows_together takes a path of at most {inputs.shape[0]} rows, got "
                             f"{tuple(path.shape)}")
    if path.shape[0] == 0:
        return
    if triton is None or not triton_runs_on(window.device):
        for w, x in zip(table.windows, table.inputs):
            shift_window(w, x, path, count)
        return
    keep, channels = window.shape
    _shift_windows_together_kernel[(len(table.windows), triton.cdiv(channels, BLOCK_W))](
        table.addresses, window, path, path.shape[0], path if count is None else count, keep, channels,
        len(table.windows), BLOCK_K=max(2, triton.next_power_of_2(keep)), BLOCK_W=BLOCK_W,
        HAS_COUNT=count is not None)


def shift_window(window: torch.Tensor, inputs: torch.Tensor, path: torch.Tensor,
                 count: torch.Tensor | None = None) -> None:
    """window[:] = last window.shape[0] rows of [window; inputs[path[:count]]], in the window's dtype.
    `count` (int64 [1] on the device, 1 <= count <= len(path)): the path's live length; None: all of it."""
    keep, channels = window.shape
    if inputs.dim() != 2 or inputs.shape[1] != channels or path.dim() != 1:
        raise FlashtreeError(f"shift_window takes a [K-1, C] window, [T, C] inputs and a path; got "
                             f"{tuple(window.shape)}, {tuple(inputs.shape)}, {tuple(path.shape)}")
    if path.shape[0] == 0:
        return
    if triton is None or not triton_runs_on(window.device) or window.stride(1) != 1 or inputs.stride(1) != 1:
        live = path if count is None else path[: int(count)]
        window.copy_(torch.cat([window, inputs[live].to(window.dtype)])[-keep:])
        return
    _shift_window_kernel[(triton.cdiv(channels, BLOCK_W),)](
        window, inputs, path, path.shape[0], path if count is None else count, keep, channels, window.stride(0),
        inputs.stride(0), BLOCK_K=max(2, triton.next_power_of_2(keep)), BLOCK_W=BLOCK_W, HAS_COUNT=count is not None)


if triton is not None:

    @triton.jit
    def _move_rows_kernel(cache_ptr, rows_ptr, source_ptr, n, width, stride_h, stride_r,
                          BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
        _move_head_rows(cache_ptr + tl.program_id(0) * stride_h, rows_ptr, source_ptr, n, width, stride_r, BLOCK_N,
                        BLOCK_W)

    @triton.jit
    def _move_head_rows(head_ptr, rows_ptr, source_ptr, n, width, stride_r, BLOCK_N: tl.constexpr,
                        BLOCK_W: tl.constexpr):
        """Columns program_id(1) of one head's rows: row rows[i] <- row source[i], all read before any write."""
        i = tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        ok = (i < n)[:, None] & (cols < width)[None, :]
        base = head_ptr + cols[None, :]
        source = tl.load(source_ptr + i, mask=i < n, other=0)
        values = tl.load(base + source[:, None] * stride_r, mask=ok)
        tl.debug_barrier()  # every source row read before any destination row is written
        rows = tl.load(rows_ptr + i, mask=i < n, other=0)
        tl.store(base + rows[:, None] * stride_r, values, mask=ok)

    @triton.jit
    def _move_rows_together_kernel(addr_ptr, like_ptr, rows_ptr, source_ptr, n, heads, width, stride_h, stride_r,
                                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
        # program_id(0) = cache x head; the cache's address from the table, 16-byte aligned (`RowTable.group`
        # checks), said so that its loads vectorize as through an argument
        cache = tl.load(addr_ptr + tl.program_id(0) // heads).to(tl.pointer_type(like_ptr.dtype.element_ty))
        cache = tl.multiple_of(cache, 16)
        _move_head_rows(cache + (tl.program_id(0) % heads) * stride_h, rows_ptr, source_ptr, n, width, stride_r,
                        BLOCK_N, BLOCK_W)

    @triton.jit
    def _shift_window_kernel(window_ptr, inputs_ptr, path_ptr, n, count_ptr, keep, channels, stride_w, stride_in,
                             BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, HAS_COUNT: tl.constexpr):
        _shift_columns(window_ptr, inputs_ptr, path_ptr, n, count_ptr, keep, channels, stride_w, stride_in,
                       tl.program_id(0), BLOCK_K, BLOCK_W, HAS_COUNT)

    @triton.jit
    def _shift_windows_together_kernel(addr_ptr, like_ptr, path_ptr, n, count_ptr, keep, channels, pairs,
                                       BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, HAS_COUNT: tl.constexpr):
        # program_id(0) = pair; its window and inputs from the table, 16-byte aligned (`WindowTable.of` checks)
        ty = tl.pointer_type(like_ptr.dtype.element_ty)
        window = tl.multiple_of(tl.load(addr_ptr + tl.program_id(0)).to(ty), 16)
        inputs = tl.multiple_of(tl.load(addr_ptr + pairs + tl.program_id(0)).to(ty), 16)
        _shift_columns(window, inputs, path_ptr, n, count_ptr, keep, channels, channels, channels, tl.program_id(1),
                       BLOCK_K, BLOCK_W, HAS_COUNT)

    @triton.jit
    def _shift_columns(window_ptr, inputs_ptr, path_ptr, n, count_ptr, keep, channels, stride_w, stride_in, col_block,
                       BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, HAS_COUNT: tl.constexpr):
        """Column block `col_block` of one window."""
        if HAS_COUNT:  # a padded path: its live length is on the device
            n = tl.load(count_ptr)
        j = tl.arange(0, BLOCK_K)  # the new window's rows
        cols = col_block * BLOCK_W + tl.arange(0, BLOCK_W)
        live = j < keep
        at = n + j  # row of [window; inputs[path]] that becomes window row j
        from_window = live & (at < keep)
        from_path = live & (at >= keep)
        node = tl.load(path_ptr + (at - keep), mask=from_path, other=0)
        col_ok = (cols < channels)[None, :]
        old = tl.load(window_ptr + at[:, None] * stride_w + cols[None, :], mask=from_window[:, None] & col_ok)
        new = tl.load(inputs_ptr + node[:, None] * stride_in + cols[None, :], mask=from_path[:, None] & col_ok)
        values = tl.where(from_window[:, None], old, new.to(old.dtype))
        tl.debug_barrier()  # every old row read before the window is overwritten
        tl.store(window_ptr + j[:, None] * stride_w + cols[None, :], values, mask=live[:, None] & col_ok)
