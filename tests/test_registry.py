"""Tests of the model registry: no network, only tiny fake wheels."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from speculant.models import integrity, registry
from speculant.models.integrity import IntegrityError
from speculant.models.registry import (
    KNOWN_MODELS,
    KnownModel,
    PullError,
    UnknownModelError,
    WheelPart,
)


def test_unknown_name_lists_known() -> None:
    with pytest.raises(UnknownModelError) as info:
        registry.get_known("no-such-model")
    msg = str(info.value)
    assert "no-such-model" in msg
    for name in KNOWN_MODELS:
        assert name in msg
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnknownModelError):
        registry.model_path("no-such-model")


def test_known_models_consistent() -> None:
    assert set(KNOWN_MODELS) == {
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
        "gemma-3-270m",
    }
    for name, m in KNOWN_MODELS.items():
        assert m.name == name
        assert len(m.sha256) == 64
        assert m.parts and len({p.member for p in m.parts}) == len(m.parts)
    assert len(KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"].parts) == 22
    assert (
        KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"].tokenizer_family
        == KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"].tokenizer_family
    )


def test_home_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    assert registry.speculant_home() == tmp_path / "home"
    m = KNOWN_MODELS["smollm2-135m-instruct"]
    assert registry.model_path(m.name) == tmp_path / "home" / "models" / m.name / m.file_name
    assert not registry.is_pulled(m.name)
    assert not registry.verify(m.name, progress=False)
    rows = {r["name"]: r for r in registry.list_models()}
    assert rows[m.name]["pulled"] is False
    assert rows[m.name]["size"] == m.size_bytes
    monkeypatch.delenv("SPECULANT_HOME")
    assert registry.speculant_home() == Path.home() / ".cache" / "speculant"


def _make_fake(tmp_path: Path, sha256: str | None = None) -> tuple[KnownModel, Path, bytes]:
    """Three tiny wheels whose members concatenate to a known payload."""
    wheel_dir = tmp_path / "fake-wheels"
    wheel_dir.mkdir(exist_ok=True)
    chunks = [bytes(range(256)) * 40, b"middle-part" * 1000, b"\x00tail"]
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        member = f"fake_model_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheel_dir / f"fake_model_part{i}-0.1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_model_part{i}/__init__.py", "")
            zf.writestr(member, chunk, compress_type=zipfile.ZIP_DEFLATED)
        parts.append(WheelPart(requirement=f"fake-model-part{i}==0.1.0", member=member))
    payload = b"".join(chunks)
    model = KnownModel(
        name="fake-model",
        description="fake",
        architecture="llama",
        tokenizer_family="fake",
        file_name="fake.gguf",
        size_bytes=len(payload),
        sha256=sha256 or hashlib.sha256(payload).hexdigest(),
        parts=tuple(parts),
    )
    return model, wheel_dir, payload


def _patch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: KnownModel, wheel_dir: Path
) -> list[list[str]]:
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(registry.KNOWN_MODELS, model.name, model)
    calls: list[list[str]] = []

    def fake_download(requirements: Sequence[str], dest: Path, *, progress: bool = True) -> None:
        calls.append(list(requirements))
        for whl in wheel_dir.glob("*.whl"):
            shutil.copy(whl, dest / whl.name)

    monkeypatch.setattr(registry, "pip_download", fake_download)
    return calls


def test_pull_fake_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model, wheel_dir, payload = _make_fake(tmp_path)
    calls = _patch(monkeypatch, tmp_path, model, wheel_dir)

    path = registry.pull(model.name, progress=False)
    assert path == tmp_path / "home" / "models" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == payload
    assert hashlib.sha256(path.read_bytes()).hexdigest() == model.sha256
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest == {
        "name": "fake-model",
        "file": "fake.gguf",
        "size_bytes": len(payload),
        "sha256": model.sha256,
    }
    assert calls == [[p.requirement for p in model.parts]]
    assert not path.with_name("fake.gguf.partial").exists()
    assert list((tmp_path / "home" / "tmp").iterdir()) == []  # work folder removed
    assert registry.is_pulled(model.name)
    assert registry.verify(model.name, progress=False)

    # already there: no second download; force: downloads again
    assert registry.pull(model.name, progress=False) == path
    assert len(calls) == 1
    registry.pull(model.name, force=True, progress=True)
    assert len(calls) == 2

    # corrupt the file: same size, so still "pulled" but verify fails
    data = bytearray(payload)
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    assert registry.is_pulled(model.name)
    assert not registry.verify(model.name, progress=False)


def test_pull_wrong_digest(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bad = "0" * 64
    model, wheel_dir, payload = _make_fake(tmp_path, sha256=bad)
    _patch(monkeypatch, tmp_path, model, wheel_dir)
    with pytest.raises(IntegrityError) as info:
        registry.pull(model.name, progress=False)
    msg = str(info.value)
    assert bad in msg
    assert hashlib.sha256(payload).hexdigest() in msg
    target = registry.model_path(model.name)
    assert not target.exists()
    assert not target.with_name(target.name + ".partial").exists()
    assert not (target.parent / "manifest.json").exists()
    assert list((tmp_path / "home" / "tmp").iterdir()) == []


def test_pull_missing_member(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model, wheel_dir, _ = _make_fake(tmp_path)
    broken = KnownModel(
        **{**model.__dict__, "parts": (*model.parts, WheelPart("x==1", "x/data/nope.bin"))}
    )
    _patch(monkeypatch, tmp_path, broken, wheel_dir)
    with pytest.raises(PullError, match="nope.bin"):
        registry.pull(broken.name, progress=False)
    assert not registry.model_path(broken.name).exists()


def test_pip_failure_raises_pull_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The real pip call with a requirement that cannot resolve, and no index at all."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    dest = tmp_path / "d"
    dest.mkdir()
    with pytest.raises(PullError, match="registry must be reachable"):
        registry.pip_download(["speculant-no-such-pkg==9.9.9"], dest, progress=False)


def test_folder_manifest_refuses_changed_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Hugging Face folder with a manifest loads verified; a flipped byte, or a model
    file the manifest does not list, is refused naming the file; the CLI agrees."""
    from tiny import save_tiny

    from speculant.cli import main
    from speculant.models.model import load_model

    folder = tmp_path / "tiny"
    save_tiny("llama", folder, seed=1)
    assert integrity.check_folder_integrity(folder) is False  # no manifest yet
    assert main(["models", "verify", str(folder)]) == 1
    assert main(["models", "verify", str(folder), "--write-manifest"]) == 0
    listed = integrity.read_manifest(folder)
    assert "model.safetensors" in listed and "config.json" in listed
    assert integrity.check_folder_integrity(folder) is True
    assert main(["models", "verify", str(folder)]) == 0
    capsys.readouterr()
    # the old spelling `speculant verify` still works, with a note
    assert main(["verify", str(folder)]) == 0
    out, err = capsys.readouterr()
    assert out.endswith(": ok\n") and "`speculant verify` is deprecated" in err
    load_model(folder, dtype="float32", progress=False)

    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model.safetensors: the manifest expects"):
        load_model(folder, dtype="float32", progress=False)
    assert main(["models", "verify", str(folder)]) == 1
    load_model(folder, dtype="float32", progress=False, trust_unverified=True)  # escape hatch

    integrity.write_manifest(folder)
    shutil.copy(weights, folder / "extra.safetensors")
    with pytest.raises(IntegrityError, match="extra.safetensors is not listed"):
        integrity.check_folder_integrity(folder)


