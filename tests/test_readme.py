"""What the README shows a newcomer, read as text (tests/test_newcomer.py runs its examples): every
chat example is greedy (issue 43: sampled at the default temperature 1.0, the small embedded
model's first answers read as nonsense), and the virtual environment one makes in a clone is one
git ignores."""
from __future__ import annotations

import re
import subprocess

import pytest

from orca_mq.server.process import ROOT

CHAT = re.compile(r"--chat|chat\.completions|/chat/completions|chat=True|llm\.chat\(")
GREEDY = re.compile(r"--temperature 0(?![.\d])|temperature=0(?![.\d])|\"temperature\": 0(?![.\d])")


def _statements(block: str) -> list[str]:
    """A fenced block's statements: a shell line with its continuations, a Python statement with its
    bracketed lines; comments left out."""
    out, current, depth = [], "", 0
    for line in block.splitlines():
        code = re.sub(r"\s+#\s.*$", "", line)
        current += code + "\n"
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0 and not code.endswith("\\"):
            out.append(current)
            current, depth = "", 0
    return out + ([current] if current.strip() else [])


def test_every_chat_example_is_greedy():
    blocks = re.findall(r"```(?:bash|python)\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    chats = [s for b in blocks for s in _statements(b) if CHAT.search(s)]
    assert len(chats) >= 6, chats   # the quick start's, the Python and offline clients', the HTTP API's
    assert not [s for s in chats if not GREEDY.search(s)], [s for s in chats if not GREEDY.search(s)]


def test_a_virtual_environment_in_the_clone_is_ignored():
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    for path in (".venv/bin/python", ".venv/pyvenv.cfg"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
