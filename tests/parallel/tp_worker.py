"""One rank of the tensor-parallel test (tests/parallel/test_tp.py starts two with flashtree.parallel.launch).

Checks, on every rank: forward (prefill, tree verify, commit, decode) logits and features equal to the
single-process model's; greedy AR / DDTree generation through TensorParallelEngine equal to one process;
an SPMD oracle-draft run; a cancellation that keeps the ranks in lock step; with a second (Q8_0) file, the
forward of shards kept as GGUF blocks; the refusal of a group of the wrong size. Writes rank<r>.json."""

import collections
import json
import sys
import traceback
from unittest import mock

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from flashtree.parallel import tp  # noqa: E402
from flashtree.engine.config import GenerationConfig  # noqa: E402
from flashtree.engine.generate import Engine  # noqa: E402
from flashtree.engine import loader  # noqa: E402
from flashtree.engine.loader import load_target  # noqa: E402
from flashtree.models import layers  # noqa: E402
from flashtree.errors import FlashtreeError  # noqa: E402
from flashtree.models.step import Step  # noqa: E402
from tests.drafting.test_lossless import OracleProposer, random_draft  # noqa: E402

PROMPTS = [[3, 17, 99, 250, 8], [400, 2, 2, 71, 5, 33, 120, 9, 61]]
N_NEW = 30


def forward_trace(model):
    cache = model.new_cache(64)
    a = model.forward(torch.tensor([5, 9, 200, 31, 7, 7, 64]), cache, capture=(1, 2))
    parents = torch.tensor([-1, 0, 0, 1, 3])
    depths = torch.tensor([0, 1, 1, 2, 3])
    ancestors = torch.eye(5, dtype=torch.bool)
    for i in range(5):
        p = int(parents[i])
        while p >= 0:
            ancestors[i, p] = True
            p = int(parents[p])
    step = Step.tree(cache.length, parents, depths, ancestors)
    b = model.forward(torch.tensor([12, 40, 41, 300, 8]), cache, step=step, capture=(1, 2))
    model.commit(cache, torch.tensor([0, 1, 3]))
    c = model.forward(torch.tensor([11, 13]), cache, capture=(1, 2))
    return [a.logits, a.features, b.logits, b.features, c.logits, c.features]


def quantized_shards(gguf: str) -> dict:
    """`gguf` loaded with its weights kept as GGUF blocks, as on a GPU (the CPU multiplies through
    quant_matmul's reference), and sharded block-wise: forward max diff against one process, and which
    kinds of linear the shards became (blocks where the columns are whole blocks, dense elsewhere)."""
    with mock.patch.object(layers, "keeps_quantized", lambda qtype, device: True):
        model = load_target(gguf, "cpu", shard=tp.join_group(2, "cpu")).model
    linears = [linear for layer in model.layers for part in (layer.mixer, layer.mlp) for value in vars(part).values()
               for linear in ([g for g, _ in value.groups] if isinstance(value, layers.Projections) else [value])
               if isinstance(linear, (layers.Linear, layers.QuantLinear))]
    kinds = collections.Counter(type(linear).__name__ for linear in linears)
    kinds[type(model.lm_head.inner).__name__ + " head"] += 1
    ours, theirs = forward_trace(model), forward_trace(load_target(gguf, device="cpu").model)
    return {"max_diff": max(float((x - y).abs().max()) for x, y in zip(ours, theirs)), "kinds": dict(kinds)}


def main(gguf: str, out: str, quantized_gguf: str | None = None) -> None:
    report = {}
    try:
        target = loader.load_tp_target(gguf, 2, "cpu")
        rank = dist.get_rank()
        report["rank"] = rank
        ref = load_target(gguf, device="cpu")
        ours, theirs = forward_trace(target.model), forward_trace(ref.model)
        report["forward_max_diff"] = max(float((x - y).abs().max()) for x, y in zip(ours, theirs))
        report["cache_kv_heads"] = target.model.config.num_kv_heads
        try:
            tp.join_group(3, "cpu")
        except FlashtreeError as exc:
            report["wrong_world"] = str(exc)
        if quantized_gguf:
            report["quantized"] = quantized_shards(quantized_gguf)

        draft = random_draft(ref, seed=0)
        reference = Engine(ref, draft)
        engine = Engine(target, random_draft(ref, seed=0))
        checks = []
        for mode, budget in (("ar", 1), ("ddtree", 15), ("chain", 8)):
            config = GenerationConfig(max_new_tokens=N_NEW, mode=mode, budget=budget, topk=4, ignore_eos=True)
            want = [reference.generate(p, config).token_ids for p in PROMPTS]
            if rank == 0:
                wrapped = tp.TensorParallelEngine(engine)
                got = [wrapped.generate(p, config).token_ids for p in PROMPTS]
                checks.append([mode, got == want])
            else:
                tp.follow(engine)  # until rank 0 says stop (below)
            if rank == 0:
                tp._broadcast(("stop",))
            # SPMD with a per-request proposer: both ranks run the same loop on the same inputs
            if mode == "ddtree":
                ok = True
                for i, prompt in enumerate(PROMPTS):
                    oracle = OracleProposer(prompt + want[i], ref.config.vocab_size, seed=i)
                    result = Engine(target, oracle).generate(prompt, config)
                    ok = ok and result.token_ids == want[i] and max(result.stats.accepted) >= 4
                checks.append(["oracle", ok])
        # cancellation on rank 0 only: the followers stop at the same token and the next request still runs
        polls = []
        config = GenerationConfig(max_new_tokens=N_NEW, mode="ddtree", budget=15, topk=4, ignore_eos=True)
        if rank == 0:
            wrapped = tp.TensorParallelEngine(engine)
            first = wrapped.generate(PROMPTS[0], config, cancelled=lambda: polls.append(1) or len(polls) > 5)
            second = wrapped.generate(PROMPTS[1], config)
            want = reference.generate(PROMPTS[1], config).token_ids
            checks.append(["cancel", first.finish_reason == "cancelled" and len(first.token_ids) == 5
                           and second.token_ids == want])
            wrapped.shutdown()
        else:
            tp.follow(engine)
        report["checks"] = checks
        if dist.is_initialized():  # rank 0's shutdown already left the group
            dist.destroy_process_group()
    except Exception:
        report["error"] = traceback.format_exc()
    with open(f"{out}/rank{report.get('rank', 'x')}.json", "w") as f:
        json.dump(report, f)
    sys.exit(1 if "error" in report else 0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
