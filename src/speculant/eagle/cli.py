"""`speculant eagle train` and `speculant eagle export`: train an EAGLE head, hand it on."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from speculant.argtypes import DTYPE_CHOICES, nonneg_int, positive_int

# Every weight format but auto: training and self-distillation name theirs.
_DTYPES = [d for d in DTYPE_CHOICES if d != "auto"]

EPILOG_TRAIN = """\
examples:
  speculant eagle train --target smollm2-135m-instruct --out heads/smollm2 --max-steps 300
  speculant eagle train --target qwen2.5-coder-0.5b-instruct --data humaneval,mtbench \\
      --self-distill 24 --out heads/qwen05          # add the target's own answers
  speculant eagle train --target ... --out DIR                  # again: resumes DIR
  speculant generate "def fib(n):" --target qwen2.5-coder-0.5b-instruct \\
      --method eagle --eagle-head heads/qwen05

The target runs once over the corpus (features cached in DIR/data.pt), then the head
trains with checkpoints in DIR/checkpoint.pt; rerunning the command resumes. DIR ends
with head.safetensors, config.json, manifest.json (SHA-256) and train.json.
"""

EPILOG_EXPORT = """\
examples:
  speculant eagle export heads/qwen05 --out exported/qwen05
  vllm serve Qwen/Qwen2.5-Coder-0.5B-Instruct \\
      --speculative-config '{"method": "eagle", "model": "exported/qwen05/vllm", \\
                             "num_speculative_tokens": 5}'
See docs/eagle.md for the layout and the SGLang command.
"""


# The help of `eagle train` (and of its old spelling `train eagle`).
TRAIN: dict[str, Any] = {
    "description": "Train an EAGLE draft head for TARGET on CPU or GPU: run the target over "
    "a corpus to collect its features, then fit one decoder layer that predicts the "
    "next feature from the current one and the next token's embedding.",
    "epilog": EPILOG_TRAIN,
    "formatter_class": argparse.RawDescriptionHelpFormatter,
}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register `eagle train` and `eagle export` (and the deprecated `train eagle`)."""
    ex = sub.add_parser("eagle", help="EAGLE draft heads: train one for a target, export it")
    esub = ex.add_subparsers(dest="eagle_command", metavar="ACTION")
    _add_train_args(
        esub.add_parser("train", help="train an EAGLE feature-level draft head", **TRAIN)
    )
    export = esub.add_parser(
        "export",
        help="write a head in the EAGLE checkpoint layout vLLM and SGLang load",
        epilog=EPILOG_EXPORT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("head", type=Path, help="a head folder from `speculant eagle train`")
    export.add_argument(
        "--out", required=True, type=Path, help="output folder (vllm/ and sglang/ inside)"
    )
    export.add_argument("--trust-unverified", action="store_true")
    export.set_defaults(func=cmd_export)
    ex.set_defaults(func=lambda args: ex.print_help() or 0)

    # `speculant train eagle`, the old spelling of `speculant eagle train` (hidden).
    train = sub.add_parser("train", description="Deprecated: use `speculant eagle train`.")
    tsub = train.add_subparsers(dest="train_command", metavar="KIND")
    _add_train_args(tsub.add_parser("eagle", **TRAIN))
    train.set_defaults(
        func=lambda args: train.print_help() or 0,
        deprecated_command=("speculant train eagle", "speculant eagle train"),
    )


def _add_train_args(eagle: argparse.ArgumentParser) -> None:
    from speculant.eagle.data import BUILTIN_SOURCES
    from speculant.eagle.train import TrainOptions

    d = TrainOptions()
    eagle.add_argument(
        "--target", required=True, help="target model (built-in name, .gguf, HF folder)"
    )
    eagle.add_argument(
        "--data",
        default="humaneval,mtbench",
        help=f"comma-separated sources: built-in {', '.join(BUILTIN_SOURCES)} (downloaded; "
        "the benchmark's prompts are held out), .txt files, or .jsonl files with 'text' or "
        "'turns' (+ 'answers') per row",
    )
    eagle.add_argument(
        "--out", required=True, type=Path, help="output folder (resumes if it exists)"
    )
    eagle.add_argument(
        "--dtype",
        default="float32",
        choices=_DTYPES,
        help="target dtype while collecting features",
    )
    eagle.add_argument("--max-steps", type=positive_int, default=d.steps, help="training steps")
    eagle.add_argument("--batch", type=positive_int, default=d.batch, help="sequences per step")
    eagle.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    eagle.add_argument(
        "--seq-len",
        type=positive_int,
        default=d.seq_len,
        help="tokens per sequence (longer ones are cut)",
    )
    eagle.add_argument(
        "--max-data-tokens",
        type=positive_int,
        default=d.max_data_tokens,
        help="stop collecting features after this many tokens",
    )
    eagle.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=d.draft_vocab,
        help="rows of the drafting LM head: the most frequent target tokens "
        "(the full vocabulary still verifies, so output is unchanged)",
    )
    eagle.add_argument(
        "--self-distill",
        type=nonneg_int,
        default=d.self_distill,
        help="add the target's own greedy answers to this many corpus prompts",
    )
    eagle.add_argument(
        "--distill-dtype",
        default="int8",
        choices=_DTYPES,
        help="target dtype for writing the self-distilled answers (int8 decodes several "
        "times faster than float32 on CPU; features still come from --dtype)",
    )
    eagle.add_argument(
        "--distill-tokens",
        type=positive_int,
        default=d.distill_tokens,
        help="longest self-distilled answer",
    )
    eagle.add_argument(
        "--save-every", type=positive_int, default=d.save_every, help="checkpoint interval (steps)"
    )
    eagle.add_argument("--seed", type=nonneg_int, default=d.seed)
    eagle.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="threads for training and the target's kernels (default: PyTorch's, and one "
        "per usable CPU for the native kernels)",
    )
    eagle.add_argument(
        "--trust-unverified",
        action="store_true",
        help="load a target that fails its SHA-256 check (logged)",
    )
    eagle.set_defaults(func=cmd_train_eagle)


