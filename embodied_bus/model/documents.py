"""Typed configuration documents: YAML mappings checked against msgspec structs, with errors
that name the key (``robot.yaml: fusion.streams.imu.pick: ...``)."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

__all__ = ["convert_document"]

T = TypeVar("T")

_AT = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`$")
_WORDS = {
    "object": "a mapping",
    "array": "a list",
    "float": "a number",
    "int": "an integer",
    "bool": "true or false",
}
_GOT = {**_WORDS, "bool": "a boolean"}


def _known(cls: type[Any]) -> list[str]:
    return sorted(getattr(cls, "__struct_fields__", ()))


def _choices(cls: type[Any], field: str) -> list[str]:
    """The values of an enum-typed field of ``cls`` (empty if it is not one)."""
    for f in msgspec.structs.fields(cls):
        if f.name == field and isinstance(f.type, type) and issubclass(f.type, enum.Enum):
            return [str(m.value) for m in f.type]
    return []


def _message(raw: str, where: str, cls: type[Any]) -> str:
    """A msgspec validation message, worded for a configuration file with the key named."""
    at = _AT.match(raw)
    msg, path = (at["msg"], at["path"]) if at else (raw, "")
    key = where + path
    if m := _UNKNOWN.match(msg):
        return f"{key}: unknown key {m['field']!r}; known: {_known(cls)}"
    if m := _MISSING.match(msg):
        return f"{key}.{m['field']}: missing"
    if m := _EXPECTED.match(msg):
        want = " or ".join(_WORDS.get(w.strip(), w.strip()) for w in m["want"].split("|"))
        return f"{key}: expected {want}, got {_GOT.get(m['got'], m['got'])}"
    if msg.startswith("Invalid enum value") and path.startswith("."):
        choices = _choices(cls, path.rsplit(".", 1)[-1])
        if choices:
            return f"{key}: {msg[len('Invalid enum value ') :]} is not one of {', '.join(choices)}"
    return f"{key}: {msg[:1].lower()}{msg[1:]}"


def convert_document(doc: Any, cls: type[T], where: str, error: Callable[[str], Exception]) -> T:
    """``doc`` (a parsed YAML mapping) as a ``cls`` struct.

    Args:
        doc: The parsed document (or part of one).
        cls: A ``msgspec.Struct`` with ``forbid_unknown_fields=True``; nested mappings whose keys
            are names (streams, routes) are better typed ``dict[str, Any]`` and converted one
            by one, so that errors name the entry.
        where: Where ``doc`` is, e.g. ``robot.yaml: fusion``; prefixed to every error.
        error: The error type to raise.

    Raises:
        Exception: ``error`` naming the key that is unknown, missing or of the wrong type.
    """
    try:
        return msgspec.convert(doc, cls)
    except msgspec.ValidationError as err:
        raise error(_message(str(err), where, cls)) from None
