"""`speculant bench`: flags into a BenchConfig, a progress bar while it runs, then the
table, results.json, results.csv and plots. `speculant bench --serve`: flags into a
ServeConfig (speculant.bench.serve), the server-load benchmark."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from speculant.argtypes import (
    DTYPE_CHOICES,
    KV_DTYPE_CHOICES,
    add_dtype_args,
    positive_int,
    seed_value,
)
from speculant.bench.measure import DEFAULT_WATTS_PER_CORE
from speculant.bench.peers import PEER_GROUPS, PEER_NAMES
from speculant.bench.quant import add_quant_args
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
  speculant bench --workloads chat --limit 2 --methods layer-skip:auto:0.75 --fresh-engines

pass cost (--pass-cost: one pass over w new tokens, ours and llama-bench's):
  speculant bench --pass-cost --draft none --pass-dtypes bfloat16,int8,int4,gguf
  speculant bench --pass-cost --pass-threads 2,1 --kernel-paths avx2,avx512vnni

server load (--serve: the real server on loopback, concurrent streaming requests):
  speculant bench --serve                                        # none, draft:3, ngram:3 at c=1,4,8
  speculant bench --serve --methods ngram:3,draft:auto --concurrency 1,2 --max-tokens 16
  speculant bench --serve --prefix-caching on,off --max-num-batched-tokens 0,32
  speculant bench --serve --no-load --methods draft:3 --long-prompt-join --chat-second-turn
  speculant bench --serve --no-load --methods draft:auto,ngram:3 --batch --batch-seqs 8

method specs: METHOD[:K[:SKIP_RATIO]]; a METHOD without K runs once per k in --k.
peers: """
    + ", ".join([*PEER_NAMES, *PEER_GROUPS])
    + """ (pip install 'speculant[peers]').
"""
)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _k_list(text: str) -> list[int | str]:
    from speculant.bench.specs import parse_k

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


def _int_list(least: int) -> Any:
    def parse(text: str) -> list[int]:
        values = []
        for part in _csv(text):
            try:
                value = int(part)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{part!r}: use comma-separated integers >= {least}"
                ) from None
            if value < least:
                raise argparse.ArgumentTypeError(
                    f"{value} is out of range: use comma-separated integers >= {least}"
                )
            values.append(value)
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least one integer >= {least}")
        return list(dict.fromkeys(values))

    return parse


def _dtype_list(text: str) -> list[str]:
    names = _csv(text)
    bad = [n for n in names if n not in DTYPE_CHOICES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"dtype {bad[0]!r}: use some of {', '.join(DTYPE_CHOICES)}"
        )
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one dtype, e.g. bfloat16,int8")
    return list(dict.fromkeys(names))


def _kv_dtype_list(text: str) -> list[str]:
    names = _csv(text)
    known = [n for n in KV_DTYPE_CHOICES if n != "auto"]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"kv dtype {(bad or [text])[0]!r}: use some of {', '.join(known)}"
        )
    return list(dict.fromkeys(names))


