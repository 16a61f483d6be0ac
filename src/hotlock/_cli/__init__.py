"""The ``hotlock`` command (also ``python -m hotlock``): doctor, locks, release, watch.

Built on argparse: it is in the standard library, so the command costs no dependency, and
its help, usage errors (exit 2) and subcommands are all this needs.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import redis

from ._output import duration, print_json, status_word, table
from ._target import FAILED, OK, UNREACHABLE, USAGE, CliError, Target, UsageError, key_arg, open_target, shown_key

__all__ = ["main"]

log = logging.getLogger("hotlock")

EXIT_STATUS = """\
exit status:
  0  ok
  1  a check failed (doctor), the lock was not held (release), or the server refused a command
  2  usage: a bad option, argument or url (nothing was sent)
  3  cannot connect: the server is unreachable, or refused the credentials
  130 interrupted (Ctrl-C); watch, which runs until Ctrl-C, exits 0
"""

ENVIRONMENT = """\
environment:
  CACHE_URL  the server when --url is not given, as hotlock.connect() reads it:
             redis://[user:password@]host[:port][/db], rediss://... (TLS), unix:///path?db=N,
             redis+sentinel://h1:26379,h2/mymaster[/db], redis+cluster://h1:7000,h2:7000
  NO_COLOR   no colors in doctor's output on a terminal
"""

DESCRIPTION = """\
Operate hotlock's Redis locks: check that the server is set up for them, list the locks
held now, break one whose holder is gone, and watch the lock traffic live.

Every key hotlock writes lives under one prefix ("hotlock:" unless the services use
connect(prefix=...); pass the same --prefix here). Lock tokens are never read, printed or
logged: only a lock's key, remaining TTL and fence.
"""

COMMANDS: dict[str, tuple[str, str, str]] = {
    # name: (one-line help, description, examples)
    "doctor": (
        "run the operator checklist against the server",
        """\
Run the operator checklist against the server, one line per check: ok, warn or fail, what
was found and, unless ok, what to do. Checks: server kind and version, topology (standalone,
Sentinel primary and replicas, cluster shards), maxmemory-policy, persistence and what a
restart forgets, whether the user's ACL allows every command the library sends (tried on
scratch keys under <prefix>doctor:, never on a lock), a lock cycle through the library
itself, the Lua-free path, round-trip latency p50/p99 over 200 PINGs, --timeout against
that latency, clock skew (TIME), and which backend this host runs.

With --json: a JSON array of objects {"check", "status", "detail", "advice"}.
Exit status 1 if any check fails; warnings alone exit 0.
""",
        """\
examples:
  hotlock doctor
  hotlock doctor --url redis://hotlock:PASSWORD@10.0.0.5:6379/0 --timeout 0.5
  hotlock doctor --json | jq -r '.[] | select(.status != "ok") | .check'
""",
    ),
    "locks": (
        "list the locks held now (SCAN, never KEYS)",
        """\
List the locks held now under the prefix, sorted by remaining TTL (soonest to expire
first; a key without a TTL, which hotlock never writes, last). PATTERN is a Redis glob
(*, ?, [abc], [^a-z], \\x) matched against the key as the services gave it. Uses SCAN (on
every primary of a cluster), never KEYS, so a large keyspace is not blocked.

Columns: KEY, TTL (remaining), FENCE (a key held with a limit: its permits' fencing
tokens; "-" for a plain lock, whose fence is not stored), HELD (time since the acquire,
read from a permit's fence and the server's clock; "-" when unknown). The lock's secret
token is never read.

With --json: a JSON array of objects {"key", "ttl" (seconds, float), "fence" (int or
null), "held" (seconds or null), "node"}.
""",
        """\
examples:
  hotlock locks
  hotlock locks 'settle:*'
  hotlock locks --json | jq -r '.[] | select(.ttl > 3600) | .key'
""",
    ),
    "release": (
        "delete one held lock: an operator's override (needs --force)",
        """\
