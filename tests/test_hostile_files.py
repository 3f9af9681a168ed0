"""Hostile and broken GGUF files: each is refused before anything is mapped or allocated
for it, with one error that names the file and what is wrong, or loads harmlessly.

The files are rewrites of a small valid one (tests/hostile_gguf.py). The loads run in a
child process with its address space capped at 3 GB, so that a file asking for
gigabytes fails the test instead of the machine; how far each file raises the child's
peak resident memory is checked too (under 1 GB). The header parser is also fuzzed
(hypothesis): it raises nothing but GGUFError."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGUFValueType as VT
from gguf_writer import write_gguf
from hostile_gguf import Parts, read_parts, write_parts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speculant.models.gguf_file import GGUFError, read_gguf


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_archs import hf_model

    root = tmp_path_factory.mktemp("hostile")
    return write_gguf(hf_model("qwen3"), root / "base.gguf", "Q8_0")


def _edit(fn: Callable[[Parts], None]) -> Callable[[Path, Path], Path]:
    def make(base: Path, out: Path) -> Path:
        parts = read_parts(base)
        fn(parts)
        return write_parts(parts, out)

    return make


def _cut(n: int) -> Callable[[Path, Path], Path]:
    def make(base: Path, out: Path) -> Path:
        out.write_bytes(base.read_bytes()[:n])
        return out

    return make


def _cut_at(marker: bytes, extra: int) -> Callable[[Path, Path], Path]:
    def make(base: Path, out: Path) -> Path:
        raw = base.read_bytes()
        out.write_bytes(raw[: raw.index(marker) + extra])
        return out

    return make


def _set(key: str, value: object, vtype: VT = VT.UINT32) -> Callable[[Parts], None]:
    return lambda p: p.set(key, value, vtype)


def _array(key: str, values: list[int]) -> Callable[[Parts], None]:
    def fn(p: Parts) -> None:
        p.kv[key] = ([VT.ARRAY, VT.UINT32], values)

    return fn


def _counts(**kw: int) -> Callable[[Parts], None]:
    def fn(p: Parts) -> None:
        for k, v in kw.items():
            setattr(p, k, v)

    return fn


def _tensor(name: str, **kw: object) -> Callable[[Parts], None]:
    def fn(p: Parts) -> None:
        t = p.tensor(name)
        for k, v in kw.items():
            setattr(t, k, v(t) if callable(v) else v)

    return fn


def _more_tokens(n: int) -> Callable[[Parts], None]:
    def fn(p: Parts) -> None:
        types, tokens = p.kv["tokenizer.ggml.tokens"]
        p.kv["tokenizer.ggml.tokens"] = (types, tokens + [f"<x{i}>" for i in range(n)])
        types, kinds = p.kv["tokenizer.ggml.token_type"]
        p.kv["tokenizer.ggml.token_type"] = (types, kinds + [1] * n)

    return fn


def _fewer_tokens(n: int) -> Callable[[Parts], None]:
    def fn(p: Parts) -> None:
        types, tokens = p.kv["tokenizer.ggml.tokens"]
        p.kv["tokenizer.ggml.tokens"] = (types, tokens[:-n])

    return fn


def _duplicate(name: str) -> Callable[[Parts], None]:
    def fn(p: Parts) -> None:
        t = p.tensor(name)
        p.tensors.append(type(t)(t.name, list(t.dims), t.ggml_type, t.data))

    return fn


def _unknown_value_type(p: Parts) -> None:
    p.kv["qwen3.weird"] = ([99], 0)  # type: ignore[list-item]


# name -> (how the file is made, what the error must say; None: it may load)
CASES: dict[str, tuple[Callable[[Path, Path], Path], str | None]] = {
    "cut inside the 24-byte header": (_cut(10), "shorter than a header"),
    "cut inside the metadata": (_cut(2000), "truncated or corrupt"),
    "cut inside the tensor table": (_cut_at(b"blk.1.attn_q", 4), "truncated or corrupt"),
    "cut inside the tensor data": (_cut_at(b"blk.3.ffn_up", 20000), "truncated"),
    "a metadata count past the file": (_edit(_counts(n_kv=1 << 60)), "cannot fit"),
    "a tensor count past the file": (_edit(_counts(n_tensors=1 << 60)), "cannot fit"),
    "version 7": (_edit(_counts(version=7)), "version 7 is not supported"),
    "head_count 0": (_edit(_set("qwen3.attention.head_count", 0)), "head_count=0"),
    "head_count_kv 0": (_edit(_set("qwen3.attention.head_count_kv", 0)), "head_count_kv=0"),
    "head_count_kv 3 of 4": (_edit(_set("qwen3.attention.head_count_kv", 3)), "a divisor"),
    "alignment 0": (_edit(_set("general.alignment", 0)), "general.alignment=0"),
    "alignment 48": (_edit(_set("general.alignment", 48)), "a power of two"),
    "embedding_length 2**31": (
        _edit(_set("qwen3.embedding_length", 1 << 31)),
        "embedding_length=2147483648",
    ),
    "embedding_length an array": (
        _edit(_array("qwen3.embedding_length", [128, 128])),
        "embedding_length=[128, 128]",
    ),
    "embedding_length a string": (
        _edit(_set("qwen3.embedding_length", "128", VT.STRING)),
        "embedding_length='128'",
    ),
    "block_count 10**6": (_edit(_set("qwen3.block_count", 10**6)), "block_count=1000000"),
    "rms epsilon NaN": (
        _edit(_set("qwen3.attention.layer_norm_rms_epsilon", float("nan"), VT.FLOAT32)),
        "layer_norm_rms_epsilon=nan",
    ),
    "eos_token_id 1e9": (
        _edit(_set("tokenizer.ggml.eos_token_id", 10**9)),
        "eos_token_id=1000000000",
    ),
    "context_length 2**40": (
        _edit(_set("qwen3.context_length", 1 << 40, VT.UINT64)),
        "context_length=1099511627776",
    ),
    "a vocabulary larger than the embedding table": (
        _edit(_more_tokens(20000)),
        "holds 20320 tokens but the model has 320",
    ),
    "a token list shorter than its types": (
        _edit(_fewer_tokens(30)),
        "token_type has 320 entries for 290 tokens",
    ),
    "a transposed ffn_down": (
        _edit(_tensor("blk.0.ffn_down.weight", dims=lambda t: [t.dims[1], t.dims[0]])),
        "blk.0.ffn_down.weight has shape",
    ),
    "a norm with no dimensions": (
        _edit(_tensor("blk.0.attn_norm.weight", dims=[])),
        "has 0 dimensions",
    ),
    "a dimension of 0": (_edit(_tensor("blk.1.attn_norm.weight", dims=[0])), "may be 0"),
    "a tensor's type changed": (
        _edit(_tensor("blk.0.attn_q.weight", ggml_type=0)),  # Q8_0 bytes read as F32
        "overlap",
    ),
    "an unknown tensor type": (_edit(_tensor("blk.0.attn_k.weight", ggml_type=99)), "type 99"),
    "a tensor listed twice": (_edit(_duplicate("blk.2.ffn_gate.weight")), "listed twice"),
    "a misaligned tensor": (_edit(_tensor("output_norm.weight", offset=3)), "alignment"),
    "a value of unknown type": (_edit(_unknown_value_type), "unknown value type 99"),
    "context_length 2**22 (harmless)": (_edit(_set("qwen3.context_length", 1 << 22)), None),
}

_CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from speculant import load_model
out = []
for name, path in json.loads(sys.argv[1]):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        m = load_model(path, progress=False)
        m.forward([5, 6, 7], m.new_cache(16), 0)
        row = [name, "loaded", "", m.net._rope_positions]
    except Exception as exc:
        project = type(exc).__module__.startswith("speculant")  # one of the project's errors
        row = [name, "refused" if project else "crashed", f"{type(exc).__name__}: {exc}", 0]
    except BaseException as exc:
        row = [name, "crashed", f"{type(exc).__name__}: {exc}", 0]
    # how far this case raised the process's peak resident memory (kB)
    out.append(row + [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak])
print(json.dumps(out))
"""


