"""Server throughput at several concurrency levels, with and without speculation.

    python scripts/bench_server.py [--concurrency 1,4,8] [--configs none,draft:3,draft:5]

For each configuration a real `speculant serve` app (uvicorn on a loopback port, the
continuous-batching engine behind it) is started in this process on the same loaded
models; for each concurrency level c, c streaming chat requests (the shipped `code`
workload, through the chat template) are sent at once with the official `openai`
client. Reported per (configuration, c): aggregate tokens/s (all tokens / wall time),
median time to first token, mean accepted length, acceptance, and the speedup over
plain decoding at the same c. Greedy runs also check that every configuration returns
the same text as plain decoding. Writes bench-out/server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import openai
import torch
import uvicorn

from speculant import Engine, load_model
from speculant.bench.workloads import load_workload
from speculant.server import AsyncEngine, create_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _one(client: openai.AsyncOpenAI, model: str, prompt: str, n: int) -> dict:
    t0 = time.perf_counter()
    first = None
    text = []
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    spec = usage.model_extra["speculation"]
    return {
        "ttft": first or 0.0,
        "text": "".join(text),
        "tokens": usage.completion_tokens,
        "drafted": spec["drafted_tokens"],
        "accepted": spec["accepted_tokens"],
        "forwards": spec["target_forwards"],
    }


async def _level(url: str, model: str, prompts: list[str], c: int, n: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    async with client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*[_one(client, model, p, n) for p in prompts[:c]])
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    return {
        "concurrency": c,
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "ttft_median_s": statistics.median(r["ttft"] for r in runs),
        "mean_accepted_length": tokens / max(1, sum(r["forwards"] for r in runs)),
        "acceptance_rate": sum(r["accepted"] for r in runs) / drafted if drafted else None,
        "texts": [r["text"] for r in runs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--configs", default="none,draft:3,draft:5,ngram:5")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench-out/server.json"))
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    target = load_model(args.target, dtype="bfloat16")
    draft = load_model(args.draft, dtype="int8")
    tok = target.tokenizer
    assert tok is not None
    prompts = [p.turns[0] for p in load_workload("code").prompts]
    while len(prompts) < max(levels):
        prompts += prompts
    report: dict = {"target": target.name, "draft": draft.name, "threads": torch.get_num_threads()}
    report["max_tokens"] = args.max_tokens
    rows = []
    for spec in args.configs.split(","):
        method, _, k = spec.partition(":")
        engine = Engine(
            target,
            draft=draft if method == "draft" else None,
            method=method,
            num_speculative_tokens=(k if k == "auto" else int(k)) if k else 5,
        )
        aeng = AsyncEngine(engine, model_name="m", max_num_seqs=max(levels))
        port = _free_port()
        server = uvicorn.Server(
            uvicorn.Config(create_app(aeng), host="127.0.0.1", port=port, log_level="error")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_level(url, "m", prompts, 1, 8))  # warm-up
        for c in levels:
            row = asyncio.run(_level(url, "m", prompts, c, args.max_tokens))
            row["config"] = spec
            rows.append(row)
            print(
                f"{spec:>10} c={c}: {row['tok_s']:6.2f} tok/s, TTFT {row['ttft_median_s']:.2f}s, "
                f"{row['mean_accepted_length']:.2f} tok/pass",
                file=sys.stderr,
            )
        server.should_exit = True
        thread.join(timeout=30)
    base = {r["concurrency"]: r for r in rows if r["config"] == "none"}
    for r in rows:
        b = base.get(r["concurrency"])
        r["speedup"] = r["tok_s"] / b["tok_s"] if b else None
        r["identical_to_plain"] = r["texts"] == b["texts"] if b else None
    report["rows"] = [{k: v for k, v in r.items() if k != "texts"} for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    head = f"{'config':>10} {'c':>3} {'tok/s':>7} {'speedup':>8} {'TTFT s':>7} {'tok/pass':>8}"
    print(f"\n{head} same")
    for r in report["rows"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "—"
        print(
            f"{r['config']:>10} {r['concurrency']:>3} {r['tok_s']:7.2f} {sp:>8} "
            f"{r['ttft_median_s']:7.2f} {r['mean_accepted_length']:8.2f} {r['identical_to_plain']}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
