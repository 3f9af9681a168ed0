"""Speculant's native CPU kernels, loaded with ctypes.

`pip install` compiles `kernels.c` into the extension module `speculant._kernels` with the
system C compiler (see setup.py). The library picks its code path at run time from the
CPU's instruction sets (AVX-512 VNNI, else AVX2 + FMA, else portable C; the AVX-512 path
without VNNI is bitwise equal but measured no faster than AVX2, so only `set_path`
selects it). `set_path` forces a path, for tests and benchmarks. When the library is
missing, `available()` is False and `why_missing()` says why, and Speculant runs its
PyTorch paths instead.

The kernels compute y = x @ W.T over GGUF-quantized weights in their stored formats
(Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; repacked exactly at load, see NativeMatrix), with
float32 activations quantized per row to int8 on the way in (as llama.cpp does). A row's
result never depends on the other rows of the call, the thread count or the code path:
see the comment at the top of kernels.c.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor

from speculant.native.cpus import default_threads

# GGML type ids the kernels execute.
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14
SUPPORTED_TYPES = {
    Q4_0: "Q4_0",
    Q4_1: "Q4_1",
    Q5_0: "Q5_0",
    Q8_0: "Q8_0",
    Q4_K: "Q4_K",
    Q6_K: "Q6_K",
}
BLOCK = {
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q8_0: (32, 34),
    Q4_K: (256, 144),
    Q6_K: (256, 210),
}

PATHS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512vnni": 4}
_PATH_NAMES = {v: k for k, v in PATHS.items() if v}
# the CPU features (bits of spec_features) each path needs
_PATH_FEATURES = {"portable": 0, "avx2": 1, "avx512": 2, "avx512vnni": 4}
MAX_PARTS = 8
# The kernels' threads: one per CPU this process may use, within its CPU
# quota, or $SPECULANT_THREADS (cpus.py); `use_threads` (a command's --threads) sets it.
THREADS, THREADS_WHY = default_threads()

_lib: Any = None
_missing: str | None = None
_loaded = False

_i64p = ctypes.POINTER(ctypes.c_int64)


def _load() -> Any:
    global _lib, _missing, _loaded
    if _loaded:
        return _lib
    _loaded = True
    if os.environ.get("SPECULANT_NATIVE", "1") == "0":
        _missing = "SPECULANT_NATIVE=0 turns them off"
        return None
    spec = importlib.util.find_spec("speculant._kernels")
    if spec is None or spec.origin is None:
        _missing = "the extension speculant._kernels was not built (no C compiler at install?)"
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as exc:
        _missing = f"{spec.origin} could not be loaded ({exc})"
        return None
    _lib = _bind(lib)
    return _lib


def _bind(lib: Any) -> Any:
    """Declares the library's functions' arguments and results to ctypes."""
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.spec_features.restype = c_int
    lib.spec_set_path.argtypes = [c_int]
    lib.spec_set_path.restype = c_int
    lib.spec_active_path.restype = c_int
    lib.spec_tune.argtypes = [c_int, c_int]
    lib.spec_tune.restype = c_int
    lib.spec_row_bytes.argtypes = [c_int, i64]
    lib.spec_row_bytes.restype = i64
    lib.spec_packed_row_bytes.argtypes = [c_int, i64]
    lib.spec_packed_row_bytes.restype = i64
    # (type, src, rows, K, dst, threads)
    lib.spec_repack.argtypes = [c_int, p, i64, i64, p, c_int]
    lib.spec_repack.restype = c_int
    # (nparts, types[], weights[], ns[], K, x, m, y, ldy, threads)
    lib.spec_linear.argtypes = [c_int, p, p, p, i64, p, i64, p, i64, c_int]
    lib.spec_linear.restype = c_int
    lib.spec_dequant_rows.argtypes = [c_int, p, i64, p, i64, p]
    lib.spec_dequant_rows.restype = c_int
    lib.spec_quantize_rows.argtypes = [c_int, p, i64, i64, p, p]
    lib.spec_quantize_rows.restype = c_int
    lib.spec_attend.argtypes = [p, i64, i64, i64, i64, p, p, i64, p, p, ctypes.c_float]
    lib.spec_attend.argtypes += [ctypes.c_float, p, c_int, c_int]
    lib.spec_attend.restype = c_int
    lib.spec_rope_attend.argtypes = [p, i64, i64, i64, i64, i64, p, p, p, p, i64, i64, p, p]
    lib.spec_rope_attend.argtypes += [ctypes.c_float, ctypes.c_float, p, c_int, c_int]
    lib.spec_rope_attend.restype = c_int
    lib.spec_rms_norm.argtypes = [p, p, i64, i64, ctypes.c_float, p]
    lib.spec_rms_norm.restype = c_int
    lib.spec_alloc_weights.argtypes = [i64]
    lib.spec_alloc_weights.restype = p
    lib.spec_free_weights.argtypes = [p, i64]
    lib.spec_free_weights.restype = None
    lib.spec_silu_mul.argtypes = [p, i64, i64, p]
    lib.spec_silu_mul.restype = c_int
    # (layers, nlayers, dim, nh, nkv, hd, eps, scale, x, m, segs, nseg, cos, sin, lo, hi, threads)
    lib.spec_layers.argtypes = [p, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float]
    lib.spec_layers.argtypes += [p, i64, p, i64, p, p, p, p, c_int]
    lib.spec_layers.restype = c_int
    return lib


def available() -> bool:
    return _load() is not None


def why_missing() -> str | None:
    """Why the kernels are unavailable (None when they load)."""
    _load()
    return _missing


def _need() -> Any:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"native kernels are unavailable: {_missing}")
    return lib


def paths() -> list[str]:
    """The code paths this CPU can run, slowest first."""
    have = _need().spec_features()
    return [name for name, need in _PATH_FEATURES.items() if (have & need) == need]


def set_path(name: str) -> None:
    """Force a code path (one of `paths()`) or let the CPU decide ("auto")."""
    if name not in PATHS:
        raise ValueError(f"kernel path {name!r} is not known: use one of {', '.join(PATHS)}")
    if _need().spec_set_path(PATHS[name]) != 0:
        raise ValueError(f"kernel path {name!r} is not available on this CPU: {paths()}")


def active_path() -> str:
    return _PATH_NAMES[_need().spec_active_path()]


# knob -> (id in spec_tune, least value)
TUNING_KNOBS = {
    "prefetch_bytes": (0, 0),
    "prefetch_rows": (1, 0),
    "chunks_per_thread": (2, 1),
    "max_chunk_cols": (3, 4),
    "attention_pairs": (4, 0),
    "span_blocks": (5, 0),
    "span_cols": (6, 1),
    "span_ahead": (7, 0),
    "rows_outer": (8, 0),
    "wide_tiles": (9, 0),
    "wide_rows": (10, 1),
    "wide_min_rows": (11, 1),
    "amx_tiles": (12, 0),
    "attention_512": (13, 0),
    "attention_long_keys": (14, 1),
    "prefetch_l2_bytes": (15, 0),
    "prefetch_l2_rows": (16, 0),
}


def tune(knob: str, value: int) -> int:
    """Set a kernel tuning knob for benchmarks (results never depend on it); returns the
    old value. `prefetch_bytes`: how far past each weight unit a tile of at least
    `prefetch_rows` rows asks for weights (0: not at all); `chunks_per_thread` and
    `max_chunk_cols`: how the columns are cut into the chunks that threads take;
    `attention_pairs` (0-8; 8 by default): the most pairs of a pass's query rows an
    attention task takes over the same keys and values while they are in L1 (two rows
    share each load; a pass of T rows takes T / 32 pairs, at least one), 0 one row at a
    time; `span_blocks` (0: off),
    `span_cols` and `span_ahead`: how a pass of a few rows over long K-quant columns goes
    a span of blocks at a time over a group of columns, and how many pieces ahead it asks
    for weights; `rows_outer` (0: off): a pass of many rows takes its row tiles outside
    the column loop, columns a span at a time where a tile's activations pass this many
    bytes; `wide_tiles` (1 on, 0 off; on by default on Intel CPUs): K-quant tiles of two
    columns in 512-bit registers on the VNNI path, for passes of at least `wide_min_rows`
    rows, `wide_rows` (1-8) rows a tile in a pass of many rows; `amx_tiles` (only where
    `has_amx()`; 1, the default there: prefill's Q4_K matmuls on AMX tiles, 2: Q6_K's
    too, 0 off); `attention_512` (1, the default; 0): attention's scores and weighted
    values in 512-bit registers on the AVX-512 paths, or in 256-bit ones (the same bits);
    `attention_long_keys` (1024 by default): from this many keys a pass's rows make as few
    attention tasks as keep every thread busy, each reading the keys and values once;
    `prefetch_l2_bytes` (0: off; 4096 by default on Intel CPUs, 0 elsewhere): passes of at
    most `prefetch_l2_rows` rows (8) also ask for the weights this many bytes past the L1
    prefetch into L2."""
    if knob not in TUNING_KNOBS:
        raise ValueError(f"unknown knob {knob!r}: one of {', '.join(TUNING_KNOBS)}")
    knob_id, least = TUNING_KNOBS[knob]
    if value < least:
        raise ValueError(f"{knob}={value}: a value >= {least} is wanted")
    old = int(_need().spec_tune(knob_id, value))
    if old == -2:
        raise ValueError(f"{knob}={value}: out of the range the kernels take")
    if old == -3:
        raise ValueError(f"{knob}={value}: this CPU (or its OS) offers no AMX-INT8 tiles")
    return old


def kernel_label() -> str:
    """The active path's name, with '+amx' where prefill's matmuls take AMX tiles (the
    VNNI path with the `amx_tiles` knob on, its default where the CPU has them)."""
    name = active_path()
    if name == "avx512vnni" and tuning()["amx_tiles"] > 0:
        return name + "+amx"
    return name


def has_amx() -> bool:
    """Whether this CPU has AMX-INT8 tiles that this process may use (the `amx_tiles`
    knob)."""
    return bool(_need().spec_features() & 8)


def tuning() -> dict[str, int]:
    """The knobs' current values."""
    lib = _need()
    return {knob: int(lib.spec_tune(knob_id, -1)) for knob, (knob_id, _) in TUNING_KNOBS.items()}


