"""What the benchmark measures around one generation: energy, memory, per-step costs,
and the speedup that the measured acceptance and costs predict."""

from __future__ import annotations

import math
import os
import re
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POWERCAP = Path("/sys/class/powercap")
# Estimate used when the CPU's energy counters cannot be read: the process's CPU time
# (every thread, user + system) times a fixed power per busy core. 10 W is a round
# figure for one busy core of a current server or desktop CPU at full clock; it
# ignores idle, uncore and memory power. Override with --watts-per-core.
DEFAULT_WATTS_PER_CORE = 10.0


# ---------------------------------------------------------------- energy


@dataclass(frozen=True)
class _Domain:
    path: Path
    max_uj: int


class EnergyMeter:
    """Joules spent during a block: RAPL package counters (powercap) when readable,
    else an estimate from CPU time, labelled as such in `source`."""

    def __init__(self, watts_per_core: float = DEFAULT_WATTS_PER_CORE, root: Path = POWERCAP):
        if not watts_per_core > 0:
            raise ValueError(f"watts_per_core={watts_per_core} is out of range: use > 0")
        self.watts_per_core = watts_per_core
        self.domains = _package_domains(root)
        self.measured = bool(self.domains)

    @property
    def source(self) -> str:
        if self.measured:
            names = ", ".join(d.path.name for d in self.domains)
            return f"measured: RAPL package energy counters ({names}), whole CPU package"
        return (
            f"estimate: process CPU-seconds x {self.watts_per_core:g} W per busy core "
            "(no readable powercap/RAPL counters)"
        )

    def read(self) -> tuple[list[int], float]:
        counters = [int((d.path / "energy_uj").read_text()) for d in self.domains]
        return counters, time.process_time()

    def joules(self, start: tuple[list[int], float], end: tuple[list[int], float]) -> float:
        if self.measured:
            total = 0
            for d, a, b in zip(self.domains, start[0], end[0], strict=True):
                total += b - a if b >= a else b + d.max_uj - a  # the counter wrapped
            return total / 1e6
        return (end[1] - start[1]) * self.watts_per_core