def _check_in_a_child(
    cases: dict[str, tuple[Callable[[Path, Path], Path], str | None]], base: Path, tmp_path: Path
) -> None:
    """Make each case's file, load them all in one child process (3 GB of address
    space), and check each outcome and how far each raised the child's peak resident
    memory (under 1 GB)."""
    files = []
    for i, (name, (make, _)) in enumerate(cases.items()):
        files.append([name, str(make(base, tmp_path / f"case{i}.gguf"))])
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(files)],
        capture_output=True,
        text=True,
        timeout=600,  # a bound on a hang, not a measurement
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = {row[0]: row[1:] for row in json.loads(run.stdout)}
    problems = []
    for (name, (_, want)), (_, path) in zip(cases.items(), files, strict=True):
        outcome, msg, rope, grew_kb = results[name]
        if grew_kb > 1_000_000:  # the bound: under 1 GB for any file
            problems.append(f"{name}: the peak resident memory grew by {grew_kb} kB")
        if want is None:
            if outcome != "loaded" or rope > 4096:
                problems.append(f"{name}: {outcome} {msg} (rotary rows {rope})")
        elif outcome != "refused" or want not in msg or Path(path).name not in msg:
            problems.append(f"{name}: {outcome}: {msg}")
    assert not problems, "\n".join(problems)


