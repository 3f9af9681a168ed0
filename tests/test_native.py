"""The native kernels (speculant.native): exact dequantization against the `gguf`
reference, matrix products within a float64 bound, bitwise row invariance (a row alone
equals the same row in any batch of up to 32, at any offset, on every code path this CPU
has, at any thread count), bitwise agreement of the code paths, and the GGUF dtype on
real models (greedy speculative output equals plain output)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import real_model_path
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize
from oracles import plain_greedy
from test_engine import ScriptedProposer

from speculant import Engine, SamplingParams, load_model, native
from speculant.models.model import ModelLoadError

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.why_missing()}"
)

TYPES = sorted(native.SUPPORTED_TYPES)
NAMES = [native.SUPPORTED_TYPES[t] for t in TYPES]
# byte offsets of the fp16 scale fields in each block (random bytes there could be inf)
_SCALES = {native.Q4_0: [0], native.Q4_1: [0, 2], native.Q5_0: [0], native.Q8_0: [0]}
_SCALES |= {native.Q4_K: [0, 2], native.Q6_K: [208]}


def random_matrix(ggml_type: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random stored blocks [n, row bytes]: every code pattern is a valid block; the
    scales are set to small finite halves."""
    rng = np.random.default_rng(seed)
    per, nbytes = native.BLOCK[ggml_type]
    raw = rng.integers(0, 256, size=(n, k // per, nbytes), dtype=np.uint8)
    for off in _SCALES[ggml_type]:
        scales = (rng.standard_normal((n, k // per)) * 0.02).astype(np.float16)
        raw[:, :, off : off + 2] = scales.view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, ggml_type: int, n: int, k: int) -> np.ndarray:
    return dequantize(raw, GGMLQuantizationType(ggml_type)).reshape(n, k).astype(np.float32)


@pytest.fixture(params=[name for name in native.PATHS if name != "auto"])
def path(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    if request.param not in native.paths():
        pytest.skip(f"this CPU has no {request.param} path")
    native.set_path(request.param)
    yield request.param
    native.set_path("auto")


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_dequantized_rows_equal_the_gguf_reference(ggml_type: int) -> None:
    n, k = 19, 512
    raw = random_matrix(ggml_type, n, k)
    matrix = native.NativeMatrix([(ggml_type, raw, n)], k)
    ids = torch.tensor([3, 0, 18, 3, 7])
    assert np.array_equal(matrix.rows(ids).numpy(), reference(raw, ggml_type, n, k)[ids.numpy()])


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_matmul_within_the_float64_bound(ggml_type: int, path: str) -> None:
    """|y - y64| <= sum over blocks of (d_b / 2) * sum |w| (the activation rounding),
    plus float32 accumulation slack, against the float64 product of the exact weights."""
    n, k, m = 45, 768, 7
    raw = random_matrix(ggml_type, n, k, seed=1)
    w = torch.from_numpy(reference(raw, ggml_type, n, k)).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * 3
    y = native.NativeMatrix([(ggml_type, raw, n)], k).matmul(x)
    y64 = x.double() @ w.T
    kquant = ggml_type in (native.Q4_K, native.Q6_K)
    per = 256 if kquant else 32
    _, scales = native.quantize_rows(x, kquant)  # [m, k / per]
    wsum = w.abs().reshape(n, k // per, per).sum(-1)  # [n, k / per]
    bound = 0.5 * scales.double() @ wsum.T + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    assert ((y.double() - y64).abs() <= bound).all()
    assert (y.double() - y64).abs().max() > 0  # the bound is not vacuous: rounding happens


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_row_alone_equals_row_in_any_batch(ggml_type: int, path: str) -> None:
    n, k = 67, 512  # 67 columns: chunks of columns do not divide it
    raw = random_matrix(ggml_type, n, k, seed=3)
    matrix = native.NativeMatrix([(ggml_type, raw, n)], k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([matrix.matmul(x[i : i + 1], threads=1) for i in range(40)])
    for m in range(1, 33):
        for offset in sorted({0, 1, 40 - m}):
            if offset + m > 40:
                continue
            for threads in (1, 2, 3):
                got = matrix.matmul(x[offset : offset + m], threads=threads)
                assert torch.equal(got, alone[offset : offset + m]), (m, offset, threads)


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
@pytest.mark.parametrize("m", [1, 4, 9])
def test_code_paths_agree_bitwise(ggml_type: int, m: int) -> None:
    """Every path this CPU has equals the portable C code bit for bit: 33 columns (two-
    column tiles and a one-column tail), 1 / 4 / 9 rows (one tile of 1 or 4 rows, or
    tiles of 4 with a tail), legacy rows of 33 blocks (a last group padded to 8 blocks)."""
    n = 33
    k = 1024 if ggml_type in (native.Q4_K, native.Q6_K) else 33 * 32
    raw = random_matrix(ggml_type, n, k, seed=5)
    matrix = native.NativeMatrix([(ggml_type, raw, n)], k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)) * 4
    outs = {}
    try:
        for p in native.paths():
            native.set_path(p)
            outs[p] = matrix.matmul(x)
    finally:
        native.set_path("auto")
    for p, y in outs.items():
        assert torch.equal(y, outs["portable"]), p


def test_build_without_x86_code_gives_the_portable_bits(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """kernels.c compiled as on a CPU that is not x86 (SPEC_PORTABLE_ONLY leaves out every
    x86 intrinsic, as an ARM compiler does) builds, offers the portable path alone, and
    gives the portable path's bits for every format's matmul, attention and the norm."""
    source = Path(native.__file__).with_name("kernels.c")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None or not source.exists():
        pytest.skip("no C compiler, or the package was installed without kernels.c")
    lib_path = tmp_path / "portable_only.so"
    flags = ["-O3", "-std=gnu11", "-ffp-contract=off", "-pthread", "-shared", "-fPIC"]
    build = subprocess.run(
        [cc, *flags, "-DSPEC_PORTABLE_ONLY", str(source), "-o", str(lib_path), "-lm"],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]

    def run_all() -> list[torch.Tensor]:
        outs = []
        for ggml_type in TYPES:
            k = 512 if ggml_type in (native.Q4_K, native.Q6_K) else 9 * 32
            matrix = native.NativeMatrix([(ggml_type, random_matrix(ggml_type, 19, k, 3), 19)], k)
            for m in (1, 5, 40):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                outs.append(matrix.matmul(x))
        keys, values = _cache(2, 90, 64, 4)
        q = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(5))
        lo, hi = torch.tensor([0, 0, 30]), torch.tensor([2, 90, 60])
        outs.append(native.attend(q, keys, values, lo, hi, 0.125))
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
        outs.append(native.rms_norm(x, x[0].abs() + 0.5, 1e-6))
        return outs

    native.set_path("portable")
    try:
        want = run_all()
    finally:
        native.set_path("auto")
    monkeypatch.setattr(native, "_lib", native._bind(ctypes.CDLL(str(lib_path))))
    assert native.paths() == ["portable"]
    assert native.active_path() == "portable"
    got = run_all()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), i


def _equal_rows_alone_under_knobs(
    ggml_type: int, n: int, k: int, seed: int, settings: list[dict[str, int]], ms: tuple[int, ...]
) -> None:
    """On every path and under every knob setting, a pass of each of `ms` rows over a
    random [n, k] matrix gives bitwise what its rows give alone."""
    raw = random_matrix(ggml_type, n, k, seed=seed)
    matrix = native.NativeMatrix([(ggml_type, raw, n)], k)
    x = torch.randn(max(ms), k, generator=torch.Generator().manual_seed(seed + 1))
    alone = torch.cat([matrix.matmul(x[i : i + 1]) for i in range(max(ms))])
    before = native.tuning()
    try:
        for name in native.paths():
            native.set_path(name)
            for knobs in settings:
                for knob, value in knobs.items():
                    native.tune(knob, value)
                for m in ms:
                    got = matrix.matmul(x[:m], threads=2)
                    assert torch.equal(got, alone[:m]), (name, knobs, m)
    finally:
        native.set_path("auto")
        for knob, value in before.items():
            native.tune(knob, value)


@pytest.mark.parametrize("ggml_type", [native.Q4_K, native.Q6_K], ids=["Q4_K", "Q6_K"])
def test_long_columns_in_spans_equal_whole_columns(ggml_type: int) -> None:
    """Passes of a few rows over long K-quant columns go a span of blocks at a time over a
    group of columns (their sums carried between spans): bitwise the whole-column result,
    on every path, for spans that do and do not divide the column, and whatever rows
    alone or in a pass (a row alone never takes spans)."""
    # 29 blocks: spans of 4 leave 1; 21 columns: groups of 8 leave 5
    spans = ((0, 8), (4, 8), (3, 5), (29, 1), (64, 32))
    # with and without two-column 512-bit tiles (pairs of a group's columns, an odd one
    # alone), whatever the CPU's default
    settings = [
        {"span_blocks": b, "span_cols": c, "wide_tiles": w, "wide_min_rows": 1}
        for b, c in spans
        for w in (0, 1)
    ]
    _equal_rows_alone_under_knobs(ggml_type, 21, 29 * 256, 13, settings, (2, 3, 5, 8))


@pytest.mark.parametrize("ggml_type", [native.Q4_K, native.Q6_K, native.Q8_0])
def test_row_tiles_outside_columns_equal_cols_order(ggml_type: int) -> None:
    """Passes of many rows (a prefill) over K-quants take their row tiles outside the
    column loop, long columns a span at a time: bitwise the result of the rows alone, on
    every path, for spans that do and do not divide the column, and for the order it
    replaces (which Q8_0, a legacy format, keeps)."""
    # 71 columns: groups of 64 leave 7; 7 blocks: off, spans of 1, 2 (leaving 1) and 3
    # blocks, whole columns
    budgets = (0, 320 * 4, 320 * 8, 320 * 12, 1 << 20)
    settings = [{"rows_outer": b} for b in budgets]
    _equal_rows_alone_under_knobs(ggml_type, 71, 7 * 256, 15, settings, (16, 23, 37))


@pytest.mark.parametrize("ggml_type", [native.Q4_K, native.Q6_K], ids=["Q4_K", "Q6_K"])
def test_wide_tiles_equal_rows_alone(ggml_type: int) -> None:
    """Two-column K-quant tiles in 512-bit registers (the wide_tiles knob, on by default on
    Intel CPUs), in prefill and verify passes, are bitwise the rows alone, on every path,
    with and without spans, for tiles of 1 to 8 rows and an odd last column; forced on
    and off here whatever the CPU."""
    budgets = (0, 320 * 3, 1 << 20)
    settings = [{"wide_tiles": 0}]
    settings += [
        {"wide_tiles": 1, "rows_outer": b, "wide_rows": r} for b in budgets for r in (1, 3, 8)
    ]
    settings += [{"wide_tiles": 1, "wide_min_rows": 1}]  # verify passes (spans: the test above)
    ms = (1, 2, 3, 5, 8, 16, 23, 37, 64)
    _equal_rows_alone_under_knobs(ggml_type, 71, 7 * 256, 17, settings, ms)


@pytest.mark.skipif(
    not native.available() or not native.has_amx(), reason="this CPU (or OS) has no AMX-INT8 tiles"
)
@pytest.mark.parametrize("ggml_type", [native.Q4_K, native.Q6_K], ids=["Q4_K", "Q6_K"])
@pytest.mark.parametrize("k", [7 * 256, 35 * 256], ids=["7-blocks", "35-blocks"])
def test_amx_tiles_equal_rows_alone(ggml_type: int, k: int) -> None:
    """Prefill's K-quant matmuls on AMX tiles (the amx_tiles knob: 1 Q4_K's, 2 Q6_K's
    too) are bitwise the rows alone and the VNNI tiles: 71 columns (four 16-column groups
    and 7 left to the VNNI tiles), rows that do and do not fill 16-row tiles, passes too
    short for the tiles (16 and 31 rows), with rows_outer's spans on and off for the
    leftover columns."""
    settings = [{"amx_tiles": 0}]
    settings += [{"amx_tiles": a, "rows_outer": b} for a in (1, 2) for b in (320 * 4, 1 << 20)]
    _equal_rows_alone_under_knobs(ggml_type, 71, k, 19, settings, (16, 31, 32, 37, 64, 100))


@pytest.mark.skipif(
    not native.available() or not native.has_amx(), reason="this CPU (or OS) has no AMX-INT8 tiles"
)
def test_amx_tiles_beside_other_parts() -> None:
    """A fused projection of Q4_K parts whose columns do not start on a 16-column group
    (after 5 Q6_K columns, and after 58) equals its parts run one by one, AMX tiles on
    (Q4_K's, then Q6_K's too), and the same pass with them off."""
    k = 3 * 256
    specs = [(native.Q6_K, 5), (native.Q4_K, 37), (native.Q6_K, 16), (native.Q4_K, 48)]
    parts = [(t, random_matrix(t, n, k, seed=40 + i), n) for i, (t, n) in enumerate(specs)]
    x = torch.randn(45, k, generator=torch.Generator().manual_seed(41))
    before = native.tuning()["amx_tiles"]
    try:
        native.tune("amx_tiles", 0)
        off = native.NativeMatrix(parts, k).matmul(x)
        for amx in (1, 2):
            native.tune("amx_tiles", amx)
            fused = native.NativeMatrix(parts, k).matmul(x)
            single = torch.cat([native.NativeMatrix([p], k).matmul(x) for p in parts], dim=1)
            assert torch.equal(fused, single), amx
            assert torch.equal(fused, off), amx
    finally:
        native.tune("amx_tiles", before)


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
def test_vendor_defaults() -> None:
    """The knobs measured on Intel CPUs only (two-column tiles, the L2 prefetch) are on by
    default there and off on every other CPU; read in a fresh process, before any test
    tunes them."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from speculant import native; print(json.dumps(native.tuning()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout)
    cpuinfo = Path("/proc/cpuinfo")
    vendor = cpuinfo.read_text() if cpuinfo.exists() else ""
    intel = "GenuineIntel" in vendor
    assert got["prefetch_l2_bytes"] == (4096 if intel else 0), got
    if native.active_path() != "avx512vnni":
        return  # wide tiles only exist on the VNNI path
    assert got["wide_tiles"] == (1 if intel else 0), got


def test_amx_knob_says_when_the_cpu_lacks_tiles() -> None:
    """amx_tiles=1 is taken where the CPU and OS offer AMX-INT8 (the load line then says
    avx512vnni+amx) and refused with a clear error elsewhere (the knob keeps its value); 0
    is always taken, 3 never."""
    before = native.tuning()["amx_tiles"]
    try:
        native.tune("amx_tiles", 0)
        if native.has_amx():
            assert native.tune("amx_tiles", 1) == 0
            assert native.tuning()["amx_tiles"] == 1
            assert native.kernel_label() == "avx512vnni+amx"
        else:
            with pytest.raises(ValueError, match="amx_tiles=1: this CPU .* no AMX-INT8 tiles"):
                native.tune("amx_tiles", 1)
            assert native.tuning()["amx_tiles"] == 0
        with pytest.raises(ValueError, match="amx_tiles=3: out of the range"):
            native.tune("amx_tiles", 3)
    finally:
        native.tune("amx_tiles", before)


def test_mixed_parts_concatenate_columns(path: str) -> None:
    """A fused projection with parts in different formats (Q5_0 queries beside Q8_0
    values in the 0.5B file) equals its parts run one by one."""
    k = 256
    specs = [(native.Q5_0, 5), (native.Q8_0, 3), (native.Q4_K, 1), (native.Q6_K, 2)]
    parts = [(t, random_matrix(t, n, k, seed=i), n) for i, (t, n) in enumerate(specs)]
    x = torch.randn(5, k)
    fused = native.NativeMatrix(parts, k).matmul(x)
    single = torch.cat([native.NativeMatrix([p], k).matmul(x) for p in parts], dim=1)
    assert torch.equal(fused, single)


def test_smallest_shapes_and_empty_input(path: str) -> None:
    raw = random_matrix(native.Q8_0, 1, 32)
    matrix = native.NativeMatrix([(native.Q8_0, raw, 1)], 32)
    x = torch.randn(3, 32)
    w = torch.from_numpy(reference(raw, native.Q8_0, 1, 32))
    torch.testing.assert_close(matrix.matmul(x), x @ w.T, rtol=0.05, atol=0.05)
    assert matrix.matmul(torch.zeros(0, 32)).shape == (0, 1)


def test_bad_shapes_and_types_are_named() -> None:
    with pytest.raises(ValueError, match="multiple of the Q4_K block"):
        native.NativeMatrix([(native.Q4_K, np.zeros(144, np.uint8), 1)], 128)
    with pytest.raises(ValueError, match="not executed natively"):
        native.NativeMatrix([(1, np.zeros(64, np.uint8), 1)], 32)
    matrix = native.NativeMatrix([(native.Q8_0, random_matrix(native.Q8_0, 2, 32), 2)], 32)
    with pytest.raises(ValueError, match=r"\[m, 32\] wanted"):
        matrix.matmul(torch.zeros(2, 64))
    with pytest.raises(IndexError, match=r"\[0, 2\)"):
        matrix.rows(torch.tensor([2]))
    with pytest.raises(ValueError, match="not known"):
        native.set_path("avx9000")


# ------------------------------------------------------------- attention and norms
def _cache(nkv: int, rows: int, hd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nkv, rows, hd, generator=g), torch.randn(nkv, rows, hd, generator=g)


def _attend64(q, keys, values, lo, hi, scale, softcap=0.0):  # type: ignore[no-untyped-def]
    """float64 reference of native.attend."""
    nh, t, _ = q.shape
    rep = nh // keys.shape[0]
    out = torch.zeros(nh, t, q.shape[2], dtype=torch.float64)
    for h in range(nh):
        for r in range(t):
            k = keys[h // rep, lo[r] : hi[r]].double()
            s = k @ q[h, r].double() * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            p = torch.softmax(s, dim=0)
            out[h, r] = p @ values[h // rep, lo[r] : hi[r]].double()
    return out


@pytest.mark.parametrize("hd", [8, 64, 128])
def test_attention_within_float64_bound(hd: int, path: str) -> None:
    nh, nkv, t, rows = 4, 2, 5, 200
    keys, values = _cache(nkv, rows, hd, 1)
    q = torch.randn(nh, t, hd, generator=torch.Generator().manual_seed(2))
    hi = torch.tensor([3, 50, 51, 150, 200])
    lo = torch.tensor([0, 0, 10, 100, 199])  # causal and sliding-window shapes
    got = native.attend(q, keys, values, lo, hi, hd**-0.5)
    want = _attend64(q, keys, values, lo, hi, hd**-0.5)
    err = (got.double() - want).abs().max().item()
    assert 0 < err < 1e-5, err  # float32 rounding, never exact by accident


def test_attention_softcap_within_float64_bound(path: str) -> None:
    """Gemma 2's soft-capped scores, on every path: the float64 reference's, and not the
    uncapped result (the cap bites on these scores)."""
    nh, nkv, t, rows, hd = 4, 2, 5, 200, 64
    keys, values = _cache(nkv, rows, hd, 11)
    q = torch.randn(nh, t, hd, generator=torch.Generator().manual_seed(12)) * 3
    lo, hi = torch.tensor([0, 0, 10, 100, 199]), torch.tensor([3, 50, 51, 150, 200])
    got = native.attend(q, keys, values, lo, hi, hd**-0.5, softcap=2.0)
    want = _attend64(q, keys, values, lo, hi, hd**-0.5, softcap=2.0)
    assert (got.double() - want).abs().max().item() < 1e-5
    uncapped = native.attend(q, keys, values, lo, hi, hd**-0.5)
    assert (uncapped - got).abs().max().item() > 0.01


def test_attention_with_spread_scores(path: str) -> None:
    """Scores hundreds apart (softmax weights far below the float range, which the kernels'
    exp takes as 0) and equal scores: still within the float64 bound, on every path."""
    nh, nkv, t, rows, hd = 4, 2, 3, 120, 64
    keys, values = _cache(nkv, rows, hd, 7)
    q = torch.randn(nh, t, hd, generator=torch.Generator().manual_seed(8)) * 8
    q[:, 2] = 0  # every score equal: uniform weights
    lo, hi = torch.tensor([0, 0, 0]), torch.tensor([40, 120, 77])
    got = native.attend(q, keys, values, lo, hi, 1.0)
    want = _attend64(q, keys, values, lo, hi, 1.0)
    assert (got.double() - want).abs().max().item() < 1e-5
    assert torch.isfinite(got).all()


def test_attention_row_alone_equals_row_in_any_pass(path: str) -> None:
    """A query row's result depends on its query and its visible keys only: not on the
    other rows of the pass, the cache's size, the keys past its range or the threads."""
    nh, nkv, hd = 6, 2, 64
    keys, values = _cache(nkv, 2200, hd, 3)
    q = torch.randn(nh, 16, hd, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(2000, 2016)
    full = native.attend(q, keys, values, torch.zeros(16, dtype=torch.int64), pos + 1, 0.125)
    for t in range(16):
        alone = native.attend(
            q[:, t : t + 1].contiguous(),
            keys[:, : pos[t] + 1].contiguous(),  # a cache that ends at the row's key
            values[:, : pos[t] + 1].contiguous(),
            torch.zeros(1, dtype=torch.int64),
            pos[t : t + 1] + 1,
            0.125,
            threads=1 + t % 3,
        )
        assert torch.equal(alone[:, 0], full[:, t]), t
    changed = keys.clone()
    changed[:, 2016:] = 1e6  # keys past every range: never read
    again = native.attend(q, changed, values, torch.zeros(16, dtype=torch.int64), pos + 1, 0.125)
    assert torch.equal(again, full)


@pytest.mark.parametrize(
    ("hd", "nh", "nkv"),
    [(8, 8, 2), (24, 9, 3), (56, 4, 2), (72, 18, 2), (128, 8, 2), (136, 3, 3)],
)
def test_attention_and_norm_paths_agree_bitwise(hd: int, nh: int, nkv: int) -> None:
    """Every path, bitwise: head sizes with and without a remainder past the vector code's
    64-value blocks (and the 512-bit code's blocks of 128, 64, 32, 16 and 8 values), key
    counts with and without one past its groups of 4, query heads per key/value head from
    1 to 9 (more than the vector code takes at once), and (head, row) queries that the
    512-bit code takes four at a time with one or two left over."""
    if "avx2" not in native.paths():
        pytest.skip("this CPU has only the portable path")
    keys, values = _cache(nkv, 300, hd, 5)
    q = torch.randn(nh, 7, hd, generator=torch.Generator().manual_seed(6))
    lo, hi = torch.tensor([0, 0, 0, 5, 0, 1, 0]), torch.arange(290, 297)
    x, w = torch.randn(9, 1536), torch.randn(1536)
    out = {}
    try:
        for name in native.paths():
            native.set_path(name)
            out[name] = (
                native.attend(q, keys, values, lo, hi, 0.09),
                native.rms_norm(x, w, 1e-6),
                native.attend(q, keys, values, lo, hi, 0.09, softcap=1.5),
            )
    finally:
        native.set_path("auto")
    for name, (att, norm, capped) in out.items():
        assert torch.equal(att, out["portable"][0]), name
        assert torch.equal(norm, out["portable"][1]), name
        assert torch.equal(capped, out["portable"][2]), name


@pytest.mark.parametrize(("nh", "nkv", "hd"), [(12, 2, 128), (9, 3, 72), (4, 2, 64), (3, 3, 136)])
def test_float16_cache_is_float32_attention_over_its_values(nh: int, nkv: int, hd: int) -> None:
    """A float16 cache is read as the float32 values it holds: bitwise the float32 code
    over the widened cache, on every path, for one row (its heads four at a time where a
    group has four or more) and for passes whose rows see shared and own keys."""
    keys, values = _cache(nkv, 700, hd, 9)
    k16, v16 = (keys * 4).half(), values.half()
    k32, v32 = k16.float(), v16.float()
    q = torch.randn(nh, 7, hd, generator=torch.Generator().manual_seed(10))
    cases = [  # (rows, lo, hi): one row over a long cache; rows with own keys either side
        (slice(0, 1), torch.tensor([0]), torch.tensor([650])),
        (slice(0, 7), torch.tensor([0, 0, 0, 5, 0, 40, 0]), torch.arange(600, 607)),
        (slice(2, 6), torch.tensor([0, 3, 0, 0]), torch.tensor([90, 97, 200, 65])),
    ]
    try:
        for name in native.paths():
            native.set_path(name)
            for rows, lo, hi in cases:
                qr = q[:, rows].contiguous()
                want = native.attend(qr, k32, v32, lo, hi, 0.09)
                native.set_path("portable")
                portable = native.attend(qr, k16, v16, lo, hi, 0.09)
                native.set_path(name)
                assert torch.equal(native.attend(qr, k16, v16, lo, hi, 0.09), want), name
                assert torch.equal(portable, want), name
    finally:
        native.set_path("auto")
    with pytest.raises(ValueError, match="keys torch.float16 and values torch.float32"):
        native.attend(q, k16, v32, torch.zeros(7, dtype=torch.int64), torch.arange(1, 8), 1.0)
    with pytest.raises(ValueError, match="keys must be contiguous float32 or float16, not"):
        native.attend(q, keys.bfloat16(), values.bfloat16(), lo, hi, 1.0)


def test_float16_cache_writes_round_as_torch(path: str) -> None:
    """The fused attention block writes a float16 cache's keys and values rounded to
    nearest even, as torch's conversion rounds (the tree path writes through torch):
    ties, subnormals, the largest half, and values past it (infinity)."""
    nh, nkv, hd, t = 4, 2, 64, 5
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=gen)
    special = torch.tensor(
        [65504.0, 65519.0, 65520.0, 1e6, -7e4, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26,
         6.1e-5, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 0.0, -0.0, 1e-9, 2.0**-14 - 2.0**-25]
    )  # fmt: skip
    v0 = (nh + nkv) * hd
    qkv[:, v0 : v0 + special.numel()] = special  # values are written as they come
    qkv[:, v0 + hd : v0 + 2 * hd] *= 2.0**-16  # subnormal halves
    ang = torch.randn(t, hd // 2, generator=gen)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    lo, hi = torch.zeros(t, dtype=torch.int64), torch.arange(4, 4 + t)
    k32, v32 = torch.zeros(nkv, 16, hd), torch.zeros(nkv, 16, hd)
    want = native.rope_attend(qkv, (nh, nkv, hd), cos, sin, k32, v32, 3, lo, hi, 0.125)
    k16, v16 = torch.zeros(nkv, 16, hd, dtype=torch.float16), torch.zeros_like(k32).half()
    got = native.rope_attend(qkv, (nh, nkv, hd), cos, sin, k16, v16, 3, lo, hi, 0.125)
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())
    assert torch.isinf(v16[0, 3:8, 3]).all() and (v16[0, 3:8, 5] == 2.0**-24).all()
    assert (v16[0, 3:8, 0] == 65504).all() and (v16[0, 3:8, 1] == 65504).all()
    assert torch.isinf(v16[0, 3:8, 2]).all()  # 65520: the tie goes to infinity (even)
    # and attends over what it wrote: float32 attention of the rotated queries over the
    # float16 cache's values (the rotation as the decoder's torch code forms it)
    q = qkv[:, : nh * hd].view(t, nh, hd).transpose(0, 1)
    half = hd // 2
    rot = torch.cat([-q[..., half:], q[..., :half]], -1)
    qr = (q * cos + rot * sin).contiguous()
    ref = native.attend(qr, k16.float(), v16.float(), lo, hi, 0.125)
    assert torch.equal(got, ref.transpose(0, 1).reshape(t, nh * hd))
    assert not torch.equal(got, want)  # the rounding shows in the result


def test_rms_norm_rows_alone_and_within_bound(path: str) -> None:
    x, w = torch.randn(12, 896) * 3, torch.randn(896)
    got = native.rms_norm(x, w, 1e-6)
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    err = (got.double() - want).abs().max().item()
    assert 0 < err < 1e-4, err
    for r in range(12):
        assert torch.equal(native.rms_norm(x[r : r + 1], w, 1e-6)[0], got[r])


def test_attention_and_norm_bad_input_is_named() -> None:
    keys, values = _cache(2, 10, 12, 0)
    with pytest.raises(ValueError, match="8 \\| hd"):
        native.attend(torch.zeros(4, 1, 12), keys, values, torch.tensor([0]), torch.tensor([1]), 1)
    keys, values = _cache(2, 10, 16, 0)
    with pytest.raises(ValueError, match="outside the cache's 10 rows"):
        native.attend(torch.zeros(4, 1, 16), keys, values, torch.tensor([0]), torch.tensor([11]), 1)
    with pytest.raises(ValueError, match="2 / 1 key ranges for 1 query rows"):
        native.attend(
            torch.zeros(4, 1, 16), keys, values, torch.tensor([0, 0]), torch.tensor([1]), 1
        )
    with pytest.raises(ValueError, match="rms_norm over 12 values"):
        native.rms_norm(torch.zeros(2, 12), torch.zeros(12), 1e-6)


# ------------------------------------------------------------------------ real models
CODE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_gguf_dtype_on_real_models(name: str) -> None:
    """Stored-block execution tracks the dequantized float32 model, and greedy
    speculation through it equals plain decoding, with drafts rejected at every position."""
    path = real_model_path(name)
    model = load_model(path, dtype="gguf", progress=False)
    assert model.dtype_name == "gguf"
    assert model.net.native_ops and model.net.row_padding == (1, 1)  # no calibration
    ids = model.tokenizer.encode(CODE)
    dense = load_model(path, dtype="float32", progress=False)
    got = model.forward(ids, model.new_cache(64), 0)
    want = dense.forward(ids, dense.new_cache(64), 0)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree
    _speculation_equals_plain(model, ids)


def _speculation_equals_plain(model, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Greedy speculation equals plain decoding: drafts rejected at the first and at the
    fourth position, and a draft model (the model itself)."""
    reference = plain_greedy(model, ids, 24)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for wrong_at in (0, 3):
        scripted = ScriptedProposer(ids, reference + [0] * 8, wrong_at, model.vocab_size)
        res = Engine(model, proposer=scripted, num_speculative_tokens=5).generate(ids, params)
        assert res.token_ids == reference
    res = Engine(model, draft=model, num_speculative_tokens=4).generate(ids, params)
    assert res.token_ids == reference


def _tree_nodes_equal_chains(model, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Every node of a tree pass gets its root-to-node chain's logits, bitwise."""
    from speculant.models.decoder import Segment

    cache = model.new_cache(96)
    model.prefill(ids, cache)
    nodes = torch.tensor([11, 22, 33, 44, 55, 66])
    parents = [-1, 0, 1, 0, 3, 2]  # paths 0-1-2-5 and 0-3-4
    logits, _ = model.net.forward_batch([Segment(nodes, cache, len(ids), tree_parents=parents)])
    assert logits is not None
    for path in ([0, 1, 2, 5], [0, 3, 4]):
        chain = model.forward(nodes[path].tolist(), cache, len(ids))
        for j, node in enumerate(path):
            assert torch.equal(logits[0][node], chain[j]), (path, node)


@pytest.mark.real
def test_gguf_tree_nodes_equal_their_chains() -> None:
    """A chain runs through the fused native attention block, a tree's paths through
    torch rotary + native attention: every tree node's logits equal its path's chain."""
    model = load_model(real_model_path("smollm2-135m-instruct"), dtype="gguf", progress=False)
    _tree_nodes_equal_chains(model, model.tokenizer.encode(CODE))


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_float16_kv_cache_on_real_models(name: str) -> None:
    """kv_dtype float16: half the cache's bytes, logits close to the float32 cache's, and
    greedy speculation equal to plain decoding with the same cache type (drafts rejected
    at every position, a draft model, tree nodes against their chains). Gemma 3 writes
    its cache through torch (q/k norms), SmolLM2 through the fused native layers."""
    path = real_model_path(name)
    model = load_model(path, dtype="gguf", progress=False, kv_dtype="float16")
    full = load_model(path, dtype="gguf", progress=False)
    assert model.new_cache(64).k.dtype == torch.float16
    assert model.new_cache(64).k.nbytes * 2 == full.new_cache(64).k.nbytes
    ids = model.tokenizer.encode(CODE)
    got = model.forward(ids, model.new_cache(64), 0)
    want = full.forward(ids, full.new_cache(64), 0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    _speculation_equals_plain(model, ids)
    _tree_nodes_equal_chains(model, ids)
    with pytest.raises(ModelLoadError, match="kv_dtype float16 is not available"):
        load_model(path, dtype="float32", progress=False, kv_dtype="float16")
    with pytest.raises(ValueError, match="kv_dtype='bfloat16': use one of auto, float32"):
        load_model(path, progress=False, kv_dtype="bfloat16")


@pytest.mark.real
def test_auto_dtype_is_the_native_path_for_gguf_files(capsys) -> None:  # type: ignore[no-untyped-def]
    from speculant.argtypes import DTYPE_CHOICES, KV_DTYPE_CHOICES
    from speculant.cli import main
    from speculant.models.model import DTYPE_NAMES, KV_DTYPE_NAMES

    assert ("auto", *DTYPE_NAMES) == DTYPE_CHOICES  # the CLIs' list, kept torch-free
    assert KV_DTYPE_NAMES == KV_DTYPE_CHOICES
    path = real_model_path("smollm2-135m-instruct")
    assert load_model(path, dtype="auto", progress=False).dtype_name == "gguf"
    with pytest.raises(ValueError, match="auto_fallback='auto': use one of bfloat16"):
        load_model(path, dtype="auto", auto_fallback="auto")
    argv = ["generate", "x", "--target", "smollm2-135m-instruct", "--method", "none"]
    assert main([*argv, "--max-tokens", "2", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert f"gguf, native {native.kernel_label()} kernels" in err, err
    assert "KV cache" not in err
    assert main([*argv, "--max-tokens", "2", "--ignore-eos", "--kv-dtype", "float16"]) == 0
    err = capsys.readouterr().err
    assert f"kernels ({native.THREADS} thread" in err, err  # and how many threads
    assert "), float16 KV cache" in err, err
    assert main(["models", "list"]) == 0
    assert "runs each file's quantized blocks on the native" in capsys.readouterr().out


@pytest.mark.real
def test_threads_flag_sets_the_kernels_threads(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """--threads N is the native kernels' thread count (it used to set only PyTorch's,
    which the default GGUF path hardly uses); PyTorch keeps one thread beside them."""
    from speculant.cli import main

    monkeypatch.setattr(native, "THREADS", native.THREADS)  # restored afterwards
    monkeypatch.setattr(native, "THREADS_WHY", native.THREADS_WHY)
    torch_threads = torch.get_num_threads()
    argv = ["generate", "x", "--target", "smollm2-135m-instruct", "--method", "none"]
    try:
        for n in (1, 3):
            assert main([*argv, "--max-tokens", "2", "--ignore-eos", "--threads", str(n)]) == 0
            err = capsys.readouterr().err
            got = (native.THREADS, native.THREADS_WHY)
            assert got == (n, "--threads")
            assert f"kernels ({n} thread{'s' if n > 1 else ''})" in err, err
            assert torch.get_num_threads() == 1
        assert native.threads_label() == "3 threads (--threads)"
        assert main([*argv, "--threads", "0"]) == 2
        assert "--threads=0 is out of range: use >= 1" in capsys.readouterr().err
        assert native.THREADS == 3  # a refused value changes nothing
    finally:
        torch.set_num_threads(torch_threads)


@pytest.mark.real
def test_missing_kernels_fall_back_to_int8_with_one_line() -> None:
    path = real_model_path("smollm2-135m-instruct")
    code = (
        "from speculant import load_model; import sys; "
        f"m = load_model({str(path)!r}, dtype='gguf'); print(m.dtype_name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "SPECULANT_NATIVE": "0"},
    )
    assert out.stdout.strip() == "int8"
    assert "native kernels unavailable (SPECULANT_NATIVE=0 turns them off)" in out.stderr
    assert "running int8 weights through PyTorch instead" in out.stderr


def test_tuning_knobs_change_no_result() -> None:
    """The benchmark knobs (prefetch distance, chunking) leave every product's bits alone,
    and out-of-range values are refused by name."""
    n, k = 67, 512
    raw = random_matrix(native.Q4_K, n, k, seed=9)
    matrix = native.NativeMatrix([(native.Q4_K, raw, n)], k)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(10))
    before = native.tuning()
    want = matrix.matmul(x, threads=2)
    want_one = matrix.matmul(x[:1], threads=2)
    try:
        for knob, value in [
            ("prefetch_rows", 0),
            ("prefetch_bytes", 64),
            ("prefetch_bytes", 0),
            ("prefetch_bytes", 8192),
            ("prefetch_l2_bytes", 0),
            ("prefetch_l2_bytes", 64),
            ("prefetch_l2_rows", 8),
            ("prefetch_l2_bytes", 8192),
            ("max_chunk_cols", 4),
        ]:
            native.tune(knob, value)
            native.tune("chunks_per_thread", 1 if knob == "max_chunk_cols" else 64)
            assert torch.equal(matrix.matmul(x, threads=2), want), knob
            assert torch.equal(matrix.matmul(x[:1], threads=2), want_one), knob
    finally:
        for knob, value in before.items():
            native.tune(knob, value)
    assert native.tuning() == before
    # attention's query rows alone, in pairs or in blocks: the same bits. A pass of T rows
    # takes up to T / 32 pairs a task, so 263 rows: blocks of up to 16 rows and an odd last
    # block of 7; rows with keys of their own before and after the shared ones, and a
    # block with a row that shares too few keys (it goes a row at a time)
    keys, values = _cache(2, 300, 64, 11)
    q = torch.randn(6, 263, 64, generator=torch.Generator().manual_seed(12))
    hi = torch.arange(263) + 30
    lo = torch.zeros(263, dtype=torch.long)
    lo[5], lo[40], lo[100:110] = 3, hi[40] - 2, 50
    got = []
    try:
        for pairs in (0, 1, 3, 8):  # rows alone, in pairs, in blocks of 6 and 16 rows
            for wide in (0, 1):  # and in 256- or 512-bit registers
                native.tune("attention_pairs", pairs)
                native.tune("attention_512", wide)
                got.append(native.attend(q, keys, values, lo, hi, 0.125))
    finally:
        native.tune("attention_pairs", before["attention_pairs"])
        native.tune("attention_512", before["attention_512"])
    assert all(torch.equal(g, got[0]) for g in got)
    # a few rows over a long cache (attention_long_keys): each group's rows in as few
    # tasks as keep the threads busy (2-16 rows in one block), the same bits as rows alone
    for t in (2, 5, 8, 16):
        qt, spread = q[:, :t].contiguous(), []
        try:
            native.tune("attention_pairs", 0)
            want = native.attend(qt, keys, values, lo[:t], hi[:t], 0.125)
            native.tune("attention_pairs", before["attention_pairs"])
            for long_keys in (1, 10**6):
                native.tune("attention_long_keys", long_keys)
                spread.append(native.attend(qt, keys, values, lo[:t], hi[:t], 0.125))
        finally:
            native.tune("attention_pairs", before["attention_pairs"])
            native.tune("attention_long_keys", before["attention_long_keys"])
        assert all(torch.equal(g, want) for g in spread), t
    with pytest.raises(ValueError, match="attention_long_keys=0: a value >= 1"):
        native.tune("attention_long_keys", 0)
    with pytest.raises(ValueError, match="attention_512=2: out of the range"):
        native.tune("attention_512", 2)
    with pytest.raises(ValueError, match="attention_pairs=9: out of the range"):
        native.tune("attention_pairs", 9)
    with pytest.raises(ValueError, match="max_chunk_cols=3: a value >= 4"):
        native.tune("max_chunk_cols", 3)
    with pytest.raises(ValueError, match="unknown knob"):
        native.tune("one_col_rows", 1)
    before_rows = native.tuning()["wide_rows"]
    with pytest.raises(ValueError, match="wide_rows=9: out of the range"):
        native.tune("wide_rows", 9)
    assert native.tuning()["wide_rows"] == before_rows


# ------------------------------------------------------ SiLU and whole layers at once
def test_silu_mul_paths_agree_and_within_bound() -> None:
    """The kernels' gated SiLU: within 2 ulp-ish of float64 on a wide range, the limits
    right (large |g|, zeros, NaN), each value from its inputs only, every path bitwise."""
    g = torch.cat([torch.linspace(-120, 120, 2001), torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    u = torch.randn(g.numel(), generator=torch.Generator().manual_seed(1))
    gu = torch.stack([g, u]).reshape(1, -1)  # one row: gate values, then up values
    outs = {}
    try:
        for name in native.paths():
            native.set_path(name)
            outs[name] = native.silu_mul(gu)[0]
    finally:
        native.set_path("auto")
    for name, out in outs.items():
        assert torch.equal(out, outs["portable"]), name
    got = outs["portable"].double()
    g64, u64 = g.double(), u.double()
    want = g64 * torch.sigmoid(g64) * u64
    normal = (g > -80) & (want != 0)  # below -80, exp(-|g|) < 2^-115: the kernels' exp flushes to 0
    rel = ((got - want).abs() / want.abs())[normal].max().item()
    assert rel < 1e-6, rel
    assert (got - want).abs()[~normal].max().item() < 1e-30
    assert torch.equal(got[-4:-2], torch.zeros(2, dtype=torch.float64))  # g = +-0
    nan = native.silu_mul(torch.tensor([[float("nan"), 2.0]]))
    assert nan.isnan().all()
    # rows alone: the same bits as in a batch of rows
    rows = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(2)) * 8
    batch = native.silu_mul(rows)
    for r in range(5):
        assert torch.equal(native.silu_mul(rows[r : r + 1])[0], batch[r])
    with pytest.raises(ValueError, match="even count"):
        native.silu_mul(torch.zeros(1, 3))


def _tiny_native_transformer(qkv_bias: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    """A 2-layer Qwen2-like decoder on random stored blocks (Q4_K, Q6_K, Q8_0 parts)."""
    from speculant.models.config import ModelConfig
    from speculant.models.decoder import GGUFWeight, LayerWeights, Transformer, Weights

    dim, nh, nkv, hd, ffn, vocab = 256, 4, 2, 64, 512, 300
    cfg = ModelConfig("qwen2", vocab, dim, 2, nh, nkv, hd, ffn, 1e-6, 10000.0, 256)
    gen = torch.Generator().manual_seed(seed)

    def mat(parts: list[tuple[int, int]], k: int, s: int) -> GGUFWeight:
        return GGUFWeight(
            native.NativeMatrix([(t, random_matrix(t, n, k, seed + s), n) for t, n in parts], k)
        )

    layers = []
    for i in range(2):
        s = 10 * i
        layers.append(
            LayerWeights(
                attn_norm=1 + 0.1 * torch.randn(dim, generator=gen),
                wqkv=mat(
                    [(native.Q4_K, nh * hd), (native.Q4_K, nkv * hd), (native.Q6_K, nkv * hd)],
                    dim,
                    s,
                ),
                wo=mat([(native.Q8_0, dim)], nh * hd, s + 1),
                ffn_norm=1 + 0.1 * torch.randn(dim, generator=gen),
                w_gate_up=mat([(native.Q4_K, 2 * ffn)], dim, s + 2),
                w_down=mat([(native.Q6_K, dim)], ffn, s + 3),
                bqkv=torch.randn((nh + 2 * nkv) * hd, generator=gen) if qkv_bias else None,
            )
        )
    emb = torch.randn(vocab, dim, generator=gen)
    weights = Weights(emb, torch.ones(dim), mat([(native.Q8_0, vocab)], dim, 99), layers)
    return Transformer(cfg, weights, torch.float32)


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 9])
def test_fused_layers_equal_the_layer_by_layer_pass(qkv_bias: bool, kv_dtype, window) -> None:  # type: ignore[no-untyped-def]
    """All layers in one native call give bitwise the logits, features and cache rows of
    the same layers run one operation at a time: a prompt, a decode step, a verify pass,
    and a batch of two sequences at different positions; with float32 and float16 caches;
    with every layer seeing a 9-token sliding window (Mistral, Phi-3) or all keys."""
    import dataclasses

    from speculant.models.segment import Segment

    net = _tiny_native_transformer(qkv_bias)
    if window:
        net.config = dataclasses.replace(
            net.config, sliding_window=window, layer_types=("sliding",) * net.config.n_layers
        )
    net.set_kv_dtype(kv_dtype)
    assert net.native_ops and net._fusable() and net.new_cache(8).k.dtype == kv_dtype
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3))

    def run(fuse: bool):  # type: ignore[no-untyped-def]
        net.fuse_layers = fuse
        c1, c2 = net.new_cache(64), net.new_cache(64)
        out = [net.forward(ids[:30], c1, 0, return_hidden=True)]
        out.append(net.forward(ids[30:31], c1, 30))
        out.append(net.forward(ids[31:36], c1, 31))
        out.extend(net.forward_batch([Segment(ids[36:40], c1, 36), Segment(ids[:7], c2, 0)])[0])
        flat = [t for o in out for t in (o if isinstance(o, tuple) else (o,)) if t is not None]
        return flat + [c1.k, c1.v, c2.k, c2.v]

    want, got = run(False), run(True)
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), i
    net.fuse_layers = True
    with pytest.raises(Exception, match="capacity"):
        net.forward(ids[:8], net.new_cache(4), 0)


def test_weight_buffers_live_as_long_as_their_tensors() -> None:
    """Large packed-weight buffers sit in 2 MiB-aligned huge-page memory (on Linux), small
    ones in ordinary tensors; the memory stays valid through views and is unmapped once
    the last one goes; results do not depend on where the weights live."""
    import gc

    big = native.weight_buffer(3 * native.HUGE_PAGE_BYTES + 123)
    assert big.numel() == 3 * native.HUGE_PAGE_BYTES + 123 and big.dtype == torch.uint8
    if sys.platform == "linux":
        assert big.data_ptr() % native.HUGE_PAGE_BYTES == 0
    big.fill_(7)
    view = big[-10:]
    del big
    gc.collect()
    assert int(view.sum()) == 70  # (unmapped memory would crash here, not differ)
    del view
    gc.collect()
    small = native.weight_buffer(1000)
    assert small.numel() == 1000
    raw = random_matrix(native.Q4_K, 2048, 1024, seed=4)  # 2.4 MB packed: huge-page memory
    x = torch.randn(3, 1024)
    ys = []
    for huge in (True, False):
        native.HUGE_PAGES = huge
        try:
            ys.append(native.NativeMatrix([(native.Q4_K, raw, 2048)], 1024).matmul(x))
        finally:
            native.HUGE_PAGES = True
    assert torch.equal(ys[0], ys[1])
