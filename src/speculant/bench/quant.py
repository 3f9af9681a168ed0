"""`speculant bench --quant-quality`: what a weight format costs in quality, and buys in speed.

A quantized *target* changes the model, so its quality is measured; a quantized *draft*
never changes the output (verification keeps the target's distribution), so for a draft
only speed and acceptance matter, which the main benchmark reports. For each dtype of
`--target` (the first is the reference):

- perplexity on a fixed text set: the first `--quant-doc-tokens` tokens of the first
  `--quant-docs` shipped summarisation documents (State of the Union excerpts);
- greedy agreement with the reference: the mean share of each continuation identical up
  to the first divergence, and the share of prompts whose whole continuation is
  identical (`--max-tokens` tokens of the shipped code and chat prompts,
  `--quant-prompts` of each);
- weight bytes and plain decoding tokens/s (median over the prompts).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speculant.argtypes import DTYPE_CHOICES, positive_int

QUANT_DTYPES = [d for d in DTYPE_CHOICES if d != "auto"]


def perplexity(model: Any, docs: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of every next token of `docs`."""
    import torch

    nll, count = 0.0, 0
    for ids in docs:
        cache = model.new_cache(len(ids) + 8)
        logits = model.forward(ids[:-1], cache, 0)  # [T-1, vocab]
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(ids[1:])
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += len(ids) - 1
    return math.exp(nll / count)


def _dtypes(text: str) -> list[str]:
    out = [d.strip() for d in text.split(",") if d.strip()]
    for d in out:
        if d not in QUANT_DTYPES:
            raise argparse.ArgumentTypeError(f"dtype {d!r}: use one of {', '.join(QUANT_DTYPES)}")
    if not out:
        raise argparse.ArgumentTypeError("give at least one dtype, e.g. bfloat16,int8,int4")
    return list(dict.fromkeys(out))


def add_quant_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "weight formats (--quant-quality)",
        "Quality and speed of the target in several weight formats: perplexity on shipped\n"
        "documents, greedy agreement with the first format, weight bytes, plain tokens/s.\n"
        "Writes results.json and results.md under --out. See docs/planning.md.",
    )
    g.add_argument(
        "--quant-quality",
        type=_dtypes,
        default=None,
        metavar="DTYPE,...",
        help="run this benchmark on these formats of --target, the first the reference "
        f"(e.g. bfloat16,int8,int4,gguf; any of {', '.join(QUANT_DTYPES)})",
    )
    g.add_argument(
        "--quant-prompts",
        type=positive_int,
        default=4,
        metavar="N",
        help="code and chat prompts each (4)",
    )
    g.add_argument("--quant-docs", type=positive_int, default=4, metavar="N", help="documents (4)")
    g.add_argument(
        "--quant-doc-tokens",
        type=positive_int,
        default=512,
        metavar="N",
        help="tokens of each document (512, at most the model's context)",
    )


def run_quant_quality(
    target: str,
    dtypes: list[str],
    *,
    prompts: int = 4,
    docs: int = 4,
    doc_tokens: int = 512,
    max_tokens: int = 64,
    trust_unverified: bool = False,
    say: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """One row per dtype (see the module docstring)."""
    from speculant import Engine, SamplingParams
    from speculant.bench.workloads import encode_turn, load_workload
    from speculant.models.model import load_model

    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    for dtype in dtypes:
        model = load_model(target, dtype=dtype, progress=False, trust_unverified=trust_unverified)
        tok = model.tokenizer
        assert tok is not None
        span = min(doc_tokens, model.config.max_seq_len - 8)
        texts = [
            tok.encode(p.turns[0].split("\n\n", 1)[-1])[:span]
            for p in load_workload("summarization").prompts[:docs]
        ]
        ids_list = []
        for name in ("code", "chat"):
            wl = load_workload(name)
            ids_list += [encode_turn(model, wl, p.turns[:1], []) for p in wl.prompts[:prompts]]
        say(f"{dtype}: perplexity over {len(texts)} documents")
        ppl = perplexity(model, texts)
        engine = Engine(model)
        outs, speeds = [], []
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        say(f"{dtype}: {len(ids_list)} greedy continuations of {max_tokens} tokens")
        for ids in ids_list:
            t0 = time.perf_counter()
            res = engine.generate(ids, params)
            speeds.append(len(res.token_ids) / (time.perf_counter() - t0))
            outs.append(res.token_ids)
        if reference is None:
            reference = outs
        prefix, whole = [], 0
        for a, b in zip(reference, outs, strict=True):
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            prefix.append(n / len(a))
            whole += a == b
        rows.append(
            {
                "dtype": model.dtype_name,
                "weights_gb": model.net.weights.nbytes() / 1e9,
                "perplexity": ppl,
                "agreement_prefix_mean": statistics.fmean(prefix),
                "identical_share": whole / len(outs),
                "tok_s_median": statistics.median(speeds),
                "doc_tokens": span,
            }
        )
        del model, engine
    return rows


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"# Weight formats: {data['target']}",
        "",
        f"`{data['command']}`. Perplexity on {data['docs']} documents; agreement with "
        f"{data['rows'][0]['dtype']} over {data['prompts']} greedy continuations of "
        f"{data['max_tokens']} tokens (mean identical prefix, share identical throughout).",
        "",
        "| dtype | weights GB | perplexity | agreement | identical | plain tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['dtype']} | {r['weights_gb']:.2f} | {r['perplexity']:.3f} | "
            f"{r['agreement_prefix_mean']:.1%} | {r['identical_share']:.0%} | "
            f"{r['tok_s_median']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def write_outputs(data: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(data, indent=2))
    (out / "results.md").write_text(markdown(data))
    return [out / "results.json", out / "results.md"]


def cmd_quant_quality(args: argparse.Namespace, command: str) -> int:
    from rich.console import Console
    from rich.table import Table

    if args.peers:
        raise ValueError("--peers does not apply to --quant-quality")
    console = Console(stderr=True)
    max_tokens = args.max_tokens or 64
    rows = run_quant_quality(
        args.target,
        args.quant_quality,
        prompts=args.quant_prompts,
        docs=args.quant_docs,
        doc_tokens=args.quant_doc_tokens,
        max_tokens=max_tokens,
        trust_unverified=args.trust_unverified,
        say=lambda text: console.print(f"[dim]{text}[/]"),
    )
    data = {
        "command": command,
        "target": args.target,
        "docs": args.quant_docs,
        "prompts": 2 * args.quant_prompts,
        "max_tokens": max_tokens,
        "rows": rows,
    }
    table = Table(title=f"weight formats of {args.target}")
    for col in ("dtype", "weights GB", "perplexity", "agreement", "identical", "plain tok/s"):
        table.add_column(col, justify="left" if col == "dtype" else "right")
    for r in rows:
        table.add_row(
            r["dtype"],
            f"{r['weights_gb']:.2f}",
            f"{r['perplexity']:.3f}",
            f"{r['agreement_prefix_mean']:.1%}",
            f"{r['identical_share']:.0%}",
            f"{r['tok_s_median']:.2f}",
        )
    Console().print(table)
    written = write_outputs(data, args.out)
    console.print("wrote " + ", ".join(str(p) for p in written))
    return 0