def _package_domains(root: Path) -> list[_Domain]:
    """Top-level package domains (intel-rapl:N; AMD CPUs use the same driver names)."""
    out: list[_Domain] = []
    if not root.is_dir():
        return out
    for path in sorted(root.iterdir()):
        if not re.fullmatch(r"[a-z-]+rapl:\d+", path.name):
            continue  # sub-domains (core, uncore, dram) are inside their package's count
        try:
            int((path / "energy_uj").read_text())
            max_uj = int((path / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            return []  # present but not readable (often root-only): estimate instead
        out.append(_Domain(path, max_uj))
    return out


# ---------------------------------------------------------------- memory


class MemoryProbe:
    """Process resident memory: current, and the peak since `reset` (Linux resets the
    peak through /proc/self/clear_refs; elsewhere the peak is the one since start)."""

    def __init__(self) -> None:
        self.status = Path("/proc/self/status")
        self.resettable = self._try_reset()

    def _try_reset(self) -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return self._field("VmHWM") is not None
        except OSError:
            return False

    def _field(self, name: str) -> int | None:
        try:
            match = re.search(rf"{name}:\s+(\d+) kB", self.status.read_text())
        except OSError:
            return None
        return int(match.group(1)) * 1024 if match else None

    def reset(self) -> None:
        if self.resettable:
            self._try_reset()

    def rss(self) -> int:
        value = self._field("VmRSS")
        return value if value is not None else self.peak()

    def peak(self) -> int:
        value = self._field("VmHWM") if self.resettable else None
        if value is not None:
            return value
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


@dataclass
class Usage:
    """Figures of one measured block."""

    seconds: float = 0.0
    joules: float = 0.0
    rss_before: int = 0
    peak_rss: int = 0

    @property
    def working_bytes(self) -> int:
        return max(0, self.peak_rss - self.rss_before)


@contextmanager
def measured(energy: EnergyMeter, memory: MemoryProbe) -> Iterator[Usage]:
    usage = Usage()
    memory.reset()
    usage.rss_before = memory.rss()
    e0 = energy.read()
    t0 = time.perf_counter()
    try:
        yield usage
    finally:
        usage.seconds = time.perf_counter() - t0
        usage.joules = energy.joules(e0, energy.read())
        usage.peak_rss = memory.peak()


# ---------------------------------------------------------------- per-step record


@dataclass
class StepRecord:
    """Every verify step of a request: drafted and accepted counts and their times, as
    the engine reports them to its speculation-length policy."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)

    def add(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.drafted.append(drafted)
        self.accepted.append(accepted)
        self.draft_s.append(draft_s)
        self.verify_s.append(verify_s)

    def extend(self, other: StepRecord) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s


def record_steps(engine: Any) -> Callable[[], StepRecord]:
    """Tap the engine's policy for per-step figures; call the result to take the record
    of the steps since the last call. Returns None-yielding tap when the engine has no
    policy to observe (the figures that need it are then left empty)."""
    policy = getattr(engine, "policy", None)
    inner = getattr(policy, "observe", None)
    state = {"record": StepRecord()}
    if policy is None or inner is None:
        return lambda: StepRecord()

    def observe(drafted: int, accepted: int, draft_s: float, verify_s: float, *step: Any) -> None:
        state["record"].add(drafted, accepted, draft_s, verify_s)
        inner(drafted, accepted, draft_s, verify_s, *step)

    setattr(policy, "observe", observe)  # noqa: B010 (an instance attribute shadows the method)

    def take() -> StepRecord:
        out, state["record"] = state["record"], StepRecord()
        return out

    return take


# ---------------------------------------------------------------- speculation figures


@dataclass(frozen=True)
class SpecFigures:
    """Acceptance and cost figures pooled over the steps of one method on one workload."""

    steps: int
    drafting_steps: int
    drafted_by_position: list[int]
    accepted_by_position: list[int]
    acceptance_by_position: list[float]  # accepted / drafted at position j (1-based j+1)
    alpha: float | None  # per-token acceptance, geometric fit (see docs/benchmarks.md)
    mean_draft_length: float | None  # tokens drafted per drafting step
    draft_ms_per_token: float | None
    step_ms: float | None  # median verify step (target forward + verification)

    @property
    def draft_step_share(self) -> float | None:
        return self.drafting_steps / self.steps if self.steps else None


def spec_figures(rec: StepRecord) -> SpecFigures:
    depth = max(rec.drafted, default=0)
    drafted = [0] * depth
    accepted = [0] * depth
    trials = 0
    for d, a in zip(rec.drafted, rec.accepted, strict=True):
        for j in range(d):
            drafted[j] += 1
        for j in range(a):
            accepted[j] += 1
        if d:
            trials += a + (1 if a < d else 0)  # the tokens tested until the first rejection
    drafting = sum(1 for d in rec.drafted if d)
    per_token = [s / d for s, d in zip(rec.draft_s, rec.drafted, strict=True) if d]
    return SpecFigures(
        steps=len(rec.drafted),
        drafting_steps=drafting,
        drafted_by_position=drafted,
        accepted_by_position=accepted,
        acceptance_by_position=[
            a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)
        ],
        alpha=sum(accepted) / trials if trials else None,
        mean_draft_length=sum(rec.drafted) / drafting if drafting else None,
        draft_ms_per_token=statistics.median(per_token) * 1e3 if per_token else None,
        step_ms=statistics.median(rec.verify_s) * 1e3 if rec.verify_s else None,
    )


def expected_tokens_per_step(alpha: float, k: float) -> float:
    """1 + alpha + ... + alpha^k: tokens one verify pass yields when each of k drafts is
    accepted with probability alpha, independently, until the first rejection."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


def theoretical_speedup(
    alpha: float, k: float, cost_ratio: float, draft_share: float = 1.0
) -> float:
    """Speedup over plain decoding predicted from acceptance and costs.

    A drafting step (share f of the steps) yields E(alpha, k) tokens for the time of
    one target forward plus k draft tokens at `cost_ratio` c each; the other steps are
    plain. S = (1 - f + f * E) / (1 + f * k * c). With f = 1 this is the standard
    (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))."""
    f = min(max(draft_share, 0.0), 1.0)
    tokens = 1.0 - f + f * expected_tokens_per_step(alpha, k)
    return tokens / (1.0 + f * k * cost_ratio)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def cpu_description() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical CPUs"
    except OSError:
        pass
    import platform

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs"


def now_utc() -> str:
    """The time a report was started, ISO 8601 in UTC to the second."""
    import datetime

    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def machine_info() -> dict[str, Any]:
    """The machine a report was measured on (every report's "machine" entry)."""
    import platform

    import torch

    from speculant import native

    return {
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kernel_threads": native.THREADS if native.available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def threads_text(machine: dict[str, Any]) -> str:
    """How many threads a report ran: the native kernels' (when they ran) and PyTorch's."""
    from speculant.native import n_threads

    kernels = machine.get("kernel_threads")
    torch_part = f"PyTorch {n_threads(machine['torch_threads'])}"
    return torch_part if kernels is None else f"native kernels {n_threads(kernels)}, {torch_part}"


def model_info(m: Any) -> dict[str, Any] | None:
    """A loaded model as reports name it (None for no model)."""
    if m is None:
        return None
    return {
        "name": m.name,
        "source": str(m.source) if m.source else None,
        "arch": m.config.arch,
        "layers": m.config.n_layers,
        "dtype": m.dtype_name,
        "weights_mb": m.net.weights.nbytes() / 1e6,
    }
