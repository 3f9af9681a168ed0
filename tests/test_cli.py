"""One spelling per flag and command: the new spellings parse, the old ones still parse
to the same thing and print a one-line deprecation note, and help lists only the new."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from speculant.cli import build_parser, main


def _sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subcommand `name` of `parser`."""
    action: Any = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = action.choices[name]
    return sub


def _note(err: str, old: str, new: str) -> None:
    lines = [line for line in err.splitlines() if "deprecated" in line]
    assert lines == [f"speculant: note: `{old}` is deprecated: use `{new}`"], err


def test_plan_dtype_and_its_old_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--target", "smollm2-135m-instruct", "--draft", "none", "--json"]
    argv += ["--memory", "24GiB"]
    assert main([*argv, "--dtype", "int8"]) == 0
    out, err = capsys.readouterr()
    new = json.loads(out)
    assert new["target"]["dtype"] == "int8" and "deprecated" not in err
    assert main([*argv, "--target-dtype", "int8"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == new
    _note(err, "--target-dtype", "--dtype")
    args = build_parser().parse_args(["plan", "--dtype", "int4", "--draft-dtype", "int4"])
    assert (args.dtype, args.draft_dtype) == ("int4", "int4")
    assert build_parser().parse_args(["plan"]).dtype == "bfloat16"  # the default stays
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--target-dtype", "int3"])  # same choices
    help_text = _sub(build_parser(), "plan").format_help()
    assert "--dtype" in help_text and "--target-dtype" not in help_text


def test_bench_k_spellings() -> None:
    parse = build_parser().parse_args
    assert parse(["bench", "-k", "3,5,auto"]).k == [3, 5, "auto"]
    assert parse(["bench", "--k", "3,5,auto"]).k == [3, 5, "auto"]
    assert parse(["bench"]).k == [5]


def test_old_commands_are_hidden_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    base = ["--target", "t", "--out", "o", "--max-steps", "7"]
    new, old = parse(["eagle", "train", *base]), parse(["train", "eagle", *base])
    assert new.func is old.func and (new.max_steps, new.dtype) == (old.max_steps, old.dtype)
    assert not getattr(new, "deprecated_command", None)
    assert old.deprecated_command == ("speculant train eagle", "speculant eagle train")
    new, old = parse(["models", "verify", "x", "--write-manifest"]), parse(["verify", "x"])
    assert new.func is old.func and new.targets == old.targets == ["x"]
    assert old.deprecated_command == ("speculant verify", "speculant models verify")
    listed = re.findall(r"^    (\w+)", build_parser().format_help(), re.MULTILINE)
    assert "eagle" in listed and "models" in listed
    assert "train" not in listed and "verify" not in listed
    # a bad target is named, through either spelling; the old one adds the note
    assert main(["models", "verify", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "'no-such-model' is neither a built-in model" in err and "deprecated" not in err
    assert main(["verify", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "'no-such-model' is neither a built-in model" in err
    _note(err, "speculant verify", "speculant models verify")


def test_help_and_docs_use_the_new_spellings() -> None:
    root = Path(__file__).resolve().parents[1]
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    parser = build_parser()
    helps = [parser.format_help()]
    helps += [_sub(parser, c).format_help() for c in ("plan", "bench", "eagle", "models")]
    helps += [_sub(_sub(parser, "eagle"), "train").format_help()]
    helps += [_sub(_sub(parser, "models"), "verify").format_help()]
    for text in [p.read_text() for p in texts] + helps:
        assert "--target-dtype" not in text
        assert "train eagle" not in text
        assert "speculant verify" not in text


def test_an_unexpected_error_is_called_a_bug_and_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No traceback reaches the user: an exception the project did not raise itself is
    one line saying it is a bug and where its traceback went, exit status 1."""
    import speculant.models.cli as models_cli

    def broken(args: object) -> int:
        raise KeyError("deep inside")

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    monkeypatch.setattr(models_cli, "cmd_models_list", broken)
    assert main(["models", "list"]) == 1
    err = capsys.readouterr().err
    assert "internal error (a bug" in err and "KeyError" in err and "Traceback" not in err
    logs = list((tmp_path / "logs").glob("crash-*.log"))
    assert len(logs) == 1 and "deep inside" in logs[0].read_text()
    assert str(logs[0]) in err
