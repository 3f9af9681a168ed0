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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range: use >= 1")
    return value


def nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use an integer >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is out of range: use >= 0")
    return value


def port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range: use 1..65535")
    return value
