"""`speculant bench`: flags into a BenchConfig, a progress bar while it runs, then the
table, results.json, results.csv and plots."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from speculant.argtypes import add_dtype_args, positive_int, seed_value
from speculant.bench.measure import DEFAULT_WATTS_PER_CORE
from speculant.bench.peers import PEER_GROUPS, PEER_NAMES
from speculant.bench.workloads import WORKLOAD_NAMES

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

EPILOG = (
    """\
examples:
  speculant bench --limit 2 --max-tokens 64                      # every method, every workload
  speculant bench --workloads code,extraction --methods ngram,suffix --k 3,5,8
  speculant bench --methods draft --peers transformers-assisted,llama.cpp-lookup
  speculant bench --target smollm2-135m-instruct --methods ngram,suffix --peers all --limit 1

method specs: METHOD[:K[:SKIP_RATIO]]; a METHOD without K runs once per k in --k.
peers: """
    + ", ".join([*PEER_NAMES, *PEER_GROUPS])
    + """ (pip install 'speculant[peers]').
"""
)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _k_list(text: str) -> list[int | str]:
    from speculant.bench.runner import parse_k

    try:
        return [parse_k(part) for part in _csv(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _workloads(text: str) -> list[str]:
    names = _csv(text)
    if names == ["all"]:
        return list(WORKLOAD_NAMES)
    bad = [n for n in names if n not in WORKLOAD_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown workload {bad[0]!r}: use all or some of {', '.join(WORKLOAD_NAMES)}"
        )
    return names


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` on the `speculant` command's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark every method and peer on the shipped workloads",
        description="Run plain decoding, every proposer and (optionally) other engines on "
        "the same prompts in one process; print a table, write results.json, "
        "results.csv and plots. Greedy runs check that every lossless method "
        "reproduces the baseline token for token (exit status 1 if not).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model (name, .gguf, folder)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for method 'draft'")
    p.add_argument(
        "--workloads",
        type=_workloads,
        default=list(WORKLOAD_NAMES),
        help=f"comma-separated, or all (default): {', '.join(WORKLOAD_NAMES)}",
    )
    p.add_argument(
        "--methods",
        type=_csv,
        default=None,
        help="comma-separated METHOD[:K[:SKIP_RATIO]] (default: every proposer); "
        "'none', the baseline, always runs",
    )
    p.add_argument(
        "--k",
        type=_k_list,
        default=[5],
        metavar="K,...",
        help="k sweep for methods given without K, e.g. 3,5,8,auto (default 5)",
    )
    p.add_argument(
        "--peers",
        type=_csv,
        default=[],
        help="comma-separated peers or groups (all, hf, llama, llama-cli: llama.cpp's own"
        " llama-completion and llama-speculative, from $SPECULANT_LLAMA_CPP_BIN or PATH);"
        " default none",
    )
    p.add_argument(
        "--limit", type=positive_int, default=None, help="prompts per workload (all: 10)"
    )
    p.add_argument(
        "--peer-limit",
        type=positive_int,
        default=None,
        help="prompts per workload for the peers (default: as --limit); speedups stay "
        "per-prompt against our baseline on the same prompts",
    )
    p.add_argument(
        "--eagle-head",
        default=None,
        metavar="DIR",
        help="head folder for method eagle (eagle[:K[:TOPK[:TOKENS]]], e.g. eagle:5:1 a "
        "chain, eagle:5:4:16 a tree)",
    )
    p.add_argument("--max-tokens", type=positive_int, default=128, help="new tokens per generation")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (lossless check)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--seed",
        type=seed_value,
        default=0,
        help="sampling seed: a seeded request's text is the same for every method, so "
        "sampled runs are checked against the baseline too; 'none' measures unseeded "
        "sampling (the standard accept / resample rule, its higher acceptance)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    add_dtype_args(p)
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench"), help="output folder")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generations")
    p.add_argument(
        "--watts-per-core",
        type=float,
        default=DEFAULT_WATTS_PER_CORE,
        help="power per busy core for the energy estimate, when RAPL counters are unreadable",
    )
    p.add_argument("--trust-unverified", action="store_true", help="load unverified GGUF files")
    p.set_defaults(func=cmd_bench)
    return p


class _RichProgress:
    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = console
        self.bar = Progress(
            TextColumn("[bold]bench[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=console,
            transient=True,
        )
        self.task = self.bar.add_task("", total=None)

    def start(self, total: int) -> None:
        self.bar.update(self.task, total=total)

    def advance(self, text: str) -> None:
        self.bar.update(self.task, advance=1, description=text)

    def message(self, text: str) -> None:
        self.bar.console.print(f"[yellow]{text}[/]")


def cmd_bench(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from speculant.bench.report import peer_lines, render_table, write_outputs
    from speculant.bench.runner import BenchConfig, parse_methods, run_bench
    from speculant.models.model import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    specs = parse_methods(args.methods, args.k)  # fail on a bad spec before loading models
    needs_draft = any(s.method == "draft" for s in specs) or any(
        p in ("all", "hf", "transformers-assisted") for p in args.peers
    )
    console = Console(stderr=True)
    trust = args.trust_unverified
    target = load_model(args.target, dtype=args.dtype, trust_unverified=trust)
    draft = None
    if needs_draft:
        draft = load_model(
            args.draft, dtype=args.draft_dtype, trust_unverified=trust, auto_fallback="int8"
        )
    if args.threads is None:
        from speculant import native

        native.share_cores_if_native(target, draft)
    config = BenchConfig(
        workloads=args.workloads,
        methods=args.methods,
        ks=args.k,
        peers=args.peers,
        limit=args.limit,
        peer_limit=args.peer_limit,
        eagle_head=args.eagle_head,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        warmup=not args.no_warmup,
        watts_per_core=args.watts_per_core,
    )
    command = "speculant " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    progress = _RichProgress(console)
    with progress.bar:
        result = run_bench(target, draft, config, progress=progress, command=command)
    # A file or pipe gets a wide table, not rich's 80-column default.
    out = Console() if sys.stdout.isatty() else Console(width=150)
    out.print(render_table(result))
    for line in peer_lines(result):
        out.print(f"[cyan]peer[/] {line}")
    for line in result.skipped:
        out.print(f"[yellow]{line}[/]")
    out.print(f"energy: {result.meta['energy_source']}")
    paths = write_outputs(result, args.out, plots=not args.no_plots)
    out.print("wrote " + ", ".join(str(p) for p in paths))
    if result.lossless_failures:
        out.print(
            "[bold red]lossless check FAILED[/] (greedy or seeded output differs from plain "
            "decoding): " + "; ".join(result.lossless_failures)
        )
        return 1
    if config.reproducible:
        out.print("[green]lossless check passed[/]: every method matched plain decoding")
    return 0
