"""`speculant models list | pull | add | remove | verify`: the built-in models, a user's
own models recorded under a name, and checking model files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from speculant.argtypes import CliError

VERIFY_DESCRIPTION = (
    "Re-hash built-in models against the registry, and .gguf files, model folders or "
    "EAGLE head folders against the manifest.json beside them. --write-manifest records "
    "the digests of a folder's model files (weights, config, tokenizer), so later loads "
    "refuse any file that changed. Exit status 1 if anything fails."
)


def add_parsers(sub: Any) -> None:
    """Register `models` (and the deprecated `verify`) on the `speculant` subparsers."""
    models = sub.add_parser(
        "models",
        help="list, pull or verify models",
        description="The built-in models: list them, pull them, and check them or any "
        "model file or folder against its SHA-256.",
    )
    msub = models.add_subparsers(dest="models_command", metavar="ACTION")
    ls = msub.add_parser("list", help="show the built-in models and whether they are pulled")
    ls.set_defaults(func=cmd_models_list)
    pull = msub.add_parser("pull", help="download, assemble and SHA-256-check a built-in model")
    pull.add_argument("names", nargs="+", metavar="NAME")
    pull.add_argument("--force", action="store_true", help="fetch again even if present")
    pull.set_defaults(func=cmd_models_pull)
    add = msub.add_parser(
        "add",
        help="record your own .gguf file (or Hugging Face folder) under a name, with its SHA-256",
        description="Record a model file of your own under a name: its header is read (an "
        "architecture or setting Speculant does not implement is refused now, not at the "
        "first load) and its SHA-256 is kept, so that loading it later, by the name or by "
        "its path, verifies it as pulled models are verified. A folder's digests go in a "
        "manifest.json inside it. Example: speculant models add ~/models/llama-3.1-8b.Q4_K_M.gguf "
        "--name llama-8b, then speculant generate --target llama-8b ...",
    )
    add.add_argument("path", metavar="PATH", help="a .gguf file or a Hugging Face model folder")
    add.add_argument("--name", default=None, help="the name to use (default: the file's stem)")
    add.set_defaults(func=cmd_models_add)
    remove = msub.add_parser(
        "remove", help="forget a model recorded by `models add` (its file is kept)"
    )
    remove.add_argument("name", metavar="NAME")
    remove.set_defaults(func=cmd_models_remove)
    _add_verify_args(
        msub.add_parser(
            "verify",
            help="check built-in models, model files or folders against their SHA-256 "
            "(or write a folder's manifest)",
            description=VERIFY_DESCRIPTION,
        )
    )
    models.set_defaults(func=lambda args: models.print_help() or 0)

    # `speculant verify`, the old spelling of `speculant models verify` (hidden).
    old = sub.add_parser(
        "verify", description="Deprecated: use `speculant models verify`. " + VERIFY_DESCRIPTION
    )
    _add_verify_args(old)
    old.set_defaults(deprecated_command=("speculant verify", "speculant models verify"))


def _add_verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("targets", nargs="+", metavar="NAME_OR_PATH")
    p.add_argument(
        "--write-manifest", action="store_true", help="hash the folders' files into manifest.json"
    )
    p.set_defaults(func=cmd_verify)


def cmd_models_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from speculant.models.registry import list_models, speculant_home

    table = Table(title=f"built-in models (cache: {speculant_home()})")
    for col in ("name", "description", "size", "pulled"):
        table.add_column(col)
    for m in list_models():
        table.add_row(
            m["name"],
            m["description"],
            f"{m['size'] / 1e6:,.0f} MB",
            "yes" if m["pulled"] else "no",
        )
    from speculant import native

    if native.available():
        table.caption = (
            f"--dtype auto (the default) runs each file's quantized blocks on the native "
            f"{native.kernel_label()} kernels ({', '.join(native.SUPPORTED_TYPES.values())}) "
            f"on {native.threads_label()}"
        )
    else:
        table.caption = (
            f"native kernels unavailable ({native.why_missing()}): --dtype auto loads "
            "int8 weights through PyTorch"
        )
    Console().print(table)
    from speculant.models import added

    mine = added.records()
    if mine:
        own = Table(title="added models (speculant models add)")
        for col in ("name", "path", "present"):
            own.add_column(col)
        for name, entry in sorted(mine.items()):
            own.add_row(name, entry["path"], "yes" if Path(entry["path"]).exists() else "NO")
        Console().print(own)
    return 0


def cmd_models_add(args: argparse.Namespace) -> int:
    from speculant.models import added

    try:
        name, what = added.add(Path(args.path), args.name)
    except added.AddError as exc:
        raise CliError(str(exc)) from None
    print(f"added {name}: {what}; load it as --target {name} (or by its path, verified)")
    return 0


def cmd_models_remove(args: argparse.Namespace) -> int:
    from speculant.models import added

    try:
        path = added.remove(args.name)
    except added.AddError as exc:
        raise CliError(str(exc)) from None
    print(f"removed {args.name} (the file {path} is kept)")
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from speculant.models.registry import get_known, pull

    for name in args.names:
        get_known(name)  # fail on a bad name before downloading anything
    for name in args.names:
        path = pull(name, force=args.force)
        print(f"{name}: {path}")
    return 0


def _is_eagle_head(folder: object) -> bool:
    from speculant.eagle.head import HEAD_FORMAT

    try:
        config = json.loads((Path(str(folder)) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("format") == HEAD_FORMAT


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash each target: a built-in name against the registry, a file, folder or
    EAGLE head against its manifest.json (or write that manifest)."""
    from speculant.models import added, integrity, registry

    bad = 0
    for target in args.targets:
        path = Path(target).expanduser()
        if target in registry.KNOWN_MODELS and not path.exists():
            ok = registry.verify(target)
            print(f"{target}: {'ok' if ok else 'MISMATCH or missing'}")
            bad += not ok
            continue
        recorded = added.path_of(target)
        if recorded is not None and not path.exists():
            path = recorded  # a name recorded by `models add`: its file or folder
            if not path.exists():
                print(f"{target}: MISSING ({path} no longer exists)")
                bad += 1
                continue
        if not path.exists():
            known = ", ".join(sorted(registry.KNOWN_MODELS))
            raise CliError(f"{target!r} is neither a built-in model ({known}) nor an existing path")
        folder = path if path.is_dir() else path.parent
        if path.is_dir() and _is_eagle_head(path):
            from speculant.eagle.head import HeadLoadError, load_head, save_head

            try:
                if args.write_manifest:
                    save_head(load_head(path, trust_unverified=True), path)
                    print(f"{target}: wrote {path / 'manifest.json'}")
                    continue
                load_head(path)
            except (integrity.IntegrityError, HeadLoadError) as exc:
                print(f"{target}: FAILED: {exc}")
                bad += 1
                continue
            print(f"{target}: ok (EAGLE head)")
            continue
        if args.write_manifest:
            print(f"{target}: wrote {integrity.write_manifest(folder)}")
            continue
        try:
            if path.is_dir():
                ok = integrity.check_folder_integrity(path)
            else:
                ok = integrity.check_integrity(path.resolve())
        except integrity.IntegrityError as exc:
            print(f"{target}: FAILED: {exc}")
            bad += 1
            continue
        print(f"{target}: {'ok' if ok else 'unverified (no manifest; see --write-manifest)'}")
        bad += not ok
    return 1 if bad else 0
