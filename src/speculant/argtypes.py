"""argparse value types shared by the subcommands: each names the bad value and what
is allowed."""

from __future__ import annotations

import argparse


def k_value(text: str) -> int | str:
    """num_speculative_tokens: an integer 0..64, or auto."""
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use an integer 0..64 or 'auto'") from None
    if not 0 <= value <= 64:
        raise argparse.ArgumentTypeError(f"{value} is out of range: use 0..64 or 'auto'")
    return value


def _int_at_least(text: str, least: int, also: str = "") -> int:
    """An integer >= least; the error names the value and what is allowed (plus `also`,
    another accepted spelling)."""
    allowed = f">= {least}{also}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use an integer {allowed}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is out of range: use {allowed}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0)


def seconds(text: str, positive: bool = False) -> float:
    """A duration in seconds: a finite number >= 0 (> 0 when positive)."""
    allowed = "a number of seconds " + ("> 0" if positive else ">= 0")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use {allowed}") from None
    if not (value > 0 if positive else value >= 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is out of range: use {allowed}")
    return value


def positive_seconds(text: str) -> float:
    return seconds(text, positive=True)


def port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range: use 1..65535")
    return value


# The weight / activation formats the command lines offer (models.model.DTYPE_NAMES plus
# "auto"); kept here so that building a parser does not import torch.
DTYPE_CHOICES = ("auto", "bfloat16", "float32", "int8", "int4", "gguf")


def add_dtype_args(parser: argparse.ArgumentParser) -> None:
    """--dtype / --draft-dtype, both "auto" by default: a .gguf file's own quantized blocks
    on the native kernels (speculant.native), else bfloat16 (target) / int8 (draft)."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="target weights: auto (default) = gguf for a .gguf model (the file's own "
        "quantized blocks run as stored by the native kernels; int8 through PyTorch if they "
        "are missing), bfloat16 for a Hugging Face folder; int8 / int4 = weight-only "
        "formats with bfloat16 activations",
    )
    parser.add_argument(
        "--draft-dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="draft weights: auto (default) = gguf for a .gguf model, int8 for a folder; a "
        "lower-precision draft stays lossless, since verification filters its errors",
    )


def seed_value(text: str) -> int | None:
    """A sampling seed: an integer >= 0, or 'none' for unseeded sampling."""
    return None if text.lower() == "none" else _int_at_least(text, 0, " or 'none'")
