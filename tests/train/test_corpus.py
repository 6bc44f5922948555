from flashtree.formats.chat_template import CHATML_TEMPLATE, ChatTemplate
from flashtree.train.corpus import Pair, chat_prompt, instruction_pairs, python_files, read_sources, render_pair

SOURCE = '''
import os

def add(a, b):
    """Add two numbers."""
    total = a + b
    return total

class Box:
    def size(self, scale=1):
        w = self.w * scale
        return w * w

def one_liner():
    """Too short."""
    return 1
'''


def test_instruction_pairs_split_signature_docstring_and_body():
    pairs = list(instruction_pairs(SOURCE))
    by_name = {p.prompt.splitlines()[0]: p for p in pairs}
    add = by_name["def add(a, b):"]
    assert add.prompt == 'def add(a, b):\n    """Add two numbers."""'
    assert add.response == "total = a + b\nreturn total"  # body dedented one level
    size = by_name["def size(self, scale=1):"]  # no docstring: the prompt is the signature alone
    assert size.response == "w = self.w * scale\nreturn w * w"
    assert not any(p.prompt.startswith("def one_liner") for p in pairs)  # single-line bodies are skipped


def test_unparseable_source_gives_no_pairs():
    assert list(instruction_pairs("def broken(:\n  pass")) == []


def test_rendered_pair_matches_the_generation_prompt():
    pair = Pair('def add(a, b):\n    """Add."""', "return a + b")
    text = render_pair(pair)
    template = ChatTemplate(CHATML_TEMPLATE)
    # The engine's prompts (thinking closed, as `flashtree run` sends; or open, as `bench`) are prefixes.
    assert text.startswith(chat_prompt(pair.prompt, template, enable_thinking=False))
    assert text.startswith(chat_prompt(pair.prompt, template))
    assert text.rstrip("\n").endswith("return a + b<|im_end|>")


def test_python_files_skips_tests_and_caches(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "pkg" / "test_mod.py").write_text(SOURCE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "x.py").write_text(SOURCE)
    (tmp_path / "pkg" / "tiny.py").write_text("x = 1\n")  # under 200 bytes
    files = python_files([tmp_path])
    assert [f.name for f in files] == ["mod.py"]
    assert read_sources(files) == [SOURCE]