# Packed weights of at least this many bytes live in huge-page memory (spec_alloc_weights)
# unless SPECULANT_HUGEPAGES=0; smaller ones could not fill a 2 MiB page.
HUGE_PAGE_BYTES = 2 << 20
HUGE_PAGES = os.environ.get("SPECULANT_HUGEPAGES", "1") != "0"


def weight_buffer(nbytes: int) -> Tensor:
    """An uninitialised uint8 tensor for packed weights: in 2 MiB-aligned memory marked
    for transparent huge pages when it is large enough (and HUGE_PAGES), else an
    ordinary tensor. Freed when the tensor is."""
    lib = _need()
    if HUGE_PAGES and nbytes >= HUGE_PAGE_BYTES:
        ptr = lib.spec_alloc_weights(nbytes)
        if ptr:
            raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
            # freed when the last tensor on it goes; not at interpreter exit, where a
            # thread still running a pass could read it after the unmap (the OS frees it)
            weakref.finalize(raw, lib.spec_free_weights, ptr, nbytes).atexit = False
            with warnings.catch_warnings():  # a writable buffer: no warning is due
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(raw, dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8)


def row_bytes(ggml_type: int, k: int) -> int:
    if ggml_type not in BLOCK:
        return 0
    per, nbytes = BLOCK[ggml_type]
    return k // per * nbytes if k % per == 0 else 0


