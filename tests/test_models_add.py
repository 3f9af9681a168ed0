"""`speculant models add`: a user's own file recorded under a name with its SHA-256, then
loaded by the name or the path and verified; a changed file refused; an unsupported
model refused when it is added, with nothing recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_writer import write_gguf

from speculant import load_model
from speculant.cli import main
from speculant.models import added
from speculant.models.integrity import IntegrityError


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def own_file(tmp_path: Path) -> Path:
    from test_archs import hf_model

    return write_gguf(hf_model("qwen3"), tmp_path / "my-qwen3.Q8_0.gguf", "Q8_0")


def test_add_then_load_by_name_and_path(
    home: Path, own_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "add", str(own_file), "--name", "mine"]) == 0
    out = capsys.readouterr().out
    assert "added mine: qwen3, 4 layers" in out
    record = json.loads((home / "added.json").read_text())["mine"]
    assert record["path"] == str(own_file.resolve()) and len(record["sha256"]) == 64
    by_name = load_model("mine", progress=False)
    assert by_name.config.arch == "qwen3"
    assert main(["models", "verify", "mine"]) == 0
    assert "mine: ok" in capsys.readouterr().out
    assert main(["models", "list"]) == 0
    assert "mine" in capsys.readouterr().out
    # the default name is the file's stem
    assert main(["models", "add", str(own_file)]) == 0
    assert "my-qwen3.Q8_0" in added.records()


def test_a_changed_file_is_refused(home: Path, own_file: Path) -> None:
    added.add(own_file, "mine", progress=False)
    data = bytearray(own_file.read_bytes())
    data[-5] ^= 0xFF  # a byte of the last tensor
    own_file.write_bytes(data)
    with pytest.raises(IntegrityError, match="recorded by speculant models add"):
        load_model("mine", progress=False)
    with pytest.raises(IntegrityError, match="record it again"):
        load_model(own_file, progress=False)  # by its path too
    assert main(["models", "verify", "mine"]) == 1


def test_a_trusted_mismatch_is_said_on_the_load_line(
    home: Path, own_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    added.add(own_file, "mine", progress=False)
    data = bytearray(own_file.read_bytes())
    data[-5] ^= 0xFF
    own_file.write_bytes(data)
    load_model(own_file, progress=True, trust_unverified=True)
    err = capsys.readouterr().err
    assert "UNVERIFIED: it fails its sha256 check" in err and "no manifest" not in err


def test_bad_adds_are_refused_and_record_nothing(
    home: Path, own_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gguf

    odd = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(odd), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from hostile_gguf import read_parts, write_parts

    parts = read_parts(own_file)
    t = parts.tensor("blk.0.ffn_down.weight")
    t.dims = [t.dims[1], t.dims[0]]
    transposed = write_parts(parts, tmp_path / "transposed.gguf")
    cases = [
        (["models", "add", str(odd)], "'mamba' is not supported"),
        (["models", "add", str(transposed)], "blk.0.ffn_down.weight has shape"),
        (["models", "add", str(tmp_path / "absent.gguf")], "does not exist"),
        (["models", "add", str(own_file), "--name", "bad name!"], "is not allowed"),
        (["models", "add", str(own_file), "--name", "smollm2-135m-instruct"], "built-in"),
        (["models", "remove", "never-added"], "no model 'never-added' was added"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert added.records() == {}
    assert not (home / "added.json").exists()


def test_remove_keeps_the_file(home: Path, own_file: Path) -> None:
    added.add(own_file, "mine", progress=False)
    assert main(["models", "remove", "mine"]) == 0
    assert added.records() == {} and own_file.exists()
    with pytest.raises(ValueError, match="unknown model 'mine'"):
        load_model("mine", progress=False)
