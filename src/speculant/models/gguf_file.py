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


def read_gguf(path: str | Path, string_arrays: bool = False) -> GGUFIndex:
    """Metadata and tensor table of a GGUF v2/v3 file. String arrays become their length
    (an int) unless `string_arrays` is set."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below, after mmap)
    except OSError as exc:
        raise GGUFError(f"cannot open {path}: {exc.strerror}") from exc
    with f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        pos = 24

        def read_str(p: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, p)
            return buf[p + 8 : p + 8 + n].decode("utf-8", errors="replace"), p + 8 + n

        def read_value(p: int, vtype: int) -> tuple[Any, int]:
            if vtype in _SCALARS:
                fmt, width = _SCALARS[vtype]
                return struct.unpack_from(fmt, buf, p)[0], p + width
            if vtype == _STRING:
                return read_str(p)
            if vtype == _ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, p)
                p += 12
                if etype in _SCALARS:
                    fmt, width = _SCALARS[etype]
                    return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, p)), p + count * width
                if etype == _STRING:
                    out: list[str] = []
                    for _ in range(count):
                        (n,) = struct.unpack_from("<Q", buf, p)
                        if string_arrays:
                            out.append(buf[p + 8 : p + 8 + n].decode("utf-8", errors="replace"))
                        p += 8 + n
                    return (out if string_arrays else count), p
                items = []
                for _ in range(count):
                    v, p = read_value(p, etype)
                    items.append(v)
                return items, p
            raise GGUFError(f"{path}: unknown GGUF value type {vtype}")

        try:
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key, pos = read_str(pos)
                (vtype,) = struct.unpack_from("<I", buf, pos)
                metadata[key], pos = read_value(pos + 4, vtype)
            infos = []
            for _ in range(n_tensors):
                name, pos = read_str(pos)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
                ggml_type, rel = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                infos.append((name, tuple(int(d) for d in dims), int(ggml_type), int(rel)))
        except struct.error as exc:
            raise GGUFError(f"{path} is truncated or corrupt: {exc}") from exc
        align = int(metadata.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        size = len(buf)
    tensors = {}
    for name, dims, ggml_type, rel in infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (KeyError, ValueError) as exc:
            raise GGUFError(f"{path}: tensor {name} has unknown type {ggml_type}") from exc
        n = int(np.prod(dims))
        nbytes = n // block * type_size
        offset = data_start + rel
        if offset + nbytes > size:
            raise GGUFError(f"{path} is truncated: tensor {name} ends past the end of the file")
        tensors[name] = TensorInfo(name, dims, ggml_type, offset, nbytes)
    return GGUFIndex(path, metadata, tensors)
