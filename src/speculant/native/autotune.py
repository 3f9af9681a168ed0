"""`speculant tune`: measure the native kernels' tuning knobs on this machine and keep the
settings that win.

Every knob is bitwise neutral (tests/test_native.py runs each at several values against
the default), so a tuned setting can only change speed. Their built-in defaults were
measured on the CPUs the project ran on (some only on Intel's, some only on AMD's); this
measures them where the engine actually runs, and with them the thread count where a
core's hardware threads make "one per CPU" and "one per core" differ (a question no
project machine could settle; the threads split the columns, so the count changes no
bit either). A tuned count never overrides `--threads` or `SPECULANT_THREADS`. Whole
passes of a model take turns within every round, a knob's alternative against the best
setting so far, and the alternative is kept only if it wins clearly: a weighted pass
cost at least MARGIN lower and at least two thirds of the rounds won. The result goes to
`tuning_path()` (under the model cache, keyed by this CPU), and `load_model` applies it
to the native kernels from then on; `SPECULANT_TUNING=0` ignores the file, `speculant
tune --reset` removes it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from speculant import native
from speculant.native import cpus

VERSION = 1
FILE_NAME = "kernel-tuning.json"
MARGIN = 0.02  # an alternative must cost this much less (weighted) to be kept
# The knobs worth measuring, with the values tried, in the order tuned (each from the
# best setting so far). Which apply depends on the code path (`_applies`).
CANDIDATES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("wide_tiles", (0, 1)),
    ("wide_min_rows", (1, 3)),
    ("prefetch_l2_bytes", (0, 4096)),
    ("prefetch_bytes", (1024, 2048, 4096)),
    ("span_blocks", (0, 4)),
    ("attention_512", (0, 1)),
)
# The kernels' thread count is tried first (the knobs are then measured at the count
# kept): every usable CPU (the default) against one thread per physical core, where a
# core's hardware threads make that fewer. It is native.THREADS, not a kernels' knob.
THREADS_KNOB = "threads"
_CPU_FLAGS: tuple[str, ...] = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl")
_CPU_FLAGS += ("avx512dq", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_tile")
_builtin: dict[str, int] | None = None  # the knobs before any saved tuning was applied
_applied: dict[str, int] | None = None  # what apply_saved set in this process


def tuning_path() -> Path:
    """`$SPECULANT_TUNING_FILE`, else kernel-tuning.json in the model cache folder
    (`$SPECULANT_HOME` or ~/.cache/speculant, as models.registry.speculant_home: the
    kernels sit below the models and cannot import it; a test keeps the two equal)."""
    env = os.environ.get("SPECULANT_TUNING_FILE")
    if env:
        return Path(env).expanduser()
    home = os.environ.get("SPECULANT_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "speculant") / FILE_NAME


def cpu_signature() -> dict[str, Any]:
    """What a saved tuning is valid for: the CPU's model name and vendor, the instruction
    sets the kernels choose by, the logical CPUs, and the code path in use."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "model name", "flags", "Features") and key not in info:
                info[key] = value.strip()
    except OSError:
        pass
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {
        "model": info.get("model name", ""),
        "vendor": info.get("vendor_id", ""),
        "flags": [f for f in _CPU_FLAGS if f in flags],
        "cpus": os.cpu_count() or 1,
        "usable_cpus": len(cpus.usable_cpus()),
        "path": native.kernel_label(),
    }


def builtin_knobs() -> dict[str, int]:
    """The knobs' values before any saved tuning (the library's defaults here)."""
    global _builtin
    if _builtin is None:
        _builtin = native.tuning()
    return dict(_builtin)


def _applies(knob: str, best: dict[str, int], path: str) -> bool:
    if knob == "wide_tiles":
        return path.startswith("avx512vnni")
    if knob == "wide_min_rows":  # only where the two-column tiles run
        return path.startswith("avx512vnni") and best.get("wide_tiles", 0) == 1
    if knob == "attention_512":
        return path.startswith("avx512")
    return True


