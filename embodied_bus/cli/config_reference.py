"""The configuration reference (``docs/config-reference.md``), generated from the typed documents
the loaders check: every key of the robot YAML, the fusion spec and the stage YAML with its type,
default and meaning (from the document's ``Attributes:``), and every bus URL option.

``python -m embodied_bus.cli.config_reference > docs/config-reference.md`` writes it; a test
checks that the file is current and that no key lacks a meaning.
"""

from __future__ import annotations

import enum
import inspect as pyinspect
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
from msgspec import inspect

from embodied_bus.engines.urls import COMMON_URL_OPTIONS, PULSAR_URL_OPTIONS, ZENOH_URL_OPTIONS, UrlOption
from embodied_bus.fusion.spec import SpecDocument, StreamDocument
from embodied_bus.fusion.stages import STAGE_DOCUMENTS, StageDocument
from embodied_bus.ros import config as robot
from embodied_bus.ros.discovery import DiscoverDocument
from embodied_bus.uplink.config import RouteDocument, UplinkDocument

__all__ = ["Section", "UndocumentedKey", "markdown", "section_rows"]


class UndocumentedKey(Exception):
    """A document field has no line in its class's ``Attributes:``."""


@dataclass(frozen=True, slots=True)
class Section:
    """The keys of one document, each shown as ``prefix + name`` (but those in ``omit``)."""

    prefix: str
    document: type[msgspec.Struct]
    omit: tuple[str, ...] = ()
    #: Shown after each key, e.g. which op takes it.
    note: str = ""


ROBOT = (
    Section("", robot.RobotDocument),
    Section("ros.", robot.RosDocument),
    Section("streams.<stream>.", robot.TopicDocument, omit=("stream",)),
    Section("publish.", robot.PublishDocument),
    Section("publish.streams[].", robot.TopicDocument),
    Section("publish.frames[].", robot.FramesDocument),
    Section("actions.", robot.ActionsDocument),
    Section("actions.routes.<kind>., actions.offer.<kind>.", robot.RouteDocument),
    Section("clock.", robot.ClockDocument),
    Section("security.", robot.SecurityDocument),
    Section("discover.", DiscoverDocument),
    Section("uplink.", UplinkDocument),
    Section("uplink.streams.<stream>.", RouteDocument),
)
FUSION = (Section("", SpecDocument), Section("streams.<name>.", StreamDocument))
STAGES = (
    Section("stages[].", StageDocument),
    *(Section("stages[].", doc, note=f" (op `{op}`)") for op, doc in STAGE_DOCUMENTS.items()),
)


def attributes(document: type) -> dict[str, str]:
    """The ``Attributes:`` of a class docstring: field name → its text, joined on one line."""
    doc = pyinspect.getdoc(document) or ""
    _, found, body = doc.partition("Attributes:\n")
    out: dict[str, str] = {}
    name = ""
    for line in body.splitlines() if found else []:
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            name = m.group(1)
            out[name] = m.group(2).strip()
        elif line.startswith("        ") and name:
            out[name] += " " + line.strip()
        elif line.strip():
            break  # the next docstring section
    return out


def _type_name(t: inspect.Type) -> str:
    if isinstance(t, inspect.Metadata):
        return _type_name(t.type)
    if isinstance(t, inspect.UnionType):
        names = [_type_name(x) for x in t.types if not isinstance(x, inspect.NoneType)]
        return " or ".join(names)
    if isinstance(t, inspect.ListType):
        item = _type_name(t.item_type)
        return f"list of {item}s" if item in ("text", "number", "mapping") else f"list of {item}"
    if isinstance(t, inspect.DictType):
        return "mapping"
    if isinstance(t, inspect.EnumType):
        return " \\| ".join(f"`{m.value}`" for m in t.cls)
    simple = {
        inspect.StrType: "text",
        inspect.IntType: "integer",
        inspect.FloatType: "number",
        inspect.BoolType: "boolean",
        inspect.AnyType: "mapping",
    }
    return next((name for cls, name in simple.items() if isinstance(t, cls)), type(t).__name__)


def _default(field: inspect.Field) -> str:
    if field.required:
        return "required"
    factory = field.default_factory
    value = factory() if factory is not msgspec.NODEFAULT else field.default
    if value is None:
        return "none"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value == "":
        return '`""`'
    if isinstance(value, list):
        return f"`[{', '.join(map(str, value))}]`"
    return f"`{value}`"


def section_rows(section: Section) -> Iterable[str]:
    meanings = attributes(section.document)
    info = inspect.type_info(section.document)
    assert isinstance(info, inspect.StructType)
    for field in info.fields:
        if field.name in section.omit:
            continue
        meaning = meanings.get(field.name)
        if not meaning:
            raise UndocumentedKey(f"{section.document.__name__}.{field.name} has no Attributes: line")
        keys = ", ".join(f"`{p.strip()}{field.name}`" for p in section.prefix.split(", ")) + section.note
        meaning = meaning.replace("``", "`").replace("|", "\\|")
        yield f"| {keys} | {_type_name(field.type)} | {_default(field)} | {meaning} |"


def _table(sections: Iterable[Section]) -> list[str]:
    lines = ["| Key | Type | Default | Meaning |", "|---|---|---|---|"]
    for section in sections:
        lines += section_rows(section)
    return [*lines, ""]


def _options(options: Iterable[UrlOption]) -> list[str]:
    lines = ["| Option | Default | Meaning |", "|---|---|---|"]
    lines += [f"| `{o.name}` | {f'`{o.default}`' if o.default else 'none'} | {o.meaning} |" for o in options]
    return [*lines, ""]


def markdown() -> str:
    """The whole reference page, as Markdown."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the documents the loaders check",
        "(`python -m embodied_bus.cli.config_reference > docs/config-reference.md`): a key that is",
        "not here is refused, naming it. [Configuration](configuration.md) shows them at work.",
        "",
        "## Robot YAML",
        "",
        "`config/robot.yaml`: the launch files, the rclpy nodes, `ros-bridge` and `replay --config`.",
        "",
        *_table(ROBOT),
        "## Fusion spec",
        "",
        "The value under `fusion:` (of the robot YAML, or a file such as `config/fusion.yaml`).",
        "",
        *_table(FUSION),
        "## Stage YAML",
        "",
        "`embodied-bus stage --config` and `fuse --stages` (`config/stages.yaml`): each entry takes",
        "the keys of `stages[]` and those of its op.",
        "",
        *_table(STAGES),
        "## Bus URL options",
        "",
        "Every URL (`zenoh:…`, `pulsar://…`, `pulsar+ssl://…`):",
        "",
        *_options(COMMON_URL_OPTIONS),
        "`zenoh:` URLs:",
        "",
        *_options(ZENOH_URL_OPTIONS),
        "`pulsar://` and `pulsar+ssl://` URLs:",
        "",
        *_options(PULSAR_URL_OPTIONS),
    ]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
