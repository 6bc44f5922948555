"""A random-weight qwen35 model built directly in device memory, with no GGUF file in between.

`RandomWeights` looks to `Qwen35Model.load` like a `GGUFFile`: the real tensor names and shapes of a
config, the per-tensor quant types of a scheme (`quant_mix.quant_types`, e.g. the Q4_K_M mix) and valid
block bytes for each. Quantized tensors are gathered on the device from a small pool of blocks that
`quants.quantize` encoded once (per quant type and scale), so a 27B model (~15 GB of Q4_K_M) takes
seconds on a GPU and little host memory. Float tensors follow `synthetic.random_tensors`' recipes.
Bytes are a function of (seed, tensor name, device type): asking twice gives the same tensor.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.formats.gguf_file import TensorInfo
from flashtree.formats.quant_mix import quant_types
from flashtree.formats.quants import bytes_for, quantize
from flashtree.formats.tokenizer import pad_vocab
from flashtree.models.gguf_config import check_tensor_types
from flashtree.models.gguf_writer import write_qwen35_gguf
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.models.synthetic import init_std, init_values, synthetic_tokenizer, tensor_shapes, tiny_config

# Overrides of `tiny_config` per named shape (qwen35-gguf-format.md 1.2 for the real models).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(),
    "qwen3.5-0.8b": dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_layers=24, num_heads=8,
                         num_kv_heads=2, head_dim=256, rope_dim=64, gdn_head_dim=128, gdn_qk_heads=16,
                         gdn_v_heads=16, context_length=262144, name="qwen3.5-0.8b"),
    "qwen3.6-27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_layers=64, num_heads=24,
                        num_kv_heads=4, head_dim=256, rope_dim=64, rope_theta=1e7, rms_eps=1e-6, conv_kernel=4,
                        gdn_head_dim=128, gdn_qk_heads=16, gdn_v_heads=48, context_length=262144,
                        name="qwen3.6-27b"),
}

POOL_BLOCKS = 4096  # distinct quantized blocks per (quant type, scale)
# `echo` models: the token embedding's scale over the unit Gaussian. The residual stream of 128 random
# sublayers on normalized inputs grows to an rms of ~10; at 64 the embedding still points the final
# hidden state at the current token's own (tied) LM-head row, by a margin no rounding can flip.
ECHO_EMBED_SCALE = 64.0
_CHUNK_BLOCKS = 1 << 22  # blocks (or float elements) generated per step: bounds the index temporaries
_PLAIN = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}


def shape_config(name: str, **overrides) -> Qwen35Config:
    """The config of a named shape (`SHAPES`), with `overrides` (e.g. context_length) applied."""
    if name not in SHAPES:
        raise FlashtreeError(f"unknown model shape {name!r}; choose one of {', '.join(SHAPES)}")
    return tiny_config(**{**SHAPES[name], **overrides})


def _stable_seed(seed: int, *keys: object) -> int:
    """A 63-bit seed from `seed` and keys, the same in every process (unlike hash())."""
    h = zlib.crc32(repr((int(seed),) + keys).encode())
    return (int(seed) * 0x9E3779B1 + h) % (1 << 63)


class RandomWeights:
    """Read-only, GGUF-like source of random qwen35 tensors on `device` (see the module docstring).

    `tensors`, `tensor(name)`, `raw(name)`, `path` and `get(key, default)` are what the model loader
    uses of a `GGUFFile`. `qtypes` overrides the scheme's type of individual tensors.

    `echo`: a decisive model for benchmarks at real shapes. The LM head is tied to a token embedding
    scaled by ECHO_EMBED_SCALE and stored in the type the scheme gives the LM head (so a step reads the
    same bytes), so the greedy next token is always the current token, by a wide margin. Acceptance in
    a replay and greedy identity then do not hinge on rounding, which on an ordinary random model
    flips near-ties between differently shaped but equally valid computations; the price is that such
    identity checks test bookkeeping (positions, rollback, cache restore), not numerics."""

    def __init__(self, config: Qwen35Config, scheme: str = "q4_k_m", device: str | torch.device = "cpu",
                 seed: int = 0, tied: bool = False, logit_scale: float = 4.0,
                 qtypes: dict[str, QType] | None = None, pool_blocks: int = POOL_BLOCKS, echo: bool = False):
        self.config, self.scheme, self.seed = config, scheme, int(seed)
        self.device = torch.device(device)
        self.tied, self.logit_scale, self.pool_blocks, self.echo = tied or echo, logit_scale, pool_blocks, echo
        kind = "echo " if echo else ""
        self.path = f"<random {kind}{config.name} {scheme} seed {seed}>"
        self.metadata: dict[str, Any] = {}
        shapes = tensor_shapes(config, self.tied)
        types = quant_types(shapes, scheme)
        if echo:  # the tied head keeps the LM head's type of the scheme
            types["token_embd.weight"] = quant_types(tensor_shapes(config, False), scheme)["output.weight"]
        types.update(qtypes or {})
        self.tensors: dict[str, TensorInfo] = {
            name: TensorInfo(name, QType(types[name]), tuple(shape), 0, bytes_for(types[name], shape))
            for name, shape in shapes.items()
        }
        self._pools: dict[tuple[QType, float], torch.Tensor] = {}  # small: pool_blocks x type_size bytes each

    def write_gguf(self, path, tokenizer_spec) -> Path:
        """These exact bytes as a real GGUF file (for tools that read files, e.g. a transformers peer)."""
        arrays, types = {}, {}
        plain = {QType.F32: np.float32, QType.F16: np.float16}
        for name, info in self.tensors.items():
            raw = self.raw(name).cpu().numpy()
            if info.qtype in plain:
                arrays[name] = raw.view(plain[info.qtype]).reshape(info.shape)
            else:
                arrays[name] = raw.reshape(math.prod(info.shape[:-1]), -1)
            types[name] = info.qtype
        return write_qwen35_gguf(path, self.config, arrays, types, tokenizer_spec)

    def __repr__(self) -> str:
        return f"RandomWeights({self.path}, {len(self.tensors)} tensors, {self.nbytes() / 1e9:.2f} GB on {self.device})"

    def get(self, key: str, default: Any = None) -> Any:
        return default

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise FlashtreeError(f"{self.path}: tensor {name!r} is missing")
        return self.tensors[name]

    def nbytes(self, exclude: tuple[str, ...] = ()) -> int:
        """Total stored bytes of the tensors (no bytes are generated)."""
        return sum(t.nbytes for t in self.tensors.values() if t.name not in exclude)

    def std(self, name: str) -> float | None:
        """The Gaussian std tensor `name` is drawn with, or None for the recipe tensors (norms, ssm_a, dt bias)."""
        info = self.tensor(name)
        std = init_std(name, info.shape)
        if std is not None and name == "output.weight" and not self.tied:
            std *= self.logit_scale  # as random_tensors: a sharper LM head
        if std is not None and name == "token_embd.weight" and self.echo:
            std *= ECHO_EMBED_SCALE
        return std

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes: uint8 [nbytes] on the device, generated afresh on every call."""
        info = self.tensor(name)
        std = self.std(name)
        if std is None:
            return self._recipe_bytes(info)
        if info.qtype in _PLAIN:
            return self._gaussian_bytes(info, std)
        return self._pooled_bytes(info, std)

    def _generator(self, name: str) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(_stable_seed(self.seed, "tensor", name))
        return gen

    def _recipe_bytes(self, info: TensorInfo) -> torch.Tensor:
        """Small tensors with their own recipe (norms, ssm_a, ssm_dt.bias), drawn on the host."""
        rng = np.random.default_rng(_stable_seed(self.seed, "tensor", info.name))
        values = init_values(rng, info.name, info.shape).astype(np.float32)
        if info.qtype in _PLAIN:
            out = torch.from_numpy(values).to(_PLAIN[info.qtype]).reshape(-1).view(torch.uint8)
        else:
            out = torch.from_numpy(quantize(values.reshape(-1, info.shape[-1]), info.qtype).reshape(-1))
        return out.to(self.device)

    def _gaussian_bytes(self, info: TensorInfo, std: float) -> torch.Tensor:
        """A float-typed Gaussian tensor (matrices of the f32/f16/bf16 schemes), drawn on the device."""
        out = torch.empty(info.nbytes, dtype=torch.uint8, device=self.device)
        values = out.view(_PLAIN[info.qtype])
        gen = self._generator(info.name)
        for start in range(0, values.numel(), _CHUNK_BLOCKS):
            n = min(_CHUNK_BLOCKS, values.numel() - start)
            chunk = torch.randn(n, generator=gen, device=self.device, dtype=torch.float32)
            values[start : start + n] = (chunk * std).to(values.dtype)
        return out

    def _pooled_bytes(self, info: TensorInfo, std: float) -> torch.Tensor:
        """A quantized Gaussian tensor: random rows of the (qtype, std) block pool, gathered on the device."""
        pool = self._pool(info.qtype, std)
        type_size = pool.shape[1]
        n_blocks = info.nbytes // type_size
        out = torch.empty(n_blocks, type_size, dtype=torch.uint8, device=self.device)
        gen = self._generator(info.name)
        for start in range(0, n_blocks, _CHUNK_BLOCKS):
            n = min(_CHUNK_BLOCKS, n_blocks - start)
            idx = torch.randint(0, pool.shape[0], (n,), generator=gen, device=self.device)
            torch.index_select(pool, 0, idx, out=out[start : start + n])
        return out.reshape(-1)

    def _pool(self, qtype: QType, std: float) -> torch.Tensor:
        key = (qtype, float(std))
        if key not in self._pools:
            block = GGML_QUANT_SIZES[qtype][0]
            rng = np.random.default_rng(_stable_seed(self.seed, "pool", qtype.name, repr(float(std))))
            values = (rng.standard_normal((self.pool_blocks, block)) * std).astype(np.float32)
            self._pools[key] = torch.from_numpy(quantize(values, qtype)).to(self.device)
        return self._pools[key]


def random_source(shape: str | Qwen35Config, scheme: str, device: torch.device, seed: int = 0, tokenizer=None,
                  **weight_options) -> tuple[Qwen35Config, RandomWeights, Any]:
    """(config, weights, tokenizer spec) of a random model of a named shape (`SHAPES`) or config: the
    synthetic tokenizer (or `tokenizer`) padded to the vocabulary, as `write_synthetic_gguf` does. The
    loader builds the model from them (flashtree.engine.loader.random_target)."""
    config = shape_config(shape) if isinstance(shape, str) else shape
    spec = tokenizer or synthetic_tokenizer()
    if config.vocab_size < len(spec.tokens):
        config = replace(config, vocab_size=len(spec.tokens))
    weights = RandomWeights(config, scheme, device, seed=seed, **weight_options)
    check_tensor_types(weights, config)
    return config, weights, pad_vocab(spec, config.vocab_size)
