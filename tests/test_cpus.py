"""The native kernels' default thread count (speculant.native.cpus): the CPUs this process
may use, capped by its control group's CPU quota; and the physical cores among them, which
`speculant tune` tries. Fake sysfs and cgroup trees, so every case runs on any machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculant.native import cpus


def _topology(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    return root


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_cpu_lists() -> None:
    assert cpus._cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpus._cpu_list("5") == {5}


def test_hardware_threads_of_one_core_count_once(tmp_path: Path) -> None:
    # 4 cores with 2 hardware threads each, Linux's usual numbering (0 and 4 share a core)
    sysfs = _topology(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    assert cpus.physical_cores(range(8), sysfs) == 4
    assert cpus.physical_cores([0, 4], sysfs) == 1  # both threads of one core
    assert cpus.physical_cores([0, 1, 4], sysfs) == 2
    # siblings listed as ranges ("0-1"), and CPUs whose topology is missing
    sysfs2 = _topology(tmp_path / "b", {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"})
    assert cpus.physical_cores(range(4), sysfs2) == 2
    assert cpus.physical_cores(range(6), sysfs2) == 4  # cpu4, cpu5: a core each
    assert cpus.physical_cores([], sysfs2) == 1


def test_cgroup_quotas(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    # v2: this process's cgroup and its ancestors; the smallest limit wins
    _write(root / "cpu.max", "max 100000")
    _write(root / "kubepods" / "cpu.max", "400000 100000")
    _write(root / "kubepods" / "pod1" / "cpu.max", "150000 100000")
    assert cpus.cpu_quota(root, "0::/kubepods/pod1\n") == 1.5
    assert cpus.cpu_quota(root, "0::/kubepods\n") == 4.0
    assert cpus.cpu_quota(root, "0::/\n") is None  # "max": no limit
    # v1: the cpu controller's folder (cpu or cpu,cpuacct), -1 meaning no limit
    v1 = tmp_path / "v1"
    _write(v1 / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_quota_us", "200000")
    _write(v1 / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_period_us", "100000")
    _write(v1 / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1")
    _write(v1 / "cpu,cpuacct" / "cpu.cfs_period_us", "100000")
    text = "12:memory:/docker/c1\n4:cpu,cpuacct:/docker/c1\n"
    assert cpus.cpu_quota(v1, text) == 2.0
    assert cpus.cpu_quota(v1, "4:cpu,cpuacct:/\n") is None
    _write(root / "odd" / "cpu.max", "150000")  # not two numbers: no limit read
    assert cpus.cpu_quota(root, "0::/odd\n") is None
    # nothing readable: no limit; no /proc/self/cgroup text: the mount points
    assert cpus.cpu_quota(tmp_path / "none", "0::/x\n") is None
    _write(tmp_path / "flat" / "cpu.max", "300000 100000")
    assert cpus.cpu_quota(tmp_path / "flat", "") == 3.0


def test_default_threads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cg"
    _write(root / "cpu.max", "max 100000")

    def count(env: dict[str, str], cpu_ids: list[int], cgroup: str = "0::/\n") -> tuple[int, str]:
        return cpus.default_threads(env, cpu_ids, root, cgroup)

    # every usable CPU, hardware threads of one core included (speculant tune measures
    # one a core where they differ)
    assert count({}, list(range(8))) == (8, "8 usable CPUs")
    assert count({}, [0, 1]) == (2, "2 usable CPUs")  # an affinity mask (taskset)
    assert count({}, [2]) == (1, "1 usable CPU")
    _write(root / "box" / "cpu.max", "250000 100000")  # docker --cpus=2.5
    assert count({}, list(range(8)), "0::/box\n") == (2, "8 usable CPUs, CPU quota 2.5")
    assert count({}, [0], "0::/box\n") == (1, "1 usable CPU")  # the quota is no limit here
    _write(root / "tiny" / "cpu.max", "50000 100000")
    assert count({}, list(range(8)), "0::/tiny\n")[0] == 1  # at least one
    assert count({"SPECULANT_THREADS": "3"}, [0]) == (3, "SPECULANT_THREADS")
    for bad in ("0", "-2", "two"):
        assert count({"SPECULANT_THREADS": bad}, [0, 1]) == (2, "2 usable CPUs")
        err = capsys.readouterr().err
        assert f"SPECULANT_THREADS={bad!r} is not a thread count: use a positive integer" in err


def test_this_machine_gets_a_sane_count() -> None:
    n, why = cpus.default_threads({})
    assert 1 <= n <= len(cpus.usable_cpus())
    assert why
