"""Benchmark output: a rich table, results.json, results.csv and PNG plots."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from speculant.bench.measure import threads_text
from speculant.bench.rows import ALL, BenchResult
from speculant.bench.specs import BASELINE

PLOTS = ("speedup_by_workload.png", "acceptance_by_position.png", "tokens_per_s_vs_k.png")

# Every row field, in CSV column order (lists are joined with ';', dicts are JSON).
ROW_FIELDS = (
    "workload",
    "method",
    "kind",
    "engine",
    "proposer",
    "k",
    "description",
    "settings",
    "prompts",
    "generations",
    "new_tokens",
    "tok_s_median",
    "tok_s_p25",
    "tok_s_p75",
    "tok_s_min",
    "tok_s_max",
    "speedup",
    "speedup_min",
    "speedup_max",
    "decode_tok_s_median",
    "decode_speedup",
    "theoretical_speedup",
    "identical_share",
    "lossless_expected",
    "anomalies",
    "acceptance_rate",
    "mean_accepted_length",
    "expected_tokens_per_step",
    "acceptance_by_position",
    "drafted_by_position",
    "alpha",
    "mean_draft_length",
    "draft_step_share",
    "draft_ms_per_token",
    "step_ms",
    "baseline_step_ms",
    "cost_ratio",
    "ttft_s_median",
    "peak_memory_mb",
    "weights_mb",
    "working_mb",
    "peak_rss_mb",
    "energy_j",
    "energy_j_per_token",
    "setup_s",
)


def write_outputs(result: BenchResult, out: Path, plots: bool = True) -> list[Path]:
    """results.json, results.csv, results.md and (unless plots=False) the PNG plots."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.csv", out / "results.md"]
    paths[0].write_text(json.dumps(result.to_dict(), indent=1, ensure_ascii=False) + "\n")
    write_csv(result.rows, paths[1])
    paths[2].write_text(markdown(result.to_dict()), encoding="utf-8")
    if plots:
        paths += write_plots(result.rows, out)
    return paths


def _cell(value: Any) -> Any:
    if isinstance(value, list):
        return ";".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return "" if value is None else value


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(ROW_FIELDS)
        for row in rows:
            writer.writerow([_cell(row.get(f)) for f in ROW_FIELDS])


