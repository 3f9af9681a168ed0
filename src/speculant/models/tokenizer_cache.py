"""The on-disk cache of tokenizers converted from GGUF files.

The cache of ``<stem>.gguf`` is the folder ``<stem>.tokenizer/`` beside it: a ``tokenizer.json``
plus a small json with the special ids and the chat template, keyed by the GGUF's size and
mtime. Each cache file has a digest record (``<file>.source.json``, see `derived`) binding its
SHA-256 to the GGUF's; a file that differs from its record, or was built from another GGUF, is
reported and rebuilt, never read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import tokenizers

from speculant.models import derived

__all__ = ["cache_dir", "cache_key", "load", "write"]

logger = logging.getLogger(__name__)

# Bump when the cache layout or the way it is built changes.
_CACHE_FORMAT = 2
_CACHE_TOKENIZER_FILE = "tokenizer.json"
_CACHE_META_FILE = "speculant_tokenizer.json"


def cache_dir(gguf: Path) -> Path:
    """The cache folder of a GGUF file."""
    return gguf.with_name(gguf.stem + ".tokenizer")


def cache_key(st: os.stat_result) -> dict[str, Any]:
    try:
        tf_version = importlib_metadata.version("transformers")
    except importlib_metadata.PackageNotFoundError:
        tf_version = None
    return {
        "format": _CACHE_FORMAT,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "transformers": tf_version,
    }


def _read_verified(path: Path, source: Path, source_sha256: str) -> bytes | None:
    """The bytes of a cache file when they match its digest record bound to source_sha256;
    None (after one warning line naming the file and both digests) when they do not."""
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
    except OSError as e:
        logger.warning("ignoring unreadable tokenizer cache %s: %s", path, e)
        return None
    why = derived.problem(path, source_sha256, data=data)
    if why is not None:
        logger.warning("tokenizer cache not used: %s; rebuilding it from %s", why, source.name)
        return None
    return data


def load(
    cache_dir: Path, key: Mapping[str, Any], source: Path, source_sha256: str
) -> tuple[tokenizers.Tokenizer, dict[str, Any]] | None:
    """(backend, meta) from the cache when it is there, matches ``key`` and its digest
    records; None when it has to be rebuilt."""
    # Both files are hashed from the bytes that are then parsed: nothing unchecked is read.
    meta_bytes = _read_verified(cache_dir / _CACHE_META_FILE, source, source_sha256)
    if meta_bytes is None:
        return None
    try:
        meta = json.loads(meta_bytes.decode("utf-8"))
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("key") != dict(key):
        return None
    data = _read_verified(cache_dir / _CACHE_TOKENIZER_FILE, source, source_sha256)
    if data is None:
        return None
    try:
        if hashlib.sha256(data).hexdigest() != meta.get("tokenizer_sha256"):
            return None
        backend = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # corrupt cache: rebuild
        logger.warning("ignoring unreadable tokenizer cache %s: %s", cache_dir, e)
        return None
    return backend, meta


def write(
    cache_dir: Path,
    key: Mapping[str, Any],
    backend_json: str,
    meta: Mapping[str, Any],
    source: Path,
    source_sha256: str,
) -> None:
    """Store a converted tokenizer (``backend_json`` and its ``meta``); a folder that cannot
    be written is logged, not raised."""
    data = backend_json.encode("utf-8")
    full_meta = dict(meta)
    full_meta["key"] = dict(key)
    full_meta["tokenizer_sha256"] = hashlib.sha256(data).hexdigest()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Each file, then its digest record (bound to the GGUF's digest); tokenizer.json
        # before the meta that vouches for it (by hash): a reader never accepts a
        # half-written or mismatched pair.
        for name, blob in (
            (_CACHE_TOKENIZER_FILE, data),
            (_CACHE_META_FILE, json.dumps(full_meta, ensure_ascii=False, indent=1).encode()),
        ):
            derived.atomic_write(cache_dir / name, blob)
            derived.write_record(cache_dir / name, source, source_sha256, data=blob)
    except OSError as e:
        logger.warning("could not write tokenizer cache %s: %s", cache_dir, e)
