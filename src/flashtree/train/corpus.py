"""Training text for the demo models: Python source found on this machine, plus chat-formatted
instruction pairs built from it.

Sources are the running interpreter's standard library and installed packages (or a folder the
caller names). Each function with a body becomes an instruction pair: the user turn is the
function's signature (and docstring, when it has one), the assistant turn is its body, dedented
one level; rendered through the ChatML template, so a HumanEval-style prompt ("def f(x):\\n
\"\"\"...\"\"\"") given to `flashtree run` is in the training distribution.
"""

from __future__ import annotations

import ast
import os
import random
import sys
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from flashtree.formats.chat_template import CHATML_TEMPLATE, ChatTemplate

SKIP_DIRS = {"__pycache__", "test", "tests", "testing", "idlelib", "turtledemo", "lib2to3", "site-packages-tests"}


def default_roots() -> list[Path]:
    """The standard library and the site-packages of the running interpreter."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"])]
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p not in roots:
            roots.append(p)
    roots += [Path(p) for p in sys.path if p.endswith("site-packages") and Path(p) not in roots]
    return [r for r in roots if r.is_dir()]


def python_files(roots: Iterable[str | Path] | None = None, max_file_bytes: int = 150_000) -> list[Path]:
    """`.py` files under `roots`, sorted, skipping test suites and very large (generated) files.
    The stdlib root is not descended into site-packages twice."""
    roots = [Path(r) for r in roots] if roots is not None else default_roots()
    seen: set[Path] = set()
    files = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")
                                 and not (d == "site-packages" and Path(dirpath) == root and len(roots) > 1))
            for name in sorted(filenames):
                if not name.endswith(".py") or name.startswith("test_"):
                    continue
                path = Path(dirpath, name)
                try:
                    real = path.resolve()
                    size = path.stat().st_size
                except OSError:
                    continue
                if real in seen or not 200 <= size <= max_file_bytes:
                    continue
                seen.add(real)
                files.append(path)
    return files


def read_sources(files: Iterable[Path], max_chars: int | None = None, seed: int = 0) -> list[str]:
    """File texts in a seeded random order, up to `max_chars` in total; undecodable files skipped."""
    files = list(files)
    random.Random(seed).shuffle(files)
    texts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if "\x00" in text:
            continue
        texts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    return texts


@dataclass(frozen=True)
class Pair:
    prompt: str  # user turn: signature (+ docstring)
    response: str  # assistant turn: the body


def instruction_pairs(source: str, max_lines: int = 40, min_body_lines: int = 2) -> Iterator[Pair]:
    """Functions of one module as (signature + docstring, body) pairs; needs a parseable module."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        start, end = node.lineno - 1, node.end_lineno or node.lineno
        if end - start > max_lines:
            continue
        body = node.body
        first = body[0]
        has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
            and isinstance(first.value.value, str)
        if has_doc:
            split = first.end_lineno or first.lineno  # prompt = lines up to the docstring's end
            rest = body[1:]
        else:
            split = first.lineno - 1
            rest = body
        if not rest or split <= start or split >= end:
            continue
        func = textwrap.dedent("\n".join(lines[start:end]))
        func_lines = func.splitlines()
        cut = split - start
        prompt = "\n".join(func_lines[:cut]).rstrip()
        response = textwrap.dedent("\n".join(func_lines[cut:])).strip("\n")
        if len(response.splitlines()) < min_body_lines or not prompt.lstrip().startswith(("def ", "async def ")):
            continue
        yield Pair(prompt, response)


_TEMPLATE = ChatTemplate(CHATML_TEMPLATE)


def chat_prompt(user: str, template: ChatTemplate | None = None, enable_thinking: bool | None = None) -> str:
    """The text the engine feeds the target for a user message (generation prompt included):
    `flashtree run` closes the think block (enable_thinking=False), `bench` leaves it open."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return (template or _TEMPLATE).render([{"role": "user", "content": user}], add_generation_prompt=True, **kwargs)


def render_pair(pair: Pair, template: ChatTemplate | None = None) -> str:
    """A full user/assistant exchange, ending with <|im_end|>, as the template renders history."""
    messages = [{"role": "user", "content": pair.prompt}, {"role": "assistant", "content": pair.response}]
    return (template or _TEMPLATE).render(messages, add_generation_prompt=False)


@dataclass
class Corpus:
    documents: list[str]  # raw source files
    pairs: list[Pair]  # instruction pairs from those files

    def chat_texts(self) -> list[str]:
        return [render_pair(p) for p in self.pairs]


def build_corpus(roots: Iterable[str | Path] | None = None, max_chars: int | None = 20_000_000,
                 max_pairs: int | None = None, seed: int = 0) -> Corpus:
    docs = read_sources(python_files(roots), max_chars=max_chars, seed=seed)
    pairs = [p for doc in docs for p in instruction_pairs(doc)]
    random.Random(seed + 1).shuffle(pairs)
    if max_pairs is not None:
        pairs = pairs[:max_pairs]
    return Corpus(docs, pairs)