class NativeMatrix:
    """One or more stored GGUF matrices [n_i, K] whose outputs are concatenated (a fused
    projection whose parts may have different formats). `data` are uint8 arrays or
    tensors holding each part's rows as the file stores them.

    The kernels read a packed copy: each part's codes permuted so that a vector lane
    collects one scale group (exact, nothing requantized; see kernels.c), made when the
    matrix is first multiplied, or at once with `pack()`. `keep_stored=False` lets the
    stored rows go once packed (a projection that is never looked up by row); `rows()`
    needs them."""

    def __init__(self, parts: list[tuple[int, Any, int]], k: int, keep_stored: bool = True) -> None:
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"{len(parts)} parts: between 1 and {MAX_PARTS} are allowed")
        self.k = k
        self.keep_stored = keep_stored
        self.parts: list[tuple[int, Tensor, int]] = []
        for ggml_type, data, n in parts:
            if ggml_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"GGML type {ggml_type} is not executed natively: "
                    f"use one of {', '.join(SUPPORTED_TYPES.values())}"
                )
            rb = row_bytes(ggml_type, k)
            if rb == 0:
                raise ValueError(
                    f"K={k} is not a multiple of the {SUPPORTED_TYPES[ggml_type]} block"
                )
            if isinstance(data, Tensor):
                t = data
            else:
                with warnings.catch_warnings():  # a read-only mapping: only read here
                    warnings.simplefilter("ignore", UserWarning)
                    t = torch.from_numpy(data)
            t = t.reshape(-1)
            if t.dtype != torch.uint8 or t.numel() != rb * n:
                raise ValueError(
                    f"part of {t.numel()} {t.dtype} values: {n} rows of {rb} bytes wanted"
                )
            self.parts.append((ggml_type, t.contiguous(), n))
        self.n = sum(n for _, _, n in self.parts)
        count = len(self.parts)
        self._types = (ctypes.c_int * count)(*[p[0] for p in self.parts])
        self._ns = (ctypes.c_int64 * count)(*[p[2] for p in self.parts])
        self.packed: list[Tensor] | None = None
        self._ptrs: Any = None

    def pack(self, threads: int | None = None) -> NativeMatrix:
        """Make the packed copy the kernels read (once); returns self."""
        if self.packed is not None:
            return self
        lib = _need()
        packed = []
        for ggml_type, data, n in self.parts:
            out = weight_buffer(n * lib.spec_packed_row_bytes(ggml_type, self.k))
            rc = lib.spec_repack(
                ggml_type,
                data.data_ptr(),
                n,
                self.k,
                out.data_ptr(),
                threads if threads is not None else THREADS,
            )
            if rc != 0:
                raise RuntimeError(f"native repack failed with code {rc}")
            packed.append(out)
        self.packed = packed
        self._ptrs = (ctypes.c_void_p * len(packed))(*[t.data_ptr() for t in packed])
        if not self.keep_stored:
            self.parts = [(t, torch.empty(0, dtype=torch.uint8), n) for t, _, n in self.parts]
        return self

    def tensors(self) -> list[Tensor]:
        """The tensors this matrix holds (stored rows where kept, the packed copy where made)."""
        return [d for _, d, _ in self.parts if d.numel()] + list(self.packed or [])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors())

    def matmul(self, x: Tensor, threads: int | None = None) -> Tensor:
        """x [m, K] float32 -> [m, n] float32."""
        lib = _need()
        if x.dtype != torch.float32:
            x = x.float()
        x = x.contiguous()
        m = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"input of shape {tuple(x.shape)}: [m, {self.k}] wanted")
        y = torch.empty(m, self.n, dtype=torch.float32)
        if m == 0:
            return y
        self.pack()
        rc = lib.spec_linear(
            len(self.parts),
            ctypes.addressof(self._types),
            ctypes.addressof(self._ptrs),
            ctypes.addressof(self._ns),
            self.k,
            x.data_ptr(),
            m,
            y.data_ptr(),
            self.n,
            threads if threads is not None else THREADS,
        )
        if rc != 0:
            raise RuntimeError(f"native matmul failed with code {rc}")
        return y

    def rows(self, ids: Tensor) -> Tensor:
        """Dequantized rows `ids` (indices into the concatenated rows) [len(ids), K]."""
        lib = _need()
        if not self.keep_stored:
            raise RuntimeError("this matrix keeps only its packed copy: no rows to look up")
        ids = ids.reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            raise IndexError(f"row ids must lie in [0, {self.n})")
        out = torch.empty(ids.numel(), self.k, dtype=torch.float32)
        offset = 0
        for ggml_type, data, n in self.parts:
            sel = ((ids >= offset) & (ids < offset + n)).nonzero().reshape(-1)
            if sel.numel():
                local = (ids[sel] - offset).contiguous()
                part = torch.empty(sel.numel(), self.k, dtype=torch.float32)
                rc = lib.spec_dequant_rows(
                    ggml_type,
                    data.data_ptr(),
                    self.k,
                    local.data_ptr(),
                    local.numel(),
                    part.data_ptr(),
                )
                if rc != 0:
                    raise RuntimeError(f"native dequantize failed with code {rc}")
                out[sel] = part
            offset += n
        return out


