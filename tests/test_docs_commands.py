"""Every `speculant ...` command line the README and docs/ cite, in code spans and code
blocks, names a command that exists and only flags that command takes (the docs and the
command line cannot drift apart)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from speculant.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
SPAN = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:^|[\s;|&(])speculant ((?:[a-z][\w-]*)(?:[^\n;|&]*))")


def _code(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every code block line (continuations joined) and span."""
    out = []
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        joined = block.group(1).replace("\\\n", " ")
        for i, line in enumerate(joined.splitlines()):
            out.append((first + i, line))
    outside = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in SPAN.finditer(outside):
        out.append((outside.count("\n", 0, span.start()) + 1, span.group(1)))
    return out


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_cited_command_and_flag_exists() -> None:
    parser = build_parser()
    cited, problems = 0, []
    for doc in DOCS:
        for lineno, code in _code(doc.read_text(encoding="utf-8")):
            for match in COMMAND.finditer(code):
                before = code[: match.start(1)].split()
                if before[-2:-1] in (["from"], ["import"], ["-m"]):  # Python, not a command line
                    continue
                words = match.group(1).split()
                p, path = parser, []
                while words and words[0] in _subparsers(p):
                    p = _subparsers(p)[words[0]]
                    path.append(words.pop(0))
                where = f"{doc.relative_to(ROOT)}:{lineno}"
                if not path:
                    cited_line = match.group(1).strip()
                    problems.append(f"{where}: `speculant {cited_line}`: no such command")
                    continue
                cited += 1
                flags = {o for a in p._actions for o in a.option_strings}
                for word in words:
                    flag = word.split("=")[0].rstrip(",.;:)'\"")
                    if flag.startswith("--") and flag not in flags:
                        problems.append(f"{where}: `speculant {' '.join(path)}` has no {flag}")
    assert not problems, "\n".join(problems)
    assert cited > 50  # the docs do cite commands: the check is not empty
