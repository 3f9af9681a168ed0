"""Every proposer on the workloads it is meant for, against plain decoding in the same
process on the same prompts (greedy, so tokens must be identical).

    python scripts/bench_methods.py --out bench-out/methods.json

Method specs are METHOD:K with K an integer or 'auto'; options after a second colon
(`layer-skip:5:0.75` = skip ratio). Prints one line per run and a summary table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from speculant import Engine, SamplingParams, load_model

SOURCE = """import csv
import sys


def load_rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def total_by_region(rows):
    totals = {}
    for row in rows:
        region = row["region"]
        totals[region] = totals.get(region, 0.0) + float(row["amount"])
    return totals


def print_report(totals):
    width = max(len(name) for name in totals)
    for name in sorted(totals):
        print(f"{name:<{width}}  {totals[name]:>12.2f}")


def main(argv):
    if len(argv) != 2:
        print("usage: report.py FILE", file=sys.stderr)
        return 2
    rows = load_rows(argv[1])
    print_report(total_by_region(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
"""

DOCUMENT = (
    "Invoice INV-2291 was issued on 14 March 2024 by Northwind Traders Ltd, 42 Harbour Road, "
    "Portsmouth, to Contoso Pharmaceuticals, attention of Dr. Amelia Reyes. The order covers "
    "120 units of sterile saline (item SAL-500) at 3.40 EUR each and 15 boxes of nitrile gloves "
    "(item GLV-M) at 11.90 EUR each. Payment terms are 30 days net; the total due is 586.50 EUR. "
    "Questions about this invoice go to billing@northwind.example, reference PO-77812."
)

PASSAGE = (
    "The council voted on Thursday to extend the night bus service to the northern suburbs. "
    "'This is about making sure shift workers can get home safely,' said councillor Maria Okafor, "
    "who proposed the motion. Opponents argued that the cost, estimated at 1.2 million a year, "
    "would be better spent on road repairs. 'We cannot keep patching potholes while people "
    "walk home at 3 a.m.,' Okafor replied. The extension starts in September and will be "
    "reviewed after twelve months."
)

WORKLOADS = {
    "edit-code": [
        "Rename the function total_by_region to sum_by_region everywhere in this file and "
        "return the complete updated file, nothing else.\n\n```python\n" + SOURCE + "```",
        "Add type hints to every function in this file and return the complete updated "
        "file.\n\n```python\n" + SOURCE + "```",
    ],
    "extract": [
        "Extract the invoice number, date, seller, buyer, contact person, every item (code, "
        "quantity, unit price), payment terms, total and e-mail from this text as JSON. Copy "
        "values verbatim.\n\n" + DOCUMENT,
    ],
    "summarize-quotes": [
        "Summarise this article in three sentences, quoting both of Okafor's statements "
        "verbatim.\n\n" + PASSAGE,
    ],
    "code": [
        "Write a Python function `is_prime(n)` that returns True when n is prime.",
        "Write a Python function that merges two sorted lists into one sorted list.",
        "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    ],
    "creative": [
        "Write a short, surprising story about a lighthouse keeper and a migrating whale.",
        "Invent five unusual names for a café and explain each in one sentence.",
    ],
}

PLAN = {
    "edit-code": ["ngram:8", "ngram:auto", "suffix:8", "suffix:auto"],
    "extract": ["ngram:8", "ngram:auto", "suffix:8", "suffix:auto"],
    "summarize-quotes": ["ngram:8", "ngram:auto", "suffix:8", "suffix:auto"],
    "code": ["draft:3", "draft:5", "draft:7", "draft:auto"],
    "creative": ["layer-skip:5:0.75", "layer-skip:auto:0.75", "ngram:5", "ngram:auto"],
}


def parse_spec(spec: str) -> tuple[str, int | str, dict[str, float]]:
    parts = spec.split(":")
    method, k = parts[0], parts[1] if len(parts) > 1 else "5"
    opts = {"skip_ratio": float(parts[2])} if len(parts) > 2 else {}
    return method, (k if k == "auto" else int(k)), opts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--draft-dtype", default="int8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--methods", default=None, help="comma-separated specs for every workload")
    ap.add_argument("--out", default="bench-out/methods.json")
    args = ap.parse_args()
    target = load_model(args.target)
    draft = load_model(args.draft, dtype=args.draft_dtype)
    tok = target.tokenizer
    assert tok is not None
    params = SamplingParams(max_tokens=args.max_tokens)
    plain = Engine(target)
    plain.generate(tok.encode("warm up"), SamplingParams(max_tokens=4))
    engines: dict[str, Engine] = {}
    rows = []
    for workload in args.workloads.split(","):
        for pi, text in enumerate(WORKLOADS[workload]):
            chat = tok.apply_chat_template([{"role": "user", "content": text}])
            ids = tok.encode(chat, add_special_tokens=False)
            base = plain.generate(ids, params)
            rows.append(_row(workload, pi, "none", len(ids), base, base))
            print(_line(rows[-1]), flush=True)
            for spec in args.methods.split(",") if args.methods else PLAN[workload]:
                if spec not in engines:
                    method, k, opts = parse_spec(spec)
                    t0 = time.perf_counter()
                    engines[spec] = Engine(
                        target,
                        draft=draft if method == "draft" else None,
                        method=method,
                        num_speculative_tokens=k,
                        proposer_options=opts,
                    )
                    print(f"  built {spec} in {time.perf_counter() - t0:.1f}s", flush=True)
                res = engines[spec].generate(ids, params)
                rows.append(_row(workload, pi, spec, len(ids), res, base))
                print(_line(rows[-1]), flush=True)
    summary = _summary(rows)
    print("\nworkload           method               tok/s  speedup  accept  tokens/pass  same")
    for s in summary:
        print(
            f"{s['workload']:<18} {s['method']:<20} {s['tok_s']:>5.2f}  {s['speedup']:>6.2f}x "
            f"{s['acceptance_rate']:>6.2f}  {s['mean_accepted_length']:>10.2f}  "
            f"{s['identical_share']:.0%}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"command": " ".join(sys.argv), "rows": rows, "summary": summary}, indent=1)
    )
    return 0


def _row(workload, pi, spec, n_prompt, res, base):  # type: ignore[no-untyped-def]
    s = res.stats
    return {
        "workload": workload,
        "prompt": pi,
        "method": spec,
        "prompt_tokens": n_prompt,
        "new_tokens": len(res.token_ids),
        "tok_s": s.tokens_per_second,
        "speedup": s.tokens_per_second / base.stats.tokens_per_second,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "accepted_per_position": s.accepted_per_position,
        "identical": res.token_ids == base.token_ids,
    }


def _line(r):  # type: ignore[no-untyped-def]
    return (
        f"{r['workload']}[{r['prompt']}] {r['method']}: {r['tok_s']:.2f} tok/s x{r['speedup']:.2f} "
        f"accept {r['acceptance_rate']:.2f} tokens/pass {r['mean_accepted_length']:.2f} "
        f"identical {r['identical']}"
    )


def _summary(rows):  # type: ignore[no-untyped-def]
    out = []
    keys = sorted(
        {(r["workload"], r["method"]) for r in rows}, key=lambda x: (x[0], x[1] != "none", x[1])
    )
    for w, m in keys:
        sel = [r for r in rows if r["workload"] == w and r["method"] == m]
        out.append(
            {
                "workload": w,
                "method": m,
                "tok_s": statistics.median(r["tok_s"] for r in sel),
                "speedup": statistics.median(r["speedup"] for r in sel),
                "acceptance_rate": statistics.median(r["acceptance_rate"] for r in sel),
                "mean_accepted_length": statistics.median(r["mean_accepted_length"] for r in sel),
                "identical_share": sum(r["identical"] for r in sel) / len(sel),
            }
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
