"""Digest records for files derived from a model file (the converted-weights and tokenizer
caches): each is bound to the SHA-256 of its own bytes and of the GGUF it was built from.

A derived file ``F`` has a record ``F.source.json`` beside it::

    {"version": 1, "file": F's name, "size": bytes, "sha256": F's digest,
     "source": the GGUF's name, "source_sha256": the GGUF's digest}

written atomically after ``F``. Before ``F`` is used, ``problem`` hashes it again and
compares both digests: a file that differs from its record, a record built from another
source, or a file without a record is reported (one line naming the file and both
digests) and the caller rebuilds it from the source instead of reading it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from speculant.models.integrity import sha256_file

__all__ = ["RECORD_SUFFIX", "atomic_path", "atomic_write", "problem", "record_path", "write_record"]

RECORD_SUFFIX = ".source.json"
RECORD_VERSION = 1


def record_path(path: Path) -> Path:
    return path.with_name(path.name + RECORD_SUFFIX)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; renamed over ``path`` when the block
    ends without an error, removed otherwise: a reader sees the old file or the new one,
    never a half-written one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through `atomic_path`."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_record(path: Path, source: Path, source_sha256: str, *, data: bytes | None = None) -> str:
    """Record ``path``'s digest (of ``data`` when given: the bytes just written) bound to
    ``source_sha256``; returns the digest. Raises OSError when it cannot be written."""
    if data is not None:
        digest, size = hashlib.sha256(data).hexdigest(), len(data)
    else:
        digest, size = sha256_file(path), path.stat().st_size
    record = {
        "version": RECORD_VERSION,
        "file": path.name,
        "size": size,
        "sha256": digest,
        "source": source.name,
        "source_sha256": source_sha256,
    }
    atomic_write(record_path(path), (json.dumps(record, indent=1) + "\n").encode("utf-8"))
    return digest


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(record_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        return None
    if not all(isinstance(record.get(k), str) for k in ("file", "sha256", "source_sha256")):
        return None
    return record


def problem(path: Path, source_sha256: str, *, data: bytes | None = None) -> str | None:
    """None when ``path`` (or ``data``, its bytes already read) is what its record says and
    the record was built from ``source_sha256``; else why not, in one line naming the file
    and both digests. Hashes the whole file: call it once per load, before reading it."""
    record = _read_record(path)
    if record is None:
        return (
            f"{path} has no valid digest record ({record_path(path).name}), so nothing vouches "
            f"that it was built from the source with sha256 {source_sha256}"
        )
    if record["file"] != path.name:
        return f"{path}: its digest record is that of {record['file']!r}"
    if record["source_sha256"] != source_sha256:
        return (
            f"{path} was built from a source with sha256 {record['source_sha256']}, "
            f"but the source now has sha256 {source_sha256}"
        )
    try:
        actual = hashlib.sha256(data).hexdigest() if data is not None else sha256_file(path)
    except OSError as e:
        return f"{path} cannot be read to check its sha256 {record['sha256']}: {e}"
    if actual != record["sha256"]:
        return f"{path} has sha256 {actual}, but its digest record says {record['sha256']}"
    return None
