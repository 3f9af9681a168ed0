"""SHA-256 digests of model files, and checking files against what vouches for them: the
built-in registry's digest, or a ``manifest.json`` beside them.

Digests are remembered beside each file (``<file>.sha256.json``, keyed by size and mtime) so
that start-up stays fast; ``sha256_file`` always hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

__all__ = [
    "CHUNK",
    "FOLDER_PATTERNS",
    "MANIFEST",
    "IntegrityError",
    "check_folder_integrity",
    "check_integrity",
    "expected_digest",
    "file_sha256",
    "listing_problems",
    "maybe_progress",
    "model_files",
    "read_manifest",
    "remember_digest",
    "sha256_file",
    "write_manifest",
]

CHUNK = 1 << 20  # 1 MiB per read while streaming / hashing

MANIFEST = "manifest.json"
# Files of a Hugging Face folder that a manifest must cover: weights, config, tokenizer.
FOLDER_PATTERNS = ("*.safetensors", "*.gguf", "config.json", "tokenizer.json", "*.bin", "*.pt")


class IntegrityError(RuntimeError):
    """A file does not have the expected size or SHA-256."""


def _warn(message: str) -> None:
    Console(stderr=True).print(f"[red]WARNING[/red] {message}")


@contextmanager
def maybe_progress(enabled: bool) -> Iterator[Progress | None]:
    """A byte-count progress bar on stderr, or None when not ``enabled``."""
    if not enabled:
        yield None
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as prog:
        yield prog


def sha256_file(path: Path, *, progress: bool = False, label: str | None = None) -> str:
    """SHA-256 of a file, hashed now (streamed, nothing remembered); a progress bar named
    ``label`` (default: the file's name) when ``progress``."""
    digest = hashlib.sha256()
    total = path.stat().st_size
    with maybe_progress(progress) as prog, path.open("rb") as fh:
        task = prog.add_task(label or path.name, total=total) if prog is not None else None
        while block := fh.read(CHUNK):
            digest.update(block)
            if prog is not None and task is not None:
                prog.advance(task, len(block))
    return digest.hexdigest()


def _digest_note(path: Path) -> Path:
    return path.with_name(path.name + ".sha256.json")


def remember_digest(path: Path, digest: str) -> None:
    """Note ``digest`` beside ``path`` for `file_sha256` (skipped in a read-only folder)."""
    st = path.stat()
    note = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    tmp = _digest_note(path).with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(note) + "\n", encoding="utf-8")
        os.replace(tmp, _digest_note(path))
    except OSError:  # a read-only folder: hash again next time
        tmp.unlink(missing_ok=True)


