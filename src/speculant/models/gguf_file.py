"""A fast reader of GGUF headers: metadata and tensor locations, tensor data memory-mapped.

`gguf.GGUFReader` builds Python objects for every element of the tokenizer arrays (151k
tokens and merges for Qwen), which takes tens of seconds; this reader walks the header
with `struct` and leaves string arrays unread unless asked for.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING = 8
_ARRAY = 9


class GGUFError(ValueError):
    """A file that is not a GGUF file we can read."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # gguf order: innermost (row length) first
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass
class GGUFIndex:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as gguf.quants.dequantize expects them: [rows, row_bytes]."""
        info = self.tensors[name]
        mm = np.memmap(
            self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,)
        )
        rows = int(np.prod(info.shape[1:])) if len(info.shape) > 1 else 1
        return mm.reshape(rows, info.nbytes // rows)


# Limits of a header this reader accepts (llama.cpp's own are similar): beyond them a
# file is refused before anything is allocated for it.
MAX_DIMS = 4  # ggml tensors have at most 4 dimensions
MAX_KEY_BYTES = 65535
MAX_ARRAY_DEPTH = 2  # an array of arrays of scalars, at most
MAX_ELEMENTS = 1 << 40  # per tensor


def read_gguf(path: str | Path, string_arrays: bool = False) -> GGUFIndex:
    """Metadata and tensor table of a GGUF v2/v3 file. String arrays become their length
    (an int) unless `string_arrays` is set.

    Every count, length and offset is checked against the file's size before it is used
    (a corrupt or hostile header is a GGUFError naming the file and what is wrong, never
    an allocation of what the header claims)."""
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below, after mmap)
    except OSError as exc:
        raise GGUFError(f"cannot open {path}: {exc.strerror}") from exc
    with f:
        size = _file_size(f, path)
        if size < 24:
            raise GGUFError(f"{path} is not a GGUF file: {size} bytes, shorter than a header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise GGUFError(f"{path} is not a GGUF file (bad magic)")
            try:
                metadata, infos, data_start = _parse(buf, path, string_arrays)
            except (struct.error, OverflowError, UnicodeDecodeError, RecursionError) as exc:
                raise GGUFError(f"{path} is truncated or corrupt: {exc}") from None
    return GGUFIndex(path, metadata, _tensor_table(path, infos, data_start, size))


def _file_size(f: Any, path: Path) -> int:
    import os

    try:
        return os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise GGUFError(f"cannot read {path}: {exc.strerror}") from exc


def _parse(
    buf: Any, path: Path, string_arrays: bool
) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
    size = len(buf)
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    # every key/value takes at least 13 bytes, every tensor entry at least 24
    if n_kv > (size - 24) // 13:
        raise GGUFError(f"{path}: {n_kv} metadata entries cannot fit in {size} bytes")
    if n_tensors > (size - 24) // 24:
        raise GGUFError(f"{path}: {n_tensors} tensors cannot fit in {size} bytes")

    def need(p: int, n: int, what: str) -> None:
        if n < 0 or p + n > size:
            raise GGUFError(
                f"{path} is truncated or corrupt: {what} ({n} bytes at {p}) ends past "
                f"its {size} bytes"
            )

    def read_str(p: int, what: str) -> tuple[str, int]:
        need(p, 8, what)
        (n,) = struct.unpack_from("<Q", buf, p)
        need(p + 8, n, what)
        return buf[p + 8 : p + 8 + n].decode("utf-8", errors="replace"), p + 8 + n

    def read_value(p: int, vtype: int, key: str, depth: int = 0) -> tuple[Any, int]:
        if vtype in _SCALARS:
            fmt, width = _SCALARS[vtype]
            need(p, width, f"the value of {key}")
            return struct.unpack_from(fmt, buf, p)[0], p + width
        if vtype == _STRING:
            return read_str(p, f"the value of {key}")
        if vtype == _ARRAY:
            need(p, 12, f"the array {key}")
            etype, count = struct.unpack_from("<IQ", buf, p)
            p += 12
            if etype in _SCALARS:
                fmt, width = _SCALARS[etype]
                need(p, count * width, f"the array {key}")
                return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, p)), p + count * width
            if etype == _STRING:
                need(p, count * 8, f"the array {key}")  # 8 bytes of length each, at least
                out: list[str] = []
                for _ in range(count):
                    need(p, 8, f"the array {key}")
                    (n,) = struct.unpack_from("<Q", buf, p)
                    need(p + 8, n, f"the array {key}")
                    if string_arrays:
                        out.append(buf[p + 8 : p + 8 + n].decode("utf-8", errors="replace"))
                    p += 8 + n
                return (out if string_arrays else count), p
            if etype == _ARRAY and depth + 1 < MAX_ARRAY_DEPTH:
                need(p, count * 12, f"the array {key}")  # each nested array's header
                items = []
                for _ in range(count):
                    need(p, 4, f"the array {key}")
                    (inner,) = struct.unpack_from("<I", buf, p)
                    v, p = read_value(p + 4, inner, key, depth + 1)
                    items.append(v)
                return items, p
            raise GGUFError(f"{path}: metadata {key} is an array of an unsupported type {etype}")
        raise GGUFError(f"{path}: metadata {key} has an unknown value type {vtype}")

    metadata: dict[str, Any] = {}
    pos = 24
    for _ in range(n_kv):
        key, pos = read_str(pos, "a metadata key")
        if len(key) > MAX_KEY_BYTES:
            raise GGUFError(f"{path}: a metadata key of {len(key)} bytes (at most {MAX_KEY_BYTES})")
        need(pos, 4, f"the type of {key}")
        (vtype,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = read_value(pos + 4, vtype, key)
    infos = []
    for _ in range(n_tensors):
        name, pos = read_str(pos, "a tensor name")
        need(pos, 4, f"tensor {name}'s dimension count")
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
        need(pos + 4, 8 * n_dims + 12, f"tensor {name}'s entry")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, rel = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, tuple(int(d) for d in dims), int(ggml_type), int(rel)))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1):
        raise GGUFError(
            f"{path}: metadata general.alignment={align!r} is not allowed: a power of two"
        )
    data_start = (pos + align - 1) // align * align
    for _name, _dims, _type, rel in infos:
        if rel % align:
            raise GGUFError(
                f"{path}: tensor {_name}'s data offset {rel} is not a multiple of the "
                f"alignment {align}"
            )
    return metadata, infos, data_start


def _tensor_table(
    path: Path, infos: list[tuple[str, tuple[int, ...], int, int]], data_start: int, size: int
) -> dict[str, TensorInfo]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, rel in infos:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name} is listed twice")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (KeyError, ValueError):
            raise GGUFError(f"{path}: tensor {name} has unknown type {ggml_type}") from None
        if any(d < 1 for d in dims):
            raise GGUFError(f"{path}: tensor {name} has shape {list(dims)}: no dimension may be 0")
        n = 1
        for d in dims:
            n *= d
        if n > MAX_ELEMENTS:
            raise GGUFError(f"{path}: tensor {name} has shape {list(dims)}: too many elements")
        if dims[0] % block:
            raise GGUFError(
                f"{path}: tensor {name}'s rows of {dims[0]} values are not whole "
                f"{GGMLQuantizationType(ggml_type).name} blocks of {block}"
            )
        nbytes = n // block * type_size
        offset = data_start + rel
        if offset + nbytes > size:
            raise GGUFError(f"{path} is truncated: tensor {name} ends past the end of the file")
        tensors[name] = TensorInfo(name, dims, ggml_type, offset, nbytes)
    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.offset + a.nbytes > b.offset:  # a type or shape changed without the data
            raise GGUFError(
                f"{path}: tensors {a.name} and {b.name} overlap: {a.name}'s "
                f"{GGMLQuantizationType(a.ggml_type).name} data of shape {list(a.shape)} "
                f"takes {a.nbytes} bytes, {b.name} starts {b.offset - a.offset} bytes after it"
            )
    return tensors
