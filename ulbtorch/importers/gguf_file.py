"""A GGUF file's metadata and tensor table, with the tensor data mapped, not
read: the loader reads one tensor's bytes when it converts that tensor.

Every count, length, type and offset is checked against the file before it
is used, so a truncated or damaged file is an error naming the file and what
is wrong in it (gguf-py's reader would reshape a short slice and report a
numpy shape). Tensor types gguf-py does not know (bitnet.cpp's I2_S) are kept
as numbers; only a tensor that is used needs a type the loader reads.
"""
from __future__ import annotations

import os
import struct
from typing import NamedTuple

import numpy as np

from .gguf_blocks import I2_S, block_shape, nbytes_of, type_name

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits and is gone from the wild
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# GGUF metadata value types: the fixed-size ones as struct formats.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


class StringArray(NamedTuple):
    """A metadata array of strings (a vocabulary), kept as its length: the
    loader hands the metadata to transformers, which reads it itself."""
    count: int


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch order: rows first, the blocked dimension last
    type: int               # the ggml type number
    offset: int             # of its first byte in the file
    nbytes: int | None      # None for a type whose size the loader does not know

    @property
    def type_name(self) -> str:
        return type_name(self.type)


class GGUFFile:
    """GGUFFile(path): .metadata (key -> value), .tensors (name -> TensorInfo,
    in file order), .architecture, .raw(info) for one tensor's bytes."""

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        self.size = os.path.getsize(self.path)
        self._data = np.memmap(self.path, mode="r", dtype=np.uint8) if self.size else np.zeros(0, np.uint8)
        if self.size < 24 or bytes(self._data[:4]) != MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (it does not start with the magic bytes 'GGUF')")
        self._pos = 4
        version = self._unpack("<I", 4, "the version")
        if version not in VERSIONS:
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            if swapped in VERSIONS:
                raise ValueError(f"{self.path}: a big-endian GGUF file; only little-endian files are read")
            raise ValueError(f"{self.path}: GGUF version {version}; versions {VERSIONS} are read")
        self.version = version
        n_tensors = self._unpack("<Q", 8, "the tensor count")
        n_kv = self._unpack("<Q", 8, "the metadata count")
        # Every entry takes at least 8 bytes, so a count beyond that is a damaged header, not a huge file.
        for what, n in (("tensor", n_tensors), ("metadata", n_kv)):
            if n * 8 > self.size:
                raise ValueError(f"{self.path}: the header claims {n} {what} entries in a {self.size}-byte file")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = self._string("a metadata key")
            if key in self.metadata:
                raise ValueError(f"{self.path}: metadata key {key!r} appears twice")
            vtype = self._unpack("<I", 4, f"the type of metadata {key!r}")
            self.metadata[key] = self._value(vtype, key)
        self.metadata_end = self._pos  # the tensor table starts here
        self.architecture = self.metadata.get("general.architecture")
        if not isinstance(self.architecture, str):
            raise ValueError(f"{self.path}: metadata 'general.architecture' is missing or not a string")
        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(self.alignment, bool) or not isinstance(self.alignment, int) or self.alignment <= 0 or (
                self.alignment & (self.alignment - 1)):
            raise ValueError(f"{self.path}: metadata 'general.alignment' is {self.alignment!r}, not a power of two")
        table = [self._tensor_entry() for _ in range(n_tensors)]
        self.data_start = -(-self._pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ttype, rel in table:
            if name in self.tensors:
                raise ValueError(f"{self.path}: tensor {name!r} appears twice in the tensor table")
            if rel % self.alignment:
                raise ValueError(f"{self.path}: tensor {name!r} starts at data offset {rel}, not a multiple of the "
                                 f"file's alignment {self.alignment}")
            info = TensorInfo(name, shape, ttype, self.data_start + rel, nbytes_of(ttype, shape))
            if info.nbytes is not None and info.offset + info.nbytes > self.size:
                raise ValueError(f"{self.path}: tensor {name!r} ({info.type_name}, shape {list(shape)}) needs bytes "
                                 f"{info.offset}..{info.offset + info.nbytes} but the file has {self.size}: "
                                 "the file is truncated")
            self.tensors[name] = info
        # As ggml's reader checks: each tensor's bytes end before the next one's begin. A type changed
        # in the table (so the bytes no longer fit the shape) shows here.
        placed = sorted((i for i in self.tensors.values() if i.nbytes is not None), key=lambda i: i.offset)
        for info, after in zip(placed, placed[1:]):
            if info.offset + info.nbytes > after.offset:
                raise ValueError(f"{self.path}: tensor {info.name!r} as {info.type_name} of shape {list(info.shape)} "
                                 f"takes {info.nbytes} bytes, but tensor {after.name!r} starts "
                                 f"{after.offset - info.offset} bytes after it: its type does not fit its shape")

    # ---- reading the header ------------------------------------------------------------------
    def _need(self, n: int, what: str) -> int:
        if n < 0 or self._pos + n > self.size:
            raise ValueError(f"{self.path}: the file ends inside {what} (byte {self._pos}, {n} bytes needed, "
                             f"{self.size} in the file): it is truncated or damaged")
        start = self._pos
        self._pos += n
        return start

    def _unpack(self, fmt: str, n: int, what: str):
        return struct.unpack_from(fmt, self._data, self._need(n, what))[0]

    def _string(self, what: str) -> str:
        length = self._unpack("<Q", 8, what)
        start = self._need(length, what)
        try:
            return bytes(self._data[start:start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}: {what} at byte {start} is not UTF-8") from None

    def _value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype], struct.calcsize(_SCALARS[vtype]), f"metadata {key!r}")
        if vtype == STRING:
            return self._string(f"metadata {key!r}")
        if vtype == ARRAY:
            etype = self._unpack("<I", 4, f"metadata {key!r}")
            count = self._unpack("<Q", 8, f"metadata {key!r}")
            if etype in _NUMPY:
                itemsize = np.dtype(_NUMPY[etype]).itemsize
                start = self._need(count * itemsize, f"metadata array {key!r} ({count} items)")
                return np.frombuffer(self._data, _NUMPY[etype], count, start).tolist()
            if etype == STRING:
                if count * 8 > self.size:
                    raise ValueError(f"{self.path}: metadata array {key!r} claims {count} strings")
                for _ in range(count):  # walked for its length: transformers reads the strings itself
                    self._need(self._unpack("<Q", 8, f"metadata array {key!r}"), f"metadata array {key!r}")
                return StringArray(count)
            raise ValueError(f"{self.path}: metadata array {key!r} holds values of type {etype}, which GGUF does "
                             "not define here")
        raise ValueError(f"{self.path}: metadata {key!r} has value type {vtype}, which GGUF does not define")

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string("a tensor name")
        n_dims = self._unpack("<I", 4, f"tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
        dims = struct.unpack_from(f"<{n_dims}Q", self._data, self._need(8 * n_dims, f"tensor {name!r}"))
        ttype = self._unpack("<I", 4, f"tensor {name!r}")
        offset = self._unpack("<Q", 8, f"tensor {name!r}")
        shape = tuple(reversed(dims))  # ggml lists the fastest-moving dimension first
        block = block_shape(ttype)
        if block is not None and shape[-1] % block[0]:
            raise ValueError(f"{self.path}: tensor {name!r} is {type_name(ttype)} with rows of {shape[-1]} values, "
                             f"not a multiple of its block of {block[0]}")
        if ttype == I2_S and int(np.prod(shape)) % 128:
            raise ValueError(f"{self.path}: tensor {name!r} is I2_S with {int(np.prod(shape))} values, not a "
                             "multiple of its block of 128")
        return name, shape, ttype, offset

    # ---- tensor data -----------------------------------------------------------------------------
    def raw(self, info: TensorInfo, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start..stop of the tensor's bytes, [rows, bytes per row]
        (flat, and the whole tensor, for I2_S, whose scale follows the codes
        of the whole tensor). Read from the file into a new buffer rather
        than through the map, so that the pages read are not counted in
        this process's memory while the rest of the model loads."""
        if info.nbytes is None:
            raise ValueError(f"{self.path}: tensor {info.name!r} is stored as {info.type_name}, a type neither "
                             "ulbtorch nor gguf-py reads")
        rows = int(np.prod(info.shape[:-1]))
        if info.type == I2_S:
            first, n = info.offset, info.nbytes
        else:
            stop = rows if stop is None else stop
            row_bytes = info.nbytes // rows if rows else 0
            first, n = info.offset + start * row_bytes, (stop - start) * row_bytes
        buf = np.empty(n, np.uint8)
        with open(self.path, "rb") as fh:
            fh.seek(first)
            if fh.readinto(memoryview(buf)) != n:
                raise ValueError(f"{self.path}: tensor {info.name!r}: the file ended while it was read")
        return buf if info.type == I2_S else buf.reshape(-1, row_bytes) if n else buf.reshape(0, 0)

    def metadata_copy(self, path: str) -> None:
        """Write a GGUF holding this file's metadata, byte for byte, and its
        tensor table with every tensor an empty F32 one: what transformers'
        own GGUF config and tokenizer loading read (names and metadata
        only), without the tensor types its reader may not know (I2_S)."""
        with open(path, "wb") as f:
            f.write(MAGIC + struct.pack("<IQQ", self.version, len(self.tensors), len(self.metadata)))
            f.write(self._data[24:self.metadata_end].tobytes())
            for name in self.tensors:
                encoded = name.encode("utf-8")
                f.write(struct.pack("<Q", len(encoded)) + encoded + struct.pack("<IQIQ", 1, 0, 0, 0))
            f.write(b"\0" * (-f.tell() % self.alignment))
