"""`speculant bench --pass-cost`: what one model pass over w new tokens costs.

Speculation pays only where a verify pass over k + 1 tokens costs little more than a
one-token step, so this is the number every other figure rests on. For the target (and
the draft, unless `--draft none`) at their dtypes, each width w in `--pass-widths` is
timed as a pass over w new tokens after a `--pass-context`-token prefix (the cache is
rewound between repeats, so every pass sees the same context); the median of
`--pass-reps` passes, its ratio to w = 1, and plain greedy decoding tok/s over
`--max-tokens` tokens. The target in several weight formats (`--pass-dtypes
bfloat16,int8,int4,gguf`, one row each), kernel paths (`--kernel-paths
avx2,avx512vnni`, optionally with tuning knobs: `avx512vnni+prefetch_bytes=0`), cache
types (`--pass-kv-dtypes float32,float16`) and kernel thread counts (`--pass-threads
2,1`: the native kernels' threads for GGUF weights, PyTorch's for the others) take turns
within every repeat, so that the machine's drift falls on all alike.

llama.cpp's `llama-bench` ($SPECULANT_LLAMA_CPP_BIN or PATH) runs beside it on the same
GGUF files at the same thread counts: `-p W1,W2,... -n N -d CONTEXT`, a pass over w
tokens costing 1000 w / (pp-w tokens/s) ms after the same number of context tokens (a
llama-bench without `-d` starts from an empty context, and its rows say so) and its tg-N
tokens/s as plain decoding. When it is absent the rows say why.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speculant import native
from speculant.bench.peers import LLAMA_CLI_HINT, llama_cli_binary
from speculant.models.model import Model
from speculant.native.autotune import prompt_ids


@dataclass
class PassCostConfig:
    widths: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    context: int = 64
    new: int = 32  # tokens of plain decoding
    reps: int = 7
    paths: list[str] = field(default_factory=lambda: [""])  # "" = the one the CPU picks
    threads: list[int] = field(default_factory=list)  # [] = the kernels' default
    kv_dtypes: list[str] = field(default_factory=list)  # [] = the models' own caches
    llama_cpp: bool = True
    # PyTorch's threads for weights PyTorch runs (not GGUF) when `threads` is empty;
    # None: as set when the run starts.
    torch_threads: int | None = None

    def __post_init__(self) -> None:
        if not self.widths or min(self.widths) < 1:
            raise ValueError(f"pass widths {self.widths}: positive integers are wanted")
        if 1 not in self.widths:
            self.widths = [1, *self.widths]  # every ratio is to w = 1
        self.widths = sorted(dict.fromkeys(self.widths))
        if self.context < 1 or self.reps < 1 or self.new < 1:
            raise ValueError(
                f"context {self.context}, reps {self.reps}, new tokens {self.new}: each >= 1"
            )
        if self.threads and min(self.threads) < 1:
            raise ValueError(f"pass threads {self.threads}: positive integers are wanted")
        known = native.PATHS
        for path in self.paths:
            name = path.split("+", 1)[0]
            if path and name not in known:
                raise ValueError(f"kernel path {name!r}: use one of {', '.join(known)}")


# A variant: (index of the model in the list, kernel path, threads, cache dtype or "").
Variant = tuple[int, str, int | None, str]


def _native(model: Model) -> bool:
    """Whether the native kernels run the model's weights (GGUF blocks), not PyTorch."""
    return model.dtype_name == "gguf" and native.available()


def _variants(cfg: PassCostConfig, models: Sequence[Model]) -> list[Variant]:
    """(model, kernel path, threads, cache dtype) that take turns; paths and cache dtypes
    only for GGUF models."""
    threads: list[int | None] = list(cfg.threads) if cfg.threads else [None]
    return [
        (i, p, t, kv)
        for i, model in enumerate(models)
        for p in (cfg.paths if _native(model) else [""])
        for t in threads
        for kv in ((cfg.kv_dtypes or [""]) if _native(model) else [""])
    ]


def _use(
    model: Model,
    path: str,
    threads: int | None,
    defaults: dict[str, int],
    torch_threads: tuple[int, int],
    kernel_threads: int,
) -> None:
    """Set the kernels for one variant: the native path, knobs and threads for GGUF
    weights; PyTorch's threads for the others. torch_threads: PyTorch's threads beside
    the native kernels, and for the weights it runs when `threads` is None."""
    if _native(model):
        _set_native(path, threads if threads is not None else kernel_threads, defaults)
        torch.set_num_threads(torch_threads[0])
    else:
        _set_native("", kernel_threads, defaults)
        torch.set_num_threads(threads if threads is not None else torch_threads[1])