def test_each_hostile_file_is_refused_by_name(base: Path, tmp_path: Path) -> None:
    _check_in_a_child(CASES, base, tmp_path)


def _retyped(name: str, ggml_type: int) -> Callable[[Parts], None]:
    return _tensor(name, ggml_type=ggml_type)


REAL_CASES: dict[str, tuple[Callable[[Path, Path], Path], str | None]] = {
    "zero heads": (_edit(_set("llama.attention.head_count", 0)), "head_count=0"),
    "a 3-million-token vocabulary": (_edit(_more_tokens(3_000_000)), "holds 3049152 tokens"),
    "a transposed ffn_down": (
        _edit(_tensor("blk.5.ffn_down.weight", dims=lambda t: [t.dims[1], t.dims[0]])),
        "blk.5.ffn_down.weight has shape",
    ),
    "a tensor's type changed": (_edit(_retyped("blk.3.attn_q.weight", 1)), "overlap"),
    "context_length 2**40": (
        _edit(_set("llama.context_length", 1 << 40, VT.UINT64)),
        "context_length=1099511627776",
    ),
}


@pytest.mark.real
def test_rewrites_of_a_real_file_are_refused_by_name(tmp_path: Path) -> None:
    """The same on SmolLM2's registry file (rewritten: metadata and tensor table changed,
    data copied): a 3-million-token vocabulary is named before the tokenizer is
    converted (it took minutes and 6.8 GB), a retyped Q4_1 tensor (as F16) overlaps its
    neighbour, a transposed matrix is named."""
    from conftest import real_model_path

    _check_in_a_child(REAL_CASES, real_model_path("smollm2-135m-instruct"), tmp_path)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_headers_raise_only_gguf_errors(
    base: Path, tmp_path: Path, data: st.DataObject
) -> None:
    """Bytes of the header and metadata overwritten, or the file cut, at random: the
    parser returns or raises GGUFError, never anything else."""
    raw = bytearray(base.read_bytes())
    header_end = raw.index(b"token_embd.weight") + 200  # into the tensor table
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, header_end))
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        raw[at : at + len(chunk)] = chunk
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    path = tmp_path / "fuzzed.gguf"
    path.write_bytes(bytes(raw))
    with contextlib.suppress(GGUFError):  # anything else fails the test
        read_gguf(path)
