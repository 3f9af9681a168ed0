"""`speculant` command line: subcommands parse flags into config, then call the library."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence

from speculant.argtypes import (
    CliError,
    add_dtype_args,
    add_proposer_args,
    deprecation_note,
    k_value,
    nonneg_int,
    proposer_options,
)

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_METHOD = "ngram"
DEFAULT_K = 3
# ngram drafts only as far as its match supports (see proposers/ngram.py), so a larger k
# costs little where the output does not copy: ngram:5 beat ngram:3 on code and edit
# prompts and matched it on chat and extraction, and k = 7 with 8-token n-grams beat k = 5
# with 4-token ones on code and edits (a pass of 8 rows: docs/performance.md).
DEFAULT_K_BY_METHOD = {"ngram": 7}

EPILOG = """\
examples:
  speculant generate "def quicksort(xs):"                  # default pair, greedy
  speculant generate "Write a haiku" --chat --temperature 0.8 --top-p 0.95 --seed 1
  speculant generate "print(1)" --method none --json      # plain decoding baseline
  speculant generate "Fix the bug: ..." --method ngram -k auto   # prompt lookup, adaptive k
  speculant eagle train --target smollm2-135m-instruct --out heads/smollm2   # EAGLE head
  speculant generate "def fib(n):" --target smollm2-135m-instruct --method eagle \\
      --eagle-head heads/smollm2 -k 5            # EAGLE head; --tree-topk 4: trees
  speculant models list
  speculant models pull smollm2-135m-instruct
  speculant models verify heads/smollm2 path/to/model.gguf   # SHA-256 against manifests
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speculant",
        description="Lossless speculative decoding: a cheap proposer drafts tokens, the "
        "target verifies them in one pass, and rejection sampling keeps the target's "
        "own output distribution.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate a continuation of PROMPT. Greedy by default (temperature 0): "
        "the output is then token for token what the target alone would produce.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    gen.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    gen.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="target model: a built-in name, a .gguf file or a HF folder",
    )
    gen.add_argument(
        "--draft",
        default=None,
        help=f"draft model for --method draft (must share the target's tokenizer); "
        f"giving one selects --method draft (default: {DEFAULT_DRAFT})%(default).0s",
    )
    gen.add_argument(
        "--method",
        default=None,
        choices=_methods(),
        help=f"how drafts are proposed; 'none' is plain decoding with the target "
        f"(default: {DEFAULT_METHOD}, or draft when --draft is given: on a CPU the 0.5B "
        "draft costs about half a target pass per token, so prompt lookup, which costs "
        "nothing and drafts only where the output repeats earlier text, is faster; see "
        "docs/performance.md)%(default).0s",
    )
    gen.add_argument(
        "--num-speculative-tokens",
        "-k",
        type=k_value,
        default=None,
        metavar="K",
        help="tokens drafted per verification pass (γ), or 'auto' to choose "
        "k per step from the live acceptance rate and measured costs (default: "
        f"{DEFAULT_K_BY_METHOD['ngram']} for ngram, which drafts only as far as its match "
        f"supports; {DEFAULT_K} otherwise)",
    )
    add_proposer_args(gen)
    gen.add_argument("--max-tokens", type=int, default=128, help="most new tokens")
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy; otherwise the sampling temperature",
    )
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    gen.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: smallest set reaching this mass; 1 = off",
    )
    gen.add_argument(
        "--seed",
        type=nonneg_int,
        default=None,
        help="seed for reproducible sampling: the same seed gives the same text with any "
        "--method and any -k (drafts are then judged by a coupled rule that accepts a "
        "sampled draft somewhat less often; see docs/how-it-works.md)",
    )
    gen.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when TEXT appears (repeatable)",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    add_dtype_args(gen)
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user message with the model's chat template",
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, token_ids, finish_reason, stats)",
    )
    gen.add_argument(
        "--trust-unverified",
        action="store_true",
        help="load model files that fail their SHA-256 check (logged)",
    )
    gen.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for the kernels (default: one per CPU this process may "
        "use, within its CPU quota, or $SPECULANT_THREADS); beside the native kernels "
        "PyTorch keeps one",
    )
    gen.add_argument(
        "--stream-cadence-ms",
        type=float,
        default=None,
        help="print one token every N ms, whatever was accepted together (hides the "
        "acceptance timing side channel; see docs/security.md)",
    )
    gen.set_defaults(func=cmd_generate)

    from speculant.models.cli import add_parsers as add_models_parsers

    add_models_parsers(sub)
    from speculant.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    from speculant.server.cli import add_parser as add_serve_parser

    add_serve_parser(sub)
    from speculant.plan_cli import add_parser as add_plan_parser

    add_plan_parser(sub)
    from speculant.tune_cli import add_parser as add_tune_parser

    add_tune_parser(sub)
    from speculant.eagle.cli import add_parsers as add_eagle_parsers

    add_eagle_parsers(sub)
    return parser