def test_concurrent_pulls_both_succeed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two pulls of one model at once: one downloads, the other waits for it and finds
    the model pulled; both return the verified file. Leftovers of a killed pull (a
    partial file, a work folder) are removed."""
    import threading
    import time

    model, wheel_dir, payload = _make_fake(tmp_path)
    calls = _patch(monkeypatch, tmp_path, model, wheel_dir)
    slow = registry.pip_download

    def slow_download(requirements: Sequence[str], dest: Path, *, progress: bool = True) -> None:
        time.sleep(0.5)  # the two pulls overlap
        slow(requirements, dest, progress=progress)

    monkeypatch.setattr(registry, "pip_download", slow_download)
    home = tmp_path / "home"
    stale_partial = home / "models" / model.name / f"{model.file_name}.999-old.partial"
    stale_partial.parent.mkdir(parents=True)
    stale_partial.write_bytes(b"left by a killed pull")
    stale_work = home / "tmp" / f"pull-{model.name}-old"
    stale_work.mkdir(parents=True)
    results: list[Path | BaseException] = []

    def run() -> None:
        try:
            results.append(registry.pull(model.name, progress=False))
        except BaseException as exc:  # noqa: BLE001 (reported by the assertion)
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2 and all(isinstance(r, Path) for r in results), results
    assert results[0] == results[1] and results[0].read_bytes() == payload
    assert registry.verify(model.name, progress=False)
    assert len(calls) == 1  # the second found it pulled
    assert not stale_partial.exists() and not stale_work.exists()
    assert list((home / "tmp").iterdir()) == []


_KILLED_PULL = r"""
import shutil, sys, time
from pathlib import Path
from speculant.models import registry
import test_registry as t
tmp = Path(sys.argv[1])
model, wheel_dir, _ = t._make_fake(tmp)
registry.KNOWN_MODELS[model.name] = model
def download(requirements, dest, *, progress=True):
    for whl in wheel_dir.glob("*.whl"):
        shutil.copy(whl, dest / whl.name)
    print("downloading", flush=True)
    time.sleep(60)
registry.pip_download = download
registry.pull(model.name, progress=False)
"""


def test_a_terminated_pull_leaves_nothing(tmp_path: Path) -> None:
    """SIGTERM in the middle of a pull: it unwinds, its work folder and partial file
    are gone, and the model is not pulled."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "SPECULANT_HOME": str(tmp_path / "home")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PULL, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "downloading"
    assert list((tmp_path / "home" / "tmp").iterdir())  # its work folder, mid-pull
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    assert proc.returncode != 0
    assert list((tmp_path / "home" / "tmp").iterdir()) == []
    folder = tmp_path / "home" / "models" / "fake-model"
    assert not list(folder.glob("*.partial")) and not (folder / "fake.gguf").exists()


def test_the_download_child_dies_with_its_parent(tmp_path: Path) -> None:
    """pip runs with PR_SET_PDEATHSIG: when the process that started it is killed
    outright, the kernel kills it too."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import subprocess, sys, time\n"
        "from speculant.models.registry import _die_with_parent\n"
        "p = subprocess.Popen(['sleep', '60'], preexec_fn=_die_with_parent)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # alive
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:  # gone (and reaped)
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its parent")
