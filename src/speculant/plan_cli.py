"""`speculant plan`: what a target + draft pair needs in memory, and where it fits."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from speculant.argtypes import KV_DTYPE_CHOICES, add_deprecated_option
from speculant.plan import DEVICES, DTYPES, GiB, Plan, PlanError, device_budget, make_plan

EPILOG = """\
examples:
  speculant plan                                            # default pair, 4k context
  speculant plan --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
      --context 32768 --batch 8 --dtype int8 --draft-dtype int4 --device RTX-4090
  speculant plan --target path/to/config.json --memory 24GiB   # any HF config.json
  speculant plan --target smollm2-135m-instruct --context 2048 --measure   # check by running
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="memory needed by a target + draft pair, and which devices it fits",
        description="Estimate weights, KV cache and working memory of the target and the "
        "draft for a context length and batch size, per dtype, and check it against a "
        "memory budget, a named device, or every known device.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="name, .gguf or config")
    p.add_argument(
        "--draft",
        default="qwen2.5-coder-0.5b-instruct",
        help="draft model, or 'none' for draft-free methods",
    )
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=list(DTYPES),
        help="target weights (default bfloat16)",
    )
    add_deprecated_option(p, "--target-dtype", "--dtype", dest="dtype", choices=list(DTYPES))
    p.add_argument(
        "--draft-dtype", default="int8", choices=list(DTYPES), help="draft weights (default int8)"
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=KV_DTYPE_CHOICES,
        help="key/value cache elements (default auto: the activations' size; float16 with "
        "the native kernels halves float32 caches, as `speculant generate --kv-dtype`)",
    )
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=5, dest="k")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--memory", default=None, help="a budget, e.g. 24GiB or 80GB")
    where.add_argument(
        "--device", default=None, help=f"one of {', '.join(DEVICES)}, or cpu (this machine)"
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="also load the models and run one request at this context in a fresh process, "
        "and print the measured peak memory beside the estimate (CPU)",
    )
    p.add_argument(
        "--prefix-cache-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="add the memory a server's prefix cache may hold (`speculant serve "
        "--prefix-cache-gib`, whose default is 1; 0, the default here, for generate)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)
    return p


def max_context(args: argparse.Namespace, budget: int) -> int:
    """The longest context (multiple of 64) whose plan fits `budget`, 0 if none."""
    from speculant.plan import resolve_config

    limit = resolve_config(args.target)[1].max_seq_len
    lo, hi = 0, limit // 64
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _plan(args, context=mid * 64).total_bytes <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * 64


def _plan(args: argparse.Namespace, context: int | None = None) -> Plan:
    return make_plan(
        args.target,
        None if args.draft in (None, "none") else args.draft,
        context=args.context if context is None else context,
        batch=args.batch,
        target_dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        k=args.k,
        prefix_cache_bytes=int(args.prefix_cache_gib * GiB),
        kv_dtype=args.kv_dtype,
    )


def measure(args: argparse.Namespace) -> dict[str, int]:
    spec = {
        "target": args.target,
        "draft": None if args.draft in (None, "none") else args.draft,
        "target_dtype": args.dtype,
        "draft_dtype": args.draft_dtype,
        "context": args.context,
        "k": args.k,
        "kv_dtype": args.kv_dtype,
    }
    # A fresh process, so that its memory before and after loading is the pair's alone.
    out = subprocess.run(
        [sys.executable, "-m", "speculant.plan_cli", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise PlanError(f"measuring failed: {out.stderr.strip().splitlines()[-1:]}")
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _status_bytes(name: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in bytes."""
    m = re.search(rf"{name}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert m is not None, name
    return int(m.group(1)) * 1024


def measure_here(spec: dict[str, Any]) -> dict[str, int]:
    """Run `measure`'s request in this process: {"runtime": resident bytes before loading
    the models, "peak": peak resident bytes after one request at the context length}."""
    from speculant import Engine, SamplingParams, load_model

    runtime = _status_bytes("VmRSS")
    kv = spec.get("kv_dtype", "auto")
    target = load_model(spec["target"], dtype=spec["target_dtype"], progress=False, kv_dtype=kv)
    draft = (
        load_model(spec["draft"], dtype=spec["draft_dtype"], progress=False, kv_dtype=kv)
        if spec["draft"]
        else None
    )
    engine = Engine(
        target,
        draft=draft,
        num_speculative_tokens=spec["k"] if draft else 0,
        max_seq_len=spec["context"],
    )
    Path("/proc/self/clear_refs").write_text("5")
    n_new = min(32, spec["context"] // 4)
    prompt = [(7 * i + 11) % target.vocab_size for i in range(spec["context"] - n_new - 1)]
    engine.generate(prompt, SamplingParams(max_tokens=n_new, ignore_eos=True))
    return {"runtime": runtime, "peak": _status_bytes("VmHWM")}


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from speculant.plan import parse_size

    plan = _plan(args)
    budgets: list[tuple[str, int]] = []
    if args.memory:
        budgets.append((f"--memory {args.memory}", parse_size(args.memory)))
    elif args.device:
        size, text = device_budget(args.device)
        budgets.append((text, size))
    else:
        budgets = [(text, int(size * share)) for size, share, text in DEVICES.values()]
        try:
            size, text = device_budget("cpu")
            budgets.append((text, size))
        except PlanError:
            pass
    fits: list[dict[str, Any]] = [
        {
            "where": where,
            "budget_bytes": size,
            "fits": plan.total_bytes <= size,
            "max_context": max_context(args, size),
        }
        for where, size in budgets
    ]
    measured = measure(args) if args.measure else None
    if args.json:
        out = plan.to_dict() | {"fits": fits}
        if measured is not None:
            out["measured_peak_bytes"] = measured["peak"]
            out["measured_runtime_bytes"] = measured["runtime"]
        print(json.dumps(out))
        return 0 if all(f["fits"] for f in fits) or not (args.memory or args.device) else 1
    console = Console() if sys.stdout.isatty() else Console(width=130)
    table = Table(
        title=f"memory plan: context {plan.context}, batch {plan.batch}, k={args.k}",
        caption="KV cache: 2 x layers x kv_heads x head_dim x (context + slack) x batch x bytes; "
        "working: the largest transient of one forward (see docs/planning.md)",
    )
    for col in ("part", "dtype", "params", "weights", "KV cache", "working", "total"):
        table.add_column(col, justify="left" if col in ("part", "dtype") else "right")
    for label, m in (("target " + plan.target.name, plan.target), ("draft", plan.draft)):
        if m is None:
            continue
        if label == "draft":
            label = "draft " + m.name
        table.add_row(
            label,
            m.dtype,
            f"{m.params / 1e9:.2f} B",
            _gib(m.weights_bytes),
            _gib(m.kv_bytes),
            _gib(m.working_bytes),
            _gib(m.total_bytes),
        )
    table.add_row("runtime (PyTorch, Python)", "", "", "", "", "", _gib(plan.runtime_bytes))
    if plan.prefix_cache_bytes:
        table.add_row("prefix cache (server)", "", "", "", "", "", _gib(plan.prefix_cache_bytes))
    table.add_row("[bold]total[/]", "", "", "", "", "", f"[bold]{_gib(plan.total_bytes)}[/]")
    console.print(table)
    fit_table = Table(title="where it fits")
    for col in ("device", "usable", "fits", "longest context that fits"):
        fit_table.add_column(col)
    for f in fits:
        fit_table.add_row(
            f["where"],
            _gib(f["budget_bytes"]),
            "[green]yes[/]" if f["fits"] else "[red]no[/]",
            f"{f['max_context']:,}" if f["max_context"] else "none",
        )
    console.print(fit_table)
    if measured is not None:
        err = plan.total_bytes / measured["peak"] - 1
        console.print(
            f"measured peak (fresh process, one request at context {plan.context}): "
            f"{_gib(measured['peak'])}; estimate {_gib(plan.total_bytes)} ({err:+.0%})"
        )
    if args.memory or args.device:
        return 0 if fits[0]["fits"] else 1
    return 0


if __name__ == "__main__":  # the process `measure` starts
    print(json.dumps(measure_here(json.loads(sys.argv[1]))))