def _methods() -> list[str]:
    from speculant.proposers import available_methods

    return available_methods()


def cmd_generate(args: argparse.Namespace) -> int:
    from speculant import Engine, SamplingParams, load_model, native

    try:
        native.use_threads(args.threads)
    except ValueError as err:  # --threads out of range
        raise CliError(str(err)) from None
    if args.method is None:
        args.method = "draft" if args.draft is not None else DEFAULT_METHOD
    if args.draft is None:
        args.draft = DEFAULT_DRAFT
    if args.num_speculative_tokens is None:
        args.num_speculative_tokens = DEFAULT_K_BY_METHOD.get(args.method, DEFAULT_K)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop),
    )
    progress = not args.json or sys.stderr.isatty()
    trust = args.trust_unverified
    kv = args.kv_dtype
    target = load_model(
        args.target, dtype=args.dtype, progress=progress, trust_unverified=trust, kv_dtype=kv
    )
    draft = None
    if args.method == "draft":
        draft = load_model(
            args.draft,
            dtype=args.draft_dtype,
            progress=progress,
            trust_unverified=trust,
            auto_fallback="int8",
            kv_dtype=kv,
        )
    native.share_cores_if_native(target, draft)
    engine = Engine(
        target,
        draft=draft,
        method=args.method,
        num_speculative_tokens=args.num_speculative_tokens,
        proposer_options=proposer_options(args.method, args),
    )
    tok = target.tokenizer
    if tok is None:
        raise CliError(f"model {args.target} has no tokenizer: text prompts need one")
    if args.chat:
        if not tok.chat_template:
            raise CliError(f"model {args.target} has no chat template: drop --chat")
        text = tok.apply_chat_template([{"role": "user", "content": prompt}])
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(prompt)
    cadence = args.stream_cadence_ms
    if cadence is not None and not cadence > 0:
        raise CliError(f"--stream-cadence-ms={cadence} is out of range: use > 0")
    if args.json:
        res = engine.generate(ids, params)
    else:
        stream = engine.stream(ids, params)
        pieces: Iterable[str] = (chunk.text for chunk in stream)
        ticker = None
        if cadence:
            from speculant.cadence import Ticker, paced

            ticker = Ticker(cadence / 1000)
            pieces = paced(stream, lambda ids: tok.decode(ids, skip_special_tokens=True), ticker)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if ticker is not None and ticker.late:
            print(
                f"note: {ticker.late} of {ticker.ticks} tokens missed their {cadence:g} ms slot "
                "(generation was slower): raise --stream-cadence-ms to hide timing fully",
                file=sys.stderr,
            )
        assert stream.result is not None
        res = stream.result
    out = {
        "text": res.text,
        "token_ids": res.token_ids,
        "finish_reason": res.finish_reason,
        "stats": res.stats.to_dict(),
    }
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        s = res.stats
        line = (
            f"[{engine.method}] {s.num_generated} tokens, {s.tokens_per_second:.1f} tok/s, "
            f"{s.target_forwards} target passes, {s.mean_accepted_length:.2f} tokens/pass"
        )
        if s.num_drafted:
            line += f", acceptance {s.acceptance_rate:.0%} ({s.num_accepted}/{s.num_drafted})"
        print(line + f", finish: {res.finish_reason}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    deprecated = getattr(args, "deprecated_command", None)
    if deprecated:
        deprecation_note(*deprecated)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, FileNotFoundError, RuntimeError, OSError) as exc:
        # Our errors name the bad value and what is allowed; no traceback for users.
        print(f"speculant: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 (anything else is a bug: said so, logged)
        where = _crash_log(exc)
        print(
            f"speculant: internal error (a bug, please report it): {type(exc).__name__}: "
            f"{exc}; the traceback is in {where}",
            file=sys.stderr,
        )
        return 1


def _crash_log(exc: BaseException) -> str:
    """Write exc's traceback under $SPECULANT_HOME/logs; its path (or why not)."""
    import time
    import traceback

    from speculant.models.registry import speculant_home

    folder = speculant_home() / "logs"
    path = folder / f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{id(exc):x}.log"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(
            " ".join(sys.argv) + "\n\n" + "".join(traceback.format_exception(exc)),
            encoding="utf-8",
        )
    except OSError as err:
        return f"nowhere ({folder} cannot be written: {err.strerror})"
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
