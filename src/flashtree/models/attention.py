"""Gated full attention of qwen35 (every `full_attention_interval`-th layer).

attn_q rows hold, per head, [query (head_dim) ; output gate (head_dim)]; q and k get a per-head
RMSNorm, then NeoX RoPE on the first `rope_dim` dims; the attention output is multiplied by
sigmoid(gate) before attn_output.

KV rows are stored in the cache's KV types (quantized on write). With TQ3_0 keys the query is rotated
into the cache's rotated domain; with TQ3_0 values the attention output is rotated back. A window W > 0
limits each query at position p to keys at positions > p - W (applied to every forward, prefill
included, so speculative decoding stays equal to windowed autoregressive decoding); it changes output.

A prefill chunk over a quantized cache dequantizes the rows it attends to. Past `dequant_bytes` of them
(PREFILL_DEQUANT_BYTES; a 262K prefix of the 27B shape is 1 GiB per layer in bf16) a plain chunk attends to
the committed prefix piece by piece and merges the pieces' outputs by their log-sum-exp, which is exact up
to rounding, so the dequantized scratch stays bounded whatever the context.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from flashtree.models.cache import AttentionKV
from flashtree.formats.gguf_file import GGUFFile
from flashtree.kernels import attention_decode, triton_runs_on
from flashtree.kernels.activations import gated_heads
from flashtree.kernels.kv_dequant import dequantize_kv
from flashtree.kernels.kv_quant import FloatKV, unrotate
from flashtree.kernels.kv_write import write_kv
from flashtree.kernels.qk_norm_rope import norm_rope_into_cache, qk_norm_rope
from flashtree.kernels.tree_attention import MAX_TREE_QUERIES, tree_attention
from flashtree.models.layers import Linear, Projections, load_weight
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.models.step import Step

# The most dequantized K+V (compute dtype, one attention layer) a prefill chunk holds at once before it
# attends to the prefix in pieces: 16K rows of the 27B shape (4 KV heads x 256, bf16), so a 262K prefix takes
# sixteen pieces (four until 2026-12-04: 192 MiB of a 24 GiB card's memory for a few launches more a chunk, issue
# #20). The planner counts this bound (engine/planner.py).
PREFILL_DEQUANT_BYTES = 64 * 2**20


class GatedAttention:
    def __init__(self, config: Qwen35Config, q: Linear, k: Linear, v: Linear, out: Linear, q_norm, k_norm,
                 dequant_bytes: int = PREFILL_DEQUANT_BYTES, dtype: torch.dtype | None = None):
        self.config = config
        # the attention operands' dtype, the model's (None: the projections' output dtype). In a bf16 model the
        # activations are float32 and attention alone stays bf16: the kernel takes float32 q and gate and
        # multiplies in bf16 (`operands`), K/V are rounded on their write to the cache, the output is float32
        # (docs/FIDELITY.md, design D); the dequantized prefill path casts q and its output
        self.dtype = dtype
        self.dequant_bytes = dequant_bytes  # dequantized K+V a prefill chunk holds at once (see the module doc)
        self.inputs = Projections.separate([q, k, v])  # one matmul once `fuse`d
        self.out = out
        self.q_norm, self.k_norm = q_norm, k_norm

    def fuse(self) -> None:
        self.inputs = self.inputs.fused()

    @classmethod
    def load(cls, gguf: GGUFFile, prefix: str, config: Qwen35Config, dtype, device) -> "GatedAttention":
        c, hd = config, config.head_dim
        return cls(
            c,
            Linear.load(gguf, f"{prefix}.attn_q.weight", 2 * c.num_heads * hd, c.hidden_size, dtype, device),
            Linear.load(gguf, f"{prefix}.attn_k.weight", c.num_kv_heads * hd, c.hidden_size, dtype, device),
            Linear.load(gguf, f"{prefix}.attn_v.weight", c.num_kv_heads * hd, c.hidden_size, dtype, device),
            Linear.load(gguf, f"{prefix}.attn_output.weight", c.hidden_size, c.num_heads * hd, dtype, device),
            load_weight(gguf, f"{prefix}.attn_q_norm.weight", (hd,), torch.float32, device),
            load_weight(gguf, f"{prefix}.attn_k_norm.weight", (hd,), torch.float32, device),
            dtype=dtype,
        )

    def __call__(self, x: torch.Tensor, step: Step, kv: AttentionKV) -> torch.Tensor:
        c = self.config
        n = x.shape[0]
        qg, k, v = self.inputs(x)
        activations, operands = qg.dtype, self.dtype or qg.dtype
        qg = qg.reshape(n, c.num_heads, 2, c.head_dim)
        raw_q, gate = qg[:, :, 0], qg[:, :, 1]
        cos, sin = step.rope(c.rope_dim, c.rope_theta)
        k, v = k.reshape(n, c.num_kv_heads, c.head_dim), v.reshape(n, c.num_kv_heads, c.head_dim)
        if type(kv.type_k) is FloatKV and type(kv.type_v) is FloatKV:  # written as cast values: one launch
            # (the exact type: a subclass may store something else than the cast, e.g. the tests' round trips)
            norm_rope_into_cache(k, v, self.k_norm, c.rms_eps, cos, sin, kv.k, kv.v, step.slots)
        else:  # quantized: one launch quantizes both, k's norm and RoPE included
            write_kv(k, v, kv.k, kv.v, step.slots, kv.type_k, kv.type_v, k_norm=(self.k_norm, c.rms_eps, cos, sin))
        if _reads_cache_in_place(step, kv, raw_q.transpose(0, 1)):
            # one launch: q's norm and RoPE at the kernel's load (not for TQ3_0 keys: one `qk_norm_rope` launch
            # norms, ropes and rotates their q; nor for a verify's float32 query, `_query_normed_apart`, nor for a
            # decode the CUDA kernel may take, `_decodes_in_cuda`), TQ3_0 values rotated back and the output gate at
            # its store
            fused_q = (not kv.type_k.rotated and not _query_normed_apart(n, activations, operands)
                       and not _decodes_in_cuda(n, kv, step.kv_end))
            if fused_q:
                q = raw_q.transpose(0, 1)
            else:  # TQ3_0 keys: rotated as well, in float32; a verify's float32 query: rounded to the operands
                q = qk_norm_rope(raw_q, self.q_norm, c.rms_eps, cos, sin, rotated=kv.type_k.rotated,
                                 out_dtype=activations if kv.type_k.rotated else operands).transpose(0, 1)
            # q and the gate in the activations' dtype, the MMAs' operands in the model's; the output in the
            # activations'
            return self.out(tree_attention(q, kv.k, kv.v, kv.type_k, kv.type_v, step.start_tensor(), step.visible,
                                           step.positions, step.kv_end, c.attention_scale, kv.window, gate=gate,
                                           q_norm=(self.q_norm, c.rms_eps, cos, sin) if fused_q else None,
                                           unrotate_values=True, operands=operands, out_dtype=activations))
        # TQ3_0 keys: R orthogonal, (Rq).(Rk) = q.k, so K is used as stored
        q = qk_norm_rope(raw_q, self.q_norm, c.rms_eps, cos, sin, rotated=kv.type_k.rotated).transpose(0, 1)
        out = self._attend_dequantized(q.to(operands), step, kv).to(activations)  # [heads, n, hd]
        if kv.type_v.rotated:  # softmax(.) @ (R v) = R (softmax(.) @ v): rotate the output back
            out = unrotate(out)
        return self.out(gated_heads(out, gate))

    def _attend_dequantized(self, q, step: Step, kv: AttentionKV):
        """Attention over the cache rows dequantized to q's dtype (the rotated domain for TQ3_0): all the
        visible rows at once, or, for a plain chunk whose rows would take more than `dequant_bytes`, in pieces."""
        lo = step.first_row(kv.window)
        piece = _piece_rows(kv, q, self.dequant_bytes)
        if step.kv_end - lo > piece and _plain_run(step, lo, kv.window, q) and q.device.type in _LSE_DEVICES:
            out = self._attend_in_pieces(q, step, kv, piece)
            if out is not None:
                return out
        keys = dequantize_kv(kv.k[:, lo : step.kv_end], kv.type_k, q.dtype)
        values = dequantize_kv(kv.v[:, lo : step.kv_end], kv.type_v, q.dtype)
        return self._attend(q, keys, values, step, lo, kv.window)

    def _attend_in_pieces(self, q, step: Step, kv: AttentionKV, piece: int):
        """A plain chunk's attention with at most `piece` prefix rows (or the chunk's own rows) dequantized at
        a time: the chunk over its own rows (causal; square, so upper-left and lower-right agree), then over
        each piece of the committed prefix (all visible), the outputs merged by their log-sum-exp in float32.
        None where the flash kernel does not take these operands (the caller then attends to all rows at once)."""
        scale = self.config.attention_scale
        keys = dequantize_kv(kv.k[:, step.start : step.kv_end], kv.type_k, q.dtype)
        values = dequantize_kv(kv.v[:, step.start : step.kv_end], kv.type_v, q.dtype)
        if not _flash_takes(q, keys, values) or q.shape[-1] % 8:  # the op itself takes no head dim to pad
            return None
        out, lse = _attention_with_lse(q, keys, values, scale, causal=True)
        acc = out.float()  # float32 [heads, T, hd]: the merged output, weighted by its pieces' share
        for first in range(0, step.start, piece):
            del keys, values  # the last piece's scratch goes before the next one is made: one piece at a time
            last = min(first + piece, step.start)
            keys = dequantize_kv(kv.k[:, first:last], kv.type_k, q.dtype)
            values = dequantize_kv(kv.v[:, first:last], kv.type_v, q.dtype)
            out, part_lse = _attention_with_lse(q, keys, values, scale, causal=False)
            total = torch.logaddexp(lse, part_lse)
            acc.mul_((lse - total).exp()[..., None]).addcmul_(out.float(), (part_lse - total).exp()[..., None])
            lse = total
        return acc.to(q.dtype)

    def _attend(self, q, keys, values, step: Step, lo: int, window: int):
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if _plain_prefill(step, lo, window, q, keys, values):
            # a prompt chunk after the whole cache: causal aligned to the last key, which the fused flash
            # kernel takes without a [T, kv] mask, and K/V shared by each query group instead of copied:
            # at 256K context those copies would be ~6 GB per layer
            with _flash_on_cuda(q):
                return F.scaled_dot_product_attention(q[None], keys[None], values[None],
                                                      attn_mask=causal_lower_right(q.shape[1], keys.shape[1]),
                                                      scale=self.config.attention_scale, enable_gqa=True)[0]
        mask = step.attention_mask(lo, window)
        if q.device.type == "cpu" and _SDPA_GQA:
            # the grouped K/V read in place: the demo target's 23-token verify over 1.2K rows takes 0.35 ms a
            # layer instead of 1.15 with per-group copies (this VM, 2 threads, 2026-12-06); AR and verify both
            # come here on the CPU, so they keep sharing one kernel
            return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                                  scale=self.config.attention_scale, enable_gqa=True)[0]
        # repeat_interleave copies K/V per query group; the broadcast-view variant saves that memory but
        # changed bf16 results on CUDA beyond the test tolerance (2026-11-29) and waits for a GPU check.
        group = self.config.num_heads // self.config.num_kv_heads
        keys = keys.repeat_interleave(group, dim=0)
        values = values.repeat_interleave(group, dim=0)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.config.attention_scale)


def _reads_cache_in_place(step: Step, kv: AttentionKV, q) -> bool:
    """The Triton kernel reads the cache as stored for every graphed step (its masks and padding are the
    kernel's) and for short eager runs over a quantized cache. Longer chunks are dequantized once
    (`dequantize_kv`) into SDPA's flash kernel: at hundreds of queries the tree kernel is ~10x slower."""
    if not triton_runs_on(q.device) or q.shape[1] > MAX_TREE_QUERIES:
        return False
    return step.graphed or not (isinstance(kv.type_k, FloatKV) and isinstance(kv.type_v, FloatKV))


def _plain_prefill(step: Step, lo: int, window: int, q, keys, values) -> bool:
    """A run of several new tokens that sees every committed row (no tree, window or graph padding), on
    the CPU or where CUDA's flash kernel takes it: elsewhere (float32, old GPUs) PyTorch would build the
    lower-right mask and, with grouped K/V, fall back to materialising every attention score."""
    return _plain_run(step, lo, window, q) and _flash_takes(q, keys, values)


def _query_normed_apart(tokens: int, activations: torch.dtype, operands: torch.dtype) -> bool:
    """Whether a call of several tokens norms and ropes its float32 query in a launch of its own (`qk_norm_rope`, stored
    as the bf16 operand) instead of at the attention kernel's load (FLASHTREE_QUERY_NORM_APART=0 keeps it fused; float16
    operands keep it too: the kernel clamps a query to float16's range before rounding it). Fused, a verify's 64-row
    query tile holds the float32 query and compiles to 2144 bytes a thread of stack (offline sm_90, 2026-12-06), in the
    prologue of every split. H100, thirtieth session: 23 queries over 1K bf16 rows 51.5 -> 18.7 us, over 8K 84.8 -> 41.3
    us (`sweep_tree_attention.py --compare --float32-query`); the 27B verify-22 12.97 -> 12.47 ms, its attention 0.790
    -> 0.214 ms. A decode's 16-row tile does not spill: it stays fused (one launch fewer)."""
    return (tokens > 1 and activations == torch.float32 and operands == torch.bfloat16
            and os.environ.get("FLASHTREE_QUERY_NORM_APART", "1") == "1")


def _decodes_in_cuda(tokens: int, kv: AttentionKV, kv_end: int) -> bool:
    """Whether a call of one token over `kv_end` rows of `kv` may take `attention_decode`'s CUDA kernel, which reads a
    query normed and roped before it: over Q8_0 rows a `qk_norm_rope` launch of its own (TQ3_0's query is normed apart
    anyway, to be rotated); below the kernel's `MIN_ROWS` the Triton decode norms it at its load."""
    return (tokens == 1 and kv.k.is_cuda and kv_end >= attention_decode.MIN_ROWS
            and kv.type_k.name == kv.type_v.name in attention_decode.KINDS)


def _plain_run(step: Step, lo: int, window: int, q) -> bool:
    """Several new tokens, causal among themselves, after every committed row: no tree, window or graph
    padding."""
    return q.shape[1] > 1 and not step.is_tree and not step.graphed and lo == 0 and window == 0 and _SDPA_GQA


def _flash_on_cuda(q):
    """A square chunk (its queries are all the keys: a prompt's first) through the flash kernel the later
    chunks take (`causal_lower_right` sends those to it directly). The dispatcher would choose cuDNN for it,
    whose first call in a process cost ~1.2 s of the 27B shape's first token on the H200 (2026-12-02 cold-start
    profile; benchmarks/sdpa_first_call.py)."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if q.device.type == "cuda" else nullcontext()


def _flash_takes(q, keys, values) -> bool:
    """The CPU, or CUDA's flash kernel takes these operands (unmasked, grouped K/V). None of the constraints
    it checks depends on the number of key rows, so any piece of the rows answers for all of them."""
    if q.device.type != "cuda":
        return True
    params = torch.backends.cuda.SDPAParams(q[None], keys[None], values[None], None, 0.0, False, True)
    return torch.backends.cuda.can_use_flash_attention(params, False)


def _piece_rows(kv: AttentionKV, q, dequant_bytes: int) -> int:
    """Cache rows whose dequantized K and V fit in `dequant_bytes`; unbounded when neither side is copied
    (a float cache in q's dtype is read as it is). At least one row."""
    itemsize = q.element_size() * q.shape[-1] * kv.k.shape[0]
    per_row = sum(itemsize for t in (kv.type_k, kv.type_v) if not (isinstance(t, FloatKV) and t.dtype == q.dtype))
    return max(1, dequant_bytes // per_row) if per_row else sys.maxsize


def _attention_with_lse(q, keys, values, scale: float, causal: bool):
    """Flash attention of [heads, T, hd] queries over grouped [kv_heads, S, hd] K/V -> (output [heads, T, hd]
    in q's dtype, float32 [heads, T] log-sum-exp of each query's scaled scores), which the pieces are merged
    by. The public function returns no log-sum-exp; these are the kernels it dispatches to (on CUDA the very
    call `causal_lower_right` makes for the whole-prefix path; `is_causal` is lower-right there)."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q[None], keys[None], values[None], 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], keys[None], values[None], 0.0, causal, scale=scale)
    return out[0], lse.reshape(q.shape[:2]).float()


# the devices `_attention_with_lse` has a kernel for (elsewhere a chunk attends to all its rows at once)
_LSE_DEVICES = ("cpu", "cuda")
# torch >= 2.5 takes grouped K/V in scaled_dot_product_attention (enable_gqa); older torch copies them
_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)
