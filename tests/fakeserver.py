"""A fake RESP server on a loopback port, scriptable by tests, for replies no real server sends.

    with FakeRedis() as fake:
        cache = hotlock.connect(fake.url, timeout=0.5)
        fake.on(b"EVALSHA", ACQUIRE.sha, reply=b"%3\\r\\n")      # the next acquire gets a map
        cue = fake.on(b"EVALSHA", EXTEND.sha, stall=True)        # the next extend waits ...
        ...
        cue.arrived.wait(5)                                     # ... until it has come
        cue.release(b":1\\r\\n")                                 # ... and is answered on cue

Every command not matched by a rule gets an honest answer (`honest`): the handshake
(AUTH, SELECT, CLIENT, SCRIPT LOAD with the true SHA1 of the source, INFO naming a Redis
7.0, PING) and the lock commands. An acquire's honest reply is a fence computed from its
key alone (`fence_of`), so a test can tell whether a call got its own reply or someone
else's: a reply handed to the wrong caller shows as the wrong fence.

A rule matches a command by its first arguments (name upper-cased) and is used once, in
the order the rules were added. What it does with the command: send `reply` (raw bytes,
anything at all: the hostile part), stall until the test calls `cue.release(...)`, cut the
connection (EOF, no reply), or never answer (the client's timeout is the only way out).

It runs one thread per connection (blocking sockets, small and readable); `stop()` closes
every connection, releases every stalled cue and joins the threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
import zlib
from collections.abc import Callable
from types import TracebackType

__all__ = ["Cue", "FakeRedis", "fence_of", "honest", "honest_exec"]

INFO = b"# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n# Memory\r\nmaxmemory_policy:noeviction\r\n"


def fence_of(key: bytes) -> int:
    """The fence an honest acquire of ``key`` (as stored, prefix included) replies with:
    the script's reply, or the TIME of the transaction that SET the key (at least one
    second, as a clock is)."""
    return (zlib.crc32(key) & 0x3FFFFFFF) + 1_000_000


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def honest(command: list[bytes], scripts: dict[bytes, str]) -> bytes:
    """The reply a healthy Redis 7.0 holding no other lock would send to ``command``.

    ``scripts`` maps each loaded SHA1 to what it does ("acquire", "extend", ...), as named
    by the caller from hotlock._scripts; an unknown SHA1 gets NOSCRIPT, as on Redis."""
    name = command[0].upper()
    args = command[1:]
    if name in (b"AUTH", b"SELECT", b"CLIENT", b"READONLY"):
        return b"+OK\r\n"
    if name == b"PING":
        return b"+PONG\r\n"
    if name == b"TIME":
        seconds, micros = divmod(time.time_ns() // 1000, 1_000_000)
        return b"*2\r\n" + bulk(b"%d" % seconds) + bulk(b"%d" % micros)
    if name == b"HELLO":
        return b"-NOPROTO this fake server speaks RESP2 only\r\n"
    if name == b"INFO":
        return bulk(INFO)
    if name == b"COMMAND":
        return b"*2\r\n*-1\r\n*-1\r\n"
    if name == b"SCRIPT" and args and args[0].upper() == b"LOAD":
        return bulk(hashlib.sha1(args[1]).hexdigest().encode())
    if name == b"EVALSHA":
        what = scripts.get(args[0])
        if what is None:
            return b"-NOSCRIPT No matching script. Please use EVAL.\r\n"
        if what.startswith("acquire"):
            return b":%d\r\n" % fence_of(args[2])
        return b":1\r\n"  # extend, release: done
    if name == b"SET":
        return b"+OK\r\n"
    if name == b"INCRBY":
        return b":%d\r\n" % int(args[1])
    if name == b"WAIT":
        return b":%d\r\n" % int(args[0])
    if name in (b"DEL", b"PUBLISH", b"UNLINK"):
        return b":0\r\n"
    return b"-ERR unknown command '%s'\r\n" % name.lower()


def honest_exec(queued: list[list[bytes]] | None, scripts: dict[bytes, str]) -> bytes:
    """EXEC's honest reply to the commands MULTI queued: each one's own, but a TIME after a
    SET tells the clock that makes the SET's key's fence_of (a transaction acquire)."""
    if queued is None:
        return b"-ERR EXEC without MULTI\r\n"
    replies, key = [], None
    for command in queued:
        name = command[0].upper()
        if name == b"SET":
            key = command[1]
        if name == b"TIME" and key is not None:
            seconds, micros = divmod(fence_of(key), 1_000_000)
            replies.append(b"*2\r\n" + bulk(b"%d" % seconds) + bulk(b"%d" % micros))
        else:
            replies.append(honest(command, scripts))
    return b"*%d\r\n" % len(replies) + b"".join(replies)


class Cue:
    """A rule's stalled reply: ``arrived`` is set once the command came; the reply is sent
    when the test calls ``release(reply)`` (``b""`` sends nothing, ``cut=True`` closes)."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self._go = threading.Event()
        self.reply: bytes | None = None
        self.cut = False

    def release(self, reply: bytes | None = None, *, cut: bool = False) -> None:
        """Answer now: with ``reply`` (None: the honest reply), or by closing (``cut``)."""
        self.reply = reply
        self.cut = cut
        self._go.set()

    def wait(self, timeout: float) -> bool:
        return self._go.wait(timeout)