def quantize_rows(x: Tensor, kquant: bool) -> tuple[Tensor, Tensor]:
    """The kernels' activation quantizer (tests): int8 codes [m, K] and scales per block."""
    lib = _need()
    x = x.float().contiguous()
    m, k = x.shape
    per = 256 if kquant else 32
    codes = torch.empty(m, k, dtype=torch.int8)
    scales = torch.empty(m, k // per, dtype=torch.float32)
    if lib.spec_quantize_rows(int(kquant), x.data_ptr(), k, m, codes.data_ptr(), scales.data_ptr()):
        raise ValueError(f"K={k} is not a multiple of {per}")
    return codes, scales


def attend(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    lo: Tensor,
    hi: Tensor,
    scale: float,
    threads: int | None = None,
    softcap: float = 0.0,
) -> Tensor:
    """Attention of T query rows: q [nh, T, hd] float32 against one layer's cache, keys and
    values [nkv, rows, hd] float32 or float16 (read as the float32 values they hold); query
    row t sees keys lo[t] .. hi[t]-1 (int64 [T]).
    Returns [nh, T, hd]. A row's result depends only on its query and its visible keys:
    not on T, the cache's length or the thread count (see kernels.c). `softcap` > 0 caps
    each score s at softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
    lib = _need()
    nh, t, hd = q.shape
    nkv, rows = keys.shape[0], keys.shape[1]
    if keys.shape != values.shape or keys.shape[2] != hd or nh % nkv or hd % 8:
        raise ValueError(
            f"attention shapes q {tuple(q.shape)}, keys {tuple(keys.shape)}, values "
            f"{tuple(values.shape)}: want [nh, T, hd], [nkv, rows, hd] with nkv | nh, 8 | hd"
        )
    _check_contiguous((("q", q),), (torch.float32,))
    kv16 = _cache_kind(keys, values)
    lo = lo.to(torch.int64).contiguous()
    hi = hi.to(torch.int64).contiguous()
    if lo.numel() != t or hi.numel() != t:
        raise ValueError(f"{lo.numel()} / {hi.numel()} key ranges for {t} query rows")
    out = torch.empty_like(q)
    if t == 0:
        return out
    rc = lib.spec_attend(
        q.data_ptr(),
        t,
        nh,
        nkv,
        hd,
        keys.data_ptr(),
        values.data_ptr(),
        rows,
        lo.data_ptr(),
        hi.data_ptr(),
        scale,
        softcap,
        out.data_ptr(),
        threads if threads is not None else THREADS,
        kv16,
    )
    if rc != 0:  # the message formats tensors: only on failure
        _attention_error(rc, f"key ranges outside the cache's {rows} rows: lo {lo}, hi {hi}")
    return out


KV_DTYPES = (torch.float32, torch.float16)  # the caches the native attention reads


def _check_contiguous(
    tensors: tuple[tuple[str, Tensor], ...], dtypes: tuple[torch.dtype, ...]
) -> None:
    for name, x in tensors:
        if x.dtype not in dtypes or not x.is_contiguous():
            got = x.dtype if x.dtype not in dtypes else "a non-contiguous view"
            want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{name} must be contiguous {want}, not {got}")


def _cache_kind(keys: Tensor, values: Tensor) -> int:
    """1 for a float16 cache, 0 for a float32 one (keys and values of one dtype)."""
    _check_contiguous((("keys", keys), ("values", values)), KV_DTYPES)
    if keys.dtype != values.dtype:
        raise ValueError(f"keys {keys.dtype} and values {values.dtype}: one dtype wanted")
    return int(keys.dtype == torch.float16)


def _attention_error(rc: int, what: str) -> None:
    if rc == -4:
        raise MemoryError("native attention could not allocate its score buffer")
    raise ValueError(what)


def rope_attend(
    qkv: Tensor,
    heads: tuple[int, int, int],
    cos: Tensor,
    sin: Tensor,
    keys: Tensor,
    values: Tensor,
    start: int,
    lo: Tensor,
    hi: Tensor,
    scale: float,
    threads: int | None = None,
    softcap: float = 0.0,
) -> Tensor:
    """One chain's attention block in one call: qkv [T, (nh + 2 nkv) hd] (the fused
    projection's rows), heads = (nh, nkv, hd), cos / sin [T, hd] of the rows' positions.
    Writes the rotated keys and the values into the cache rows start .. start+T-1 of
    keys / values [nkv, rows, hd], then attends as `attend`. Returns [T, nh * hd]."""
    lib = _need()
    nh, nkv, hd = heads
    t = qkv.shape[0]
    rows = keys.shape[1]
    _check_contiguous((("qkv", qkv), ("cos", cos), ("sin", sin)), (torch.float32,))
    kv16 = _cache_kind(keys, values)
    if cos.shape != (t, hd) or sin.shape != (t, hd) or keys.shape != (nkv, rows, hd):
        raise ValueError(f"rotary tables {tuple(cos.shape)} / cache {tuple(keys.shape)}")
    lo = lo.to(torch.int64).contiguous()
    hi = hi.to(torch.int64).contiguous()
    out = torch.empty(t, nh * hd, dtype=torch.float32)
    if t == 0:
        return out
    rc = lib.spec_rope_attend(
        qkv.data_ptr(),
        t,
        qkv.shape[1],
        nh,
        nkv,
        hd,
        cos.data_ptr(),
        sin.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        rows,
        start,
        lo.data_ptr(),
        hi.data_ptr(),
        scale,
        softcap,
        out.data_ptr(),
        threads if threads is not None else THREADS,
        kv16,
    )
    if rc != 0:  # the message formats tensors: only on failure
        _attention_error(
            rc,
            f"attention block rejected: qkv {tuple(qkv.shape)}, heads {heads}, rows "
            f"{start}..{start + t} of a {rows}-row cache, key ranges {lo} .. {hi}",
        )
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., d] float32 -> x / sqrt(mean(x^2) + eps) * weight, each row on its own."""
    lib = _need()
    d = x.shape[-1]
    if d % 8 or weight.shape != (d,):
        raise ValueError(f"rms_norm over {d} values with a weight of {tuple(weight.shape)}")
    xc = x.contiguous().float()
    w = weight.float().contiguous()
    y = torch.empty_like(xc)
    lib.spec_rms_norm(xc.data_ptr(), w.data_ptr(), xc.numel() // d, d, eps, y.data_ptr())
    return y


def use_threads(threads: int | None) -> None:
    """A command's --threads: the native kernels' threads and PyTorch's (None: leave
    both as they are). Call it before loading models, so that repacking uses them too,
    and `share_cores_if_native` after."""
    global THREADS, THREADS_WHY
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads={threads} is out of range: use >= 1")
    THREADS, THREADS_WHY = threads, "--threads"
    torch.set_num_threads(threads)


def n_threads(n: int) -> str:
    """'1 thread', '2 threads'."""
    return f"{n} thread{'s' if n != 1 else ''}"


def threads_label() -> str:
    """'2 threads (2 usable CPUs)': the kernels' threads and where the count came from."""
    return f"{n_threads(THREADS)} ({THREADS_WHY})"


def share_cores_with_torch() -> None:
    """Give the cores to the native kernels: PyTorch's remaining per-token work (norms,
    attention over short contexts) runs on one thread. With several torch threads, their
    spinning OpenMP workers and the kernels' threads take turns on the same cores: on a
    2-core machine the 0.5B model decoded at ~9 tok/s that way and ~16-25 tok/s this way.
    Called by the CLIs when a gguf model is used (after `use_threads`)."""
    if available():
        torch.set_num_threads(1)


def share_cores_if_native(*models: Any) -> None:
    """`share_cores_with_torch` when any of the loaded models (None skipped) runs GGUF
    weights natively; the command lines call it once their models are loaded."""
    if any(m is not None and m.dtype_name == "gguf" for m in models):
        share_cores_with_torch()


def silu_mul(gu: Tensor) -> Tensor:
    """gu [m, 2F] float32 (gate, then up) -> silu(gate) * up [m, F], each value from its
    own inputs; the exp is the kernels' own (see kernels.c), the same on every path."""
    lib = _need()
    gu = gu.float().contiguous()
    m, two_f = gu.shape
    if two_f % 2:
        raise ValueError(f"gate/up rows of {two_f} values: an even count is wanted")
    out = torch.empty(m, two_f // 2, dtype=torch.float32)
    lib.spec_silu_mul(gu.data_ptr(), m, two_f // 2, out.data_ptr())
    return out


class _Mat(ctypes.Structure):
    _fields_ = [
        ("nparts", ctypes.c_int32),
        ("types", ctypes.c_int32 * MAX_PARTS),
        ("w", ctypes.c_void_p * MAX_PARTS),
        ("ns", ctypes.c_int64 * MAX_PARTS),
        ("K", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("ffn_norm", ctypes.c_void_p),
        ("qkv", _Mat),
        ("wo", _Mat),
        ("gate_up", _Mat),
        ("down", _Mat),
    ]


class _Seg(ctypes.Structure):
    _fields_ = [
        ("T", ctypes.c_int64),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("start", ctypes.c_int64),
        ("layer_stride", ctypes.c_int64),
        ("kv16", ctypes.c_int64),
    ]


def _mat(matrix: NativeMatrix, bias: Tensor | None, keep: list[Tensor]) -> _Mat:
    matrix.pack()
    assert matrix.packed is not None
    mt = _Mat()
    mt.nparts = len(matrix.parts)
    for i, (ggml_type, _, n) in enumerate(matrix.parts):
        mt.types[i] = ggml_type
        mt.w[i] = matrix.packed[i].data_ptr()
        mt.ns[i] = n
    mt.K, mt.n = matrix.k, matrix.n
    if bias is not None:
        b = bias.float().contiguous()
        if b.shape != (matrix.n,):
            raise ValueError(f"bias of shape {tuple(b.shape)} for {matrix.n} outputs")
        keep.append(b)
        mt.bias = b.data_ptr()
    return mt


# (attn_norm, ffn_norm, qkv, qkv bias or None, wo, gate_up, down) of one layer
LayerParts = tuple[
    Tensor, Tensor, NativeMatrix, Tensor | None, NativeMatrix, NativeMatrix, NativeMatrix
]


class LayerTable:
    """Pre-norm Llama / Qwen2 layers (attention, then a SiLU-gated MLP) described for
    `run_layers`: the packed weights and float32 norms and biases, kept alive here.
    `layers` holds per layer (attn_norm, ffn_norm, qkv, qkv_bias or None, wo, gate_up,
    down), the matrices NativeMatrix."""

    def __init__(
        self,
        layers: list[LayerParts],
        heads: tuple[int, int, int],
        eps: float,
        scale: float,
    ) -> None:
        self.heads = heads
        self.eps = eps
        self.scale = scale
        self._keep: list[Tensor] = []
        self._mats: list[NativeMatrix] = []
        table = (_Layer * len(layers))()
        for i, (attn_norm, ffn_norm, qkv, bqkv, wo, gate_up, down) in enumerate(layers):
            norms = [n.float().contiguous() for n in (attn_norm, ffn_norm)]
            self._keep.extend(norms)
            self._mats.extend([qkv, wo, gate_up, down])
            entry = table[i]
            entry.attn_norm, entry.ffn_norm = norms[0].data_ptr(), norms[1].data_ptr()
            entry.qkv = _mat(qkv, bqkv, self._keep)
            entry.wo = _mat(wo, None, self._keep)
            entry.gate_up = _mat(gate_up, None, self._keep)
            entry.down = _mat(down, None, self._keep)
        self.table = table
        self.n_layers = len(layers)
        self.dim = layers[0][4].n if layers else 0


def run_layers(
    table: LayerTable,
    x: Tensor,
    segments: list[tuple[int, Tensor, Tensor, int]],
    cos: Tensor,
    sin: Tensor,
    lo: Tensor,
    hi: Tensor,
    threads: int | None = None,
) -> Tensor:
    """Every layer of `table` over x [m, dim] float32 (the rows of several sequences, in
    order) in one native call; returns the new residual stream [m, dim]. `segments` are
    (rows T, cache keys, cache values, start) per sequence, the caches [n_layers, 1, nkv,
    rows, hd] float32 or float16 whose rows start .. start+T-1 receive the keys and values
    (float16: rounded to nearest even); cos / sin
    [m, hd] are each row's rotary tables and lo / hi [m] the keys it sees. Bitwise the
    same as running the layers one operation at a time through this module."""
    lib = _need()
    nh, nkv, hd = table.heads
    x = x.float().contiguous().clone()
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != table.dim:
        raise ValueError(f"rows of shape {tuple(x.shape)}: [m, {table.dim}] wanted")
    segs = (_Seg * len(segments))()
    total = 0
    for i, (t, k, v, start) in enumerate(segments):
        kv16 = _cache_kind(k, v)
        if k.shape != v.shape:
            raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)}: one shape wanted")
        if k.shape[0] < table.n_layers or k.shape[2:] != (nkv, k.shape[3], hd):
            raise ValueError(f"cache of shape {tuple(k.shape)} for {table.n_layers} layers")
        rows = k.shape[3]
        if start < 0 or start + t > rows:
            raise ValueError(f"rows {start}..{start + t} of a {rows}-row cache")
        segs[i].T, segs[i].k, segs[i].v = t, k.data_ptr(), v.data_ptr()
        segs[i].rows, segs[i].start, segs[i].layer_stride = rows, start, nkv * rows * hd
        segs[i].kv16 = kv16
        total += t
    if total != m:
        raise ValueError(f"segments of {total} rows for {m} rows")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    lo = lo.to(torch.int64).contiguous()
    hi = hi.to(torch.int64).contiguous()
    if cos.shape != (m, hd) or sin.shape != (m, hd) or lo.numel() != m or hi.numel() != m:
        raise ValueError(f"rotary tables {tuple(cos.shape)} / key ranges {lo.numel()} for {m} rows")
    rc = lib.spec_layers(
        ctypes.addressof(table.table),
        table.n_layers,
        table.dim,
        nh,
        nkv,
        hd,
        table.eps,
        table.scale,
        x.data_ptr(),
        m,
        ctypes.addressof(segs),
        len(segments),
        cos.data_ptr(),
        sin.data_ptr(),
        lo.data_ptr(),
        hi.data_ptr(),
        threads if threads is not None else THREADS,
    )
    if rc != 0:
        _attention_error(rc, f"native layers failed with code {rc}: key ranges {lo} .. {hi}")
    return x