def _set_native(path: str, threads: int, defaults: dict[str, int]) -> None:
    if not native.available():
        return
    native.set_path(path.split("+", 1)[0] if path else "auto")
    for knob, value in defaults.items():
        native.tune(knob, value)
    for item in path.split("+")[1:]:
        name, _, text = item.partition("=")
        native.tune(name, int(text))
    native.THREADS = threads


def measure_models(
    models: Sequence[Model], role: str, cfg: PassCostConfig, say: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """One row per (model, kernel path, threads) with pass ms by width and plain tok/s;
    every (width, row) takes its turn within every repeat. `models` are one model in
    several weight formats (or any models sharing a tokenizer's prompt)."""
    ids_of: list[list[int]] = []
    variants = _variants(cfg, models)
    caches: dict[tuple[int, str], Any] = {}
    for i, model in enumerate(models):
        need = cfg.context + max(cfg.widths) + cfg.new
        if need > model.config.max_seq_len:
            raise ValueError(
                f"--pass-context {cfg.context} + a {max(cfg.widths)}-token pass + {cfg.new} "
                f"decoded tokens = {need} positions: {model.name} has "
                f"{model.config.max_seq_len}"
            )
        ids = prompt_ids(model, cfg.context)
        if len(ids) < cfg.context:
            raise ValueError(f"the prompt gives {len(ids)} tokens, fewer than {cfg.context}")
        for kv in dict.fromkeys(v[3] for v in variants if v[0] == i):
            cache = caches[i, kv] = model.new_cache(need + 8, getattr(torch, kv) if kv else None)
            model.prefill(ids, cache)
        ids_of.append(ids)
    defaults = native.tuning() if native.available() else {}
    start_kernels = native.THREADS  # the kernels' threads when none are asked for
    start_torch = torch.get_num_threads()
    torch_threads = cfg.torch_threads or start_torch

    def use(v: Variant) -> None:
        _use(models[v[0]], v[1], v[2], defaults, (start_torch, torch_threads), start_kernels)

    def label(v: Variant) -> str:
        kv = f"kv {v[3]} " if v[3] else ""
        return (f"{models[v[0]].dtype_name} " if len(models) > 1 else "") + kv

    def row(v: Variant) -> dict[str, Any]:
        i, path, threads, kv = v
        if _native(models[i]):
            kernel = path or native.kernel_label()
            used = threads if threads is not None else start_kernels
        else:
            kernel = "torch"
            used = threads if threads is not None else torch_threads
        return {
            "role": role,
            "engine": "speculant",
            "model": models[i].name,
            "dtype": models[i].dtype_name,
            "kernel_path": kernel,
            "threads": used,
            "pass_ms": {},
        } | ({"kv_dtype": kv} if kv else {})

    rows: dict[Variant, dict[str, Any]] = {v: row(v) for v in variants}
    try:
        # every (width, variant) takes its turn within each repeat, so the ratios between
        # widths (the targets) do not move with the machine's drift between widths
        times: dict[tuple[int, Variant], list[float]] = {}
        for w in cfg.widths:
            for v in variants:
                use(v)
                models[v[0]].forward(ids_of[v[0]][:w], caches[v[0], v[3]], cfg.context)  # warm
                times[w, v] = []
        for _ in range(cfg.reps):
            for w in cfg.widths:
                for v in variants:
                    use(v)
                    model, tokens, cache = models[v[0]], ids_of[v[0]][:w], caches[v[0], v[3]]
                    t0 = time.perf_counter()
                    model.forward(tokens, cache, cfg.context)
                    times[w, v].append(time.perf_counter() - t0)
        for w in cfg.widths:
            for v in variants:
                rows[v]["pass_ms"][w] = 1e3 * statistics.median(times[w, v])
            say(
                f"{role} {models[0].name}: w={w} "
                + ", ".join(f"{label(v)}{rows[v]['pass_ms'][w]:.1f} ms" for v in variants)
            )
        speeds: dict[Variant, list[float]] = {v: [] for v in variants}
        for _ in range(2):
            for v in variants:
                use(v)
                model, ids, cache = models[v[0]], ids_of[v[0]], caches[v[0], v[3]]
                cache.length = cfg.context
                last = int(model.forward(ids[-1:], cache, cfg.context - 1)[-1].argmax())
                t0 = time.perf_counter()
                for i in range(cfg.new):
                    last = int(model.forward([last], cache, cfg.context + i)[-1].argmax())
                speeds[v].append(cfg.new / (time.perf_counter() - t0))
        for v in variants:
            rows[v]["plain_tok_s"] = statistics.median(speeds[v])
    finally:
        _set_native("", start_kernels, defaults)
        torch.set_num_threads(start_torch)
    return list(rows.values())


def llama_bench_rows(
    model: Model, role: str, cfg: PassCostConfig, say: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """llama.cpp's `llama-bench` on the model's GGUF file, one row per thread count; a row
    with `unavailable` (and the reason) when it cannot run."""
    base = {"role": role, "engine": "llama.cpp", "model": model.name, "dtype": "gguf"}
    tool = llama_cli_binary("llama-bench")
    src = model.source
    if src is None or src.suffix != ".gguf":
        return [base | {"unavailable": f"{model.name} was not loaded from a GGUF file"}]
    if tool is None:
        return [base | {"unavailable": f"llama-bench not found: {LLAMA_CLI_HINT}"}]
    rows = []
    depth = cfg.context if _takes_depth(tool) else 0
    for threads in cfg.threads or [native.THREADS]:
        cmd = [
            str(tool),
            "-m",
            str(src),
            "-t",
            str(threads),
            "-p",
            ",".join(str(w) for w in cfg.widths),
            "-n",
            str(cfg.new),
            "-r",
            str(min(cfg.reps, 3)),
            "-o",
            "json",
        ] + (["-d", str(depth)] if depth else [])
        say(f"{role} {model.name}: llama-bench -t {threads}" + (f" -d {depth}" if depth else ""))
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        row: dict[str, Any] = base | {
            "threads": threads,
            "depth": depth,
            "command": " ".join(cmd[0:1] + cmd[3:]),
        }
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append(row | {"unavailable": f"llama-bench exited {out.returncode}: {tail}"})
            continue
        try:
            entries = json.loads(out.stdout)
        except json.JSONDecodeError:
            rows.append(row | {"unavailable": "llama-bench printed no JSON"})
            continue
        row["pass_ms"], row["build"] = {}, None
        for e in entries:
            row["build"] = e.get("build_commit", row["build"])
            if e.get("n_prompt", 0) > 0 and e.get("n_gen", 0) == 0:
                row["pass_ms"][int(e["n_prompt"])] = 1e3 * e["n_prompt"] / e["avg_ts"]
            elif e.get("n_gen", 0) > 0 and e.get("n_prompt", 0) == 0:
                row["plain_tok_s"] = float(e["avg_ts"])
        rows.append(row)
    return rows


def _takes_depth(tool: Path) -> bool:
    """Whether this llama-bench takes `-d` (a context depth before each test)."""
    try:
        out = subprocess.run([str(tool), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--n-depth" in out.stdout + out.stderr


def run_pass_cost(
    models: Sequence[tuple[str, Model]], cfg: PassCostConfig, say: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """Rows for every role: ours (the role's models, several weight formats of one model
    taking turns), then llama.cpp's once for each GGUF file among them (or one row saying
    why it could not run)."""
    rows: list[dict[str, Any]] = []
    for role in dict.fromkeys(role for role, _ in models):
        group = [m for r, m in models if r == role]
        rows += measure_models(group, role, cfg, say)
        if cfg.llama_cpp:
            files = {
                m.source: m for m in group if m.source is not None and m.source.suffix == ".gguf"
            }
            for model in list(files.values()) or group[:1]:
                rows += llama_bench_rows(model, role, cfg, say)
    return rows


def report(rows: list[dict[str, Any]], cfg: PassCostConfig, command: str) -> dict[str, Any]:
    """results.json's content: what ran, where, and the rows."""
    from speculant.bench.measure import machine_info, now_utc

    return {
        "meta": {
            "command": command,
            "when": now_utc(),
            "machine": machine_info(),
            "kernel_path": native.active_path() if native.available() else "none",
        },
        "config": {"widths": cfg.widths, "context": cfg.context, "new": cfg.new, "reps": cfg.reps},
        "rows": rows,
    }


def render_table(data: dict[str, Any]) -> Any:
    """The rich table of a report: ms by width (ratio to w=1) and plain tokens/s."""
    from rich.table import Table

    widths = data["config"]["widths"]
    table = Table(title=f"pass cost by width, ms (ratio to w=1): {data['meta']['machine']['cpu']}")
    for col in ("role", "engine", "threads", *[f"w={w}" for w in widths], "plain tok/s"):
        table.add_column(col, justify="left" if col in ("role", "engine") else "right")
    for r in data["rows"]:
        if "unavailable" in r:
            table.add_row(r["role"], r["engine"], "", r["unavailable"])
            continue
        plain = f"{r['plain_tok_s']:.1f}" if "plain_tok_s" in r else "-"
        cells = [pass_cell(r, w) for w in widths]
        table.add_row(r["role"], engine_label(r), str(r["threads"]), *cells, plain)
    return table


def pass_cell(row: dict[str, Any], w: int) -> str:
    ms = row.get("pass_ms", {})
    if w not in ms:
        return "-"
    return f"{ms[w]:.1f} ({ms[w] / ms[1]:.2f}x)" if 1 in ms else f"{ms[w]:.1f}"


def engine_label(row: dict[str, Any]) -> str:
    if row["engine"] == "llama.cpp":
        return "llama.cpp"
    kv = f" kv {row['kv_dtype']}" if row.get("kv_dtype") else ""
    return (
        f"speculant {row['dtype']}"
        + (f" {row['kernel_path']}" if row["dtype"] == "gguf" else "")
        + kv
    )


def _peer_depth(data: dict[str, Any]) -> str:
    """What context llama.cpp's rows had, where it differs from ours."""
    peers = [r for r in data["rows"] if r["engine"] == "llama.cpp" and "pass_ms" in r]
    if any(r.get("depth", 0) != data["config"]["context"] for r in peers):
        return " (llama.cpp: from an empty context; its llama-bench takes no -d)"
    return ""


def markdown(data: dict[str, Any]) -> str:
    widths = data["config"]["widths"]
    lines = [
        f"# Pass cost: {data['meta']['machine']['cpu']}",
        "",
        f"`{data['meta']['command']}` ({data['meta']['when']}). A pass over w new tokens after "
        f"a {data['config']['context']}-token context{_peer_depth(data)}, "
        "median ms and its ratio to w = 1; plain: greedy decoding tokens/s.",
        "",
        "| role | model | engine | threads | "
        + " | ".join(f"w={w}" for w in widths)
        + " | plain tok/s |",
        "|---|---|---|---|" + "---|" * (len(widths) + 1),
    ]
    for r in data["rows"]:
        if "unavailable" in r:
            lines.append(f"| {r['role']} | {r['model']} | {r['engine']} | | {r['unavailable']} |")
            continue
        cells = [pass_cell(r, w) for w in widths]
        plain = f"{r['plain_tok_s']:.1f}" if "plain_tok_s" in r else "-"
        lines.append(
            f"| {r['role']} | {r['model']} | {engine_label(r)} | {r['threads']} | "
            + " | ".join(cells)
            + f" | {plain} |"
        )
    return "\n".join(lines) + "\n"


def write_plot(data: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r.get("pass_ms")]
    roles = sorted({r["role"] for r in rows})
    fig, axes = plt.subplots(1, len(roles), figsize=(6 * len(roles), 4.2), squeeze=False)
    for ax, role in zip(axes[0], roles, strict=True):
        for r in rows:
            if r["role"] != role:
                continue
            ws = sorted(r["pass_ms"])
            style = "--" if r["engine"] == "llama.cpp" else "-"
            ax.plot(
                ws,
                [r["pass_ms"][w] for w in ws],
                style,
                marker="o",
                label=f"{engine_label(r)}, {r['threads']} threads",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["config"]["widths"], [str(w) for w in data["config"]["widths"]])
        ax.set_xlabel("new tokens in the pass (w)")
        ax.set_ylabel("ms per pass (median)")
        ax.set_title(f"{role}: {rows[0]['model'] if len(roles) == 1 else role}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Cost of one pass by width")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(data: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    # JSON keys must be strings: widths become "1", "2", ...
    (out / "results.json").write_text(json.dumps(data, indent=2, default=str))
    (out / "results.md").write_text(markdown(data))
    if plots and any(r.get("pass_ms") for r in data["rows"]):
        paths.append(write_plot(data, out / "pass_cost.png"))
    return paths
