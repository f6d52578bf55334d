"""Single-pass ROS 1 → ROS 2 CDR conversion for the common message shapes.

rosbags' :meth:`Typestore.ros1_to_cdr` walks a message twice (size, then copy) through one
generated function per nested type. For types made of primitives, strings, fixed arrays and
sequences of primitives (Imu, Odometry, NavSatFix, TF, ...) this module flattens the whole type
once into straight-line code that copies runs of equally aligned primitives in one slice. The
output is byte-identical to rosbags' (the replay reader checks that on the first message of
each topic and keeps rosbags for anything else); types with sequences of messages or strings
(PointCloud2, ...) are not compiled and stay with rosbags.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

__all__ = ["Ros1ToCdr", "compile_ros1_to_cdr"]

#: A compiled converter: ROS 1 bytes in, little-endian CDR (with its 4-byte header) out.
Ros1ToCdr = Callable[[Any], bytes]

#: CDR size and alignment of the primitive types this module handles.
_SIZES = {
    "bool": 1,
    "byte": 1,
    "char": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
}

# rosbags' Nodetype values (rosbags.interfaces.Nodetype), compared by value
_BASE, _NAME, _ARRAY, _SEQUENCE = 1, 2, 3, 4


class _Unsupported(Exception):
    pass


def _flatten(store: Any, typename: str, ops: list[tuple[Any, ...]], depth: int = 0) -> None:
    if depth > 32:
        raise _Unsupported("nesting too deep")
    if typename == "std_msgs/msg/Header":
        ops.append(("skip", 4))  # ROS 1 Header.seq has no ROS 2 counterpart
    for name, desc in store.fielddefs[typename][1]:
        if name == "structure_needs_at_least_one_member":
            ops.append(("zero",))
            continue
        kind = int(desc[0])
        if kind == _NAME:
            _flatten(store, desc[1], ops, depth + 1)
        elif kind == _BASE:
            base = desc[1][0]
            if base == "string":
                ops.append(("string",))
            elif base in _SIZES:
                ops.append(("fixed", _SIZES[base], _SIZES[base]))
            else:
                raise _Unsupported(base)
        elif kind == _ARRAY:
            sub, length = desc[1]
            if int(sub[0]) == _BASE and sub[1][0] in _SIZES:
                size = _SIZES[sub[1][0]]
                if length:
                    ops.append(("fixed", size, size * length))
            elif int(sub[0]) == _BASE and sub[1][0] == "string":
                ops.extend([("string",)] * length)
            elif int(sub[0]) == _NAME:
                for _ in range(length):
                    _flatten(store, sub[1], ops, depth + 1)
            else:
                raise _Unsupported(str(sub))
        elif kind == _SEQUENCE:
            sub = desc[1][0]
            if int(sub[0]) == _BASE and sub[1][0] in _SIZES:
                ops.append(("seq", _SIZES[sub[1][0]]))
            else:
                raise _Unsupported(str(sub))
        else:
            raise _Unsupported(str(desc))


def _merge(ops: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Join consecutive fixed runs of one alignment into one copy."""
    out: list[tuple[Any, ...]] = []
    for op in ops:
        if op[0] == "fixed" and out and out[-1][0] == "fixed" and out[-1][1] == op[1]:
            out[-1] = ("fixed", op[1], out[-1][2] + op[2])
        else:
            out.append(op)
    return out


def _pad(align: int) -> str:
    # CDR aligns relative to the end of the 4-byte encapsulation header
    return f"    out += Z[:(4 - len(out)) & {align - 1}]" if align > 1 else ""


def _source(ops: list[tuple[Any, ...]]) -> str:
    lines = ["def convert(inp):", "    out = bytearray(HEAD)", "    ipos = 0"]
    for op in ops:
        if op[0] == "skip":
            lines.append(f"    ipos += {op[1]}")
        elif op[0] == "zero":
            lines.append("    out += Z[:1]")
        elif op[0] == "fixed":
            _, align, n = op
            lines += [_pad(align), f"    out += inp[ipos:ipos + {n}]", f"    ipos += {n}"]
        elif op[0] == "string":
            lines += [
                _pad(4),
                "    n = U32(inp, ipos)[0]",
                "    out += P32(n + 1)",
                "    ipos += 4",
                "    out += inp[ipos:ipos + n]",
                "    out += Z[:1]",
                "    ipos += n",
            ]
        else:  # seq
            size = op[1]
            lines += [_pad(4), "    n = U32(inp, ipos)[0]", "    out += P32(n)", "    ipos += 4"]
            if size > 1:
                lines += ["    if n:", "    " + _pad(size)]
            lines += [f"    out += inp[ipos:ipos + n * {size}]", f"    ipos += n * {size}"]
    lines += [
        "    if ipos != len(inp):",
        "        raise ValueError(f'ROS 1 message is {len(inp)} bytes, its type needs {ipos}')",
        "    return bytes(out)",
    ]
    return "\n".join(line for line in lines if line)


def compile_ros1_to_cdr(store: Any, typename: str) -> Ros1ToCdr | None:
    """Compile a single-pass converter for ``typename`` (ROS 2 name) of a rosbags typestore.

    Returns:
        The converter, or None if the type has a shape this module leaves to rosbags. The
        converter raises ``ValueError`` or ``struct.error`` on truncated or oversized input.
    """
    ops: list[tuple[Any, ...]] = []
    try:
        _flatten(store, typename, ops)
    except (_Unsupported, KeyError):
        return None
    namespace: dict[str, Any] = {
        "HEAD": b"\x00\x01\x00\x00",
        "Z": bytes(8),
        "U32": struct.Struct("<I").unpack_from,
        "P32": struct.Struct("<I").pack,
    }
    exec(compile(_source(_merge(ops)), f"<ros1_to_cdr {typename}>", "exec"), namespace)
    converter: Ros1ToCdr = namespace["convert"]
    return converter
