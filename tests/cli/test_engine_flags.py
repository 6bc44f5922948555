"""Engine flags shared by run, serve, chat and bench."""

from flashtree.cli.args import placement_args
from flashtree.cli.main import build_parser
from flashtree.engine.loader import load_engine


def test_enforce_eager_turns_cuda_graphs_off():
    args = build_parser().parse_args(["run", "--enforce-eager", "hi"])
    assert placement_args(args) == {"enforce_eager": True}
    assert placement_args(build_parser().parse_args(["run", "hi"])) == {}
    assert not load_engine(device="cpu", **placement_args(args)).use_cuda_graphs
    assert load_engine(device="cpu").use_cuda_graphs
