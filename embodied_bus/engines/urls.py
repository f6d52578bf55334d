"""Bus URLs: which engine to use and how to reach it.

Zenoh (embedded, the default)::

    zenoh:                                   embedded peer, multicast scouting off
    zenoh://10.0.0.2:7447                    peer that connects to a router at that address
    zenoh:?listen=tcp/0.0.0.0:7447           peer that also listens
    zenoh:?mode=router&listen=tcp/0.0.0.0:7447   host the router inside this process
    zenoh:?mode=client&connect=tcp/10.0.0.2:7447 client of a router
    zenoh:?scouting=multicast                enable multicast scouting (LAN discovery)
    zenoh:?shm=0                             shared memory off (on by default, for large payloads)
    zenoh:?shm_pool=64MiB                    shared-memory pool for large messages (default 32 MiB)
    zenoh:?config=/etc/zenoh/robot.json5     start from a Zenoh config file (TLS, access control...)
    zenoh:?listen=tls/0.0.0.0:7447&tls_ca=ca.pem&tls_cert=robot.pem&tls_key=robot.key&mtls=1
                                             TLS endpoints; mtls=1 requires client certificates

Apache Pulsar (a cluster)::

    pulsar://broker:6650?tenant=public&pulsar_namespace=default
    pulsar://broker1:6650,broker2:6650       several brokers of one cluster (tried in turn)
    pulsar+ssl://broker:6651?tls_ca=/path/ca.pem&token_file=/path/token

Every URL accepts ``ns=<robot namespace>`` and ``timeout=<seconds>`` (connect timeout).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import SplitResult, parse_qs, urlsplit

from embodied_bus.errors import BusConfigError

__all__ = [
    "COMMON_URL_OPTIONS",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_NAMESPACE",
    "DEFAULT_SHM_POOL_BYTES",
    "DEFAULT_URL",
    "PULSAR_URL_OPTIONS",
    "ZENOH_URL_OPTIONS",
    "PulsarSettings",
    "UrlOption",
    "ZenohSettings",
    "parse_bus_url",
    "validate_namespace",
    "with_connect",
]

#: The URL used when none is given: an embedded Zenoh peer.
DEFAULT_URL = "zenoh:"
#: Default robot namespace.
DEFAULT_NAMESPACE = "default"
#: Default time to reach a router or broker, in seconds.
DEFAULT_CONNECT_TIMEOUT_S = 5.0
#: Shared-memory pool a Zenoh session uses for large messages to peers on the same host, in
#: bytes (Zenoh's own default is 16 MiB: two 8 MiB clouds in flight; large clouds move
#: faster with room for four). Lives in ``/dev/shm``: containers need room there
#: (Docker's default is 64 MiB; ``--shm-size`` or ``--ipc=host``).
DEFAULT_SHM_POOL_BYTES = 32 * 1024 * 1024

_NS_RE = re.compile(r"^[A-Za-z0-9_\-]+$")
_ZENOH_MODES = ("peer", "client", "router")


def validate_namespace(namespace: str) -> str:
    """Return ``namespace`` if valid (letters, digits, ``_``, ``-``), else raise BusConfigError."""
    if not isinstance(namespace, str) or not _NS_RE.match(namespace):
        raise BusConfigError(f"invalid namespace {namespace!r}: use letters, digits, '_' or '-' only")
    return namespace


def _loopback(endpoint: str) -> bool:
    """Whether a Zenoh endpoint (``tcp/127.0.0.1:7447``, ``tcp/[::1]:7447``,
    ``tcp/localhost:7447``) is on the loopback interface."""
    address = endpoint.split("/", 1)[-1].split("#", 1)[0]
    host = address.rsplit(":", 1)[0].strip("[]").lower()
    return host == "localhost" or host == "::1" or host.startswith("127.")


@dataclass(frozen=True, slots=True)
class ZenohSettings:
    """How to open the Zenoh session.

    Attributes:
        mode: ``peer`` (default), ``client`` or ``router`` (host a router in this process).
        listen: Endpoints to listen on, e.g. ``tcp/0.0.0.0:7447``. Empty: engine default.
        connect: Endpoints (routers or peers) to connect to. With endpoints given, opening the
            bus fails if none is reachable within ``connect_timeout_s``.
        multicast_scouting: Enable multicast scouting (off by default: robots on a shared LAN
            should not discover each other by accident).
        shm: Shared-memory transport on or off (None: engine default, on); off also keeps
            publishers from writing large payloads into their own pools.
        shm_pool_bytes: Size of the shared-memory pool Zenoh moves large messages to same-host
            peers through, in bytes. None: :data:`DEFAULT_SHM_POOL_BYTES`, unless
            ``config_file`` sets one; 0: Zenoh's own default.
        config_file: A Zenoh JSON5 config file applied first (TLS, access control, ...).
        tls_ca: CA certificate (PEM) that peer and router certificates must chain to.
        tls_cert: This session's certificate (PEM), for its TLS listeners and, with mTLS, for
            the connections it opens.
        tls_key: The private key of ``tls_cert``.
        mtls: Require and present client certificates (mutual TLS).
        connect_timeout_s: Seconds to reach the endpoints in ``connect``.
        namespace: Robot namespace; streams live under ``eb/<namespace>/``.
    """

    mode: str = "peer"
    listen: tuple[str, ...] = ()
    connect: tuple[str, ...] = ()
    multicast_scouting: bool = False
    shm: bool | None = None
    shm_pool_bytes: int | None = None
    config_file: str | None = None
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    namespace: str = DEFAULT_NAMESPACE
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    mtls: bool = False

    @property
    def scheme(self) -> str:
        """The URL scheme, which picks the engine (see :mod:`embodied_bus.engines.registry`)."""
        return "zenoh"

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise BusConfigError("zenoh TLS: give tls_cert and tls_key together")
        if self.mtls and (self.tls_cert is None or self.tls_ca is None):
            raise BusConfigError("zenoh mtls=1 needs tls_ca, tls_cert and tls_key")
        if self.mode not in _ZENOH_MODES:
            raise BusConfigError(f"zenoh mode must be one of {_ZENOH_MODES}, got {self.mode!r}")
        if self.mode == "client" and not self.connect:
            raise BusConfigError("zenoh mode=client needs connect=<endpoint> (a router to use)")
        pool = self.shm_pool_bytes
        if pool is not None and (not isinstance(pool, int) or pool < 0):
            raise BusConfigError(f"zenoh shm_pool_bytes must be a byte count >= 0, not {pool!r}")
        validate_namespace(self.namespace)

    @property
    def reaches_other_processes(self) -> bool:
        """False for an isolated embedded peer: no endpoint, no listener, no multicast scouting
        and no config file, so no other process can ever meet it."""
        return bool(
            self.mode != "peer" or self.listen or self.connect or self.multicast_scouting or self.config_file
        )

    @property
    def reaches_other_hosts(self) -> bool:
        """Whether processes on other hosts may reach this session: multicast scouting, a
        config file, or an endpoint that is not loopback."""
        if self.multicast_scouting or self.config_file:
            return True
        return any(not _loopback(endpoint) for endpoint in (*self.listen, *self.connect))

    @property
    def needs_queue_service(self) -> bool:
        """Actions on Zenoh go through a durable queue service process (``embodied-bus queue``)."""
        return True


@dataclass(frozen=True, slots=True)
class PulsarSettings:
    """How to reach an Apache Pulsar cluster.

    Attributes:
        service_url: ``pulsar://host:port[,host:port...]`` or ``pulsar+ssl://...``.
        tenant: Pulsar tenant of the bus topics.
        pulsar_namespace: Pulsar namespace of the bus topics.
        tls_trust_certs_file: CA bundle for ``pulsar+ssl``.
        tls_allow_insecure: Accept any broker certificate (testing only).
        token: Authentication token (JWT) if the cluster requires one.
        listener: The brokers' advertised listener whose addresses this client uses (clients
            outside the cluster's network, e.g. robots on a cellular link).
        connect_timeout_s: Seconds to reach the broker before failing.
        namespace: Robot namespace; topics are named ``eb.<namespace>.<stream>``.
    """

    service_url: str
    tenant: str = "public"
    pulsar_namespace: str = "default"
    tls_trust_certs_file: str | None = None
    tls_allow_insecure: bool = False
    token: str | None = None
    listener: str | None = None
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    namespace: str = DEFAULT_NAMESPACE
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        """The URL scheme (``pulsar`` or ``pulsar+ssl``), which picks the engine."""
        return self.service_url.split("://", 1)[0].lower()

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        for key, value in (("tenant", self.tenant), ("pulsar_namespace", self.pulsar_namespace)):
            if not _NS_RE.match(value):
                raise BusConfigError(f"invalid Pulsar {key} {value!r}")

    @property
    def reaches_other_processes(self) -> bool:
        """Always: every client of the cluster meets the others there."""
        return True

    @property
    def needs_queue_service(self) -> bool:
        """No: planners and executors use the cluster's topics directly."""
        return False


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _flag(key: str, value: str) -> bool:
    v = value.lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise BusConfigError(f"URL option {key}={value!r} is not a boolean (use 1/0, true/false)")


