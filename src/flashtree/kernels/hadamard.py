"""The TQ3_0 rotation inside Triton kernels, as a fast Walsh-Hadamard transform.

`kv_quant` rotates each 128-value group by R = diag(s2) H diag(s1) (H the normalized Sylvester Hadamard
matrix) as a product with the [128, 128] matrix: 64 KB read per group. Here R (`kv_quant.rotate`) and
R^T = diag(s1) H diag(s2) (`kv_quant.unrotate`) are 7 butterfly stages over values held in registers, the
signs read from `kv_quant.rotation_signs` (float32 [2, 128]: s1, s2). The butterflies add in another order
than the matrix product, so the two agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

try:  # kernels that run these need triton; kv_quant's torch forms do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None

if triton is not None:

    @triton.jit
    def rotate_row(x, signs_ptr, D: tl.constexpr, INVERSE: tl.constexpr):
        """R x (R^T x with INVERSE) for one row x [D] of float32, D a multiple of 128."""
        return tl.reshape(rotate_groups(tl.reshape(x, (D // 128, 128)), signs_ptr, D // 128, INVERSE), (D,))

    @triton.jit
    def rotate_groups(g, signs_ptr, G: tl.constexpr, INVERSE: tl.constexpr):
        """R g (R^T g with INVERSE) for each row of g [G, 128] (float32): the first sign vector, the 7 stages,
        then the second sign vector and 1 / sqrt(128)."""
        i = tl.arange(0, 128)
        first = tl.load(signs_ptr + (128 if INVERSE else 0) + i)
        second = tl.load(signs_ptr + (0 if INVERSE else 128) + i)
        g = g * first[None, :]
        for stage in tl.static_range(7):
            g = _butterflies(g, G, 1 << stage)
        return g * (second * 0.08838834764831845)[None, :]

    @triton.jit
    def _butterflies(g, G: tl.constexpr, H: tl.constexpr):
        """One Walsh-Hadamard stage over the rows of g [G, 128]: (a + b, a - b) for the pairs H apart."""
        a, b = tl.split(tl.permute(tl.reshape(g, (G, 64 // H, 2, H)), (0, 1, 3, 2)))
        return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (G, 128))