def markdown(data: dict[str, Any]) -> str:
    """The table of a results.json as Markdown (for docs and reports)."""
    meta = data["meta"]
    measured = bool(meta.get("energy_measured"))
    lines = [
        f"Command: `{meta.get('command') or 'run_bench(...)'}`  ",
        f"Machine: {meta['machine']['cpu']}, torch {meta['machine']['torch']}, "
        f"{threads_text(meta['machine'])}. Energy: {meta['energy_source']}.",
        "",
        "| workload | method | tok/s (min-max) | speedup | decode | theory | same | accept "
        "| tok/step | TTFT s | mem MB | J/tok" + ("" if measured else "*") + " |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["workload"],
                    f"`{r['method']}`" if r["kind"] == "speculant" else f"*{r['method']}*",
                    f"{r['tok_s_median']:.2f} ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f})",
                    _f(r["speedup"], ".2f", "x"),
                    _f(r["decode_speedup"], ".2f", "x"),
                    _f(r["theoretical_speedup"], ".2f", "x"),
                    _f(r["identical_share"], ".0%"),
                    _f(r["acceptance_rate"], ".2f"),
                    _f(r["mean_accepted_length"], ".2f"),
                    _f(r["ttft_s_median"], ".2f"),
                    _f(r["peak_memory_mb"], ",.0f"),
                    _f(r["energy_j_per_token"], ".2f"),
                ]
            )
            + " |"
        )
    peers = {r["method"]: r["description"] for r in data["rows"] if r["kind"] == "peer"}
    if peers:
        lines += ["", "Peers (in italics):"]
        lines += [f"- *{name}*: {text}" for name, text in peers.items()]
    for note in data.get("skipped", []):
        lines.append(f"- skipped: {note}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- terminal table


def _f(value: float | None, fmt: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{fmt}}{suffix}"


def render_table(result: BenchResult) -> Any:
    """A rich Table: one line per (workload, method), sections by workload."""
    from rich.table import Table

    measured = bool(result.meta.get("energy_measured"))
    title = (
        f"speculant bench: {result.meta['target']['name']}"
        + (f" (draft {result.meta['draft']['name']})" if result.meta.get("draft") else "")
        + f", {result.meta['max_tokens']} new tokens"
    )
    caption = (
        "tok/s: median (min-max) over prompts, prefill included. speedup: median per-prompt "
        "ratio to `none` in this run; decode: the same without prefill (time to first token); "
        "theory: predicted from the measured acceptance and cost ratio (decode only). same: "
        "share of prompts token-identical to `none` (greedy runs). J/tok: "
        + ("measured (RAPL)." if measured else "ESTIMATE* from CPU time (no RAPL counters).")
    )
    table = Table(title=title, caption=caption, show_lines=False)
    for col, justify in (
        ("workload", "left"),
        ("method", "left"),
        ("tok/s", "right"),
        ("speedup", "right"),
        ("decode", "right"),
        ("theory", "right"),
        ("same", "right"),
        ("accept", "right"),
        ("tok/step", "right"),
        ("TTFT s", "right"),
        ("mem MB", "right"),
        ("J/tok" if measured else "J/tok*", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    rows = result.rows
    for i, r in enumerate(rows):
        last = i + 1 == len(rows) or rows[i + 1]["workload"] != r["workload"]
        same = r["identical_share"]
        same_text = _f(same, ".0%")
        if same is not None and r["lossless_expected"] and same < 1:
            same_text = f"[bold red]{same_text}[/]"
        elif same is not None and r["lossless_expected"]:
            same_text = f"[green]{same_text}[/]"
        table.add_row(
            r["workload"],
            r["method"] if r["kind"] == "speculant" else f"[cyan]{r['method']}[/]",
            f"{r['tok_s_median']:.2f} ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f})",
            _f(r["speedup"], ".2f", "x"),
            _f(r["decode_speedup"], ".2f", "x"),
            _f(r["theoretical_speedup"], ".2f", "x"),
            same_text,
            _f(r["acceptance_rate"], ".2f"),
            _f(r["mean_accepted_length"], ".2f"),
            _f(r["ttft_s_median"], ".2f"),
            _f(r["peak_memory_mb"], ",.0f"),
            _f(r["energy_j_per_token"], ".2f"),
            end_section=last,
        )
    return table


def peer_lines(result: BenchResult) -> list[str]:
    """One line per peer that ran: what it is and its settings."""
    seen: dict[str, str] = {}
    for r in result.rows:
        if r["kind"] == "peer" and r["method"] not in seen:
            seen[r["method"]] = f"{r['method']}: {r['description']}; settings {r['settings']}"
    return list(seen.values())


# ---------------------------------------------------------------- plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(rows: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    plt = _pyplot()
    paths = [out / name for name in PLOTS]
    _plot_speedup(plt, rows, paths[0])
    _plot_acceptance(plt, rows, paths[1])
    _plot_k(plt, rows, paths[2])
    return paths


def _plot_speedup(plt: Any, rows: Sequence[dict[str, Any]], path: Path) -> None:
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != BASELINE))
    value = {(r["workload"], r["method"]): r["speedup"] for r in rows}
    peers = {r["method"] for r in rows if r["kind"] == "peer"}
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(workloads) + 4.5), 4.8))
    width = 0.8 / max(1, len(methods))
    colors = plt.get_cmap("tab20")
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(workloads))]
        ys = [value.get((w, m)) or 0.0 for w in workloads]
        hatch = "//" if m in peers else None  # peers hatched, our methods solid
        ax.bar(xs, ys, width, label=m, color=colors(j % 20), hatch=hatch, edgecolor="white")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(workloads)), workloads, rotation=20)
    ax.set_ylabel("speedup vs plain decoding (median per prompt)")
    ax.set_title("Speedup by workload and method (hatched: peers)")
    if methods:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_acceptance(plt: Any, rows: Sequence[dict[str, Any]], path: Path) -> None:
    pooled = _pooled(rows)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    ax.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
    drawn = 0
    for r in pooled:
        acc = r.get("acceptance_by_position")
        if r["method"] == BASELINE or not acc:
            continue
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["method"])
        drawn += 1
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of drafts at this position accepted")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position (all workloads)")
    if drawn:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.text(0.5, 0.5, "no drafts in this run", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_k(plt: Any, rows: Sequence[dict[str, Any]], path: Path) -> None:
    pooled = _pooled(rows)
    ks = sorted({r["k"] for r in pooled if isinstance(r["k"], int)})
    has_auto = any(r["k"] == "auto" for r in pooled)
    positions: dict[int | str, int] = {k: i for i, k in enumerate(ks)}
    if has_auto:
        positions["auto"] = len(ks)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    ax.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
    families: dict[str, list[tuple[int, float]]] = {}
    for r in pooled:
        key = r["k"]
        if r["method"] == BASELINE or key not in positions:
            continue
        family = r["proposer"] + (
            f":{r['settings'].get('skip_ratio')}" if "skip_ratio" in r["settings"] else ""
        )
        families.setdefault(family, []).append((positions[key], r["tok_s_median"]))
    for family, points in families.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=family)
    for r in pooled:
        if r["k"] is None and r["method"] != BASELINE:
            ax.axhline(r["tok_s_median"], linestyle=":", linewidth=1.2, label=r["method"])
        if r["method"] == BASELINE:
            ax.axhline(r["tok_s_median"], color="black", linestyle="--", label="none (plain)")
    labels = [str(k) for k in ks] + (["auto"] if has_auto else [])
    if labels:
        ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("k (tokens drafted per step)")
    ax.set_ylabel("tokens/s (median over prompts)")
    ax.set_title("Tokens/s versus k (all workloads)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pooled(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows pooled over every workload (or the only workload's rows)."""
    pooled = [r for r in rows if r["workload"] == ALL]
    return pooled or list(rows)