def cmd_train_eagle(args: argparse.Namespace) -> int:
    from speculant import native
    from speculant.eagle.train import TrainError, TrainOptions, run
    from speculant.models.model import load_model

    native.use_threads(args.threads)
    if not args.lr > 0:
        raise TrainError(f"--lr={args.lr} is out of range: use > 0")
    sources = [s.strip() for s in args.data.split(",") if s.strip()]
    if not sources:
        raise TrainError("--data names no source")
    opts = TrainOptions(
        seq_len=args.seq_len,
        max_data_tokens=args.max_data_tokens,
        draft_vocab=args.draft_vocab,
        steps=args.max_steps,
        batch=args.batch,
        lr=args.lr,
        save_every=args.save_every,
        seed=args.seed,
        self_distill=args.self_distill,
        distill_tokens=args.distill_tokens,
        warmup=min(TrainOptions().warmup, max(1, args.max_steps // 10)),
    )
    target = load_model(args.target, dtype=args.dtype, trust_unverified=args.trust_unverified)
    generator = None
    if args.self_distill and args.distill_dtype != args.dtype:
        generator = load_model(
            args.target, dtype=args.distill_dtype, trust_unverified=args.trust_unverified
        )
    summary = run(
        target,
        str(args.target),
        sources,
        args.out,
        opts,
        progress=sys.stderr.isatty(),
        generator_model=generator,
    )
    print(json.dumps(summary, indent=2))
    print(
        f"head written to {args.out} (head.safetensors, config.json, manifest.json)",
        file=sys.stderr,
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from speculant.eagle.export import export_head

    paths = export_head(args.head, args.out, trust_unverified=args.trust_unverified)
    for engine, path in paths.items():
        print(f"{engine}: {path}")
    return 0
