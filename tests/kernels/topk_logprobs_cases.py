"""Runs the topk_logprobs interpreter cases in one process (TRITON_INTERPRET=1 must be set before triton is imported,
so test_topk_logprobs.py launches this file as a subprocess). Prints one JSON object: case id -> [ids as expected,
largest |log-prob difference| from the torch form]."""

import json
import os
import sys

import torch

# (rows, vocab, k, dtype): a slice per row and several, a vocab that is not a whole number of blocks, k not a power
# of two, bf16 logits, the tree's largest k
SHAPES = {"one-slice": (3, 1500, 8, torch.float32), "slices": (2, 9000, 8, torch.float32),
          "ragged-k5": (4, 5001, 5, torch.float32), "bf16": (2, 4096, 8, torch.bfloat16),
          "k32": (1, 6000, 32, torch.float32), "k1": (15, 300, 1, torch.float32)}


def case_ids() -> list[str]:
    return [*SHAPES, "ties", "masked"]


def compare(logits: torch.Tensor, k: int) -> list:
    """[ids those of a stable descending sort (equal logits, as bf16 rows have many: the lower column first), the
    largest |log-prob difference| from torch's log-softmax top-k]."""
    from flashtree.kernels.topk_logprobs import topk_logprobs, topk_logprobs_reference

    values, ids = topk_logprobs(logits, k, kernel=True)
    want_ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    return [torch.equal(ids, want_ids), (values - topk_logprobs_reference(logits, k)[0]).abs().max().item()]


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from flashtree.kernels.topk_logprobs import topk_logprobs

    gen = torch.Generator().manual_seed(0)
    result = {}
    for name, (rows, vocab, k, dtype) in SHAPES.items():
        result[name] = compare((torch.randn(rows, vocab, generator=gen) * 4).to(dtype), k)
    # equal logits: the lower column first (the key's reversed column), the log-prob the same for each
    tied = torch.zeros(2, 5000)
    tied[:, [4999, 17, 2500, 3]] = 2.0
    values, ids = topk_logprobs(tied, 6, kernel=True)
    result["ties"] = [ids.tolist() == [[3, 17, 2500, 4999, 0, 1]] * 2,
                      (values - torch.log_softmax(tied, -1).topk(6).values).abs().max().item()]
    # -inf logits (a masked vocabulary) are never picked while finite ones remain
    masked = torch.full((1, 7000), float("-inf"))
    masked[0, [6999, 10, 3000]] = torch.tensor([1.0, 3.0, 2.0])
    values, ids = topk_logprobs(masked, 3, kernel=True)
    result["masked"] = [ids.tolist() == [[10, 3000, 6999]],
                        (values - torch.log_softmax(masked, -1).topk(3).values).abs().max().item()]
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