Delete the lock on KEY whoever holds it: an operator's override for a lock whose holder is
gone (a crashed job's lock with a long TTL). The holder, if it is still running, is not
told: its next extend() raises LockLost and its unlock() returns False, but whatever it
does before that runs unprotected. So release only locks whose holder you know is gone.

--force is required. On a terminal it asks for confirmation unless --yes; without a
terminal (a script, a pipe) it refuses unless --yes. The check and the delete are one
transaction (MULTI), so the TTL and fence printed are those of the lock deleted. A WARNING
is logged on the "hotlock" logger (stderr here). Exit status 1 if KEY was not held.

With --json: {"key", "ttl", "fence", "held", "node", "released": true}.
""",
        """\
examples:
  hotlock release 'export:tenant-1' --force
  hotlock release 'export:tenant-1' --force --yes --json
""",
    ),
    "watch": (
        "a live view of the held locks and the lock traffic",
        """\
A live view, refreshed every --interval seconds (1 by default) until Ctrl-C: the number of
locks held, the one held longest, and per second: acquisitions, waits (failed acquire
attempts: a waiter's poll or a try-once conflict), extends, releases and script calls.

The rates come from the server's INFO commandstats, which counts the commands a script
calls under their own names (each successful acquire calls SET, each failed one PTTL,
each extend PEXPIRE, each release DEL). They are server-wide: other clients' SET, PTTL and
DEL on the same server count too.

On a terminal it draws a full screen (the terminal is restored on exit); otherwise it
prints one line per refresh, and with --json one JSON object per line.
""",
        """\
examples:
  hotlock watch
  hotlock watch --interval 5 --json >> lock-traffic.jsonl
""",
    ),
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, not {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text!r}")
    return value


def _common(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--url, --prefix, --timeout: accepted before and after the subcommand. The copies on
    the subcommands default to SUPPRESS, so they never overwrite a value given before it."""
    d: dict[str, Any] = {} if defaults else {"default": argparse.SUPPRESS}
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--url",
        metavar="URL",
        help="the server (default: $CACHE_URL): redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://",
        **d,
    )
    group.add_argument(
        "--prefix",
        metavar="PREFIX",
        help="the prefix of every hotlock key, as given to connect(prefix=...) (default: hotlock:)",
        **({"default": "hotlock:"} if defaults else d),
    )
    group.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_positive,
        help="connect and reply timeout (default: 2, as hotlock.connect())",
        **({"default": 2.0} if defaults else d),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotlock",
        description=DESCRIPTION,
        epilog=EXIT_STATUS + "\n" + ENVIRONMENT + "\nrun 'hotlock COMMAND --help' for each command's options",
        formatter_class=_Formatter,
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"hotlock {__version__}")
    _common(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (summary, description, examples) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=summary,
            description=description,
            epilog=examples + "\n" + EXIT_STATUS,
            formatter_class=_Formatter,
        )
        _common(p, defaults=False)
        if name == "locks":
            p.add_argument(
                "pattern", nargs="?", metavar="PATTERN", help="a Redis glob on the key (default: every lock)"
            )
        if name == "release":
            p.add_argument("key", metavar="KEY", help="the lock's key, as the services give it (without the prefix)")
            p.add_argument("--force", action="store_true", help="required: this breaks somebody's lock")
            p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
        if name == "watch":
            p.add_argument(
                "--interval", type=_positive, default=1.0, metavar="SECONDS", help="refresh period (default: 1)"
            )
            p.add_argument("--count", type=_count, metavar="N", help="stop after N refreshes (default: until Ctrl-C)")
        p.add_argument("--json", action="store_true", help="machine-readable output (see above)")
    return parser


