"""``embodied-bus keys``: keys of planners, executors and the queue service, and the allow-list.

embodied-bus keys init keys/ --executors arm,gripper         # every key of a robot, its allow-list
embodied-bus keys generate ops-planner                      # ops-planner.pem (0600) + ops-planner.pub
embodied-bus keys allow ops-planner.pub --kinds navigate_to,dock --allow-list allow.yaml
embodied-bus keys allow arm-left.pub --role executor --allow-list allow.yaml
embodied-bus keys allow queue.pub --role queue --allow-list allow.yaml
embodied-bus keys rotate ops-planner --allow-list allow.yaml --grace 300
embodied-bus keys revoke KEY_ID --allow-list allow.yaml
embodied-bus keys list --allow-list allow.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from embodied_bus.cli.common import fmt_table
from embodied_bus.security import (
    AllowedKey,
    AllowList,
    KeyFileError,
    Role,
    generate_private_key,
    key_id,
    load_allow_list,
    load_private_key,
    load_public_key,
    public_key_b64,
    save_allow_list,
    save_private_key,
)

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "keys", help="keys of planners, executors and the queue: generate, allow, rotate, revoke, list"
    )
    ks = p.add_subparsers(dest="keys_command", metavar="KEYS_COMMAND", required=True)

    i = ks.add_parser(
        "init",
        help="a robot's keys (queue, planner, executors, bridge) and allow-list in DIR; prints the "
        "robot YAML section and the flags that turn sealing on everywhere",
    )
    i.add_argument("dir", metavar="DIR")
    i.add_argument(
        "--executors",
        default="executor",
        help="comma-separated executor names, a key each (default: executor)",
    )
    i.add_argument("--planner", default="planner", help="name of the planner key (default: planner)")
    i.add_argument("--kinds", default="*", help="action kinds the planner may sign (default: '*')")
    i.add_argument(
        "--bridge-node",
        default="embodied_bus_bridge",
        help="ROS node name of the bridge whose executor runs routed kinds (default: embodied_bus_bridge)",
    )
    i.set_defaults(func=run_init)

    g = ks.add_parser("generate", help="new Ed25519 key: NAME.pem (private, 0600) and NAME.pub")
    g.add_argument("name")
    g.add_argument("--dir", default=".", help="where to write the files (default: .)")
    g.set_defaults(func=run_generate)

    a = ks.add_parser("allow", help="allow a public key (NAME.pub or base64) a role")
    a.add_argument("public_key", help="a .pub file or the base64 key")
    a.add_argument(
        "--role",
        action="append",
        choices=[r.value for r in Role],
        default=None,
        help="what the key may do (repeatable; default planner)",
    )
    a.add_argument("--kinds", default=None, help="planner: comma-separated action kinds it may sign, or '*'")
    a.add_argument(
        "--executors",
        default=None,
        help="executor: comma-separated executor names it may act as (default: NAME)",
    )
    a.add_argument("--name", default=None, help="label in the allow-list (default: file stem)")
    a.add_argument("--allow-list", required=True, metavar="ALLOW.yaml")
    a.set_defaults(func=run_allow)

    r = ks.add_parser("rotate", help="replace NAME.pem with a new key; the old one stays valid --grace s")
    r.add_argument("name")
    r.add_argument("--dir", default=".")
    r.add_argument("--allow-list", required=True, metavar="ALLOW.yaml")
    r.add_argument("--grace", type=float, default=300.0, help="seconds the old key is still accepted")
    r.set_defaults(func=run_rotate)

    v = ks.add_parser("revoke", help="remove a key (by key id or label) from the allow-list")
    v.add_argument("key")
    v.add_argument("--allow-list", required=True, metavar="ALLOW.yaml")
    v.set_defaults(func=run_revoke)

    ls = ks.add_parser("list", help="show the allow-list")
    ls.add_argument("--allow-list", required=True, metavar="ALLOW.yaml")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=run_list)


def _allow(path: str) -> AllowList:
    return load_allow_list(path) if Path(path).exists() else AllowList()


async def run_init(args: argparse.Namespace) -> int:
    folder = Path(args.dir).resolve()
    executors = _split(args.executors)
    if not executors:
        raise KeyFileError("--executors: name at least one executor")
    # the bridges' executor runs routed kinds as ros-<node> (ros-bridge) or ros-action_bridge
    bridge = ("bridge", Role.EXECUTOR, (f"ros-{args.bridge_node}", "ros-action_bridge"))
    parties = [("queue", Role.QUEUE, ()), (args.planner, Role.PLANNER, ()), bridge]
    parties += [(name, Role.EXECUTOR, (name,)) for name in executors]
    names = [name for name, *_ in parties]
    if len(set(names)) != len(names):
        raise KeyFileError(f"key names must differ: {', '.join(names)}")
    taken = [str(folder / f) for n in names for f in (f"{n}.pem", f"{n}.pub")] + [str(folder / "allow.yaml")]
    if any(Path(t).exists() for t in taken):
        raise KeyFileError(f"{folder} already holds keys or an allow-list; choose an empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, role, acts_as in parties:
        key = generate_private_key()
        save_private_key(key, folder / f"{name}.pem")
        (folder / f"{name}.pub").write_text(public_key_b64(key) + "\n")
        kinds = _split(args.kinds) if role is Role.PLANNER else []
        entries.append(
            AllowedKey(name, public_key_b64(key), frozenset(kinds), 0, frozenset({role}), frozenset(acts_as))
        )
    save_allow_list(AllowList(entries), folder / "allow.yaml")
    print(secure_setup_text(folder, args.planner, executors))
    return 0


def secure_setup_text(folder: Path, planner: str, executors: list[str]) -> str:
    """What to give each process to run sealed with the keys of ``folder``."""
    allow = folder / "allow.yaml"
    trust = f"--trust {allow}"
    plan = folder / f"{planner}.pem"
    lines = [
        f"keys and allow-list written to {folder} (private keys 0600: copy each only to its process)",
        "",
        "# robot YAML (ros2 launch, ros-bridge, action_bridge): queue, bridges and their planner sealed",
        "security:",
        f"  allow_list: {allow}",
        f"  queue_key: {folder / 'queue.pem'}",
        f"  planner_key: {plan}",
        f"  executor_key: {folder / 'bridge.pem'}",
        "",
        "# processes started by hand",
        f"embodied-bus queue ... --seal {folder / 'queue.pem'} {trust}",
        *(
            f"embodied-bus executor ... --name {n} --seal {folder / (n + '.pem')} {trust} --allow {allow}"
            for n in executors
        ),
        f"embodied-bus send ... --sign {plan} --seal {plan} {trust}",
        "# Python: Planner(bus, signer=Signer(key),",
        f"#     backend=ZenohQueueOptions(Sealer(key), Trust(WatchedAllowList('{allow}'))))",
    ]
    return "\n".join(lines)


async def run_generate(args: argparse.Namespace) -> int:
    key = generate_private_key()
    pem = save_private_key(key, Path(args.dir) / f"{args.name}.pem")
    (Path(args.dir) / f"{args.name}.pub").write_text(public_key_b64(key) + "\n")
    print(json.dumps({"name": args.name, "key_id": key_id(key), "private_key": str(pem),
                      "public_key": public_key_b64(key)}))  # fmt: skip
    return 0


async def run_allow(args: argparse.Namespace) -> int:
    src = Path(args.public_key)
    b64 = src.read_text().strip() if src.exists() else args.public_key
    load_public_key(b64)
    roles = frozenset(Role(r) for r in (args.role or [Role.PLANNER.value]))
    kinds = _split(args.kinds)
    if Role.PLANNER in roles and not kinds:
        raise KeyFileError("--kinds: a planner key needs at least one action kind (or '*')")
    name = args.name or (src.stem if src.exists() else key_id(load_public_key(b64)))
    entry = AllowedKey(name, b64, frozenset(kinds), 0, roles, frozenset(_split(args.executors)))
    save_allow_list(_allow(args.allow_list).add(entry), args.allow_list)
    what = ", ".join(sorted(r.value for r in roles)) + (
        f" sending {', '.join(sorted(kinds))}" if kinds else ""
    )
    print(f"allowed {name} ({key_id(load_public_key(b64))}): {what}")
    return 0


def _split(text: str | None) -> list[str]:
    return [k.strip() for k in (text or "").split(",") if k.strip()]


async def run_rotate(args: argparse.Namespace) -> int:
    pem = Path(args.dir) / f"{args.name}.pem"
    old = load_private_key(pem)
    old_b64 = public_key_b64(old)
    allow = _allow(args.allow_list)
    entry = next((k for k in allow.keys if k.public_key == old_b64), None)
    if entry is None:
        raise KeyFileError(f"the key in {pem} is not in {args.allow_list}; allow it before rotating")
    new = generate_private_key()
    pem.rename(pem.with_name(f"{args.name}.{key_id(old)}.pem.retired"))
    save_private_key(new, pem)
    (Path(args.dir) / f"{args.name}.pub").write_text(public_key_b64(new) + "\n")
    not_after = time.time_ns() + int(args.grace * 1e9)
    keys = [
        dataclasses.replace(k, name=f"{k.name}@{key_id(old)}", not_after_ns=not_after) if k is entry else k
        for k in allow.keys
    ]
    keys.append(dataclasses.replace(entry, public_key=public_key_b64(new), not_after_ns=0))
    save_allow_list(AllowList(keys), args.allow_list)
    print(
        f"rotated {args.name}: new key {key_id(new)}; "
        f"old key {key_id(old)} accepted for {args.grace:g} s more"
    )
    return 0


async def run_revoke(args: argparse.Namespace) -> int:
    allow = _allow(args.allow_list)
    keep = [k for k in allow.keys if args.key not in (k.key_id, k.name)]
    if len(keep) == len(allow.keys):
        raise KeyFileError(f"no key {args.key!r} in {args.allow_list}")
    save_allow_list(AllowList(keep), args.allow_list)
    print(f"revoked {args.key}")
    return 0


async def run_list(args: argparse.Namespace) -> int:
    rows = [
        {"name": k.name, "key_id": k.key_id, "roles": ",".join(sorted(r.value for r in k.roles)),
         "kinds": ",".join(sorted(k.kinds)), "executors": ",".join(sorted(k.executors)) or None,
         "not_after_ns": k.not_after_ns or None}
        for k in load_allow_list(args.allow_list).keys
    ]  # fmt: skip
    print(
        json.dumps(rows, indent=2)
        if args.json
        else fmt_table(rows, ["name", "key_id", "roles", "kinds", "executors", "not_after_ns"])
    )
    return 0
