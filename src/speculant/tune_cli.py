"""`speculant tune`: measure the native kernels' knobs on this machine and keep the
settings that win (speculant.native.autotune)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from speculant.argtypes import positive_int

EPILOG = """\
examples:
  speculant tune                 # measure (a few minutes), save, apply from then on
  speculant tune --dry-run       # measure and print, save nothing
  speculant tune --show          # what is saved, and whether it applies here
  speculant tune --reset         # remove the saved tuning: the built-in defaults again

Every knob is bitwise neutral: tuning changes speed, never a token. Whole passes of the
model over 1, 4 and 8 tokens take turns (one-token decode steps weigh half); a knob's
alternative is kept only if it costs at least 2% less and wins two thirds of the rounds.
Where a core's hardware threads make one thread per core fewer than one per CPU, the
thread count is measured first (never over --threads or SPECULANT_THREADS). The file is
tied to this CPU, its usable CPUs and the code path; SPECULANT_TUNING=0 ignores it.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune",
        help="measure the native kernels' knobs on this CPU and keep the faster settings",
        description="Measure the native kernels' tuning knobs (which code each pass takes, "
        "how far ahead weights are prefetched) on this machine with whole passes of a "
        "model, and save the settings that win; load_model applies them from then on.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        default="qwen2.5-coder-1.5b-instruct",
        help="the GGUF model whose passes are timed (default: the built-in default model)",
    )
    p.add_argument("--rounds", type=positive_int, default=7, help="rounds per knob (7)")
    p.add_argument("--context", type=positive_int, default=256, help="context tokens (256)")
    p.add_argument("--dry-run", action="store_true", help="measure and print; save nothing")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="print the saved tuning and exit")
    what.add_argument("--reset", action="store_true", help="remove the saved tuning and exit")
    p.add_argument(
        "--trust-unverified", action="store_true", help="load a model file that fails its check"
    )
    p.set_defaults(func=cmd_tune)
    return p


def cmd_tune(args: argparse.Namespace) -> int:
    from speculant import native

    if not native.available():
        raise RuntimeError(f"native kernels are unavailable: {native.why_missing()}")
    from speculant.native import autotune

    path = autotune.tuning_path()
    if args.reset:
        if path.exists():
            path.unlink()
            print(f"removed {path}: the built-in defaults apply")
        else:
            print(f"no saved tuning at {path}")
        return 0
    if args.show:
        if not path.is_file():
            print(f"no saved tuning at {path}")
            return 0
        knobs, why = autotune.load_saved(path)
        print(path.read_text().rstrip())
        print(
            f"applies here: {autotune.describe(knobs) or 'the defaults'}"
            if knobs is not None
            else f"does not apply here: {why}"
        )
        return 0
    from speculant.models.model import load_model

    model = load_model(args.target, dtype="gguf", trust_unverified=args.trust_unverified)
    if not model.net.native_ops:
        raise RuntimeError(f"{args.target} does not run on the native kernels")
    native.share_cores_if_native(model, None)
    print(
        f"tuning on {autotune.cpu_signature()['model'] or 'this CPU'} "
        f"({native.kernel_label()}), {args.rounds} rounds a knob",
        file=sys.stderr,
    )
    result = autotune.run_tune(
        model,
        rounds=args.rounds,
        context=args.context,
        say=lambda text: print(text, file=sys.stderr),
    )
    chosen = autotune.describe(result["knobs"]) or "the built-in defaults"
    if args.dry_run:
        print(json.dumps(result, indent=2))
        print(f"would keep: {chosen} (nothing saved: --dry-run)", file=sys.stderr)
        return 0
    saved = autotune.save(result, path)
    print(f"kept: {chosen}; saved to {saved} (load_model applies it on this CPU)")
    return 0
