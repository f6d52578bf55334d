"""The ament_python package metadata: package.xml, setup.py data files, console scripts."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from catkin_pkg.package import parse_package
from package_setup import setup_kwargs

ROOT = Path(__file__).resolve().parents[2]


def test_package_xml_is_format_3_with_the_ros_dependencies() -> None:
    pkg = parse_package(str(ROOT / "package.xml"))
    pkg.validate()
    assert pkg.package_format == 3 and pkg.name == "embodied_bus"
    execs = {d.name for d in pkg.exec_depends}
    assert {"rclpy", "sensor_msgs", "std_msgs", "launch", "launch_ros", "ament_index_python"} <= execs
    assert any(d.name.startswith("ament_") for d in pkg.test_depends)
    assert pkg.get_build_type() == "ament_python"


def test_setup_installs_the_ament_marker_launch_and_config_files() -> None:
    kw = setup_kwargs()
    files = {dest: list(srcs) for dest, srcs in kw["data_files"]}  # type: ignore[union-attr]
    assert files["share/ament_index/resource_index/packages"] == ["resource/embodied_bus"]
    assert "package.xml" in files["share/embodied_bus"]
    assert files["share/embodied_bus/launch"] and all(
        (ROOT / f).exists() for f in files["share/embodied_bus/launch"]
    )
    assert "config/fusion.yaml" in files["share/embodied_bus/config"]
    scripts = kw["entry_points"]["console_scripts"]  # type: ignore[index]
    assert any(s.startswith("embodied-bus = ") for s in scripts)
    assert (ROOT / "setup.cfg").read_text().count("$base/lib/embodied_bus") == 2
    assert (ROOT / "embodied_bus" / "py.typed").exists()


def test_launch_files_parse_and_only_run_existing_commands() -> None:
    scripts = {s.split("=")[0].strip() for s in setup_kwargs()["entry_points"]["console_scripts"]}  # type: ignore[index]
    for path in (ROOT / "launch").glob("*.launch.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert "generate_launch_description" in names, path
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg in ("cmd", "executable"):
                first = node.value.elts[0] if isinstance(node.value, ast.List) else node.value
                assert isinstance(first, ast.Constant) and first.value in scripts, (path, first)
    assert sys.version_info >= (3, 10)


def test_every_subcommand_of_the_command_line_is_in_the_readme() -> None:
    import argparse

    from embodied_bus.cli.main import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in sorted(sub.choices) if f"embodied-bus {name}" not in readme]
    assert not missing, f"subcommands the README does not show: {missing}"


def test_the_readmes_streams_example_runs_as_shown() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Streams in 20 lines")
    code = readme[readme.index("```python\n", start) + len("```python\n") : readme.index("```\n", start + 20)]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, counters = out.stdout.splitlines()[-2:]
    assert first.startswith("1 ") and first.endswith("lidar_top (100000,)"), first
    assert "'received': 1," in counters and "'gaps': 0," in counters, counters


def test_the_readmes_actions_example_runs_as_shown() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Actions in 20 lines")
    begin = readme.index("```python\n", start) + len("```python\n")
    code = readme[begin : readme.index("```\n", begin)]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "{'picked': 'cup'}", out.stdout


def test_the_readme_is_a_front_door_of_at_most_12_kb() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024


#: Files that may reach beside the repository: the interoperability tests with ros-z
#: (``../shared/ros-z``), which skip with a reason where it is absent.
#: The harnesses of the ROS 2 interoperability tests: they find ros-z and the ROS 2 Jazzy
#: wheels beside the repository (and the tests skip, saying why, where those are absent).
ROS_INTEROP = frozenset({"test/support/ros_z.py", "embodied_bus/testing/ros2.py"})


def test_nothing_but_the_ros_2_interoperability_harnesses_reaches_outside_the_repository() -> None:
    """A clone with nothing beside it tests itself: the data the tests and benchmarks read ships
    in the repository (``test/data``, ``data``)."""
    import re

    outside = re.compile(r"\.\./shared|ROOT\.parent|EMBODIED_BUS_RECORDINGS|[\"']shared[\"']\s*/")
    found = []
    for folder in ("test", "bench", "scripts", ".ci", "embodied_bus", "launch"):
        for path in sorted((ROOT / folder).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if not path.is_file() or path.suffix not in ("", ".py", ".sh") or rel in ROS_INTEROP:
                continue
            if rel.startswith("test/data/") or rel == "test/package/test_package.py":
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if outside.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "reaches outside the repository:\n" + "\n".join(found)
    assert (ROOT / "test" / "data" / "recordings" / "MANIFEST.md").exists()


def test_headers_are_constructed_by_keyword_everywhere_but_the_bulk_decoder() -> None:
    """Twelve fields are too many to get right by position (a swapped stamp and bucket type-check)."""
    positional = []
    for folder in ("embodied_bus", "test", "bench", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "Header"
                    and node.args
                ):
                    positional.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not positional, positional


def test_the_command_line_reference_is_generated_from_the_parsers() -> None:
    from embodied_bus.cli.reference import markdown

    assert (ROOT / "docs" / "cli.md").read_text() == markdown(), (
        "docs/cli.md is stale: python -m embodied_bus.cli.reference > docs/cli.md"
    )


def test_the_configuration_reference_is_generated_from_the_documents_the_loaders_check() -> None:
    """Every key the loaders take has a line (type, default, meaning) and the page is current;
    the tables cover every document class of the loaders."""
    import msgspec
    import pytest

    from embodied_bus.cli import config_reference as ref
    from embodied_bus.fusion import spec, stages
    from embodied_bus.ros import config, discovery

    assert (ROOT / "docs" / "config-reference.md").read_text() == ref.markdown(), (
        "docs/config-reference.md is stale: "
        "python -m embodied_bus.cli.config_reference > docs/config-reference.md"
    )
    covered = {s.document for s in (*ref.ROBOT, *ref.FUSION, *ref.STAGES)}
    documents = {
        cls
        for module in (config, discovery, spec, stages)
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and cls.__name__.endswith("Document")
    }
    assert documents <= covered, f"documents missing from the reference: {documents - covered}"

    class Half(msgspec.Struct):
        """A document.

        Attributes:
            said: Documented.
        """

        said: int
        unsaid: int

    with pytest.raises(ref.UndocumentedKey, match=r"Half\.unsaid"):
        list(ref.section_rows(ref.Section("", Half)))


def test_the_api_reference_documents_every_public_name() -> None:
    """docs/api.md is what scripts/api_reference.py writes, and every name of a public
    package's ``__all__`` (among them LiveView, open_queue, decode_frame, frame_arrays, the
    security helpers, PermanentFailure, RecordingError, FusionWorker) has its entry there."""
    import importlib
    import re

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "api_reference.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    api = (ROOT / "docs" / "api.md").read_text()
    documented = {(m, n) for m, n in re.findall(r"^::: ([\w.]+)\.(\w+)$", api, re.M)}
    objects = {id(getattr(importlib.import_module(m), n)) for m, n in documented}
    sections = re.findall(r"^`(embodied_bus[\w.]*)`$", api, re.M)
    for module in sections:
        mod = importlib.import_module(module)
        for name in (n for n in mod.__all__ if not n.startswith("__")):
            assert (module, name) in documented or id(getattr(mod, name)) in objects, f"{module}.{name}"
    named = ["LiveView", "open_queue", "decode_frame", "frame_arrays", "PermanentFailure", "RecordingError"]
    for name in [*named, "FusionWorker", "Signer", "Sealer", "WatchedAllowList"]:
        assert re.search(rf"^::: [\w.]+\.{name}$", api, re.M), name
