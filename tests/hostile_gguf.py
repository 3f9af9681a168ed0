"""The tests' hostile-file generator: a small valid GGUF file read into plain lists
(metadata with its value types, the tensor table with each tensor's bytes) that a case
edits freely, then writes back with its own serializer, which checks nothing, so that
headers no honest writer makes (counts past the file, zero dimensions, overlapping
tensors, a key typed as an array) can be built."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
from gguf import GGUFValueType as VT

_FMT = {
    VT.UINT8: "<B",
    VT.INT8: "<b",
    VT.UINT16: "<H",
    VT.INT16: "<h",
    VT.UINT32: "<I",
    VT.INT32: "<i",
    VT.FLOAT32: "<f",
    VT.BOOL: "<?",
    VT.UINT64: "<Q",
    VT.INT64: "<q",
    VT.FLOAT64: "<d",
}


@dataclass
class Tensor:
    name: str
    dims: list[int]  # gguf order: row length first
    ggml_type: int
    data: bytes
    offset: int | None = None  # relative data offset; None: laid out in order


@dataclass
class Parts:
    kv: dict[str, tuple[list[VT], Any]] = field(default_factory=dict)  # key -> (types, value)
    tensors: list[Tensor] = field(default_factory=list)
    version: int = 3
    n_kv: int | None = None  # header counts; None: the true ones
    n_tensors: int | None = None
    alignment: int = 32

    def set(self, key: str, value: Any, vtype: VT = VT.UINT32) -> None:
        self.kv[key] = ([vtype], value)

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)


def read_parts(path: Path) -> Parts:
    r = gguf.GGUFReader(str(path))
    parts = Parts()
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types[0] == VT.ARRAY:
            value: Any = [f.contents(i) for i in range(len(f.data))]
        else:
            value = f.contents()
        parts.kv[key] = (list(f.types), value)
    raw = path.read_bytes()
    for t in r.tensors:
        start = int(t.data_offset)
        parts.tensors.append(
            Tensor(
                t.name,
                [int(d) for d in t.shape],
                int(t.tensor_type),
                raw[start : start + int(t.n_bytes)],
            )
        )
    return parts


def _value(vtype: VT, value: Any) -> bytes:
    if vtype == VT.STRING:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(data)) + data
    if vtype not in _FMT:  # a type no reader knows: four bytes of something
        return struct.pack("<I", value)
    return struct.pack(_FMT[vtype], value)


def write_parts(parts: Parts, path: Path) -> Path:
    out = bytearray(b"GGUF")
    n_kv = len(parts.kv) if parts.n_kv is None else parts.n_kv
    n_t = len(parts.tensors) if parts.n_tensors is None else parts.n_tensors
    out += struct.pack("<IQQ", parts.version, n_t, n_kv)
    for key, (types, value) in parts.kv.items():
        out += _value(VT.STRING, key) + struct.pack("<I", types[0])
        if types[0] == VT.ARRAY:
            out += struct.pack("<IQ", types[1], len(value))
            for v in value:
                out += _value(types[1], v)
        else:
            out += _value(types[0], value)
    at, offsets = 0, []
    for t in parts.tensors:
        offsets.append(at if t.offset is None else t.offset)
        at += -(-len(t.data) // parts.alignment) * parts.alignment
    for t, off in zip(parts.tensors, offsets, strict=True):
        out += _value(VT.STRING, t.name) + struct.pack("<I", len(t.dims))
        out += struct.pack(f"<{len(t.dims)}Q", *t.dims) + struct.pack("<IQ", t.ggml_type, off)
    out += b"\0" * (-len(out) % parts.alignment)
    for t in parts.tensors:
        out += t.data + b"\0" * (-len(t.data) % parts.alignment)
    path.write_bytes(bytes(out))
    return path