def thread_candidates() -> tuple[int, ...]:
    """The thread counts to measure: the default (the usable CPUs within the CPU quota)
    and the physical cores among those CPUs, when fewer; none when SPECULANT_THREADS
    chose the count or the CPUs are one a core."""
    n, why = cpus.default_threads()
    cores = min(n, cpus.physical_cores(cpus.usable_cpus()))
    return (n, cores) if why != "SPECULANT_THREADS" and cores < n else ()


def _set(knobs: dict[str, int]) -> None:
    for knob, value in knobs.items():
        if knob == THREADS_KNOB:
            native.THREADS = value
        else:
            native.tune(knob, value)


PROMPT = "def quicksort(items):\n    "  # repeated to the context's length


def prompt_ids(model: Any, n: int) -> list[int]:
    """The first n tokens of PROMPT repeated (>= 1 token a copy), the context every timed
    pass follows (here and in `speculant bench --pass-cost`)."""
    if model.tokenizer is None:  # a file without a tokenizer (synthetic weights): fixed ids
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, model.vocab_size, (n,), generator=gen).tolist()
    ids: list[int] = model.tokenizer.encode(PROMPT * max(64, n))[:n]
    return ids


def measure(
    model: Any,
    settings: Sequence[dict[str, int]],
    widths: Sequence[int],
    context: int,
    rounds: int,
    state: dict[str, Any] | None = None,
) -> list[list[dict[int, float]]]:
    """times[s][round][w]: seconds of a pass over w tokens after `context` tokens with the
    knobs of settings[s]; the settings take turns within every round (order alternating),
    one warm-up pass each first. `state` keeps the prompt and its prefilled cache from one
    call to the next (every pass rewrites the same rows past the context)."""
    state = {} if state is None else state
    if "cache" not in state:
        state["ids"] = prompt_ids(model, context + max(widths))
        state["cache"] = model.new_cache(context + max(widths) + 8)
        model.prefill(state["ids"][:context], state["cache"])
    ids, cache = state["ids"], state["cache"]
    times: list[list[dict[int, float]]] = [[] for _ in settings]
    for r in range(rounds + 1):
        order = list(range(len(settings)))
        if r % 2:
            order.reverse()
        for s in order:
            _set(settings[s])
            row: dict[int, float] = {}
            for w in widths:
                t0 = time.perf_counter()
                model.forward(ids[context : context + w], cache, context)
                row[w] = time.perf_counter() - t0
            if r:  # round 0 warms up
                times[s].append(row)
    return times


def weighted(row: dict[int, float], weights: dict[int, float]) -> float:
    return sum(weights[w] * t for w, t in row.items())


def compare(
    a: list[dict[int, float]], b: list[dict[int, float]], weights: dict[int, float]
) -> tuple[float, float]:
    """(b's weighted cost over a's, from per-width medians; the share of rounds b won)."""
    widths = list(a[0])
    med_a = {w: statistics.median(r[w] for r in a) for w in widths}
    med_b = {w: statistics.median(r[w] for r in b) for w in widths}
    wins = sum(weighted(rb, weights) < weighted(ra, weights) for ra, rb in zip(a, b, strict=True))
    return weighted(med_b, weights) / weighted(med_a, weights), wins / len(a)


