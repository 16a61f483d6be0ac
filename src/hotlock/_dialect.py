"""The server's dialect: which server it is, and what extend and release send to it.

Detected once at connect, below the backend line (docs/architecture.md): connect() asks the
backend for INFO and ``COMMAND INFO DELIFEQ DELEX``, ``detect`` decides, and the backend
keeps the answer and builds its extend/release commands from it. ``Cache`` never asks.

Where the server compares and sets, or compares and deletes, without Lua, extend and
release need no script (the acquire of a free key needs none anywhere: hotlock._acquire):

    extend   SET key value IFEQ value PX ms     Valkey >= 8.1, Redis >= 8.4   reply OK / nil
    release  DELIFEQ key value                  Valkey >= 9.0                 reply 1 / 0
             DELEX key IFEQ value               Redis >= 8.4 (Valkey >= 9.2)  reply 1 / 0

``value`` is the lock's whole stored value (its token), the same bytes the
EXTEND/RELEASE scripts compare, so both paths act on exactly the same locks. SET IFEQ
rewrites the value with itself and sets the new TTL from now, as the script's PEXPIRE does;
on a missing key it writes nothing (nil), as the script returns 0.

One server difference the backends hide: at maxmemory under ``noeviction`` the server
refuses SET (it may grow a key) with OOM but runs the EXTEND script (its PEXPIRE never
grows memory). So a Lua-free extend refused OOM is sent again as the script, at once (an
extend that runs twice only sets the same TTL from now again): a full server still lets
holders keep their locks, on every path. DELIFEQ/DELEX free memory and are never refused.

Keys held with a concurrency limit are hashes of permits, which no Lua-free command
reaches: a permit's extend and release always go by script (``by_script``). A plain lock's
Lua-free extend or release that meets such a hash (its key expired and was since taken
with a limit) is refused WRONGTYPE, and goes again by script too, which says "not held".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from ._ident import TOKEN_BYTES
from ._scripts import PERMIT_MARK

__all__ = [
    "COMMAND_PROBE",
    "MEMORY",
    "NODE_PROBE",
    "SCRIPTS_POLICIES",
    "UNDETECTED",
    "ClusterDialect",
    "Dialect",
    "by_script",
    "check_fences",
    "check_scripts",
    "commands_from",
    "detect",
    "extend_command",
    "info_fields",
    "kind_and_version",
    "lacks_command",
    "node_dialect",
    "probe_needed",
    "release_command",
    "script_serves",
]

# connect(scripts=...): "auto" sends the Lua-free commands where the server has them;
# "always" keeps every call on the scripts (for comparison, and as an escape hatch).
SCRIPTS_POLICIES = ("auto", "always")

# Asked once at connect; the reply lists, in this order, each command's info or nil.
COMMAND_PROBE: tuple[bytes, ...] = (b"COMMAND", b"INFO", b"DELIFEQ", b"DELEX")

# What a cluster asks each primary, in one round trip, to decide that node's dialect.
NODE_PROBE: tuple[tuple[bytes, ...], ...] = ((b"INFO", b"server"), COMMAND_PROBE)

# The release commands a Dialect can name, and "script" for EVALSHA of _scripts.RELEASE.
_RELEASES = ("script", "DELIFEQ", "DELEX")

_FORCED = "connect(scripts='always')"


@dataclass(frozen=True)
class Dialect:
    """What connect() found: the server's kind and version, and what release sends
    (extend sends SET IFEQ exactly when release is not the script)."""

    kind: str  # "redis", "valkey", "unknown" (INFO refused), or "memory"
    version: str | None
    release: str  # "script", "DELIFEQ" or "DELEX"
    reason: str  # why this path: shown in the connect log line and in server_info
    # connect(fences=False): every lock's fence is 0, and a free key is taken by SET NX PX
    # alone (the clock that makes the fence is not read). The client's choice, as scripts= is.
    fenced: bool = True

    def __post_init__(self) -> None:
        assert self.release in _RELEASES, self.release

    @property
    def lua_free(self) -> bool:
        return self.release != "script"

    @property
    def transaction(self) -> bool:
        """Whether the acquire of a free key goes as hotlock._acquire's transaction (MULTI,
        SET NX PX, TIME, EXEC: every server has them) rather than the ACQUIRE script:
        everywhere but under connect(scripts='always') and in-process."""
        return not self.forced and self.kind != "memory"

    @property
    def acquire(self) -> str:
        """What the acquire of a free key sends (hotlock._acquire): every other case, and
        every acquire under connect(scripts='always') or in-process, is the script."""
        if not self.transaction:
            return "script"
        return "SET NX in MULTI" if self.fenced else "SET NX"

    @property
    def forced(self) -> bool:
        """Whether connect(scripts='always') chose the scripts (a cluster then keeps every
        node on them, whatever each node has)."""
        return self.reason == _FORCED

    def mapping(self) -> Mapping[str, object]:
        """cache.server_info: a read-only mapping."""
        return MappingProxyType(
            {
                "kind": self.kind,
                "version": self.version,
                "lua_free": self.lua_free,
                # The acquire of a free key (hotlock._acquire); every other case by script.
                "acquire": self.acquire,
                "fences": self.fenced,
                "extend": "SET IFEQ" if self.lua_free else "script",
                "release": "DELEX IFEQ" if self.release == "DELEX" else self.release,
                # Keys held with a limit are hashes of permits: every call on them is a
                # script, Lua-free server or not.
                "limits": "script",
                "reason": self.reason,
            }
        )

    def describe(self) -> str:
        """For the connect log line: 'Valkey 9.1.2, Lua-free extend/release (SET IFEQ, DELIFEQ)'."""
        name = {"redis": "Redis", "valkey": "Valkey"}.get(self.kind, "server")
        server = f"{name} {self.version}" if self.version else name
        fences = "" if self.fenced else ", no fences (fences=False)"
        if self.lua_free:
            release = "DELEX IFEQ" if self.release == "DELEX" else self.release
            return f"{server}, Lua-free extend/release (SET IFEQ, {release}){fences}"
        return f"{server}, extend/release by script ({self.reason}){fences}"


@dataclass(frozen=True)
class ClusterDialect(Dialect):
    """A cluster's dialect: each primary has its own (``nodes``, by "host:port"), and the
    Dialect fields sum them up. ``mixed``: the primaries differ (a rolling upgrade), and
    extend/release are "per node"."""

    nodes: Mapping[str, Dialect] = field(default_factory=dict)
    mixed: bool = False

    def mapping(self) -> Mapping[str, object]:
        fields = dict(super().mapping())
        if self.mixed:
            fields["extend"] = fields["release"] = "per node"
        fields["nodes"] = MappingProxyType({where: d.describe() for where, d in self.nodes.items()})
        return MappingProxyType(fields)

    @property
    def acquire(self) -> str:
        # A cluster's router sends one form: the transaction, fences on or off (a lock's
        # fence is 0 all the same).
        return "SET NX in MULTI" if self.transaction else "script"

    def describe(self) -> str:
        if not self.mixed:
            return super().describe()
        name = {"redis": "Redis", "valkey": "Valkey"}.get(self.kind, "server")
        server = f"{name} {self.version}" if self.version else name
        return f"{server}, extend/release per node ({self.reason})"

    @classmethod
    def of(cls, connected: Dialect, nodes: Mapping[str, Dialect]) -> ClusterDialect:
        """The summary of ``nodes``, named after ``connected`` (the first primary's INFO)."""
        releases = {d.release for d in nodes.values()}
        kind, version = connected.kind, connected.version
        if len(releases) == 1:
            (release,) = releases
            reason = next(iter(nodes.values())).reason
            return cls(kind, version, release, reason, connected.fenced, MappingProxyType(dict(nodes)))
        if not nodes:
            return cls(kind, version, "script", connected.reason, connected.fenced)
        free = sum(d.lua_free for d in nodes.values())
        reason = f"{free} of {len(nodes)} primaries Lua-free"
        return cls(kind, version, "script", reason, connected.fenced, MappingProxyType(dict(nodes)), mixed=True)


MEMORY = Dialect("memory", None, "script", "in-process: no server")
# A backend's dialect before connect() has detected the server: the scripts work anywhere.
UNDETECTED = Dialect("unknown", None, "script", "not detected")


class Detected:
    """What a backend speaks, as connect() detected it and told it once (use_dialect): its
    ``dialect``, the scripts until then (UNDETECTED), and connect(fences=...). The base of
    the redis-py backends, sync and async."""

    dialect: Dialect = UNDETECTED
    fenced = True

    def use_dialect(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self.fenced = dialect.fenced


def check_fences(fences: object) -> bool:
    """connect()'s ``fences`` argument, checked before any I/O."""
    if not isinstance(fences, bool):
        raise TypeError(f"fences must be a bool, not {type(fences).__name__}")
    return fences


def check_scripts(scripts: object) -> str:
    """connect()'s ``scripts`` argument, checked before any I/O."""
    if not isinstance(scripts, str):
        raise TypeError(
            f"scripts must be a str ({' or '.join(map(repr, SCRIPTS_POLICIES))}), not {type(scripts).__name__}"
        )
    if scripts not in SCRIPTS_POLICIES:
        raise ValueError(f"scripts must be one of {', '.join(map(repr, SCRIPTS_POLICIES))}, not {scripts!r}")
    return scripts


def _version(text: str | None) -> tuple[int, ...]:
    parts: list[int] = []
    for part in (text or "").split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def kind_and_version(info: Mapping[str, str] | None) -> tuple[str, str | None]:
    """From INFO: Valkey names itself (server_name:valkey, valkey_version:9.1.2) and reports
    a frozen redis_version (7.2.4) for old clients; Redis has only redis_version."""
    if info is None:
        return "unknown", None
    if "valkey_version" in info or info.get("server_name") == "valkey":
        return "valkey", info.get("valkey_version") or info.get("redis_version")
    if "redis_version" in info:
        return "redis", info["redis_version"]
    return "unknown", None


def detect(
    info: Mapping[str, str] | None, commands: Mapping[str, bool] | None, scripts: str, fences: bool = True
) -> Dialect:
    """The dialect of a server from its INFO (None: refused by the ACL) and which of
    DELIFEQ and DELEX ``COMMAND INFO`` says it has (None: COMMAND refused, or not asked),
    with connect()'s ``scripts`` and ``fences``."""
    dialect = _server_dialect(info, commands, scripts)
    return dialect if fences else replace(dialect, fenced=False)


def _server_dialect(info: Mapping[str, str] | None, commands: Mapping[str, bool] | None, scripts: str) -> Dialect:
    """detect()'s server part.

    Lua-free only for a server known by INFO, so an unknown server that happens to have a
    DELEX of its own is never sent SET IFEQ on a guess. With COMMAND refused, the version
    decides: Valkey 9.0 brought DELIFEQ (SET IFEQ came in 8.1), Redis 8.4 DELEX and SET IFEQ.
    """
    kind, version = kind_and_version(info)
    if scripts == "always":
        return Dialect(kind, version, "script", _FORCED)
    if kind == "unknown":
        return Dialect(kind, version, "script", "INFO refused: the server's kind is unknown")
    v = _version(version)
    if kind == "valkey":
        has = commands["DELIFEQ"] if commands is not None else v >= (9, 0)
        if has and v >= (8, 1):
            how = "COMMAND INFO" if commands is not None else "the version (COMMAND refused)"
            return Dialect(kind, version, "DELIFEQ", f"DELIFEQ and SET IFEQ, from {how}")
        if commands is not None and v >= (9, 0):
            # A Valkey 9 without it: the command renamed away (rename-command), or a build without it.
            return Dialect(kind, version, "script", "no DELIFEQ, from COMMAND INFO")
        return Dialect(kind, version, "script", "no DELIFEQ before Valkey 9.0")
    has = commands["DELEX"] if commands is not None else v >= (8, 4)
    if has and v >= (8, 4):
        how = "COMMAND INFO" if commands is not None else "the version (COMMAND refused)"
        return Dialect(kind, version, "DELEX", f"DELEX IFEQ and SET IFEQ, from {how}")
    return Dialect(kind, version, "script", "no DELEX or SET IFEQ before Redis 8.4")


def probe_needed(info: Mapping[str, str] | None, scripts: str) -> bool:
    """Whether COMMAND INFO can change the answer (saves the round trip where it cannot)."""
    kind, version = kind_and_version(info)
    v = _version(version)
    return scripts == "auto" and ((kind == "valkey" and v >= (8, 1)) or (kind == "redis" and v >= (8, 4)))


def commands_from(reply: object) -> dict[str, bool] | None:
    """COMMAND INFO DELIFEQ DELEX's reply (a list: each command's info, or nil when the
    server has no such command) as {"DELIFEQ": bool, "DELEX": bool}; None if malformed."""
    if not isinstance(reply, list) or len(reply) != 2:
        return None
    return {"DELIFEQ": bool(reply[0]), "DELEX": bool(reply[1])}


def info_fields(reply: object) -> dict[str, str]:
    """INFO's text as {field: value}."""
    text = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)
    fields = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, sep, value = line.partition(":")
            if sep:
                fields[name] = value
    return fields


def node_dialect(info_reply: object, command_reply: object, scripts: str, error: type[BaseException]) -> Dialect:
    """One cluster node's dialect from its replies to NODE_PROBE: an ``error`` instance
    for INFO means refused (the kind is unknown), for COMMAND INFO that the version decides."""
    info = None if isinstance(info_reply, error) else info_fields(info_reply)
    commands = None if isinstance(command_reply, error) else commands_from(command_reply)
    return detect(info, commands if probe_needed(info, scripts) else None, scripts)


def lacks_command(error: str) -> bool:
    """Whether a Lua-free extend or release refused with this error text says the node
    does not have the command (any more): DELIFEQ or DELEX unknown, or SET without IFEQ
    (a syntax error). The node was downgraded, or its configuration renamed the command
    away, in place: the call goes by script, and so does every later one on that node.
    redis-py takes the ERR code off the text, so it is optional here."""
    text = error.removeprefix("ERR ").lower()
    return text.startswith(("unknown command", "syntax error"))


def by_script(values: Iterable[bytes]) -> bool:
    """Whether extend or release of these held values must go by script on every path: a
    permit's (token '#' fence), a field of a hash, which SET IFEQ and DELIFEQ/DELEX cannot
    reach. (A bare token meets a hash only when its permit's acquire reply never came: the
    Lua-free command is refused WRONGTYPE, and the script serves, as script_serves says.)"""
    return any(v[TOKEN_BYTES : TOKEN_BYTES + 1] == PERMIT_MARK for v in values)


def script_serves(error: str) -> bool:
    """Whether a Lua-free extend or release refused with this error text is to go again by
    script: OOM (a full server refuses SET, not the script's PEXPIRE) and WRONGTYPE (the
    key now holds permits: the script finds no lock of ours there and says 0)."""
    return error.startswith(("OOM", "WRONGTYPE"))


def extend_command(key: bytes, value: bytes, ttl_ms: int) -> tuple[bytes, ...]:
    """The Lua-free extend (see the module docstring); its reply is OK or nil."""
    return (b"SET", key, value, b"IFEQ", value, b"PX", b"%d" % ttl_ms)


def release_command(dialect: Dialect, key: bytes, value: bytes) -> tuple[bytes, ...]:
    """The Lua-free release for ``dialect``; its reply is 1 (deleted) or 0."""
    if dialect.release == "DELIFEQ":
        return (b"DELIFEQ", key, value)
    assert dialect.release == "DELEX", dialect
    return (b"DELEX", key, b"IFEQ", value)
