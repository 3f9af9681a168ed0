"""Models a user recorded with `speculant models add PATH [--name N]`: their own GGUF
files (or Hugging Face folders) under a name, with their SHA-256, so that later loads,
by the name or by the path, verify them as pulled models are verified.

The records live in `$SPECULANT_HOME/added.json` ({name: {"path", "sha256", ...}}),
rewritten atomically. A folder's digests go in a manifest.json inside it (as
`speculant models verify --write-manifest` writes it) and its record names the folder.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from speculant.models.registry import KNOWN_MODELS, RegistryError, speculant_home

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class AddError(RegistryError, ValueError):
    """A model that cannot be recorded (a missing file, a bad name, an unsupported model)."""


def records_path() -> Path:
    return speculant_home() / "added.json"


def records() -> dict[str, dict[str, Any]]:
    """{name: record}; an unreadable file reads as none (and is named by `add`)."""
    try:
        data = json.loads(records_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, dict) and "path" in v}


def _write(entries: dict[str, dict[str, Any]]) -> None:
    target = records_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".added-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entries, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def path_of(name: str) -> Path | None:
    """The file or folder recorded under `name`, or None."""
    entry = records().get(name)
    return None if entry is None else Path(entry["path"])


def digest_for(path: Path) -> tuple[str, str] | None:
    """(sha256, where it comes from) when `path` is a file recorded by `add`."""
    resolved = path.resolve()
    for name, entry in records().items():
        if "sha256" in entry and Path(entry["path"]) == resolved:
            return str(entry["sha256"]), f"the model {name!r} recorded by speculant models add"
    return None


def describe(path: Path) -> str:
    """'<architecture>, <n> layers, ...' of a model file or folder; refuses one that
    cannot be loaded (its header fails a check a load makes, an unsupported architecture
    or setting) with the loader's reason."""
    from speculant.models import loader

    cfg_file = path / "config.json"
    if path.is_dir() and not cfg_file.is_file():
        raise AddError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        if path.is_dir():
            config = loader.config_from_hf(json.loads(cfg_file.read_text()), str(cfg_file))
        else:
            config = loader.check_gguf(path)
    except ValueError as exc:  # ModelLoadError, or a config.json that is not JSON
        raise AddError(f"{path} cannot be loaded, so it is not recorded: {exc}") from None
    return (
        f"{config.arch}, {config.n_layers} layers, width {config.dim}, "
        f"{config.num_params / 1e9:.2f}B parameters"
    )


def add(path: Path, name: str | None = None, *, progress: bool = True) -> tuple[str, str]:
    """Record `path` (a .gguf file or a Hugging Face folder) under `name` (default: its
    file name without .gguf); returns (name, a one-line description). Adding a name
    again replaces its record."""
    from speculant.models import integrity

    path = path.expanduser()
    if not path.exists():
        raise AddError(f"{path} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise AddError(f"{path} is not a .gguf file (or a Hugging Face folder)")
    name = name if name is not None else path.name.removesuffix(".gguf")
    if not NAME.match(name):
        raise AddError(
            f"model name {name!r} is not allowed: use letters, digits, '.', '_' and '-' "
            "(up to 100, starting with a letter or digit)"
        )
    if name in KNOWN_MODELS:
        raise AddError(f"{name!r} is a built-in model's name: choose another with --name")
    what = describe(path)
    entry: dict[str, Any] = {"path": str(path.resolve())}
    if path.is_dir():
        integrity.write_manifest(path)
        entry["manifest"] = str(path.resolve() / integrity.MANIFEST)
    else:
        digest = integrity.sha256_file(path, progress=progress, label=f"hashing {name}")
        integrity.remember_digest(path, digest)  # the first load does not hash it again
        entry["sha256"] = digest
        entry["size"] = path.stat().st_size
    entries = records()
    entries[name] = entry
    _write(entries)
    return name, what


def remove(name: str) -> Path:
    """Forget the record `name` (the file stays); returns its path."""
    entries = records()
    if name not in entries:
        have = ", ".join(sorted(entries)) or "none"
        raise AddError(f"no model {name!r} was added (added: {have})")
    entry = entries.pop(name)
    _write(entries)
    return Path(entry["path"])
