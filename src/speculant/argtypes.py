"""argparse value types shared by the subcommands: each names the bad value and what
is allowed."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def deprecation_note(old: str, new: str) -> None:
    """The one-line note an old spelling prints on stderr (it still works)."""
    print(f"speculant: note: `{old}` is deprecated: use `{new}`", file=sys.stderr)


class _DeprecatedOption(argparse.Action):
    """A hidden old spelling of an option: stores into the new option's dest, with a note."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str, **kw: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        deprecation_note(option_string or self.option_strings[0], self.new)
        setattr(namespace, self.dest, values)


def add_deprecated_option(
    parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kw: Any
) -> None:
    """Accept `old` as a hidden alias of option `new` (same dest, same value checks)."""
    parser.add_argument(
        old,
        dest=dest,
        action=_DeprecatedOption,
        new=new,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **kw,
    )


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


def seconds(text: str, positive: bool = False, what: str = "a number of seconds") -> float:
    """A duration in seconds: a finite number >= 0 (> 0 when positive)."""
    allowed = what + (" > 0" if positive else " >= 0")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use {allowed}") from None
    if not (value > 0 if positive else value >= 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is out of range: use {allowed}")
    return value


def positive_seconds(text: str) -> float:
    return seconds(text, positive=True)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return seconds(text, positive=True, what="a number")


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
    add_kv_dtype_arg(parser)


# The key/value caches' element types (models.model.KV_DTYPE_NAMES, kept torch-free here).
KV_DTYPE_CHOICES = ("auto", "float32", "float16")


def add_kv_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """--kv-dtype: the element type of the key/value caches (target and draft)."""
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        choices=KV_DTYPE_CHOICES,
        help="key/value cache elements: auto (default) = the activations' dtype (float32 on "
        "the native kernels); float16 = half the cache's memory and reads, keys and values "
        "rounded to float16 as llama.cpp stores them (native kernels only; attention still "
        "computes in float32, and speculative output stays identical to plain decoding "
        "with the same cache type)",
    )


def seed_value(text: str) -> int | None:
    """A sampling seed: an integer >= 0, or 'none' for unseeded sampling."""
    return None if text.lower() == "none" else _int_at_least(text, 0, " or 'none'")


def int_list(text: str) -> list[int]:
    """Comma-separated integers (layer indices)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use comma-separated layer indices") from None


def add_proposer_args(parser: argparse.ArgumentParser) -> None:
    """The options of each drafting method, the same for generate and serve."""
    g = parser.add_argument_group("method options")
    g.add_argument(
        "--ngram-max",
        type=int,
        default=8,
        help="ngram: longest suffix matched against earlier text",
    )
    g.add_argument(
        "--ngram-min",
        type=int,
        default=2,
        help="ngram: shortest suffix matched against earlier text",
    )
    g.add_argument(
        "--skip-layers",
        type=int_list,
        default=None,
        metavar="I,J,...",
        help="layer-skip: target layers to skip when drafting "
        "(default: chosen by a one-pass calibration)",
    )
    g.add_argument(
        "--skip-ratio",
        type=float,
        default=0.5,
        help="layer-skip: share of layers the calibration skips",
    )
    g.add_argument(
        "--eagle-head",
        default=None,
        metavar="DIR",
        help="eagle: a head folder from `speculant eagle train` for this target",
    )
    g.add_argument(
        "--tree-topk",
        type=int,
        default=1,
        help="eagle: candidates per tree node; 1 = a chain sampled from the head's q (the "
        "fastest on CPUs here), 2+ = an EAGLE-2 dynamic tree",
    )
    g.add_argument(
        "--tree-tokens",
        type=int,
        default=16,
        help="eagle: draft tokens per tree (the most confident ones); -k sets its depth",
    )


def proposer_options(method: str, args: argparse.Namespace) -> dict[str, object]:
    """The proposer_options for `method` from the flags of add_proposer_args."""
    if method == "ngram":
        return {"ngram_max": args.ngram_max, "ngram_min": args.ngram_min}
    if method == "layer-skip":
        return {"skip_layers": args.skip_layers, "skip_ratio": args.skip_ratio}
    if method == "eagle":
        return {
            "eagle_head": args.eagle_head,
            "tree_topk": args.tree_topk,
            "tree_tokens": args.tree_tokens,
            "trust_unverified": args.trust_unverified,
        }
    return {}


# vLLM's --speculative-config methods, and ours, by the name this project uses.
SPEC_METHODS = {
    "draft_model": "draft",
    "ngram": "ngram",
    "eagle": "eagle",
    "eagle3": "eagle",
    "suffix": "suffix",
    "draft": "draft",
    "layer-skip": "layer-skip",
    "none": "none",
}
SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def speculative_config(text: str) -> dict[str, object]:
    """vLLM's --speculative-config JSON: {"method", "model", "num_speculative_tokens",
    "prompt_lookup_max", "prompt_lookup_min"}, checked and with the method named as this
    project names it (a "model" without a "method" is a draft model)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    unknown = sorted(set(config) - set(SPEC_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unsupported key(s) {', '.join(unknown)}: use {', '.join(SPEC_KEYS)}"
        )
    method = config.get("method") or ("draft_model" if config.get("model") else None)
    if method not in SPEC_METHODS:
        raise argparse.ArgumentTypeError(
            f"method {method!r} is not supported: use one of {', '.join(SPEC_METHODS)}"
        )
    out: dict[str, object] = {"method": SPEC_METHODS[method]}
    if out["method"] in ("draft", "eagle") and not isinstance(config.get("model"), str):
        raise argparse.ArgumentTypeError(
            f'method {method!r} needs "model": a draft model, or an EAGLE head folder'
        )
    if "model" in config:
        out["model"] = config["model"]
    if "num_speculative_tokens" in config:
        out["num_speculative_tokens"] = k_value(str(config["num_speculative_tokens"]))
    for key, ours in (("prompt_lookup_max", "ngram_max"), ("prompt_lookup_min", "ngram_min")):
        if key in config:
            out[ours] = _int_at_least(str(config[key]), 1)
    return out