class Rule:
    def __init__(
        self,
        match: tuple[bytes, ...],
        reply: bytes | None,
        cue: Cue | None,
        cut: bool,
        silent: bool,
        extra: bytes,
        close: bool = False,
    ) -> None:
        self.close = close
        self.match = match
        self.reply = reply
        self.cue = cue
        self.cut = cut
        self.silent = silent
        self.extra = extra

    def matches(self, command: list[bytes]) -> bool:
        if len(command) < len(self.match):
            return False
        head = [command[0].upper(), *command[1:]]
        return all(want == got for want, got in zip(self.match, head, strict=False))


class _Closed(Exception):
    pass


class _Conn:
    """One client connection: reads whole commands (RESP arrays of bulk strings)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise _Closed()
        self.buf += data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n + 2 :]
        return data

    def command(self) -> list[bytes]:
        head = self._line()
        if not head.startswith(b"*"):
            return head.split()  # an inline command
        args = []
        for _ in range(int(head[1:])):
            size = self._line()
            assert size.startswith(b"$"), size
            args.append(self._exactly(int(size[1:])))
        return args


class FakeRedis:
    def __init__(self, answer: Callable[[list[bytes], dict[bytes, str]], bytes] = honest) -> None:
        from hotlock import _scripts

        self.answer = answer
        # What each script does, by SHA1, for the honest answers.
        self.scripts: dict[bytes, str] = {
            _scripts.ACQUIRE.sha: "acquire",
            _scripts.ACQUIRE_WAIT.sha: "acquire_wait",
            _scripts.ACQUIRE_CHAIN.sha: "acquire_chain",
            _scripts.EXTEND.sha: "extend",
            _scripts.RELEASE.sha: "release",
            _scripts.RELEASE_SHARDED.sha: "release_sharded",
        }
        self._rules: list[Rule] = []
        self._mutex = threading.Lock()
        self.received: list[list[bytes]] = []  # every command, in arrival order
        self.connections = 0  # accepted so far
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"

    # -- scripting ---------------------------------------------------------------------

    def on(
        self,
        *match: bytes,
        reply: bytes | None = None,
        stall: bool = False,
        cut: bool = False,
        silent: bool = False,
        extra: bytes = b"",
        close: bool = False,
    ) -> Cue:
        """The next command whose first arguments are ``match`` gets ``reply`` (raw bytes;
        None: the honest one) followed by ``extra`` and, with ``close``, the connection
        closed; or waits for its cue (``stall``); or the connection is closed unanswered
        (``cut``); or it is never answered (``silent``)."""
        cue = Cue()
        if not stall:
            cue.release(reply, cut=cut)
        rule = Rule(
            tuple(m.upper() if i == 0 else m for i, m in enumerate(match)), reply, cue, cut, silent, extra, close
        )
        with self._mutex:
            self._rules.append(rule)
        return cue

    def pending(self) -> int:
        """How many rules have not matched yet."""
        with self._mutex:
            return len(self._rules)

    def count(self, *match: bytes) -> int:
        """How many commands received so far start with ``match``."""
        probe = Rule(tuple(m.upper() if i == 0 else m for i, m in enumerate(match)), None, None, False, False, b"")
        with self._mutex:
            return sum(probe.matches(c) for c in self.received)

    # -- lifetime ----------------------------------------------------------------------

    def start(self) -> FakeRedis:
        self._spawn(self._accept, "fakeredis-accept")
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._mutex:
            rules, self._rules = self._rules, []
            socks = list(self._socks)
        for rule in rules:
            if rule.cue is not None:
                rule.cue.release(b"")
        # shutdown() wakes the accept() blocked in the accepting thread (close() alone does not).
        _shut(self._listener)
        for sock in socks:
            _shut(sock)
        for thread in list(self._threads):
            thread.join(5)

    def cut_all(self) -> None:
        """Close every open connection now (the server went away; it still accepts new ones)."""
        with self._mutex:
            socks = list(self._socks)
        for sock in socks:
            _shut(sock)

    def __enter__(self) -> FakeRedis:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- the threads -------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.settimeout(None)
            with self._mutex:
                self.connections += 1
                self._socks.add(sock)
            self._spawn(self._serve, "fakeredis-conn", sock)

    def _serve(self, sock: socket.socket) -> None:
        conn = _Conn(sock)
        # The replies to the commands that came in one piece go out in one write, as Redis
        # sends a pipeline's: an extra reply then arrives with the rest, where the client
        # can tell it is one too many.
        out = b""
        # The commands MULTI queued, until EXEC (None: not in a transaction). A rule's
        # reply stands in for the honest one of whatever it matches, MULTI and EXEC included.
        queued: list[list[bytes]] | None = None
        try:
            while not self._stopping.is_set():
                if out and not conn.buf:
                    sock.sendall(out)
                    out = b""
                command = conn.command()
                name = command[0].upper()
                with self._mutex:
                    self.received.append(command)
                    rule = next((r for r in self._rules if r.matches(command)), None)
                    if rule is not None:
                        self._rules.remove(rule)
                done, queued = queued, [] if name == b"MULTI" else None if name == b"EXEC" else queued
                if done is not None and name not in (b"MULTI", b"EXEC"):
                    done.append(command)
                if rule is None:
                    if name == b"MULTI":
                        out += b"+OK\r\n"
                    elif name == b"EXEC":
                        out += honest_exec(done, self.scripts)
                    elif done is not None:
                        out += b"+QUEUED\r\n"
                    else:
                        out += self.answer(command, self.scripts)
                    continue
                cue = rule.cue
                assert cue is not None
                if rule.silent or not cue.wait(0):
                    # What came before is answered; this one waits (or never gets answered).
                    sock.sendall(out)
                    out = b""
                cue.arrived.set()
                if rule.silent:
                    # Never answered: neither is anything after it on this connection, as
                    # on a server stuck on one command. The client's timeout ends it.
                    while True:
                        conn._fill()
                if not cue.wait(10):
                    return
                if cue.cut:
                    sock.sendall(out)
                    return
                reply = cue.reply if cue.reply is not None else self.answer(command, self.scripts)
                out += reply + rule.extra
                if rule.close:
                    sock.sendall(out)
                    return
        except (_Closed, OSError):
            pass
        finally:
            with self._mutex:
                self._socks.discard(sock)
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
