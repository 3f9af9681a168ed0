"""Cost of one target pass over w new tokens, per weight format, and plain decode speed.

    python scripts/bench_pass.py [--model qwen2.5-coder-1.5b-instruct]
        [--dtypes gguf,int4] [--widths 1,2,4,6,8,16] [--context 64] [--out bench-out/pass]
        [--paths avx2,avx512vnni]

For each dtype: the median ms of a pass over w tokens after a `--context`-token prefix
(the cache is rewound between repeats, so every pass sees the same context), the ratio
to w=1, and greedy plain decoding tok/s over `--new` tokens. Prints a table and writes
`pass.json` and `pass.md` under --out. The kernel path and CPU model go in the report.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from speculant import native
from speculant.models.model import load_model


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def measure(
    name: str, dtype: str, widths: list[int], context: int, new: int, reps: int, paths: list[str]
) -> list[dict]:
    """One row per kernel path (`paths`, or [""] for the one the CPU picks); the paths
    take turns within every repeat, so that the machine's drift falls on all alike."""
    model = load_model(name, dtype=dtype, progress=False)
    tok = model.tokenizer
    assert tok is not None
    ids = tok.encode("def quicksort(items):\n    " * 16)[:context]
    cache = model.new_cache(context + max(widths) + new + 8)
    model.prefill(ids, cache)

    defaults = native.tuning() if any(paths) else {}

    def use(path: str) -> None:
        """`path` is a kernel path, optionally with tuning knobs: avx512vnni+prefetch_rows=2"""
        if path:
            name, *knobs = path.split("+")
            native.set_path(name)
            for knob, value in defaults.items():
                native.tune(knob, value)
            for item in knobs:
                knob, _, value = item.partition("=")
                native.tune(knob, int(value))

    rows = {path: {"dtype": dtype, "path": path, "pass_ms": {}} for path in paths}
    try:
        for w in widths:
            tokens = ids[:w]
            times: dict[str, list[float]] = {path: [] for path in paths}
            for path in paths:
                use(path)
                model.forward(tokens, cache, context)  # warm
            for _ in range(reps):
                for path in paths:
                    use(path)
                    t0 = time.perf_counter()
                    model.forward(tokens, cache, context)
                    times[path].append(time.perf_counter() - t0)
            for path in paths:
                rows[path]["pass_ms"][w] = 1e3 * statistics.median(times[path])
        speeds: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(2):
            for path in paths:
                use(path)
                cache.length = context
                last = int(model.forward(ids[-1:], cache, context - 1)[-1].argmax())
                t0 = time.perf_counter()
                for i in range(new):
                    last = int(model.forward([last], cache, context + i)[-1].argmax())
                speeds[path].append(new / (time.perf_counter() - t0))
        for path in paths:
            rows[path]["plain_tok_s"] = statistics.median(speeds[path])
    finally:
        if any(paths):
            native.set_path("auto")
            for knob, value in defaults.items():
                native.tune(knob, value)
    return list(rows.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtypes", default="gguf,int4")
    p.add_argument("--widths", default="1,2,4,6,8,16")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--new", type=int, default=32, help="tokens for the plain tok/s figure")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument(
        "--paths",
        default="",
        help="native kernel paths to compare for gguf, taking turns (e.g. avx2,avx512vnni),"
        " each optionally with tuning knobs (avx512vnni+prefetch_rows=1+prefetch_bytes=4096);"
        " default: the one the CPU picks",
    )
    p.add_argument("--out", type=Path, default=Path("bench-out/pass"))
    args = p.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    dtypes = args.dtypes.split(",")
    if "gguf" in dtypes:
        native.share_cores_with_torch()
    rows = []
    for dtype in dtypes:
        paths = args.paths.split(",") if args.paths and dtype == "gguf" else [""]
        for r in measure(args.model, dtype, widths, args.context, args.new, args.reps, paths):
            rows.append(r)
            ms = r["pass_ms"]
            label = f"{dtype} {r['path']}".strip()
            print(
                f"{label:>16}: "
                + " ".join(f"w{w}={ms[w]:.0f}ms({ms[w] / ms[1]:.2f}x)" for w in widths)
                + f"  plain {r['plain_tok_s']:.1f} tok/s",
                flush=True,
            )
    path = native.active_path() if native.available() else f"none ({native.why_missing()})"
    meta = {
        "model": args.model,
        "cpu": cpu_name(),
        "kernel_path": path,
        "torch_threads": torch.get_num_threads(),
        "native_threads": native.THREADS,
        "context": args.context,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pass.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        f"{args.model}, {meta['cpu']}, kernel path {path}, context {args.context}",
        "",
        "| dtype | path | " + " | ".join(f"w={w}" for w in widths) + " | plain tok/s |",
        "|---|---|" + "---|" * (len(widths) + 1),
    ]
    for r in rows:
        ms = r["pass_ms"]
        cells = [f"{ms[w]:.0f} ms ({ms[w] / ms[1]:.2f}x)" for w in widths]
        row_path = r["path"] or path
        lines.append(
            f"| {r['dtype']} | {row_path} | " + " | ".join(cells) + f" | {r['plain_tok_s']:.1f} |"
        )
    (args.out / "pass.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'pass.json'} and {args.out / 'pass.md'}")


if __name__ == "__main__":
    main()
