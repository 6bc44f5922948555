"""KV cache storage types (torch reference, CPU or any device): F32, F16, BF16, Q8_0, Q4_0, TQ3_0.

The unit of quantization is one cache row: the `head_dim` values of one token in one KV head
(256 dims = 8 Q8_0/Q4_0 blocks of 32, or 2 TQ3_0 groups of 128). A quantized cache side is a
uint8 tensor `[kv_heads, capacity, row_bytes]` in the llama.cpp block layout, so moving rows with
fancy indexing (the tree commit) works exactly as for a float cache.

* Q8_0: 32 values -> fp16 scale d = amax/127 + 32 int8 (34 B, 8.5 bits/value).
* Q4_0: 32 values -> fp16 scale d = max/-8 (max = the value of largest magnitude) + 16 bytes of
  nibbles, byte j = q[j] | q[j+16] << 4, value = (q - 8) * d (18 B, 4.5 bits/value).
* TQ3_0: 128-value groups. n = |x|, u = x/n, r = s2 * H(s1 * u) with H the normalized 128-point
  Walsh-Hadamard transform and s1, s2 fixed +-1 vectors; each r_i -> nearest of 8 Lloyd-Max
  centroids +-{0.021460, 0.065717, 0.117832, 0.190685}; stored norm = n / |C[idx]| (fp16, repeated
  in each of the group's 4 blocks). Block (14 B per 32 values, 3.5 bits/value) = norm fp16 ·
  qs[8] (2-bit low index, element j at bits 2(j%4) of byte j/4) · signs[4] (high index bit,
  element j at bit j%8 of byte j/8). Index = low2 | hi << 2 with low2 = magnitude level and
  hi = 1 for a negative centroid (the spec fixes the bit layout, not the level order; this is ours).
  The sign vectors are our own fixed +-1 constants (not the fork's), so caches are not
  byte-compatible with the fork. Dequantization stays in the rotated domain: K.q is computed with
  q rotated forward, and the attention output over rotated V is rotated back (`rotate`,
  `unrotate`), so no un-rotated copy of the cache is ever made.
"""

from __future__ import annotations

import math

import torch

from flashtree.errors import FlashtreeError
from flashtree.formats.quants import device_constant


class KVType:
    """One storage format. `quantize` maps float rows [..., head_dim] to storage rows; `dequantize`
    maps them back to float values (in the rotated domain when `rotated`)."""

    name: str = ""
    rotated: bool = False
    row_multiple: int = 1  # head_dim must be a multiple of this

    def check(self, head_dim: int) -> None:
        if head_dim % self.row_multiple:
            raise FlashtreeError(f"KV cache type {self.name} needs head_dim to be a multiple of {self.row_multiple}, "
                                 f"got {head_dim}")

    def row_bytes(self, head_dim: int) -> int:
        raise NotImplementedError

    def bits_per_value(self) -> float:
        return 8.0 * self.row_bytes(256) / 256

    def allocate(self, heads: int, capacity: int, head_dim: int, device) -> torch.Tensor:
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"KVType({self.name})"


class FloatKV(KVType):
    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def row_bytes(self, head_dim: int) -> int:
        return head_dim * torch.finfo(self.dtype).bits // 8

    def allocate(self, heads, capacity, head_dim, device):
        return torch.zeros(heads, capacity, head_dim, device=device, dtype=self.dtype)

    def quantize(self, x):
        return x.to(self.dtype)

    def dequantize(self, rows, dtype=torch.float32):
        return rows.to(dtype)


class BlockKV(KVType):
    """Blocks of 32 values: fp16 scale first, then the payload, packed as uint8."""

    block_bytes: int = 0
    row_multiple = 32

    def row_bytes(self, head_dim: int) -> int:
        return head_dim // 32 * self.block_bytes

    def allocate(self, heads, capacity, head_dim, device):
        self.check(head_dim)
        return torch.zeros(heads, capacity, self.row_bytes(head_dim), device=device, dtype=torch.uint8)

    def quantize(self, x):
        self.check(x.shape[-1])
        blocks = x.float().reshape(*x.shape[:-1], -1, 32)
        scale, payload = self._encode(blocks)
        out = torch.cat([_f16_bytes(scale), payload], dim=-1)
        return out.reshape(*x.shape[:-1], -1)

    def dequantize(self, rows, dtype=torch.float32):
        blocks = rows.reshape(*rows.shape[:-1], -1, self.block_bytes)
        scale = _f16_from_bytes(blocks[..., :2])
        values = self._decode(scale, blocks[..., 2:])
        return values.reshape(*rows.shape[:-1], -1).to(dtype)