def _on_off(text: str) -> list[bool]:
    words = {"on": [True], "off": [False], "both": [True, False]}
    out: list[bool] = []
    for part in _csv(text.lower()):
        if part not in words:
            raise argparse.ArgumentTypeError(f"{part!r}: use on, off, both or on,off")
        out += [v for v in words[part] if v not in out]
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: use on, off, both or on,off")
    return out


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The --serve group: the server-load benchmark and its scenarios."""
    g = p.add_argument_group(
        "server load (--serve)",
        "Speculation under concurrent load, through the real server. For each configuration\n"
        "in --methods (default draft:3,ngram:3; plain decoding `none` always runs first, the\n"
        "baseline), each --prefix-caching setting, each --max-num-batched-tokens budget and\n"
        "each --concurrency level c, `speculant serve`'s app is started on a loopback port in\n"
        "this process and c streaming chat requests (first turns of the first workload in\n"
        "--workloads, default code) are sent at once with the official openai client (pip\n"
        "install openai). Reported per row: time to first token and inter-token latency (gaps\n"
        "between a stream's content chunks) p50 / p99, aggregate tokens/s and requests/s,\n"
        "acceptance and tokens per target pass (from the responses' usage), speedup over\n"
        "plain decoding at the same c, and for greedy or seeded runs whether every text\n"
        "equals plain decoding's (exit status 1 if not). Requests ignore EOS: each generates\n"
        "--max-tokens (default 32 with --serve). Writes results.json, results.md and\n"
        "serve_concurrency.png under --out. See docs/benchmarks.md.",
    )
    g.add_argument(
        "--serve", action="store_true", help="run the server-load benchmark instead of the suite"
    )
    g.add_argument(
        "--concurrency",
        type=_int_list(1),
        default=[1, 4, 8],
        metavar="C,...",
        help="concurrent requests per level (default 1,4,8; on 2 cores each level of 8 "
        "with a 1.5B target takes minutes)",
    )
    g.add_argument(
        "--prefix-caching",
        type=_on_off,
        default=[True],
        metavar="on|off|both",
        help="the server's prefix cache: on (default, as `speculant serve`), off, or both "
        "to compare (each level starts with a fresh cache)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=_int_list(0),
        default=[32],
        metavar="N,...",
        help="prefill budgets (rows per pass that prompt chunks share with decoding; 0: "
        "prefill each prompt whole): the load sweep runs once per value, and "
        "--long-prompt-join measures each (default 32, `speculant serve`'s)",
    )
    g.add_argument(
        "--no-load",
        action="store_true",
        help="skip the concurrency sweep: run only the scenarios below",
    )
    g.add_argument(
        "--long-prompt-join",
        action="store_true",
        help="scenario: a chat stream runs alone, then while a --long-tokens prompt joins "
        "at its 5th step, once per --max-num-batched-tokens budget; reports the stream's "
        "per-token latency p50 / p99 / max from the join to the long prompt's first token, "
        "and that prompt's time to first token (what chunked prefill buys running streams)",
    )
    g.add_argument(
        "--long-tokens",
        type=positive_int,
        metavar="N",
        default=512,
        help="length of the joining prompt, in tokens (default 512; performance.md uses 1500)",
    )
    g.add_argument(
        "--stream-tokens",
        type=positive_int,
        metavar="N",
        default=64,
        help="new tokens of the running stream (default 64; it must still run when the "
        "long prompt's first token comes, or fewer gaps are measured)",
    )
    g.add_argument(
        "--chat-second-turn",
        action="store_true",
        help="scenario: a chat's first turn (a --history-tokens message) and its second turn, "
        "without and with the prefix cache: time to first token of each",
    )
    g.add_argument(
        "--history-tokens",
        type=positive_int,
        metavar="N",
        default=512,
        help="length of the chat's first message, in tokens (default 512; performance.md "
        "uses 1000)",
    )
    g.add_argument(
        "--batch",
        action="store_true",
        help="scenario: --batch-seqs chat requests decoded together in one scheduler, plain "
        "decoding against each configuration, each twice on one engine (the second run "
        "knows the pass costs the first measured): does speculation pay beside a busy batch?",
    )
    g.add_argument(
        "--batch-seqs",
        type=positive_int,
        metavar="N",
        default=8,
        help="sequences decoded together by --batch (default 8)",
    )


def add_pass_cost_args(p: argparse.ArgumentParser) -> None:
    """The --pass-cost group: what one pass over w new tokens costs, beside llama.cpp."""
    g = p.add_argument_group(
        "pass cost (--pass-cost)",
        "What one model pass over w new tokens costs: speculation pays only where a verify\n"
        "pass over k + 1 tokens costs little more than one token. For the target at --dtype\n"
        "(or at each of --pass-dtypes) and the draft at --draft-dtype (unless --draft none):\n"
        "the median ms of a pass over w tokens after a --pass-context-token prefix, its\n"
        "ratio to w = 1, and plain greedy tokens/s over --max-tokens (default 32 here);\n"
        "llama.cpp's llama-bench on the same GGUF files beside it ($SPECULANT_LLAMA_CPP_BIN\n"
        "or PATH). Writes results.json, results.md and pass_cost.png under --out. See\n"
        "docs/benchmarks.md.",
    )
    g.add_argument(
        "--pass-cost", action="store_true", help="run the pass-cost benchmark instead of the suite"
    )
    g.add_argument(
        "--pass-widths",
        type=_int_list(1),
        default=[1, 2, 4, 8, 16],
        metavar="W,...",
        help="new tokens per pass (default 1,2,4,8,16; w=1 is always added)",
    )
    g.add_argument(
        "--pass-context", type=positive_int, default=64, metavar="N", help="prefix tokens (64)"
    )
    g.add_argument(
        "--pass-reps", type=positive_int, default=7, metavar="N", help="passes per width (7)"
    )
    g.add_argument(
        "--pass-dtypes",
        type=_dtype_list,
        default=None,
        metavar="DTYPE,...",
        help="measure the target in each of these weight formats instead of --dtype, one row "
        "each, taking turns within every repeat: e.g. bfloat16,int8,int4 (a folder) or "
        f"gguf,int8,int4 (a .gguf file); any of {', '.join(DTYPE_CHOICES)}",
    )
    g.add_argument(
        "--pass-kv-dtypes",
        type=_kv_dtype_list,
        default=[],
        metavar="KV,...",
        help="key/value caches that take turns, one row each, for the models on the native "
        "kernels: float32,float16 (see --kv-dtype; default: the models' own)",
    )
    g.add_argument(
        "--pass-threads",
        type=_int_list(1),
        default=[],
        metavar="T,...",
        help="kernel thread counts taking turns, e.g. 2,1: the native kernels' threads for "
        "GGUF weights, PyTorch's for the others (default: --threads, else $SPECULANT_THREADS, "
        "else one per usable CPU); llama-bench runs at each",
    )
    g.add_argument(
        "--kernel-paths",
        type=_csv,
        default=[""],
        metavar="PATH,...",
        help="native kernel paths taking turns (portable, avx2, avx512, avx512vnni), each "
        "optionally with tuning knobs: avx512vnni+prefetch_bytes=0 (default: the one the "
        "CPU picks)",
    )
    g.add_argument(
        "--no-llama-bench", action="store_true", help="skip llama.cpp's llama-bench beside it"
    )


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
        help="comma-separated METHOD[:K[:SKIP_RATIO]] (default: every proposer; with "
        "--serve: draft:3,ngram:3); 'none', the baseline, always runs",
    )
    p.add_argument(
        "-k",
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
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="new tokens per generation (default 128; with --serve 32 per request)",
    )
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
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="threads for the kernels and the peers (default: one per CPU this "
        "process may use, within its CPU quota, or $SPECULANT_THREADS); beside the native "
        "kernels PyTorch keeps one",
    )
    p.add_argument("--out", type=Path, default=Path("bench-out/bench"), help="output folder")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generations")
    p.add_argument(
        "--fresh-engines",
        action="store_true",
        help="build each method's engine anew for every request (every turn of every "
        "prompt; not timed): each run is a first request, with nothing learned by -k auto "
        "or the proposer; plain decoding, the baseline, keeps one warmed-up engine",
    )
    p.add_argument(
        "--watts-per-core",
        type=float,
        default=DEFAULT_WATTS_PER_CORE,
        help="power per busy core for the energy estimate, when RAPL counters are unreadable",
    )
    p.add_argument("--trust-unverified", action="store_true", help="load unverified GGUF files")
    p.add_argument(
        "--synthetic",
        metavar="SHAPE[:MIX]",
        default=None,
        help="target: a GGUF of a real model's shape with random weights (a pass costs "
        "what the real model's does), written once into $SPECULANT_HOME/synthetic/: "
        "SHAPE one of llama-3.1-8b, llama-3.2-1b, qwen2.5-0.5b, qwen2.5-7b, qwen2.5-14b, "
        "qwen3-0.6b, qwen3-8b; MIX one of Q4_K_M (default), Q8_0, Q4_0, Q6_K. It has no "
        "tokenizer: use it with --pass-cost (e.g. speculant bench --pass-cost --synthetic "
        "llama-3.1-8b:Q4_K_M --draft none)",
    )
    add_serve_args(p)
    add_pass_cost_args(p)
    add_quant_args(p)
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


def _command() -> str:
    """The command line, as reports quote it."""
    return "speculant " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _load_models(args: argparse.Namespace, with_draft: bool) -> tuple[Any, Any]:
    """The target (and the draft when asked) as the flags say, and the threads: --threads
    for the kernels (`native.use_threads`), PyTorch on one core beside the native ones."""
    targets, draft = _load_targets(args, [args.dtype], with_draft)
    return targets[0], draft


def _load_targets(
    args: argparse.Namespace, dtypes: list[str], with_draft: bool
) -> tuple[list[Any], Any]:
    """_load_models with the target in each of `dtypes` (a dtype that resolves to a format
    already loaded, as auto may, is left out)."""
    from speculant import native
    from speculant.models.model import load_model

    native.use_threads(args.threads)
    trust, kv = args.trust_unverified, args.kv_dtype
    targets: list[Any] = []
    for dtype in dtypes:
        target = load_model(args.target, dtype=dtype, trust_unverified=trust, kv_dtype=kv)
        if any(t.dtype_name == target.dtype_name for t in targets):
            print(
                f"--pass-dtypes: {dtype} is {target.dtype_name}, already measured", file=sys.stderr
            )
            continue
        targets.append(target)
    draft = None
    if with_draft:
        draft = load_model(
            args.draft,
            dtype=args.draft_dtype,
            trust_unverified=trust,
            auto_fallback="int8",
            kv_dtype=kv,
        )
    native.share_cores_if_native(*targets, draft)
    return targets, draft


def cmd_bench(args: argparse.Namespace) -> int:
    if args.synthetic:
        from speculant.bench import synthetic

        shape, mix = synthetic.parse(args.synthetic)
        if not args.pass_cost:
            raise ValueError("--synthetic files have no tokenizer: use them with --pass-cost")
        args.target = str(synthetic.write(shape, mix))
    modes = [m for m in ("serve", "pass_cost", "quant_quality") if getattr(args, m)]
    if len(modes) > 1:
        names = " and ".join("--" + m.replace("_", "-") for m in modes)
        raise ValueError(f"{names} are separate benchmarks: run one at a time")
    if args.serve:
        return cmd_bench_serve(args)
    if args.pass_cost:
        return cmd_bench_pass_cost(args)
    if args.quant_quality:
        from speculant.bench.quant import cmd_quant_quality

        return cmd_quant_quality(args, _command())
    from rich.console import Console

    from speculant.bench.report import peer_lines, render_table, write_outputs
    from speculant.bench.runner import run_bench
    from speculant.bench.specs import BenchConfig, parse_methods

    specs = parse_methods(args.methods, args.k)  # fail on a bad spec before loading models
    needs_draft = any(s.method == "draft" for s in specs) or any(
        p in ("all", "hf", "transformers-assisted") for p in args.peers
    )
    console = Console(stderr=True)
    target, draft = _load_models(args, needs_draft)
    config = BenchConfig(
        workloads=args.workloads,
        methods=args.methods,
        ks=args.k,
        peers=args.peers,
        limit=args.limit,
        peer_limit=args.peer_limit,
        eagle_head=args.eagle_head,
        max_tokens=args.max_tokens or 128,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        warmup=not args.no_warmup,
        fresh_engines=args.fresh_engines,
        watts_per_core=args.watts_per_core,
    )
    progress = _RichProgress(console)
    with progress.bar:
        result = run_bench(target, draft, config, progress=progress, command=_command())
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


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """`speculant bench --serve`: the server-load benchmark and its scenarios."""
    from rich.console import Console

    from speculant.bench.serve import (
        ServeConfig,
        render_tables,
        run_serve_bench,
        write_serve_outputs,
    )

    if args.peers:
        raise ValueError("--peers does not apply to --serve: peers run in `speculant bench`")
    if args.no_load and not (args.long_prompt_join or args.chat_second_turn or args.batch):
        raise ValueError(
            "--no-load leaves nothing to run: add --long-prompt-join, --chat-second-turn or --batch"
        )
    config = ServeConfig(
        methods=args.methods,
        ks=args.k,
        concurrency=args.concurrency,
        prefix_caching=args.prefix_caching,
        budgets=args.max_num_batched_tokens,
        workload=args.workloads[0],
        max_tokens=args.max_tokens or 32,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        load=not args.no_load,
        long_prompt_join=args.long_prompt_join,
        long_tokens=args.long_tokens,
        stream_tokens=args.stream_tokens,
        chat_second_turn=args.chat_second_turn,
        history_tokens=args.history_tokens,
        batch=args.batch,
        batch_seqs=args.batch_seqs,
        eagle_head=args.eagle_head,
        warmup=not args.no_warmup,
    )
    specs = config.specs  # fail on a bad spec before loading models
    if config.load:
        from speculant.bench.serve import require_openai

        require_openai()
    target, draft = _load_models(args, any(s.method == "draft" for s in specs))
    console = Console(stderr=True)
    command = _command()
    result = run_serve_bench(
        target,
        draft,
        config,
        command=command,
        log=lambda text: console.print(text, markup=False, highlight=False),
    )
    out = Console() if sys.stdout.isatty() else Console(width=150)
    for table in render_tables(result):
        out.print(table)
    paths = write_serve_outputs(result, args.out, plots=not args.no_plots)
    out.print("wrote " + ", ".join(str(p) for p in paths))
    if result.lossless_failures:
        out.print(
            "[bold red]identical-text check FAILED[/] (greedy or seeded text differs from "
            "plain decoding): " + "; ".join(result.lossless_failures)
        )
        return 1
    if result.lossless_checked:
        out.print("[green]identical-text check passed[/]: every configuration matched plain")
    return 0


def cmd_bench_pass_cost(args: argparse.Namespace) -> int:
    """`speculant bench --pass-cost`: pass cost by width, ours and llama.cpp's."""
    import torch
    from rich.console import Console

    from speculant.bench.pass_cost import (
        PassCostConfig,
        render_table,
        report,
        run_pass_cost,
        write_outputs,
    )

    if args.peers:
        raise ValueError("--peers does not apply to --pass-cost: llama-bench runs beside it")
    cfg = PassCostConfig(
        widths=args.pass_widths,
        context=args.pass_context,
        new=args.max_tokens or 32,
        reps=args.pass_reps,
        paths=args.kernel_paths or [""],
        threads=args.pass_threads,
        kv_dtypes=args.pass_kv_dtypes,
        llama_cpp=not args.no_llama_bench,
        # PyTorch-run weights keep every core even where GGUF ones share them (below)
        torch_threads=args.threads or torch.get_num_threads(),
    )
    dtypes = args.pass_dtypes or [args.dtype]
    targets, draft = _load_targets(args, dtypes, args.draft not in (None, "none"))
    models = [("target", t) for t in targets] + ([("draft", draft)] if draft is not None else [])
    console = Console(stderr=True)
    rows = run_pass_cost(models, cfg, say=lambda text: console.print(f"[dim]{text}[/]"))
    data = report(rows, cfg, _command())
    Console().print(render_table(data))
    written = write_outputs(data, args.out, plots=not args.no_plots)
    console.print("wrote " + ", ".join(str(p) for p in written))
    return 0
