"""Choose prompt-lookup settings by replaying greedy outputs, without timing anything.

Under greedy decoding a drafted token is accepted exactly when it equals the target's
next greedy token, so the plain outputs of a model decide how every `ngram` setting would
have fared: how many tokens each verify pass yields, how wide each pass is. Weighting
each pass by a machine's measured cost of a pass over w rows (`speculant bench
--pass-cost`, as multiples of one row) predicts the decoding speedup of each setting.

    python scripts/replay_ngram.py record greedy.json --workloads code,edit,chat,extraction
    python scripts/replay_ngram.py replay greedy.json --k 5,7,8 --ngram-max 4,8 \\
        --cost zen4=1:1,2:1.16,4:1.41,8:2.54,16:5.5 --cost intel=1:1,2:1.1,4:1.34,8:2.29,16:4.4

`record` runs the target (default: the built-in default model) on every prompt of the
workloads (a conversation turn by turn, as `speculant bench` does) and saves prompt and
output ids; `replay` prints, per workload and setting, tokens per pass and the predicted
speedup over plain decoding for each cost curve (prefill and per-step overheads left out).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def record(
    path: str, workloads: list[str], target_name: str, max_tokens: int, limit: int | None
) -> None:
    from speculant.bench.runner import _reply_text
    from speculant.bench.workloads import encode_turn, load_workload
    from speculant.cli import DEFAULT_K_BY_METHOD
    from speculant.engine import Engine
    from speculant.models.model import load_model
    from speculant.sampling import SamplingParams

    target = load_model(target_name)
    # the default drafting: lossless, so the ids are plain decoding's, only sooner
    engine = Engine(target, method="ngram", num_speculative_tokens=DEFAULT_K_BY_METHOD["ngram"])
    rows = []
    for name in workloads:
        wl = load_workload(name).limited(limit)
        for prompt in wl.prompts:
            replies: list[str] = []
            for t in range(len(prompt.turns)):
                ids = encode_turn(target, wl, prompt.turns[: t + 1], replies)
                out = engine.generate(ids, SamplingParams(max_tokens=max_tokens)).token_ids
                rows.append({"wl": name, "id": prompt.id, "turn": t, "prompt": ids, "out": out})
                replies.append(_reply_text(target, out))
                print(f"{name} {prompt.id} turn {t}: {len(ids)} + {len(out)} tokens", flush=True)
    with open(path, "w") as f:
        json.dump(rows, f)


def parse_cost(text: str) -> tuple[str, dict[int, float]]:
    name, _, points = text.partition("=")
    curve = {int(w): float(c) for w, c in (p.split(":") for p in points.split(","))}
    if not name or 1 not in curve:
        raise SystemExit(f"--cost {text!r}: use NAME=1:1,2:C2,4:C4,... (w=1 included)")
    return name, curve


def replay(path: str, ks: list[int], maxes: list[int], costs: dict[str, dict[int, float]]) -> None:
    from speculant.proposers.ngram import NgramProposer

    with open(path) as f:
        rows = json.load(f)

    def cost(curve: dict[int, float], w: int) -> float:
        ws = sorted(curve)
        return float(np.interp(w, ws, [curve[x] for x in ws]))

    for name in dict.fromkeys(r["wl"] for r in rows):
        for ngram_max in maxes:
            for k in ks:
                tokens = passes = 0
                spent = dict.fromkeys(costs, 0.0)
                for r in (r for r in rows if r["wl"] == name):
                    prompt, out = r["prompt"], r["out"]
                    proposer = NgramProposer(ngram_max=ngram_max)
                    i = 1  # the prefill pass gives the first token
                    while i < len(out):
                        draft = proposer.propose(prompt + out[:i], min(k, len(out) - i), None, None)
                        d = draft.token_ids
                        a = 0
                        while a < len(d) and d[a] == out[i + a]:
                            a += 1
                        i += a + 1
                        tokens += a + 1
                        passes += 1
                        for c, curve in costs.items():
                            spent[c] += cost(curve, len(d) + 1)
                speed = "  ".join(f"{c} {tokens / spent[c]:.3f}x" for c in costs)
                print(
                    f"{name:12s} k={k:<2d} ngram_max={ngram_max:<2d} "
                    f"tokens/pass {tokens / max(passes, 1):.2f}  {speed}"
                )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="save greedy outputs of the shipped prompts")
    rec.add_argument("path")
    rec.add_argument("--workloads", default="code,edit,chat,extraction")
    rec.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    rec.add_argument("--max-tokens", type=int, default=128)
    rec.add_argument("--limit", type=int, default=None, help="first N prompts a workload")
    rep = sub.add_parser("replay", help="predict each setting's tokens per pass and speedup")
    rep.add_argument("path")
    rep.add_argument("--k", default="5,7")
    rep.add_argument("--ngram-max", default="4,8")
    rep.add_argument("--cost", action="append", default=[], help="NAME=W:COST,... (repeat)")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args.path, args.workloads.split(","), args.target, args.max_tokens, args.limit)
    else:
        costs = dict(parse_cost(c) for c in args.cost) or {"w1": {1: 1.0}}
        ks = [int(v) for v in args.k.split(",")]
        replay(args.path, ks, [int(v) for v in args.ngram_max.split(",")], costs)


if __name__ == "__main__":
    sys.exit(main())