def run_tune(
    model: Any,
    *,
    rounds: int = 7,
    widths: Sequence[int] = (1, 4, 8),
    context: int = 256,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Tune the thread count (where `thread_candidates` offers two) and the knobs of
    CANDIDATES one after another from the built-in defaults; returns the result to save
    (`knobs`: those that differ from the defaults) with every trial."""
    if rounds < 3:
        raise ValueError(f"rounds={rounds}: at least 3 are needed to judge a knob")
    if not widths or min(widths) < 1:
        raise ValueError(f"widths {list(widths)}: positive integers are wanted")
    if context < 1:
        raise ValueError(f"context={context}: at least 1 token")
    builtin = builtin_knobs()
    start_threads = native.THREADS
    counts = thread_candidates()
    candidates: tuple[tuple[str, tuple[int, ...]], ...] = (
        ((THREADS_KNOB, counts),) if counts else ()
    )
    if counts:
        builtin[THREADS_KNOB] = counts[0]
    path = native.kernel_label()
    # decode steps weigh half, verify passes the rest (the default drafts up to 7 tokens)
    share = 0.5 / max(1, len([w for w in widths if w > 1]))
    weights = {w: (0.5 if w == 1 else share) for w in widths}
    state: dict[str, Any] = {}  # the prefilled context, shared by every comparison
    candidates += CANDIDATES
    best = {knob: builtin[knob] for knob, _ in candidates}
    trials: list[dict[str, Any]] = []
    try:
        for knob, values in candidates:
            if not _applies(knob, best, path):
                continue
            start = best[knob]  # each other value is tried once, against the best so far
            for value in values:
                if value == start:
                    continue
                alt = dict(best, **{knob: value})
                a, b = measure(model, [best, alt], widths, context, rounds, state)
                ratio, won = compare(a, b, weights)
                kept = ratio <= 1 - MARGIN and won >= 2 / 3
                trials.append(
                    {"knob": knob, "from": best[knob], "to": value, "ratio": ratio, "won": won}
                )
                say(
                    f"{knob}: {best[knob]} -> {value}: {ratio:.3f}x the time, won "
                    f"{won:.0%} of rounds: {'kept' if kept else 'not kept'}"
                )
                if kept:
                    best = alt
    finally:
        _set({knob: builtin[knob] for knob, _ in CANDIDATES})
        native.THREADS = start_threads
    return {
        "version": VERSION,
        "cpu": cpu_signature(),
        "knobs": {k: v for k, v in best.items() if v != builtin[k]},
        "builtin": {k: builtin[k] for k, _ in candidates},
        "trials": trials,
        "model": model.name,
        "widths": list(widths),
        "context": context,
        "rounds": rounds,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def save(result: dict[str, Any], path: Path | None = None) -> Path:
    """Write the result whole or not at all (a temporary file renamed over it)."""
    path = path or tuning_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    return path


def load_saved(path: Path | None = None) -> tuple[dict[str, int] | None, str]:
    """(the saved knobs valid for this machine, or None; why not, when None)."""
    path = path or tuning_path()
    if os.environ.get("SPECULANT_TUNING", "1") == "0":
        return None, "SPECULANT_TUNING=0"
    if not path.is_file():
        return None, f"no {path}"
    try:
        data = json.loads(path.read_text())
        knobs = data["knobs"]
        ok = data.get("version") == VERSION and isinstance(knobs, dict)
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"{path} is not a tuning file"

    def valid(k: str, v: Any) -> bool:
        if k == THREADS_KNOB:
            return isinstance(v, int) and v >= 1
        return k in native.TUNING_KNOBS and isinstance(v, int)

    if not ok or not all(valid(k, v) for k, v in knobs.items()):
        return None, f"{path} is not a tuning file of version {VERSION}"
    if data.get("cpu") != cpu_signature():
        return None, f"{path} was measured on another CPU or code path"
    return {str(k): int(v) for k, v in knobs.items()}, ""


def apply_saved(path: Path | None = None) -> dict[str, int]:
    """Apply the saved tuning once per process (when valid here); returns what it set."""
    global _applied
    if _applied is not None:
        return dict(_applied)
    builtin_knobs()  # remember the defaults before changing them
    knobs, _ = load_saved(path)
    _applied = {}
    for knob, value in (knobs or {}).items():
        if knob == THREADS_KNOB:
            # never over a count the user chose, nor past the default (the usable CPUs)
            if native.THREADS_WHY in ("--threads", "SPECULANT_THREADS"):
                continue
            if 1 <= value < native.THREADS:
                native.THREADS, native.THREADS_WHY = value, "speculant tune"
                _applied[knob] = value
            continue
        try:
            native.tune(knob, value)
        except ValueError:
            continue  # a value this build no longer takes: its default stays
        _applied[knob] = value
    return dict(_applied)


def describe(knobs: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(knobs.items()))
