"""How many threads the native kernels use when none are asked for.

One thread per CPU this process may run on, within its CPU quota:

- **the CPUs it may run on** (`os.sched_getaffinity`): a `taskset`, a container's
  cpuset or a batch scheduler often leaves fewer than the machine has, and
  `os.cpu_count()` counts them all;
- **the CPU quota** of its control group (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`;
  `docker --cpus`, Kubernetes CPU limits): at most the quota's whole CPUs (at least 1).
  More threads than that are throttled in turn, and a pass waits for its slowest thread.

More threads than usable CPUs take turns on them, and every pass waits for the last.
On a 2-core Xeon (Emerald Rapids kind), one-row passes of the 1.5B with thread counts
taking turns in one process: limited to one CPU (`taskset -c 0`), 2 threads took 1.01x
and 4 threads 1.05x the time of 1; on both CPUs, 4 threads 1.03x, 8 threads 1.09x and 16
threads 1.21x the time of 2.

A core's hardware threads (SMT, Hyper-Threading) each count: whether one thread per
physical core is faster (as PyTorch and llama.cpp assume) was not measured on the
project's machines, and a virtual machine's CPUs may be listed as siblings of one core
when they are not. `speculant tune` measures it where they differ (`physical_cores`).

`SPECULANT_THREADS` (a positive integer) overrides the count; a command's `--threads`
overrides both.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

SYSFS_CPU = Path("/sys/devices/system/cpu")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _cpu_list(text: str) -> set[int]:
    """A Linux CPU list such as '0-3,8,10-11'."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def physical_cores(cpus: Iterable[int], sysfs: Path = SYSFS_CPU) -> int:
    """How many physical cores `cpus` span: each CPU's hardware-thread siblings
    (topology/thread_siblings_list) count once. A CPU whose topology cannot be read
    counts as a core of its own."""
    cpus = set(cpus)
    cores: set[frozenset[int]] = set()
    for cpu in cpus:
        try:
            text = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
            siblings = frozenset(_cpu_list(text) & cpus) or frozenset({cpu})
        except (OSError, ValueError):
            siblings = frozenset({cpu})
        cores.add(siblings)
    return max(1, len(cores))


def _quota(quota_text: str, period_text: str) -> float | None:
    """CPUs a quota of quota_text microseconds per period_text allows (None: no limit,
    written 'max' in v2 and -1 in v1)."""
    if quota_text == "max":
        return None
    quota, period = int(quota_text), int(period_text)
    return quota / period if quota > 0 and period > 0 else None


def _cgroup_dirs(root: Path, self_cgroup: str) -> list[tuple[str, Path]]:
    """(version, folder) pairs to look for a CPU quota in: this process's own cgroup and
    its ancestors up to the root, for v2 and for v1's cpu controller."""
    found: list[tuple[str, Path]] = []

    def chain(base: Path, rel: str) -> list[Path]:
        parts = [p for p in rel.strip("/").split("/") if p]
        return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]

    for line in self_cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, rel = fields
        if controllers == "":
            found += [("v2", d) for d in chain(root, rel)]
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                if (root / mount).is_dir():
                    found += [("v1", d) for d in chain(root / mount, rel)]
                    break
    if not found:  # no /proc/self/cgroup: the mount points themselves
        found = [("v2", root), ("v1", root / "cpu"), ("v1", root / "cpu,cpuacct")]
    return found


def cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: str | None = None) -> float | None:
    """The smallest CPU quota (in CPUs) of this process's control group and its
    ancestors, or None when there is none (or none can be read)."""
    if self_cgroup is None:
        try:
            self_cgroup = PROC_SELF_CGROUP.read_text()
        except OSError:
            self_cgroup = ""
    limits: list[float] = []
    for version, folder in _cgroup_dirs(root, self_cgroup):
        try:
            if version == "v2":  # cpu.max: "QUOTA PERIOD" or "max PERIOD"
                limit = _quota(*(folder / "cpu.max").read_text().split())
            else:
                limit = _quota(
                    (folder / "cpu.cfs_quota_us").read_text(),
                    (folder / "cpu.cfs_period_us").read_text(),
                )
        except (OSError, ValueError, TypeError):  # unreadable, or not two numbers
            continue
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def parse_threads(text: str, source: str) -> int:
    """A thread count given as text (SPECULANT_THREADS, a flag): a positive integer."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{source}={text!r} is not a thread count: use a positive integer")
    return n


def default_threads(
    environ: Mapping[str, str] | None = None,
    cpus: Iterable[int] | None = None,
    cgroup_root: Path = CGROUP_ROOT,
    self_cgroup: str | None = None,
) -> tuple[int, str]:
    """(threads, why): SPECULANT_THREADS if set, else the CPUs this process may use,
    capped by its CPU quota's whole CPUs. A malformed SPECULANT_THREADS is reported on
    stderr and the count is worked out as if unset."""
    env = os.environ if environ is None else environ
    text = env.get("SPECULANT_THREADS", "").strip()
    if text:
        try:
            return parse_threads(text, "SPECULANT_THREADS"), "SPECULANT_THREADS"
        except ValueError as err:
            print(f"speculant: {err}; ignored", file=sys.stderr)
    usable = list(usable_cpus() if cpus is None else cpus)
    n = max(1, len(usable))
    why = f"{n} usable CPU{'s' if n != 1 else ''}"
    quota = cpu_quota(cgroup_root, self_cgroup)
    if quota is not None and math.floor(quota) < n:
        n = max(1, math.floor(quota))
        why += f", CPU quota {quota:g}"
    return n, why
