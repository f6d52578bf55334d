"""Write docs/api.md from the public packages' ``__all__`` (``--check``: exit 1 if the file
is not what this would write). Each public object is documented once, under the first package
that exports it, so every name a user imports from a public package has its entry."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: The public packages and modules, in reading order, with their section titles.
SECTIONS = [
    ("embodied_bus", "The bus"),
    ("embodied_bus.streams", "Streams"),
    ("embodied_bus.model", "Samples, headers and the wire format"),
    ("embodied_bus.engines", "Engines and bus URLs"),
    ("embodied_bus.fusion", "Fused perception"),
    ("embodied_bus.actions", "Actions"),
    ("embodied_bus.state", "Latest-value state"),
    ("embodied_bus.uplink", "Fleet uplink"),
    ("embodied_bus.security", "Security"),
    ("embodied_bus.replay", "Recordings"),
    ("embodied_bus.rosmsg", "ROS messages without ROS"),
    ("embodied_bus.ros.config", "ROS 2: the robot YAML"),
    ("embodied_bus.ros.rmw_bridge", "ROS 2: the rclpy-free bridge"),
    ("embodied_bus.ros.message_filters", "ROS 2: message_filters on fused frames"),
    ("embodied_bus.sim", "Simulated sensors"),
    ("embodied_bus.viz", "Pictures and the live view"),
]

HEAD = """# API reference

Generated from the docstrings by `scripts/api_reference.py`: every name in the `__all__` of a
public package below, documented once under the first package that exports it. Import them
from the package named in each heading.
"""


def public_names(module: str) -> list[str]:
    """The public names of ``module`` (its ``__all__``, dunders left out)."""
    mod = importlib.import_module(module)
    return [n for n in getattr(mod, "__all__", []) if not n.startswith("__")]


def render() -> str:
    seen: set[int] = set()
    out = [HEAD]
    for module, title in SECTIONS:
        mod = importlib.import_module(module)
        entries = []
        for name in public_names(module):
            obj = getattr(mod, name)
            key = id(obj)
            if key in seen and not isinstance(obj, (int, float, str, bool, tuple)):
                continue
            seen.add(key)
            entries.append(f"::: {module}.{name}\n    options:\n      heading_level: 3\n")
        if entries:
            out.append(f"## {title}\n\n`{module}`\n\n" + "\n".join(entries))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is out of date")
    args = ap.parse_args()
    text = render()
    path = ROOT / "docs" / "api.md"
    if args.check:
        if path.read_text() != text:
            print("docs/api.md is out of date: run python scripts/api_reference.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
