"""Payload encodings that embodied_bus understands natively.

The encoding string travels in the header. Known forms:

* ``raw`` — opaque bytes.
* ``npy`` — a NumPy ``.npy`` blob (format 1.0 to 3.0); decoded as a zero-copy view.
* ``cdr:<ros type>`` — ROS 2 CDR, e.g. ``cdr:sensor_msgs/msg/PointCloud2``.
* ``jpeg``, ``png`` — compressed images.
* ``json`` — UTF-8 JSON.
"""

from __future__ import annotations

import ast
import struct
from typing import Any

import numpy as np

from embodied_bus.errors import EncodingError

__all__ = ["ENCODING_NPY", "ENCODING_RAW", "decode_npy", "encode_npy"]

ENCODING_RAW = "raw"
ENCODING_NPY = "npy"

_NPY_MAGIC = b"\x93NUMPY"


def encode_npy(array: np.ndarray[Any, Any]) -> bytearray:
    """Encode an array as a ``.npy`` blob with a single copy of its data.

    Args:
        array: Any NumPy array without Python objects.

    Returns:
        A bytearray holding the ``.npy`` header followed by the array's bytes.
    """
    if array.dtype.hasobject:
        raise EncodingError("npy encoding does not carry arrays of Python objects")
    fortran = array.flags.f_contiguous and not array.flags.c_contiguous
    descr = np.lib.format.dtype_to_descr(array.dtype)
    header = repr({"descr": descr, "fortran_order": fortran, "shape": array.shape}).encode("latin1")
    # Pad so that data starts on a 64-byte boundary (as numpy does).
    pre = len(_NPY_MAGIC) + 2 + 2
    pad = 64 - (pre + len(header) + 1) % 64
    header = header + b" " * pad + b"\n"
    out = bytearray(pre + len(header) + array.nbytes)
    out[0:6] = _NPY_MAGIC
    out[6:8] = b"\x01\x00"
    out[8:10] = struct.pack("<H", len(header))
    out[10 : 10 + len(header)] = header
    body = memoryview(out)[10 + len(header) :]
    if array.nbytes:
        src = array if (array.flags.c_contiguous or fortran) else np.ascontiguousarray(array)
        np.frombuffer(body, dtype=np.uint8)[:] = src.reshape(-1, order="A").view(np.uint8)
    return out


def decode_npy(buffer: bytes | bytearray | memoryview) -> np.ndarray[Any, Any]:
    """Decode a ``.npy`` blob into an array that views ``buffer`` (no copy).

    Raises:
        EncodingError: The blob is not a valid ``.npy`` payload; the message says why.
    """
    mv = memoryview(buffer)
    if mv[:6].tobytes() != _NPY_MAGIC or len(mv) < 10:
        raise EncodingError("npy payload lacks the \\x93NUMPY magic")
    major = mv[6]
    if major == 1:
        (hlen,) = struct.unpack_from("<H", mv, 8)
        start = 10
    elif major in (2, 3):
        if len(mv) < 12:
            raise EncodingError("npy payload truncated in its header")
        (hlen,) = struct.unpack_from("<I", mv, 8)
        start = 12
    else:
        raise EncodingError(f"unsupported npy format version {major}")
    if start + hlen > len(mv):
        raise EncodingError("npy header runs past the end of the payload")
    try:
        text = mv[start : start + hlen].tobytes().decode("utf8" if major == 3 else "latin1")
        meta = ast.literal_eval(text)
        dtype = np.lib.format.descr_to_dtype(meta["descr"])
        shape = tuple(int(x) for x in meta["shape"])
        fortran = bool(meta["fortran_order"])
    except (ValueError, SyntaxError, KeyError, TypeError) as err:
        raise EncodingError(f"npy header is malformed: {err}") from err
    if any(d < 0 for d in shape):
        raise EncodingError(f"npy shape {shape} has negative dimensions")
    if dtype.hasobject:
        raise EncodingError("npy payload with Python objects is refused")
    count = int(np.prod(shape, dtype=np.int64))
    offset = start + hlen
    if offset + count * dtype.itemsize != len(mv):
        raise EncodingError(
            f"npy payload size mismatch: {len(mv) - offset} data bytes for shape {shape} "
            f"of {dtype} ({count * dtype.itemsize} bytes)"
        )
    flat = np.frombuffer(mv, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran else "C")