def _prefix(text: str) -> bytes:
    """--prefix as bytes, checked as connect(prefix=...) checks it."""
    from .._keys import check_prefix

    raw = text.encode("utf-8", "surrogateescape")
    if not raw or len(raw) > 256:
        raise UsageError("--prefix must be 1 to 256 bytes long")
    try:
        return check_prefix(raw)
    except ValueError as exc:
        raise UsageError(f"--prefix: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see EXIT_STATUS)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error, with argparse's message
    if args.command is None:
        parser.print_help(sys.stderr)
        return USAGE
    logging.basicConfig(level=logging.WARNING, format="hotlock: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        return _run(args, sys.stdout)
    except CliError as exc:
        sys.stderr.write(f"hotlock {args.command}: {exc}\n")
        return exc.code
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # Reached at first, lost since (a node down mid-scan, a restart): cannot connect.
        sys.stderr.write(f"hotlock {args.command}: lost the server: {exc}\n")
        return UNREACHABLE
    except redis.RedisError as exc:
        sys.stderr.write(f"hotlock {args.command}: the server replied: {exc}\n")
        return FAILED
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130


def _run(args: argparse.Namespace, out: TextIO) -> int:
    url = args.url or os.environ.get("CACHE_URL")
    # Everything a bad invocation can get wrong is checked before the first byte is sent.
    if not url:
        raise UsageError("no server: pass --url or set CACHE_URL")
    prefix = _prefix(args.prefix)
    key = key_arg(args.key) if args.command == "release" else None
    pattern = None
    if args.command == "locks" and args.pattern is not None:
        pattern = args.pattern.encode("utf-8", "surrogateescape")
    if args.command == "release" and not args.force:
        raise UsageError(f"release breaks somebody's lock: say so with --force (hotlock release {args.key!r} --force)")
    if args.command == "release" and not args.yes and not sys.stdin.isatty():
        raise UsageError("stdin is not a terminal, so release cannot ask: add --yes to release without asking")
    target = open_target(url, prefix, args.timeout)
    try:
        if args.command == "doctor":
            return _cmd_doctor(target, url, args.json, out)
        if args.command == "locks":
            return _cmd_locks(target, pattern, args.json, out)
        if args.command == "release":
            assert key is not None
            return _cmd_release(target, key, yes=args.yes, as_json=args.json, out=out)
        from ._watch import watch

        return watch(target, interval=args.interval, count=args.count, as_json_lines=args.json, out=out)
    finally:
        target.close()


def _cmd_doctor(target: Target, url: str, as_json: bool, out: TextIO) -> int:
    from .. import connect
    from ._doctor import FAIL, run_checks

    checks = run_checks(target, url, connect)
    if as_json:
        print_json(out, [c.as_json() for c in checks])
    else:
        width = max(len(c.check) for c in checks)
        for c in checks:
            advice = f" -> {c.advice}" if c.advice else ""
            out.write(f"{status_word(out, c.status)}  {c.check:<{width}}  {c.detail}{advice}\n")
    return FAILED if any(c.status == FAIL for c in checks) else OK


def _cmd_locks(target: Target, pattern: bytes | None, as_json: bool, out: TextIO) -> int:
    from ._locks import scan_locks

    found, _ = scan_locks(target, pattern)
    if as_json:
        print_json(out, [lk.as_json() for lk in found])
        return OK
    if not found:
        what = "" if pattern is None else f" matching {pattern.decode('utf-8', 'backslashreplace')!r}"
        out.write(f"no locks held{what} under {_shown_prefix(target)} on {target.display}\n")
        return OK
    # A key held with a limit: a row per permit, the key marked with its number of holders.
    rows = [
        [
            shown_key(lk.key) if lk.permits is None else f"{shown_key(lk.key)} ({len(lk.permits)} holders)",
            "no TTL" if held.ttl is None else duration(held.ttl),
            "-" if held.fence is None else str(held.fence),
            "-" if held.held is None else duration(held.held),
        ]
        + ([lk.node] if target.kind == "cluster" else [])
        for lk in found
        for held in lk.holders()
    ]
    header = ["KEY", "TTL", "FENCE", "HELD"] + (["NODE"] if target.kind == "cluster" else [])
    table(out, header, rows)
    return OK


def _shown_prefix(target: Target) -> str:
    return repr(target.prefix.decode("utf-8", "backslashreplace"))


def _cmd_release(target: Target, key: bytes, *, yes: bool, as_json: bool, out: TextIO) -> int:
    from ._locks import peek_lock, release_lock

    shown = shown_key(key)
    if not yes:
        held = peek_lock(target, key)
        if held is None:
            raise CliError(f"no lock is held on {shown!r} under {_shown_prefix(target)} ({target.display})")
        ttl = "no TTL" if held.ttl is None else f"{duration(held.ttl)} left"
        fence = "" if held.fence is None else f", fence {held.fence}"
        what = "the lock" if held.permits is None else f"all {len(held.permits)} holders of the limited key"
        sys.stderr.write(f"release {what} on {shown!r} ({ttl}{fence}) on {target.display}? [y/N] ")
        sys.stderr.flush()
        answer = sys.stdin.readline().strip().lower()
        if answer not in ("y", "yes"):
            sys.stderr.write("nothing released\n")
            return FAILED
    removed = release_lock(target, key)
    if removed is None:
        raise CliError(f"no lock is held on {shown!r} under {_shown_prefix(target)} ({target.display})")
    ttl = "no TTL" if removed.ttl is None else f"{removed.ttl:.3f} s"
    fence = "none" if removed.fence is None else str(removed.fence)
    log.warning(
        "lock %r released by operator override (hotlock release --force) on %s: %s of its TTL left, fence %s",
        shown,
        target.display,
        ttl,
        fence,
    )
    if as_json:
        print_json(out, {**removed.as_json(), "released": True})
    else:
        left = "no TTL" if removed.ttl is None else f"{duration(removed.ttl)} of its TTL left"
        holders = "" if removed.permits is None else f"{len(removed.permits)} holders, the first to expire with "
        out.write(f"released {shown!r} ({holders}{left}, fence {fence})\n")
    return OK