class Q8_0(BlockKV):
    name, block_bytes = "q8_0", 34

    def _encode(self, blocks):
        d = blocks.abs().amax(-1, keepdim=True) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = _round_away(blocks * inv).clamp(-127, 127).to(torch.int8)
        return d.squeeze(-1), q.view(torch.uint8)

    def _decode(self, scale, payload):
        return payload.contiguous().view(torch.int8).float() * scale[..., None]


class Q4_0(BlockKV):
    name, block_bytes = "q4_0", 18

    def _encode(self, blocks):
        index = blocks.abs().argmax(-1, keepdim=True)
        d = blocks.gather(-1, index) / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.floor(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8)
        return d.squeeze(-1), q[..., :16] | (q[..., 16:] << 4)

    def _decode(self, scale, payload):
        q = torch.cat([payload & 0x0F, payload >> 4], dim=-1).float()
        return (q - 8.0) * scale[..., None]


TQ3_GROUP = 128
TQ3_LEVELS = (0.021460, 0.065717, 0.117832, 0.190685)
TQ3_THRESHOLDS = (0.043589, 0.091775, 0.154259)


def _tq3_constants():
    gen = torch.Generator().manual_seed(0x7C3)  # our fixed sign vectors (any fixed +-1 vectors work)
    s1 = torch.randint(0, 2, (TQ3_GROUP,), generator=gen).float() * 2 - 1
    s2 = torch.randint(0, 2, (TQ3_GROUP,), generator=gen).float() * 2 - 1
    h = torch.ones(1, 1)
    while h.shape[0] < TQ3_GROUP:  # Sylvester construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(TQ3_GROUP)
    rotation = s2[:, None] * h * s1[None, :]  # R = diag(s2) H diag(s1), orthogonal
    return s1, s2, rotation


TQ3_S1, TQ3_S2, TQ3_ROTATION = _tq3_constants()
_ROTATIONS: dict[torch.device, torch.Tensor] = {}


def rotation_matrix(device) -> torch.Tensor:
    device = torch.device(device)
    if device not in _ROTATIONS:
        _ROTATIONS[device] = TQ3_ROTATION.to(device)
    return _ROTATIONS[device]


_SIGNS: dict[torch.device, torch.Tensor] = {}


def rotation_signs(device) -> torch.Tensor:
    """float32 [2, 128]: s1 and s2 of R = diag(s2) H diag(s1) (H normalized), for kernels that apply R as a
    fast Walsh-Hadamard transform."""
    device = torch.device(device)
    if device not in _SIGNS:
        _SIGNS[device] = torch.stack([TQ3_S1, TQ3_S2]).to(device)
    return _SIGNS[device]


def rotate(x: torch.Tensor) -> torch.Tensor:
    """R x per 128-value group of the last dim (R = diag(s2) H diag(s1)); float32 math, input dtype out."""
    g = x.float().reshape(*x.shape[:-1], -1, TQ3_GROUP)
    return (g @ rotation_matrix(x.device).T).reshape(x.shape).to(x.dtype)


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """R^T y per 128-value group: the inverse of `rotate` (s2, then H, then s1)."""
    g = y.float().reshape(*y.shape[:-1], -1, TQ3_GROUP)
    return (g @ rotation_matrix(y.device)).reshape(y.shape).to(y.dtype)


