"""`speculant tune` (speculant.native.autotune): the measuring loop keeps an alternative
only when it wins clearly, the saved file is tied to this CPU and applied once by
load_model, and bad or foreign files are ignored. Timing is injected, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import real_model_path

from speculant import native
from speculant.cli import main

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.why_missing()}"
)


@pytest.fixture
def autotune(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from speculant.native import autotune as mod

    monkeypatch.setenv("SPECULANT_TUNING_FILE", str(tmp_path / "tuning.json"))
    monkeypatch.setenv("SPECULANT_TUNING", "1")
    monkeypatch.setattr(mod, "_applied", None)
    before = native.tuning()
    yield mod
    for knob, value in before.items():
        native.tune(knob, value)


def _fake_measure(costs: dict[tuple[str, int], float]):  # type: ignore[no-untyped-def]
    """A measure() whose pass costs follow the knobs set (a fixed cost per knob value),
    with a little alternating noise: the comparison logic, not this machine, decides."""

    def measure(model, settings, widths, context, rounds, state):  # type: ignore[no-untyped-def]
        out = []
        for s in settings:
            base = 1.0 + sum(costs.get((k, v), 0.0) for k, v in s.items())
            out.append(
                [{w: base * w * (1 + 0.001 * (r % 2)) for w in widths} for r in range(rounds)]
            )
        return out

    return measure


class _Model:
    name = "fake"


def test_only_clear_wins_are_kept(autotune, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    builtin = autotune.builtin_knobs()
    flip = 1 - builtin["attention_512"]
    costs = {("attention_512", flip): -0.10, ("prefetch_l2_bytes", 4096): 0.005}
    costs[("prefetch_l2_bytes", 0)] = 0.005 if builtin["prefetch_l2_bytes"] else 0.0
    monkeypatch.setattr(autotune, "measure", _fake_measure(costs))
    result = autotune.run_tune(_Model(), rounds=3, widths=(1, 4))
    if native.kernel_label().startswith("avx512"):
        assert result["knobs"].get("attention_512") == flip  # 10% faster: kept
        # tried once: the default it beat is not tried again against it
        assert [t["to"] for t in result["trials"] if t["knob"] == "attention_512"] == [flip]
    assert "prefetch_l2_bytes" not in result["knobs"]  # 0.5% apart: the default stays
    assert all(t["knob"] in native.TUNING_KNOBS for t in result["trials"])
    assert native.tuning() == builtin  # defaults restored after
    with pytest.raises(ValueError, match="rounds=2: at least 3"):
        autotune.run_tune(_Model(), rounds=2)


def test_threads_are_tuned_where_cores_have_hardware_threads(  # type: ignore[no-untyped-def]
    autotune, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a core's hardware threads make one thread per core fewer than one per CPU,
    both counts are measured first; a kept count is saved, restored after the run, and
    applied by load_model unless --threads or SPECULANT_THREADS chose one."""
    monkeypatch.setattr(native, "THREADS", 4)
    monkeypatch.setattr(native, "THREADS_WHY", "4 usable CPUs")
    monkeypatch.setattr(autotune, "thread_candidates", lambda: (4, 2))
    costs = {("threads", 2): -0.10}
    monkeypatch.setattr(autotune, "measure", _fake_measure(costs))
    result = autotune.run_tune(_Model(), rounds=3, widths=(1, 4))
    assert result["trials"][0]["knob"] == "threads" and result["knobs"]["threads"] == 2
    assert result["builtin"]["threads"] == 4 and native.THREADS == 4  # restored
    autotune.save(result)
    assert autotune.apply_saved()["threads"] == 2
    assert (native.THREADS, native.threads_label()) == (2, "2 threads (speculant tune)")
    for chosen in ("--threads", "SPECULANT_THREADS"):  # the user's count stays
        monkeypatch.setattr(autotune, "_applied", None)
        monkeypatch.setattr(native, "THREADS", 4)
        monkeypatch.setattr(native, "THREADS_WHY", chosen)
        assert "threads" not in autotune.apply_saved() and native.THREADS == 4
    data = json.loads(autotune.tuning_path().read_text())
    autotune.save(dict(data, knobs={"threads": 0}))  # not a thread count: the file is refused
    assert autotune.load_saved()[0] is None
    # one thread a core losing: nothing kept; no second count: not measured at all
    monkeypatch.setattr(autotune, "measure", _fake_measure({("threads", 2): 0.10}))
    assert "threads" not in autotune.run_tune(_Model(), rounds=3, widths=(1, 4))["knobs"]
    monkeypatch.setattr(autotune, "thread_candidates", lambda: ())
    result = autotune.run_tune(_Model(), rounds=3, widths=(1, 4))
    assert all(t["knob"] != "threads" for t in result["trials"])
    assert "threads" not in result["builtin"]


