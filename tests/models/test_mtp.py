"""A GGUF that carries an MTP block after the trunk loads, and the MTP block does not change the trunk."""

from dataclasses import replace

import numpy as np
import torch

from flashtree.engine.loader import load_target
from flashtree.models.gguf_writer import write_qwen35_gguf
from flashtree.models.synthetic import random_tensors, tensor_shapes, tiny_config


def test_mtp_block_is_recognised_and_skipped(tmp_path, tokenizer_spec):
    config = tiny_config(vocab_size=len(tokenizer_spec.tokens))
    tensors = random_tensors(config, seed=3)
    plain = write_qwen35_gguf(tmp_path / "plain.gguf", config, tensors, None, tokenizer_spec)

    with_mtp = dict(tensors)
    n = config.num_layers
    attention_layer = {k.replace("blk.3.", f"blk.{n}."): v for k, v in tensors.items() if k.startswith("blk.3.")}
    with_mtp.update(attention_layer)
    rng = np.random.default_rng(0)
    d = config.hidden_size
    with_mtp[f"blk.{n}.nextn.eh_proj.weight"] = rng.standard_normal((d, 2 * d)).astype(np.float32)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        with_mtp[f"blk.{n}.nextn.{norm}.weight"] = np.ones(d, np.float32)
    mtp_config = replace(config, num_mtp_layers=1)
    mtp = write_qwen35_gguf(tmp_path / "mtp.gguf", mtp_config, with_mtp, None, tokenizer_spec)

    a, b = load_target(plain, device="cpu"), load_target(mtp, device="cpu")
    assert b.config.num_layers == n and b.config.num_mtp_layers == 1 and b.gguf.get("qwen35.block_count") == n + 1
    ids = torch.arange(5, 40)
    logits_a = a.model.forward(ids, a.model.new_cache(64)).logits
    logits_b = b.model.forward(ids, b.model.new_cache(64)).logits
    assert torch.equal(logits_a, logits_b)
    assert set(tensor_shapes(config)) < set(b.gguf.tensors)