class TQ3_0(KVType):
    name, rotated, row_multiple = "tq3_0", True, TQ3_GROUP
    block_bytes = 14

    def row_bytes(self, head_dim):
        return head_dim // 32 * self.block_bytes

    def allocate(self, heads, capacity, head_dim, device):
        self.check(head_dim)
        return torch.zeros(heads, capacity, self.row_bytes(head_dim), device=device, dtype=torch.uint8)

    def codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index [..., groups, 128] int64 in 0..7, stored norm [..., groups] float32, fp16-rounded)."""
        self.check(x.shape[-1])
        g = x.float().reshape(*x.shape[:-1], -1, TQ3_GROUP)
        n = g.norm(dim=-1, keepdim=True)
        u = torch.where(n > 1e-30, g / n.clamp_min(1e-30), torch.zeros_like(g))
        r = u @ rotation_matrix(x.device).T
        thresholds = device_constant(tuple(TQ3_THRESHOLDS), torch.float32, x.device)
        level = torch.bucketize(r.abs(), thresholds)
        negative = (r < 0).long()
        index = level | (negative << 2)
        centroid_norm = self._centroids(x.device)[index].norm(dim=-1, keepdim=True)
        stored = (n / centroid_norm).squeeze(-1).to(torch.float16).float()
        return index, stored

    @staticmethod
    def _centroids(device) -> torch.Tensor:
        levels = device_constant(tuple(TQ3_LEVELS), torch.float32, device)
        return torch.cat([levels, -levels])  # index = level | negative << 2

    def quantize(self, x):
        index, norm = self.codes(x)
        blocks = index.reshape(*index.shape[:-1], 4, 32).to(torch.uint8)  # [..., groups, 4 blocks, 32]
        low = (blocks & 3).reshape(*blocks.shape[:-1], 8, 4)
        qs = (low << device_constant((0, 2, 4, 6), torch.uint8, x.device)).sum(-1, dtype=torch.uint8)
        hi = (blocks >> 2).reshape(*blocks.shape[:-1], 4, 8)
        signs = (hi << torch.arange(8, dtype=torch.uint8, device=x.device)).sum(-1, dtype=torch.uint8)
        norms = _f16_bytes(norm[..., None].expand(*norm.shape, 4))  # [..., groups, 4, 2]
        out = torch.cat([norms, qs, signs], dim=-1)  # [..., groups, 4, 14]
        return out.reshape(*x.shape[:-1], -1)

    def dequantize(self, rows, dtype=torch.float32):
        """Values in the rotated domain: C[idx] * norm. `unrotate` gives the original domain."""
        norm = _f16_from_bytes(rows.reshape(*rows.shape[:-1], -1, self.block_bytes)[..., :2])
        values = self._centroids(rows.device)[self.indices(rows)] * norm[..., None]
        return values.reshape(*rows.shape[:-1], -1).to(dtype)

    def indices(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 [..., blocks, 32]: each value's 3-bit index (low | hi << 2) from the rows' qs and sign bytes."""
        blocks = rows.reshape(*rows.shape[:-1], -1, self.block_bytes)
        qs, signs = blocks[..., 2:10], blocks[..., 10:14]
        low = (qs[..., :, None] >> device_constant((0, 2, 4, 6), torch.uint8, rows.device)) & 3
        hi = (signs[..., :, None] >> torch.arange(8, dtype=torch.uint8, device=rows.device)) & 1
        return low.reshape(*low.shape[:-2], 32).long() | (hi.reshape(*hi.shape[:-2], 32).long() << 2)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float [...] -> uint8 [..., 2] (little-endian fp16)."""
    return x.to(torch.float16).contiguous().unsqueeze(-1).view(torch.uint8)


def _f16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1).float()


KV_TYPES: dict[str, KVType] = {
    "f32": FloatKV("f32", torch.float32),
    "f16": FloatKV("f16", torch.float16),
    "bf16": FloatKV("bf16", torch.bfloat16),
    "q8_0": Q8_0(),
    "q4_0": Q4_0(),
    "tq3_0": TQ3_0(),
}
_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def kv_type(spec) -> KVType:
    """A KV type from a llama.cpp-style name (f16, bf16, f32, q8_0, q4_0, tq3_0), a torch float
    dtype, or a KVType."""
    if isinstance(spec, KVType):
        return spec
    if isinstance(spec, torch.dtype):
        if spec not in _DTYPE_NAMES:
            raise FlashtreeError(f"no KV cache type for dtype {spec}; choose one of {', '.join(KV_TYPES)}")
        return KV_TYPES[_DTYPE_NAMES[spec]]
    key = str(spec).strip().lower()
    if key not in KV_TYPES:
        raise FlashtreeError(f"unknown KV cache type {spec!r}; choose one of {', '.join(KV_TYPES)}")
    return KV_TYPES[key]