def test_saved_tuning_applies_once_and_only_on_this_cpu(autotune, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = autotune.tuning_path()
    default = native.tuning()["span_cols"]
    result = {"version": 1, "cpu": autotune.cpu_signature(), "knobs": {"span_cols": default + 4}}
    autotune.save(result)
    assert json.loads(path.read_text())["knobs"] == {"span_cols": default + 4}
    assert not path.with_name(path.name + ".tmp").exists()
    assert autotune.apply_saved() == {"span_cols": default + 4}
    assert native.tuning()["span_cols"] == default + 4
    native.tune("span_cols", default)
    assert autotune.apply_saved() == {"span_cols": default + 4}  # once per process
    assert native.tuning()["span_cols"] == default
    for bad, why in [
        (dict(result, cpu=dict(result["cpu"], model="another CPU")), "another CPU"),
        (dict(result, version=99), "not a tuning file of version 1"),
        (dict(result, knobs={"no_such_knob": 1}), "not a tuning file of version 1"),
    ]:
        path.write_text(json.dumps(bad))
        knobs, reason = autotune.load_saved()
        assert knobs is None and why in reason, reason
    path.write_text("{not json")
    assert autotune.load_saved() == (None, f"{path} is not a tuning file")
    path.write_text(json.dumps(result))
    import os

    os.environ["SPECULANT_TUNING"] = "0"
    assert autotune.load_saved() == (None, "SPECULANT_TUNING=0")


def test_tuning_file_sits_in_the_model_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """tuning_path mirrors models.registry.speculant_home (the kernels cannot import it)."""
    from speculant.models.registry import speculant_home
    from speculant.native import autotune

    monkeypatch.delenv("SPECULANT_TUNING_FILE", raising=False)
    for home in (None, str(tmp_path / "home")):
        if home is None:
            monkeypatch.delenv("SPECULANT_HOME", raising=False)
        else:
            monkeypatch.setenv("SPECULANT_HOME", home)
        assert autotune.tuning_path() == speculant_home() / autotune.FILE_NAME


@pytest.mark.real
def test_tune_cli_end_to_end(autotune, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """`speculant tune` on SmolLM2 (3 rounds, short context): saves a file for this CPU
    that --show reads back and load_model applies; --reset removes it."""
    from speculant import load_model

    path = real_model_path("smollm2-135m-instruct")
    argv = ["tune", "--target", str(path), "--rounds", "3", "--context", "16"]
    assert main(argv) == 0
    saved = autotune.tuning_path()
    data = json.loads(saved.read_text())
    assert data["cpu"] == autotune.cpu_signature() and data["model"]
    assert "kept:" in capsys.readouterr().out
    assert main(["tune", "--show"]) == 0
    assert "applies here" in capsys.readouterr().out
    data["knobs"] = {"span_cols": native.tuning()["span_cols"] + 4}
    saved.write_text(json.dumps(data))
    autotune._applied = None  # a new process, as far as apply_saved knows
    load_model(path, progress=True)
    assert f"; tuned: span_cols={data['knobs']['span_cols']})" in capsys.readouterr().err
    assert main(["tune", "--reset"]) == 0 and not saved.exists()
    assert main(["tune", "--rounds", "2", "--target", str(path)]) == 2
    assert "rounds=2: at least 3" in capsys.readouterr().err
