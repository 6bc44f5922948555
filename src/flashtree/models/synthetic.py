"""Random qwen35 weights in GGUF layout and conventions, for tests and benchmarks.

Conventions match what the llama.cpp converter writes: norm weights are final multipliers (around 1),
ssm_a = -exp(A_log) < 0, ssm_conv1d is [conv_dim, kernel], value-side heads are in tiled order
(irrelevant for random values, but the tensor names and shapes are the real ones).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from flashtree.formats.quant_mix import quant_types
from flashtree.formats.tokenizer import pad_vocab, train_bpe
from flashtree.models.gguf_writer import write_qwen35_gguf
from flashtree.models.qwen35_config import Qwen35Config


def tiny_config(**overrides) -> Qwen35Config:
    """A small config with every structural feature of the real one (Hk != Hv, partial RoPE, GQA)."""
    base = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_mtp_layers=0,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_dim=8, rope_theta=1e7, rms_eps=1e-6,
        attention_scale=32**-0.5, recurrent_layers=(True, True, True, False), conv_kernel=4,
        gdn_head_dim=16, gdn_qk_heads=2, gdn_v_heads=4, context_length=4096, name="tiny-qwen35",
    )
    base.update(overrides)
    if "num_layers" in overrides and "recurrent_layers" not in overrides:
        base["recurrent_layers"] = tuple((i + 1) % 4 != 0 for i in range(base["num_layers"]))
    if "head_dim" in overrides and "attention_scale" not in overrides:
        base["attention_scale"] = base["head_dim"] ** -0.5
    return Qwen35Config(**base)


def tensor_shapes(config: Qwen35Config, tied: bool = False) -> dict[str, tuple[int, ...]]:
    c = config
    d, hd = c.hidden_size, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab_size, d), "output_norm.weight": (d,)}
    if not tied:
        shapes["output.weight"] = (c.vocab_size, d)
    for i in range(c.num_layers):
        p = f"blk.{i}"
        shapes.update({f"{p}.attn_norm.weight": (d,), f"{p}.post_attention_norm.weight": (d,),
                       f"{p}.ffn_gate.weight": (c.intermediate_size, d), f"{p}.ffn_up.weight": (c.intermediate_size, d),
                       f"{p}.ffn_down.weight": (d, c.intermediate_size)})
        if c.recurrent_layers[i]:
            hv = c.gdn_v_heads
            shapes.update({f"{p}.attn_qkv.weight": (c.conv_dim, d), f"{p}.attn_gate.weight": (c.gdn_value_dim, d),
                           f"{p}.ssm_beta.weight": (hv, d), f"{p}.ssm_alpha.weight": (hv, d),
                           f"{p}.ssm_conv1d.weight": (c.conv_dim, c.conv_kernel), f"{p}.ssm_dt.bias": (hv,),
                           f"{p}.ssm_a": (hv,), f"{p}.ssm_norm.weight": (c.gdn_head_dim,),
                           f"{p}.ssm_out.weight": (d, c.gdn_value_dim)})
        else:
            shapes.update({f"{p}.attn_q.weight": (2 * c.num_heads * hd, d), f"{p}.attn_k.weight": (c.num_kv_heads * hd, d),
                           f"{p}.attn_v.weight": (c.num_kv_heads * hd, d), f"{p}.attn_output.weight": (d, c.num_heads * hd),
                           f"{p}.attn_q_norm.weight": (hd,), f"{p}.attn_k_norm.weight": (hd,)})
    return shapes


def random_tensors(config: Qwen35Config, seed: int = 0, tied: bool = False, logit_scale: float = 4.0) -> dict[str, np.ndarray]:
    """Random weights with sane magnitudes: activations stay O(1) through any depth."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(config, tied).items():
        out[name] = init_values(rng, name, shape).astype(np.float32)
    head = "token_embd.weight" if tied else "output.weight"
    out[head] = out[head] * (logit_scale if not tied else 1.0)
    return out


def init_std(name: str, shape: tuple[int, ...]) -> float | None:
    """Std of the zero-mean Gaussian a tensor starts as (before any LM-head `logit_scale`), or None for
    the tensors with a recipe of their own (ssm_a, ssm_dt.bias, norms: see `init_values`)."""
    if name.endswith(("ssm_a", "ssm_dt.bias")) or "norm" in name:
        return None
    return 1.0 / _divisor(name, shape)


def _divisor(name: str, shape: tuple[int, ...]) -> float:
    # token_embd is unit Gaussian; every matrix and the conv kernel are scaled by 1/sqrt(fan-in)
    return 1.0 if name == "token_embd.weight" else float(np.sqrt(shape[-1]))


def init_values(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor's random values (float64) by its kind; `init_std` gives the std of the Gaussian ones."""
    if name.endswith("ssm_a"):
        return -np.exp(rng.uniform(np.log(0.05), np.log(4.0), shape))
    if name.endswith("ssm_dt.bias"):
        return rng.uniform(-1.0, 1.0, shape)
    if "norm" in name:
        return 1.0 + 0.1 * rng.standard_normal(shape)
    return rng.standard_normal(shape) / _divisor(name, shape)


_CORPUS = '''def fib(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fib(n - 1) + fib(n - 2)

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

for i in range(10):
    print(i, fib(i))
The quick brown fox jumps over the lazy dog. 你好，世界！ Ünïcödé ✓ 🚀 emoji and    spaces\t\ttabs
import os, sys, json
data = {"name": "flashtree", "version": 1, "tags": ["fast", "tree"]}
print(json.dumps(data, indent=2))
'''


def synthetic_tokenizer(vocab_size: int = 400):
    """A small byte-level BPE with Qwen's special tokens and a ChatML template, trained on a fixed text."""
    return train_bpe([_CORPUS] * 4, vocab_size)


def write_synthetic_gguf(path, config: Qwen35Config | None = None, scheme: str = "f32", tied: bool = False,
                         seed: int = 0, qtypes=None, tokenizer=None):
    """A random-weight qwen35 GGUF with a real tokenizer, padded like Qwen's to the model's vocab size."""
    tokenizer = tokenizer or synthetic_tokenizer()
    config = config or tiny_config()
    if config.vocab_size < len(tokenizer.tokens):
        config = replace(config, vocab_size=len(tokenizer.tokens))
    tokenizer = pad_vocab(tokenizer, config.vocab_size)
    tensors = random_tensors(config, seed=seed, tied=tied)
    types = quant_types({k: v.shape for k, v in tensors.items()}, scheme)
    types.update(qtypes or {})
    return write_qwen35_gguf(path, config, tensors, types, tokenizer)

