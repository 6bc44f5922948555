"""`--draft-type q8_0`: the draft's layer matrices as Q8_0 blocks, loaded so, planned so, and lossless."""

import pytest
import torch

from flashtree.cli.args import engine_args
from flashtree.cli.main import build_parser, main
from flashtree import kernels
from flashtree.engine.config import DEFAULT_DRAFT_TYPE, EngineArgs, GenerationConfig
from flashtree.engine.decode import proposer_for
from flashtree.engine.loader import load_engine
from flashtree.engine.memory_check import check_memory
from flashtree.engine.planner import DraftShape, PlanRequest, plan, target_from_gguf, target_from_preset
from flashtree.errors import FlashtreeError
from flashtree.kernels.host_rows import gpu_reads_host
from flashtree.parallel import placement
from tests.drafting.test_lossless import prompts

GIB = 2**30


@pytest.fixture(scope="module")
def draft_dir(draft, tmp_path_factory):
    path = tmp_path_factory.mktemp("draft") / "draft"
    draft.save(path)
    return path


def _packed(model):
    """The Q8_0 bytes of each of the layers' matrices, by name."""
    return {name: buf for name, buf in model.named_buffers() if name.endswith("packed")}


def test_q8_0_draft_loads_packed_and_decodes_the_target_greedy_output(target, draft, draft_dir):
    ar = load_engine(EngineArgs(target.path, None, "cpu", spec="ar"))
    engine = load_engine(EngineArgs(target.path, draft_dir, "cpu", spec="ddtree", draft_type="q8_0", adaptive=False))
    loaded = engine.draft
    assert not any(name.startswith("layers.") and p.dim() == 2 for name, p in loaded.named_parameters())
    # the very blocks an in-memory quantization of the same weights gives (the file goes through the host)
    expected = _packed(type(draft).load(draft_dir, dtype=torch.float32).quantize_layers("q8_0"))
    got = _packed(loaded)
    assert got.keys() == expected.keys() and len(got) == 2 * 7
    assert all(torch.equal(got[name], expected[name]) for name in got)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for prompt in prompts(target.config.vocab_size)[:4]:
        assert engine.generate(prompt, config).token_ids == ar.generate(prompt, config).token_ids


def test_the_default_draft_stays_dense(target, draft_dir):
    engine = load_engine(EngineArgs(target.path, draft_dir, "cpu"))
    assert not _packed(engine.draft)
    assert EngineArgs().draft_type == DEFAULT_DRAFT_TYPE == "dense"


def test_an_unknown_draft_type_is_refused_by_name():
    with pytest.raises(FlashtreeError, match="unknown draft type 'q4_k'; choose one of dense, q8_0"):
        EngineArgs(draft_type="q4_k")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--draft-type", "q4_k", "hi"])


def test_the_flag_reaches_the_engine_settings():
    assert engine_args(build_parser().parse_args(["run", "--draft-type", "q8_0", "hi"])).draft_type == "q8_0"
    assert engine_args(build_parser().parse_args(["serve"])).draft_type == DEFAULT_DRAFT_TYPE


def test_the_plan_counts_the_q8_0_layers():
    config, weights, embed, dense, draft, layers = target_from_preset("qwen3.6-27b")

    def request(draft_type):
        return PlanRequest(config, weights, embed, draft, 262144, "tq3_0", "tq3_0", dense_params=dense,
                           layer_bytes=layers, draft_type=draft_type)

    bf16, q8 = plan(request("dense")), plan(request("q8_0"))
    packed = sum(rows * cols for rows, cols in draft.layer_matrices)
    assert 1.55e9 < packed < 1.65e9 and len(draft.layer_matrices) == 5 * 7  # 5 layers x q, k, v, o, gate, up, down
    assert bf16.bytes_of("draft weights") == 2 * draft.params
    assert q8.bytes_of("draft weights") == 2 * (draft.params - packed) + packed // 32 * 34  # 34 bytes a block of 32
    assert round(q8.bytes_of("draft weights") / GIB, 2) == 1.83
    assert bf16.total - q8.total == bf16.bytes_of("draft weights") - q8.bytes_of("draft weights")
    assert q8.total <= 23 * GIB  # the 24 GiB card's goal (issue #20), CUDA context included
    with pytest.raises(FlashtreeError, match="unknown draft type"):
        request("q4_0")


