"""Quality and speed of quantized weights: a quantized TARGET changes the model, so its
quality is measured; a quantized DRAFT never changes the output (verification keeps
the target's distribution), so only its speed and acceptance matter.

    python scripts/quant_quality.py [--model qwen2.5-coder-1.5b-instruct] [--dtypes ...]

For each dtype of the model: perplexity on a fixed text set (the first 512 tokens of
the shipped summarisation documents, State of the Union excerpts), greedy agreement
with bfloat16 (share of identical tokens up to the first divergence, and the share of
prompts whose whole 64-token continuation is identical, on the shipped code and chat
prompts), and plain decoding speed. Writes bench-out/quant_quality.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from speculant import Engine, SamplingParams, load_model
from speculant.bench.workloads import encode_turn, load_workload


def perplexity(model, docs: list[list[int]]) -> float:  # type: ignore[no-untyped-def]
    nll, count = 0.0, 0
    for ids in docs:
        cache = model.new_cache(len(ids) + 8)
        logits = model.forward(ids[:-1], cache, 0)  # [T-1, vocab]
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(ids[1:])
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += len(ids) - 1
    return math.exp(nll / count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtypes", default="bfloat16,int8,int4")
    ap.add_argument("--prompts", type=int, default=4, help="per workload (code, chat)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("bench-out/quant_quality.json"))
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    rows = []
    reference: list[list[int]] | None = None
    for dtype in dtypes:
        model = load_model(args.model, dtype=dtype)
        tok = model.tokenizer
        assert tok is not None
        docs = [
            tok.encode(p.turns[0].split("\n\n", 1)[-1])[:512]
            for p in load_workload("summarization").prompts[: args.docs]
        ]
        prompts = []
        for name in ("code", "chat"):
            wl = load_workload(name)
            prompts += [encode_turn(model, wl, p.turns[:1], []) for p in wl.prompts[: args.prompts]]
        ppl = perplexity(model, docs)
        engine = Engine(model)
        outs, speeds = [], []
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for ids in prompts:
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
        row = {
            "dtype": dtype,
            "weights_gb": model.net.weights.nbytes() / 1e9,
            "perplexity": ppl,
            "agreement_prefix_mean": statistics.fmean(prefix),
            "identical_share": whole / len(outs),
            "tok_s_median": statistics.median(speeds),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        del model, engine
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "model": args.model,
        "docs": args.docs,
        "doc_tokens": 512,
        "prompts": 2 * args.prompts,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'dtype':>9} {'GB':>5} {'ppl':>7} {'agree':>6} {'same':>5} {'tok/s':>6}")
    for r in rows:
        print(
            f"{r['dtype']:>9} {r['weights_gb']:5.2f} {r['perplexity']:7.3f} "
            f"{r['agreement_prefix_mean']:6.1%} {r['identical_share']:5.0%} "
            f"{r['tok_s_median']:6.2f}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
