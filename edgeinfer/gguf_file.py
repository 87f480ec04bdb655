"""Open a GGUF file: parse and validate its header, keep tensors as raw blocks (zero copy).

Why not `gguf.GGUFReader`: it builds one numpy view per array element, which takes ~19 s
for a 262k-token vocabulary. This parser walks the header once with `struct` and keeps
the tensor data as views into one read-only mmap, so opening a 250 MB file takes
milliseconds once the OS cache is warm and nothing is dequantized or copied.

A split model (llama.cpp's gguf-split: `NAME-00001-of-0000N.gguf` ...) is opened by its first
part: every part is mapped and checked (see `gguf_split`), and each tensor reads from its part.

Every problem ends in a `GGUFError` whose one line names the file and the problem. Strings
are decoded here, once, with invalid UTF-8 replaced by U+FFFD, so nothing downstream meets
undecodable text; no claimed count is believed before it is checked against the bytes left.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from edgeinfer import gguf_split
from edgeinfer.errors import GGUFError
from edgeinfer.metadata import Metadata, check_common_keys, meta_int, meta_str

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Sanity bounds: a header that claims more than this is corrupt, not big.
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
MAX_DIMS = 4
MAX_ELEMENTS = (1 << 63) - 1  # a tensor's element count must fit in int64
# Fewest header bytes one entry can take: key length + type + 1-byte value; name length +
# n_dims + one dim + type + offset. A count the remaining bytes cannot hold is a lie.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8

# GGUF metadata value types -> (struct format, numpy dtype). 8 = string, 9 = array.
_SCALAR_TYPES: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),  # bool
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's place in the file. `shape` is in GGML order: shape[0] is the row length."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file (its part's file, for a split model)
    n_bytes: int
    part: int = 0  # which file of a split model holds it (0: the first part, `GGUFFile.path`)

    @property
    def n_cols(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def row_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.n_cols // block_size * type_size


class _Cursor:
    """Reads little-endian values from the mapped header, failing with a 'truncated' error."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated file: header ends past the end of the file")

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self) -> int:
        return self.scalar("<I")

    def u64(self) -> int:
        return self.scalar("<Q")

    def string(self) -> str:
        n = self.u64()
        self._need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        # GGUF strings should be UTF-8; anything else is shown with U+FFFD everywhere
        return raw.decode("utf-8", "replace")

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def string_array(self, count: int, key: str) -> list[str]:
        if count * 8 > self.remaining():  # each string takes at least its 8-byte length
            raise GGUFError(f"{self.path}: metadata key {key!r} claims {count} strings, more than "
                            f"the {self.remaining()} bytes left in the file can hold")
        # Two passes: walk the length prefixes (each checked against the bytes left), then
        # decode slices of one bytes copy of the array, which is about twice as fast as
        # decoding memoryview slices one by one (262k tokens: the bulk of opening a file).
        buf, start, pos = self.buf, self.pos, self.pos
        end = len(buf)
        unpack = struct.Struct("<Q").unpack_from
        starts: list[int] = []
        append = starts.append
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self._need(8)
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                self.pos = pos
                self._need(n)
            append(pos - start)
            pos += n
        self.pos = pos
        data = bytes(buf[start:pos])
        # string k ends 8 bytes (the next length) before string k+1 starts
        ends = [s - 8 for s in starts[1:]]
        ends.append(pos - start)
        return [data[s:e].decode("utf-8", "replace") for s, e in zip(starts, ends)]

    def value(self, vtype: int, key: str) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.u32()
            count = self.u64()
            if item_type == _STRING:
                return self.string_array(count, key)
            if item_type not in _SCALAR_TYPES:
                raise GGUFError(f"{self.path}: metadata key {key!r} has an array of unknown type {item_type}")
            dtype = np.dtype(_SCALAR_TYPES[item_type][1])
            nbytes = count * dtype.itemsize
            if nbytes > self.remaining():
                raise GGUFError(f"{self.path}: metadata key {key!r} claims {count} values, more than "
                                f"the {self.remaining()} bytes left in the file can hold")
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += nbytes
            return arr.astype(bool) if item_type == _BOOL else arr
        if vtype not in _SCALAR_TYPES:
            raise GGUFError(f"{self.path}: metadata key {key!r} has unknown value type {vtype}")
        return self.scalar(_SCALAR_TYPES[vtype][0])