_SIZE_RE = re.compile(r"^(\d+)\s*(|k|kib|m|mib|g|gib)$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
_SIZE_UNITS |= {"g": 1 << 30, "gib": 1 << 30}


def _size(key: str, value: str) -> int:
    m = _SIZE_RE.match(value.strip())
    if m is None:
        raise BusConfigError(f"URL option {key}={value!r} is not a size (bytes, or e.g. 32MiB)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


def _read_token(path: str | None) -> str | None:
    if not path:
        return None
    try:
        token = open(path, encoding="utf-8").read().strip()  # noqa: SIM115
    except OSError as err:
        raise BusConfigError(f"cannot read Pulsar token file {path!r}: {err}") from err
    if not token:
        raise BusConfigError(f"Pulsar token file {path!r} is empty")
    return token


def _split_list(values: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    for v in values:
        out.extend(x for x in v.split(",") if x)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _ParsedUrl:
    """A bus URL split up, with the options every engine takes already read."""

    url: str
    parts: SplitResult
    #: Every value of each option, in order.
    query: dict[str, list[str]]
    #: The last value of each engine option (``ns`` and ``timeout`` taken out).
    options: dict[str, str]
    namespace: str
    connect_timeout_s: float

    def check_known(self, engine: str, known: set[str]) -> None:
        unknown = set(self.options) - known
        if unknown:
            every = sorted(known | {o.name for o in COMMON_URL_OPTIONS})
            raise BusConfigError(f"unknown {engine} URL option(s) {sorted(unknown)}; known: {every}")


def _parse(url: str, namespace: str | None, connect_timeout_s: float | None) -> _ParsedUrl:
    if not isinstance(url, str) or not url:
        raise BusConfigError(f"bus URL must be a non-empty string, got {url!r}")
    parts = urlsplit(url)
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as err:
        raise BusConfigError(f"malformed query in bus URL {url!r}: {err}") from err
    last = {k: v[-1] for k, v in query.items()}
    ns = last.pop("ns", DEFAULT_NAMESPACE)
    timeout = last.pop("timeout", None)
    try:
        timeout_s = (
            connect_timeout_s
            if connect_timeout_s is not None
            else float(timeout or DEFAULT_CONNECT_TIMEOUT_S)
        )
    except ValueError as err:
        raise BusConfigError(f"URL option timeout must be a number of seconds: {err}") from err
    if timeout_s <= 0:
        raise BusConfigError(f"connect timeout must be positive, got {timeout_s}")
    return _ParsedUrl(url, parts, query, last, namespace if namespace is not None else ns, timeout_s)


@dataclass(frozen=True, slots=True)
class UrlOption:
    """One query option of a bus URL (``?name=value``), as the configuration reference lists it."""

    name: str
    meaning: str
    default: str = ""


#: Options of every bus URL.
COMMON_URL_OPTIONS = (
    UrlOption("ns", "Robot namespace (a command's `--ns` wins)", DEFAULT_NAMESPACE),
    UrlOption("timeout", "Seconds to reach the router, peers or broker", f"{DEFAULT_CONNECT_TIMEOUT_S:g}"),
)
#: Options of ``zenoh:`` URLs.
ZENOH_URL_OPTIONS = (
    UrlOption("mode", "`peer`, `client` (of a router) or `router` (host one in this process)", "peer"),
    UrlOption("listen", "Endpoints to listen on, comma-separated or repeated (`tcp/0.0.0.0:7447`)"),
    UrlOption("connect", "Endpoints to connect to (`zenoh://host:port` adds one)"),
    UrlOption("scouting", "`off` or `multicast` (LAN discovery)", "off"),
    UrlOption("shm", "Shared memory for large payloads to processes on the same host, `1` or `0`", "1"),
    UrlOption(
        "shm_pool", "The shared-memory pool (bytes, or e.g. `64MiB`; `0`: Zenoh's own default)", "32MiB"
    ),
    UrlOption("config", "A Zenoh JSON5 config file applied first (access control, anything else)"),
    UrlOption("tls_ca", "CA certificate (PEM) that peer and router certificates must chain to"),
    UrlOption("tls_cert", "This session's certificate (PEM); with `tls_key`"),
    UrlOption("tls_key", "The private key of `tls_cert`"),
    UrlOption("mtls", "Require and present client certificates (mutual TLS), `1` or `0`", "0"),
)
#: Options of ``pulsar://`` and ``pulsar+ssl://`` URLs.
PULSAR_URL_OPTIONS = (
    UrlOption("tenant", "Pulsar tenant of the bus topics", "public"),
    UrlOption("pulsar_namespace", "Pulsar namespace of the bus topics", "default"),
    UrlOption("tls_ca", "CA bundle for `pulsar+ssl`"),
    UrlOption("tls_allow_insecure", "Accept any broker certificate (testing only), `1` or `0`", "0"),
    UrlOption("token", "Authentication token (JWT), inline"),
    UrlOption("token_file", "A file holding the token"),
    UrlOption(
        "listener",
        "The brokers' advertised listener to use (`advertisedListeners`), for clients outside the "
        "cluster's network",
    ),
)
_ZENOH_OPTIONS = {o.name for o in ZENOH_URL_OPTIONS}
_PULSAR_OPTIONS = {o.name for o in PULSAR_URL_OPTIONS}


def _zenoh_settings(u: _ParsedUrl) -> ZenohSettings:
    connect = list(_split_list(u.query.get("connect", [])))
    if u.parts.hostname:
        connect.insert(0, f"tcp/{u.parts.hostname}:{u.parts.port or 7447}")
    u.check_known("zenoh", _ZENOH_OPTIONS)
    opt = u.options
    scouting = opt.get("scouting", "off").lower()
    if scouting not in ("off", "multicast"):
        raise BusConfigError(f"URL option scouting must be 'off' or 'multicast', got {scouting!r}")
    return ZenohSettings(
        mode=opt.get("mode", "peer"),
        listen=_split_list(u.query.get("listen", [])),
        connect=tuple(connect),
        multicast_scouting=scouting == "multicast",
        shm=_flag("shm", opt["shm"]) if "shm" in opt else None,
        shm_pool_bytes=_size("shm_pool", opt["shm_pool"]) if "shm_pool" in opt else None,
        config_file=opt.get("config") or None,
        connect_timeout_s=u.connect_timeout_s,
        namespace=u.namespace,
        tls_ca=opt.get("tls_ca") or None,
        tls_cert=opt.get("tls_cert") or None,
        tls_key=opt.get("tls_key") or None,
        mtls=_flag("mtls", opt.get("mtls", "0")),
    )


def _pulsar_hosts(u: _ParsedUrl, scheme: str) -> str:
    """``host:port[,host:port...]`` of a Pulsar URL (several brokers of one cluster: the client
    tries them in turn), each with the scheme's default port where it has none."""
    default_port = 6651 if scheme == "pulsar+ssl" else 6650
    hosts = []
    for item in u.parts.netloc.rpartition("@")[2].split(","):
        item = item.strip()
        if item.startswith("["):  # an IPv6 address
            end = item.find("]") + 1
            host, port = item[:end], item[end + 1 :] if item[end : end + 1] == ":" else ""
        else:
            host, _, port = item.partition(":")
        if not host:
            raise BusConfigError(f"Pulsar URL {u.url!r} needs a host, e.g. pulsar://localhost:6650")
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise BusConfigError(f"bad port {port!r} in bus URL {u.url!r}")
        hosts.append(f"{host}:{port or default_port}")
    return ",".join(hosts)


def _pulsar_settings(u: _ParsedUrl) -> PulsarSettings:
    scheme = u.parts.scheme.lower()
    hosts = _pulsar_hosts(u, scheme)
    u.check_known("pulsar", _PULSAR_OPTIONS)
    opt = u.options
    return PulsarSettings(
        service_url=f"{scheme}://{hosts}",
        tenant=opt.get("tenant", "public"),
        pulsar_namespace=opt.get("pulsar_namespace", "default"),
        tls_trust_certs_file=opt.get("tls_ca") or None,
        tls_allow_insecure=_flag("tls_allow_insecure", opt.get("tls_allow_insecure", "0")),
        token=opt.get("token") or _read_token(opt.get("token_file")),
        listener=opt.get("listener") or None,
        connect_timeout_s=u.connect_timeout_s,
        namespace=u.namespace,
    )


#: Settings builder of each URL scheme.
_SCHEMES: dict[str, Callable[[_ParsedUrl], ZenohSettings | PulsarSettings]] = {
    "zenoh": _zenoh_settings,
    "pulsar": _pulsar_settings,
    "pulsar+ssl": _pulsar_settings,
}


def parse_bus_url(
    url: str, *, namespace: str | None = None, connect_timeout_s: float | None = None
) -> ZenohSettings | PulsarSettings:
    """Parse a bus URL into engine settings.

    Args:
        url: See the module docstring for the forms.
        namespace: Robot namespace; overrides ``ns=`` in the URL.
        connect_timeout_s: Overrides ``timeout=`` in the URL.

    Raises:
        BusConfigError: Unknown scheme or option, or an invalid value; the message names it.
    """
    parsed = _parse(url, namespace, connect_timeout_s)
    build = _SCHEMES.get(parsed.parts.scheme.lower())
    if build is None:
        raise BusConfigError(
            f"unknown bus URL scheme {parsed.parts.scheme!r} in {url!r}; use zenoh:, pulsar:// or pulsar+ssl://"
        )
    return build(parsed)


def with_connect(url: str, endpoints: tuple[str, ...] | list[str]) -> str:
    """``url`` with ``connect=`` endpoints added (e.g. the robot's router for an isolated peer)."""
    if not endpoints:
        return url
    sep = "&" if urlsplit(url).query else ("" if url.endswith("?") else "?")
    return f"{url}{sep}connect={','.join(endpoints)}"
