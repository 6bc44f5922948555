"""Train a small qwen35-architecture target from scratch and export it as a GGUF.

Pipeline: Python corpus (`corpus.py`) -> byte-level BPE with Qwen's special tokens and ChatML
template (`train_bpe`) -> transformers' `Qwen3_5ForCausalLM` (hybrid Gated DeltaNet / gated
attention, Hk != Hv) trained with AdamW on random windows of the token stream -> GGUF through
`write_qwen35_gguf` with a llama-quantize style mix (Q4_K_M by default).

Dimensions default to multiples of 256 along every matrix's input axis, so K-quants apply.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from flashtree.formats.chat_template import ANSWER_FIRST_TEMPLATE
from flashtree.formats.quant_mix import quant_types
from flashtree.formats.tokenizer import Tokenizer, TokenizerSpec, pad_vocab, train_bpe
from flashtree.models.gguf_writer import write_qwen35_gguf
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.train.convert import gguf_tensors_from_hf, new_hf_model
from flashtree.train.corpus import Corpus, build_corpus

TARGET_FILE = "target.gguf"


@dataclass(frozen=True)
class TargetShape:
    vocab_size: int = 6144
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_dim: int = 16
    gdn_head_dim: int = 64
    gdn_qk_heads: int = 4
    gdn_v_heads: int = 8
    full_attention_interval: int = 4
    context_length: int = 8192
    tied: bool = True  # tied embedding / LM head (as Qwen3.5's small models); keeps the Q4_K_M file < 16 MiB

    def config(self, vocab_size: int | None = None, name: str = "flashtree-demo-qwen35") -> Qwen35Config:
        s = self
        return Qwen35Config(
            vocab_size=vocab_size or s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
            num_layers=s.num_layers, num_mtp_layers=0, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim, rope_dim=s.rope_dim, rope_theta=1e7, rms_eps=1e-6, attention_scale=s.head_dim**-0.5,
            recurrent_layers=tuple((i + 1) % s.full_attention_interval != 0 for i in range(s.num_layers)),
            conv_kernel=4, gdn_head_dim=s.gdn_head_dim, gdn_qk_heads=s.gdn_qk_heads, gdn_v_heads=s.gdn_v_heads,
            context_length=s.context_length, name=name,
        )


TINY_SHAPE = TargetShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=32, rope_dim=8, gdn_head_dim=16, gdn_qk_heads=2, gdn_v_heads=4,
                         tied=False)


@dataclass
class TrainConfig:
    steps: int = 2000
    time_budget_s: float | None = None  # stop early (and anneal the LR on time) when set
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.03
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 50


def build_tokenizer(corpus: Corpus, vocab_size: int, sample_chars: int = 8_000_000, seed: int = 0) -> TokenizerSpec:
    """BPE over a sample of documents and chat texts, padded to `vocab_size` (>= 1 unused id kept)."""
    rng = np.random.default_rng(seed)
    texts = corpus.documents + corpus.chat_texts()
    order = rng.permutation(len(texts))
    sample, total = [], 0
    for i in order:
        sample.append(texts[i])
        total += len(texts[i])
        if total >= sample_chars:
            break
    spec = train_bpe(sample, vocab_size - 8)
    # trained on answers only (corpus.render_pair): thinking is off unless asked for
    return replace(pad_vocab(spec, vocab_size), chat_template=ANSWER_FIRST_TEMPLATE)


def tokenize_stream(tokenizer: Tokenizer, texts: list[str], seed: int = 0) -> np.ndarray:
    """All texts in a seeded order, each followed by <|endoftext|>, as one int32 token stream."""
    sep = tokenizer.token_id("<|endoftext|>")
    order = np.random.default_rng(seed).permutation(len(texts))
    encoded = tokenizer.backend.encode_batch([texts[i] for i in order], add_special_tokens=False)
    parts = []
    for e in encoded:
        parts.append(np.asarray(e.ids, dtype=np.int32))
        parts.append(np.asarray([sep], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def lr_factor(progress: float, warmup: float, min_ratio: float) -> float:
    if progress < warmup:
        return max(progress / warmup, 1e-3)
    p = min((progress - warmup) / max(1 - warmup, 1e-9), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def train_lm(model, stream: np.ndarray, cfg: TrainConfig, device: torch.device,
             log: Callable[[str], None] = print) -> list[float]:
    """Next-token training on random windows of `stream`; returns the per-step losses."""
    model.to(device).train()
    gen = torch.Generator().manual_seed(cfg.seed)
    data = torch.from_numpy(stream.astype(np.int64))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    seq = min(cfg.seq_len, len(stream) - 1)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    losses, start = [], time.perf_counter()
    for step in range(cfg.steps):
        elapsed = time.perf_counter() - start
        progress = step / cfg.steps
        if cfg.time_budget_s:
            if elapsed >= cfg.time_budget_s:
                log(f"target: time budget reached after {step} steps")
                break
            progress = max(progress, elapsed / cfg.time_budget_s)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(progress, cfg.warmup, cfg.min_lr_ratio)
        starts = torch.randint(0, len(data) - seq, (cfg.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).to(device, non_blocking=True)
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            tok_s = (step + 1) * cfg.batch_size * seq / max(time.perf_counter() - start, 1e-9)
            log(f"target step {step} loss {losses[-1]:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{tok_s:,.0f} tok/s {time.perf_counter() - start:.0f}s")
    model.eval()
    return losses


def export_gguf(model, config: Qwen35Config, tokenizer: TokenizerSpec, path: str | Path, scheme: str = "q4_k_m") -> Path:
    tensors = gguf_tensors_from_hf(model, config)
    types = quant_types({k: v.shape for k, v in tensors.items()}, scheme)
    return write_qwen35_gguf(path, config, tensors, types, tokenizer)


def train_target(out_dir: str | Path, shape: TargetShape = TargetShape(), train: TrainConfig = TrainConfig(),
                 device: str = "cpu", roots=None, max_chars: int | None = 20_000_000, scheme: str = "q4_k_m",
                 corpus: Corpus | None = None, log: Callable[[str], None] = print) -> dict:
    """Corpus -> tokenizer -> trained model -> `out_dir/target.gguf`. Returns paths, model and losses."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device)
    if dev.type == "cpu":
        # the tokenizers thread pool, once used, fights torch's CPU threads (100x slower training steps)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.manual_seed(train.seed)
    t0 = time.perf_counter()
    corpus = corpus or build_corpus(roots, max_chars=max_chars, seed=train.seed)
    log(f"corpus: {len(corpus.documents)} files, {sum(map(len, corpus.documents)):,} chars, "
        f"{len(corpus.pairs)} instruction pairs ({time.perf_counter() - t0:.0f}s)")
    spec = build_tokenizer(corpus, shape.vocab_size, seed=train.seed)
    tokenizer = Tokenizer(spec)
    stream = tokenize_stream(tokenizer, corpus.documents + corpus.chat_texts(), seed=train.seed)
    log(f"tokenizer: {len(spec.tokens)} ids; stream {len(stream):,} tokens ({time.perf_counter() - t0:.0f}s)")
    config = shape.config(len(spec.tokens))
    model = new_hf_model(config, tied=shape.tied)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.1f}M parameters, layers {['D' if r else 'A' for r in config.recurrent_layers]}")
    losses = train_lm(model, stream, train, dev, log)
    model = model.float().cpu()
    path = export_gguf(model, config, spec, out / TARGET_FILE, scheme)
    summary = {"target": str(path), "bytes": path.stat().st_size, "params": n_params, "steps": len(losses),
               "final_loss": float(np.mean(losses[-20:])) if losses else None, "shape": asdict(shape),
               "train": asdict(train), "scheme": scheme, "stream_tokens": int(len(stream)),
               "seconds": round(time.perf_counter() - t0, 1)}
    (out / "target-train.json").write_text(json.dumps(summary, indent=2))
    log(f"target: wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return {"path": path, "model": model, "config": config, "tokenizer": spec, "losses": losses,
            "corpus": corpus, "summary": summary}