def file_sha256(path: Path, *, progress: bool = True) -> str:
    """SHA-256 of a file, remembered beside it by size and mtime so start-up stays fast.

    The note is a speed-up for files left as they were; ``verify`` always re-hashes."""
    st = path.stat()
    try:
        note = json.loads(_digest_note(path).read_text(encoding="utf-8"))
        if note["size"] == st.st_size and note["mtime_ns"] == st.st_mtime_ns:
            return str(note["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_file(path, progress=progress, label=f"checking {path.name}")
    remember_digest(path, digest)
    return digest


def expected_digest(path: Path) -> tuple[str, str] | None:
    """(digest, where it comes from) for a model file: the registry entry whose file this
    is, else the record of `speculant models add`, else a manifest.json beside it that
    names it; None when nothing vouches for it."""
    # registry imports this module, so its catalogue is looked up at call time.
    from speculant.models.registry import KNOWN_MODELS, model_path

    for model in KNOWN_MODELS.values():
        if path.resolve() == model_path(model.name).resolve():
            return model.sha256, f"the registry entry {model.name}"
    from speculant.models import added

    recorded = added.digest_for(path)
    if recorded is not None:
        return recorded
    manifest = path.parent / MANIFEST
    listed = read_manifest(path.parent).get(path.name)
    return (listed, str(manifest)) if listed is not None else None


def read_manifest(folder: Path) -> dict[str, str]:
    """{file name: sha256} of folder/manifest.json: the registry's single-file form
    {"file", "sha256"} and the multi-file form {"files": {name: sha256}}."""
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out: dict[str, str] = {}
    if not isinstance(data, dict):
        return out
    if isinstance(data.get("file"), str) and isinstance(data.get("sha256"), str):
        out[data["file"]] = data["sha256"]
    files = data.get("files")
    if isinstance(files, dict):
        out.update({k: v for k, v in files.items() if isinstance(v, str)})
    return out


def model_files(folder: Path) -> list[Path]:
    """The files of a model folder that integrity checks cover."""
    found = {p for pattern in FOLDER_PATTERNS for p in folder.glob(pattern) if p.is_file()}
    return sorted(found)


def write_manifest(
    folder: Path, files: Sequence[Path] | None = None, *, progress: bool = True
) -> Path:
    """Hash ``files`` (default: every model file of ``folder``) into folder/manifest.json
    (atomically)."""
    files = model_files(folder) if files is None else list(files)
    if not files:
        raise ValueError(f"{folder} holds no model files ({', '.join(FOLDER_PATTERNS)})")
    digests = {p.name: sha256_file(p, progress=progress, label=f"hashing {p.name}") for p in files}
    for p in files:
        remember_digest(p, digests[p.name])
    target = folder / MANIFEST
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps({"files": digests}, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, target)
    return target


def listing_problems(
    files: Iterable[Path], listed: Mapping[str, str], manifest: Path | str, *, progress: bool
) -> list[str]:
    """One line per file that ``listed`` (a manifest's {name: sha256}, named ``manifest`` in
    the lines) leaves out, or whose SHA-256 differs from the listed one."""
    problems = []
    for path in files:
        digest = listed.get(path.name)
        if digest is None:
            problems.append(f"{path.name} is not listed in {manifest}")
            continue
        actual = file_sha256(path, progress=progress)
        if actual != digest:
            problems.append(
                f"{path.name}: the manifest expects sha256 {digest}, the file has {actual}"
            )
    return problems


def check_folder_integrity(
    folder: Path, *, trust_unverified: bool = False, progress: bool = True
) -> bool:
    """Check every model file of a folder against its manifest.json. True when all are
    verified, False when the folder has no manifest. A mismatch, or a model file the
    manifest does not list, raises IntegrityError unless `trust_unverified`."""
    listed = read_manifest(folder)
    if not listed:
        return False
    problems = listing_problems(model_files(folder), listed, folder / MANIFEST, progress=progress)
    missing = [name for name in listed if not (folder / name).is_file()]
    problems += [f"{name} is listed in the manifest but missing" for name in missing]
    if not problems:
        return True
    message = (
        f"{folder} fails its integrity check: " + "; ".join(problems) + ". Restore the "
        "files, or pass --trust-unverified to load them anyway"
    )
    if trust_unverified:
        _warn(f"loading unverified files: {message}")
        return False
    raise IntegrityError(message)


def check_integrity(path: Path, *, trust_unverified: bool = False, progress: bool = True) -> bool:
    """Refuse a model file whose SHA-256 differs from what vouches for it.

    Returns True when verified, False when nothing vouches for the file. A mismatch raises
    IntegrityError naming the file and both digests, unless `trust_unverified` is set,
    in which case it is logged as a warning and loading goes on."""
    expected = expected_digest(path)
    if expected is None:
        return False
    digest, source = expected
    actual = file_sha256(path, progress=progress)
    if actual == digest:
        return True
    if "models add" in source:
        fix = "if you changed it yourself, record it again (speculant models add PATH --name NAME)"
    else:
        fix = "pull it again (speculant models pull NAME --force)"
    message = (
        f"{path} fails its integrity check: {source} expects sha256 {digest}, the file has "
        f"{actual}. It is corrupt or was replaced: {fix}, or pass --trust-unverified to "
        "load it anyway"
    )
    if trust_unverified:
        _warn(f"loading an unverified file: {message}")
        return False
    raise IntegrityError(message)
