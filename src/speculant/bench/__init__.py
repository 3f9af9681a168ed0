"""Benchmark suite: every method and the installed peers on the same prompts, in one
process, against the plain baseline of the same run. `speculant bench` is its CLI;
see docs/benchmarks.md for what each figure means."""

from speculant.bench.peers import PEER_NAMES, PeerSpec, PeerUnavailable, expand_peers
from speculant.bench.report import render_table, write_outputs
from speculant.bench.rows import BenchResult
from speculant.bench.runner import run_bench
from speculant.bench.specs import BenchConfig, MethodSpec, parse_methods
from speculant.bench.workloads import (
    WORKLOAD_NAMES,
    Prompt,
    Workload,
    load_workload,
    load_workloads,
)

__all__ = [
    "PEER_NAMES",
    "WORKLOAD_NAMES",
    "BenchConfig",
    "BenchResult",
    "MethodSpec",
    "PeerSpec",
    "PeerUnavailable",
    "Prompt",
    "Workload",
    "expand_peers",
    "load_workload",
    "load_workloads",
    "parse_methods",
    "render_table",
    "run_bench",
    "write_outputs",
]