class GGUFFile:
    """A validated GGUF file: metadata dict, tensor table, and zero-copy tensor views."""

    def __init__(self, path: Path, version: int, metadata: Metadata,
                 tensors: dict[str, TensorInfo], data_offset: int, mapped: np.ndarray) -> None:
        self.path = path  # the first part, for a split model
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.data_offset = data_offset
        self.part_paths = [path]  # every file of a split model, in order
        self._maps = [mapped]  # per part: a read-only uint8 view of the whole file
        self._mmaps: list[mmap.mmap | None] = [None]  # the mapping behind each view, where it is one
        self._raw_views: dict[str, np.ndarray] = {}  # decode asks for each matrix every token

    # -- opening ---------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "GGUFFile":
        """Open a GGUF file, or all parts of a split one given its first part."""
        gf = cls._open_one(Path(path))
        keys = gguf_split.read_keys(gf.metadata, gf.path)
        if keys is not None:
            gf._add_parts(keys)
        return gf

    @classmethod
    def _open_one(cls, path: Path) -> "GGUFFile":
        if not path.exists():
            raise GGUFError(f"{path}: no such file")
        if path.is_dir():
            raise GGUFError(f"{path}: is a directory, not a GGUF file")
        size = path.stat().st_size
        if size < 4:
            raise GGUFError(f"{path}: not a GGUF file (only {size} bytes)")
        try:
            with open(path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise GGUFError(f"{path}: cannot read file: {exc}") from None
        mapped = np.frombuffer(mm, dtype=np.uint8)
        gf = _parse(path, memoryview(mm), mapped)
        gf._mmaps = [mm]
        return gf

    def _add_parts(self, keys: gguf_split.SplitKeys) -> None:
        """Map parts 2..N next to this first part and take their tensors into the table."""
        opened = []
        # other_parts checks that every part exists before any is mapped
        for no, part_path in enumerate(gguf_split.other_parts(self.path, keys), start=1):
            part = GGUFFile._open_one(part_path)
            gguf_split.check_part(part.metadata, part_path, no, keys)
            opened.append(part)
        tables = [(self.path, self.tensors)] + [(p.path, p.tensors) for p in opened]
        self.tensors = gguf_split.join_tensors(tables, keys)
        self.part_paths += [p.path for p in opened]
        self._maps += [p._maps[0] for p in opened]
        self._mmaps += [p._mmaps[0] for p in opened]

    # -- access ----------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return meta_str(self.metadata, "general.architecture", "")

    @property
    def file_size(self) -> int:
        """Bytes on disk: all parts together, for a split model."""
        return sum(int(m.shape[0]) for m in self._maps)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array of shape (n_rows, row_bytes)."""
        view = self._raw_views.get(name)
        if view is None:
            info = self.tensors[name]
            flat = self._maps[info.part][info.offset : info.offset + info.n_bytes]
            view = self._raw_views[name] = flat.reshape(info.n_rows, info.row_bytes)
        return view

    def drop_pages(self, name: str) -> None:
        """Let the OS take the tensor's mapped pages out of this process's memory (the CPU
        backend calls it once it holds a copy in another layout): they stay in the page
        cache, and a later read maps them back. Only pages wholly inside the tensor."""
        info = self.tensors[name]
        mm = self._mmaps[info.part]
        if mm is None or not hasattr(mm, "madvise"):
            return
        start = -(-info.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (info.offset + info.n_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def array(self, name: str) -> np.ndarray:
        """An F32/F16/BF16 tensor as a numpy array in row-major (numpy) shape, zero copy."""
        info = self.tensors[name]
        dtypes = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        if info.qtype not in dtypes:
            raise TypeError(f"{name} is {info.qtype.name}, not a float tensor")
        flat = self._maps[info.part][info.offset : info.offset + info.n_bytes].view(dtypes[info.qtype])
        return flat.reshape(tuple(reversed(info.shape)))

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for info in self.tensors.values():
            counts[info.qtype.name] = counts.get(info.qtype.name, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def parameter_count(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors.values())


def _parse(path: Path, buf: memoryview, mapped: np.ndarray) -> GGUFFile:
    cur = _Cursor(buf, path)
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.u32()
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 16) in SUPPORTED_VERSIONS:
            raise GGUFError(f"{path}: big-endian GGUF files are not supported")
        raise GGUFError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
    n_tensors = cur.u64()
    n_kv = cur.u64()
    if (n_tensors > MAX_TENSORS or n_kv > MAX_KV
            or n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > cur.remaining()):
        raise GGUFError(f"{path}: corrupt header ({n_tensors} tensors, {n_kv} metadata keys "
                        f"in a {len(buf)}-byte file)")

    metadata = Metadata(path)
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.u32()
        value = cur.value(vtype, key)
        if key in metadata:
            raise GGUFError(f"{path}: metadata key {key!r} appears twice")
        metadata[key] = value

    alignment = meta_int(metadata, "general.alignment", 1, 1 << 30, DEFAULT_ALIGNMENT)
    if alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
    check_common_keys(metadata)

    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        shape = tuple(cur.u64() for _ in range(n_dims))
        type_id = cur.u32()
        rel_offset = cur.u64()
        raw_infos.append((name, shape, type_id, rel_offset))

    data_offset = -(-cur.pos // alignment) * alignment
    file_size = len(buf)
    tensors: dict[str, TensorInfo] = {}
    for name, shape, type_id, rel_offset in raw_infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown type id {type_id}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise GGUFError(f"{path}: tensor {name!r} has type {qtype.name} with unknown block size")
        if any(d <= 0 for d in shape):
            raise GGUFError(f"{path}: tensor {name!r} has an empty dimension {shape}")
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if shape[0] % block_size:
            raise GGUFError(f"{path}: tensor {name!r} row length {shape[0]} is not a multiple of "
                            f"the {qtype.name} block size {block_size}")
        if rel_offset % alignment:
            raise GGUFError(f"{path}: tensor {name!r} data is not aligned to {alignment} bytes")
        n_elems = math.prod(shape)  # Python ints: a hostile shape cannot wrap around
        if n_elems > MAX_ELEMENTS:
            raise GGUFError(f"{path}: tensor {name!r} has shape {list(shape)}, whose element count "
                            f"overflows 64 bits")
        n_bytes = n_elems // block_size * type_size
        offset = data_offset + rel_offset
        if offset + n_bytes > file_size:
            raise GGUFError(f"{path}: truncated file: tensor {name!r} ends at byte {offset + n_bytes}"
                            f" but the file has {file_size}")
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        tensors[name] = TensorInfo(name, shape, qtype, offset, n_bytes)

    return GGUFFile(path, version, metadata, tensors, data_offset, mapped)