def test_the_load_time_check_plans_the_draft_type(target, draft_dir):
    config, weights, embed, dense, layers = target_from_gguf(target.path)
    # the embedding where the load will keep it: in pinned host memory where the GPU reads it in place
    on_host = gpu_reads_host(torch.device("cuda", 0))
    q8 = plan(PlanRequest(config, weights, embed, DraftShape.from_dir(draft_dir), 1024, "bf16", "bf16",
                          dense_params=dense, layer_bytes=layers, draft_type="q8_0", embed_on_host=on_host)).total
    args = dict(draft=draft_dir, target_devices=[torch.device("cuda:0")], split=None, draft_device=None, ctx=1024,
                gpu_memory=f"{q8}B", budget=22, cache_type_k=None, cache_type_v=None)
    check_memory(target.path, **args, draft_type="q8_0")  # fits to the byte
    with pytest.raises(FlashtreeError, match="cuda:0 needs"):
        check_memory(target.path, **args)  # the dense draft does not


def test_plan_command_takes_the_draft_type(capsys):
    command = ["plan", "--synthetic", "qwen3.6-27b", "--ctx", "262144", "-ctk", "tq3_0", "-ctv", "tq3_0",
               "--gpu-memory", "22.5GiB"]
    assert main(command) == 1  # the bf16 draft does not fit 22.5 GiB (22.98 GiB planned, the Q8_0 one 21.58)
    capsys.readouterr()
    assert main(command + ["--draft-type", "q8_0"]) == 0
    out = capsys.readouterr().out
    assert "DFlash draft (q8_0)" in out and "1.83 GiB" in out and "fits" in out


@pytest.mark.parametrize("bf16_dot", [True, False])
def test_the_dense_draft_is_bf16_on_a_cpu_with_bf16_instructions_and_the_output_stays_the_targets(
        target, draft_dir, monkeypatch, bf16_dot):
    """`draft_dtype`: beside the float32 target, a CPU that multiplies bf16 in hardware gets a bf16 draft and a bf16
    copy of the LM head for its logits (made once per model); one without keeps float32 and the target's head.
    Either way the greedy output is the target's."""
    monkeypatch.setattr(placement, "cpu_has_bf16_dot", lambda: bf16_dot)
    dtype = torch.bfloat16 if bf16_dot else torch.float32
    assert placement.draft_dtype(torch.float32, torch.device("cpu")) == dtype
    assert placement.draft_dtype(torch.bfloat16, torch.device("cuda", 0)) == torch.bfloat16  # GPUs: the target's
    ar = load_engine(EngineArgs(target.path, None, "cpu", spec="ar"))
    engine = load_engine(EngineArgs(target.path, draft_dir, "cpu", spec="ddtree", adaptive=False))
    assert {p.dtype for p in engine.draft.parameters()} == {dtype}
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    proposer = proposer_for(engine.runner, config)
    model = engine.target.model
    assert proposer.head_dtype == dtype and (proposer.head is model.lm_head) == (not bf16_dot)
    assert proposer.head.weight.dtype == dtype
    assert torch.equal(proposer.head.weight, model.lm_head.weight.to(dtype))
    assert proposer_for(engine.runner, config).head is proposer.head  # one copy however many requests
    assert proposer.propose(5, 0).dtype == torch.float32
    for prompt in prompts(target.config.vocab_size)[:4]:
        assert engine.generate(prompt, config).token_ids == ar.generate(prompt, config).token_ids


def test_cpu_has_bf16_dot_reads_torchs_checks_and_says_no_without_them(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    kernels.cpu_has_bf16_dot.cache_clear()
    assert kernels.cpu_has_bf16_dot()
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    kernels.cpu_has_bf16_dot.cache_clear()
    assert not kernels.cpu_has_bf16_dot()
    kernels.cpu_has_bf16_dot.cache_clear()  # the machine's own answer again for later tests
