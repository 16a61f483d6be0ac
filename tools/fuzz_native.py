"""Coverage-guided fuzzing of the native extension's reply paths, with Atheris (libFuzzer).

    python tools/fuzz_native.py aio  [libFuzzer options] [corpus dir]
    python tools/fuzz_native.py sync [libFuzzer options] [corpus dir]

aio: the asyncio protocol (ext/_aio.pxi). A connection with commands and pipelines pending
is fed the fuzz bytes, cut into chunks, through data_received. Checked: nothing but the
library's own errors comes out; every reply goes to the command it answers (hiredis-py's
reader, the same C parser, decodes the same bytes as the reference); a reply nobody waits
for, or bytes that are no reply, drop the connection and fail the waiters; a waiter left
pending had no complete reply.

sync: the blocking client (ext/_sync.pxi) against a loopback server in a thread that
answers the handshake as Redis does (SCRIPT LOAD returns the SHA1 of what it was sent),
then answers the call's first command with the fuzz bytes and closes. Checked: the call
(acquire, extend, release and their batch forms) ends in a result of its type or one of
the library's errors (hotlock.errors.HotlockError), well within its reply timeout.

The reply is bounded as hiredis's own fuzzer bounds its input: -max_len (libFuzzer, 4096
here) caps the bytes, and an input declaring an aggregate of more than MAX_ELEMENTS
elements is skipped, as hiredis's reader preallocates the elements it is told of (its
maxelements cap is 2^32-1), which would make any large header a malloc-limit report.

Run on the normal build it is guided by Python coverage only (the C code is not
instrumented); make fuzz runs it on a clang build with -fsanitize=fuzzer-no-link plus ASan
and UBSan, so libFuzzer sees the edges of the extension and of hiredis. A finding prints
the input and its traceback, and libFuzzer writes it to crash-<sha1> (-artifact_prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import socket
import sys
import threading
import time
from typing import Any

import atheris

with atheris.instrument_imports():
    import hiredis

    from hotlock._config import parse_url
    from hotlock._scripts import SCRIPTS
    from hotlock.backends.native import native_module
    from hotlock.backends.native_async import NotSent, ReplyError
    from hotlock.errors import HotlockError

MAX_ELEMENTS = 4096
_AGGREGATE = re.compile(rb"[*%~>|](\d+)")
_native, _why = native_module()
if _native is None:
    raise SystemExit(f"fuzz_native: the native extension is not loaded: {_why}")


def _bounded(data: bytes) -> bool:
    return all(int(m.group(1)) <= MAX_ELEMENTS for m in _AGGREGATE.finditer(data))


# -- aio: data_received ---------------------------------------------------------------------


class _Transport:
    """What AioCore uses of a transport; abort and close report the loss as a loop would."""

    def __init__(self, loop: asyncio.AbstractEventLoop, proto: Any) -> None:
        self.loop = loop
        self.proto = proto
        self.written = bytearray()
        self.gone = False

    def write(self, data: bytes | bytearray) -> None:
        assert not self.gone, "write after abort/close"
        self.written += data

    def _lose(self) -> None:
        if not self.gone:
            self.gone = True
            self.loop.call_soon(self.proto.connection_lost, None)

    def abort(self) -> None:
        self._lose()

    def close(self) -> None:
        self._lose()


_ANY = object()  # a reply type AioCore does not decode: it must come as a ReplyError
_NO_REPLY = object()
_loop = asyncio.new_event_loop()


@atheris.instrument_func
def _expected(value: Any) -> Any:
    """hiredis-py's decoding of a reply, as AioCore must hand it over."""
    if value is None or type(value) in (bytes, int):
        return value
    if type(value) is list:
        return [_expected(v) for v in value]
    if isinstance(value, hiredis.ReplyError):
        return ReplyError(str(value))
    return _ANY  # RESP3: double, bool, map, set, push (a list subclass)


@atheris.instrument_func
def _matches(want: Any, got: Any) -> bool:
    if isinstance(got, ReplyError) and str(got).startswith("unexpected reply type"):
        return True  # RESP3 types hiredis-py decodes and AioCore refuses (bignum, verbatim, attribute)
    if want is _ANY:
        return isinstance(got, ReplyError)
    if isinstance(want, ReplyError):
        return isinstance(got, ReplyError) and str(got) == str(want)
    if type(want) is list:
        return type(got) is list and len(got) == len(want) and all(map(_matches, want, got))
    return type(got) is type(want) and got == want


@atheris.instrument_func
def _reference(data: bytes) -> tuple[list[Any], bool, bool]:
    """The complete replies in data, whether the bytes after them are a protocol error, and
    whether hiredis-py could decode them all (it cannot build a map keyed by a list)."""
    # Its own sentinel for "no complete reply": the default, False, is also RESP3's false.
    reader = hiredis.Reader(notEnoughData=_NO_REPLY)
    reader.feed(data)
    replies: list[Any] = []
    while True:
        try:
            reply = reader.gets()
        except hiredis.ProtocolError:
            return replies, True, True
        except TypeError:
            return replies, False, False
        if reply is _NO_REPLY:
            return replies, False, True
        replies.append(reply)


@atheris.instrument_func
def fuzz_aio(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    shape = [fdp.ConsumeIntInRange(0, 3) for _ in range(fdp.ConsumeIntInRange(1, 6))]  # 0: one command, n: pipeline
    cuts = [fdp.ConsumeIntInRange(1, 64) for _ in range(4)]
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    if _bounded(stream):
        check_aio(shape, cuts, stream)


@atheris.instrument_func
def check_aio(shape: list[int], cuts: list[int], stream: bytes, protocol: Any = None) -> None:
    """Commands of ``shape`` pending (0: one command, n: a pipeline of n), then ``stream`` fed
    in chunks of ``cuts`` bytes, in turn; fails when an invariant does not hold. ``protocol``
    replaces AioProtocol (tests/test_fuzz.py shows the checks catch a broken one)."""
    proto = (protocol or _native.AioProtocol)(_loop, 30.0, ReplyError, NotSent)
    transport = _Transport(_loop, proto)
    proto.connection_made(transport)
    futures = [
        proto.execute(b"GET", b"k") if n == 0 else proto.pipeline([(b"GET", b"k%d" % i) for i in range(n)])
        for n in shape
    ]
    wants = [1 if n == 0 else n for n in shape]
    _loop.run_until_complete(asyncio.sleep(0))  # the flush: the commands are written
    assert transport.written, "nothing was written"
    pos, i = 0, 0
    while pos < len(stream) and not transport.gone:
        step = cuts[i % len(cuts)]
        with contextlib.suppress(HotlockError):
            proto.data_received(stream[pos : pos + step])
        pos += step
        i += 1
    _loop.run_until_complete(asyncio.sleep(0))  # connection_lost, when dropped
    replies, bad, decoded = _reference(stream)
    # A push reply answers nobody: what AioCore does with it may differ from the model, so
    # past one, as past what the model cannot decode, only the kinds of outcome are checked.
    pushed = not decoded or any(isinstance(r, hiredis.PushNotification) for r in replies)
    broken = transport.gone
    if decoded and (bad or len(replies) > sum(wants)) and pos >= len(stream):
        assert broken, (
            f"bytes that are no reply ({bad}) or a reply nobody asked for, yet the connection stays: {replies}"
        )
    at = 0
    for fut, n, want in zip(futures, shape, wants, strict=True):
        mine = replies[at : at + want]
        at += want
        if not fut.done():
            assert not broken, "the connection dropped and a waiter was left pending"
            assert len(mine) < want or pushed, f"a complete reply was not delivered: {mine}"
            fut.cancel()
            continue
        exc = fut.exception()
        if exc is not None:
            assert broken and isinstance(exc, ConnectionError | TimeoutError), repr(exc)
            continue
        if pushed:
            continue
        got, expect = fut.result(), [_expected(r) for r in mine]
        if n == 0:
            assert len(expect) == 1 and _matches(expect[0], got), f"waiter got {got!r}, its reply is {mine!r}"
        else:
            assert type(got) is list and len(got) == len(expect), (got, mine)
            assert all(map(_matches, expect, got)), f"pipeline got {got!r}, its replies are {mine!r}"
    proto.abort()
    _loop.run_until_complete(asyncio.sleep(0))


# -- sync: a fake server ---------------------------------------------------------------------


class _Server:
    """A loopback RESP server: the handshake as Redis answers it, then the fuzz reply and EOF."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.payload = b""
        self.used = True
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def arm(self, payload: bytes) -> None:
        with self.lock:
            self.payload, self.used = payload, False

    def _serve(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            conn.settimeout(10)
            try:
                self._session(conn)
            except OSError:
                pass
            finally:
                conn.close()

    def _session(self, conn: socket.socket) -> None:
        reader = hiredis.Reader()
        while True:
            data = conn.recv(65536)
            if not data:
                return
            reader.feed(data)
            out = bytearray()
            while (command := reader.gets()) is not False:
                name = command[0].upper()
                if name in (b"AUTH", b"SELECT", b"CLIENT"):  # CLIENT SETINFO / SETNAME: the connection's name
                    out += b"+OK\r\n"
                elif name == b"SCRIPT":
                    sha = hashlib.sha1(command[2]).hexdigest().encode()
                    out += b"$40\r\n" + sha + b"\r\n"
                elif name == b"PING":
                    out += b"+PONG\r\n"
                else:
                    with self.lock:
                        payload, first = self.payload, not self.used
                        self.used = True
                    if first:
                        out += payload
                    conn.sendall(out)
                    conn.shutdown(socket.SHUT_RDWR)
                    return
            if out:
                conn.sendall(out)


_server: _Server | None = None
_backend: Any = None
TIMEOUT = 1.0
KEYS = [b"hl:k%d" % i for i in range(8)]
TOKENS = [b"t" * 22 + b"%02d" % i for i in range(8)]


def _setup_sync() -> None:
    global _server, _backend
    _server = _Server()
    config = parse_url(f"redis://127.0.0.1:{_server.port}/0", connect_timeout=TIMEOUT, timeout=TIMEOUT)
    _backend = _native.NativeBackend(config)
    assert {s.sha for s in SCRIPTS}, "no scripts"


@atheris.instrument_func
def fuzz_sync(data: bytes) -> None:
    assert _server is not None
    fdp = atheris.FuzzedDataProvider(data)
    op = fdp.ConsumeIntInRange(0, 5)
    n = fdp.ConsumeIntInRange(1, len(KEYS))
    payload = fdp.ConsumeBytes(fdp.remaining_bytes())
    if not _bounded(payload):
        return
    _server.arm(payload)
    keys, tokens = list(KEYS[:n]), list(TOKENS[:n])
    start = time.monotonic()
    try:
        if op == 0:
            result: Any = _backend.acquire(keys[0], tokens[0], 5000)
            assert type(result) is int, result
        elif op == 1:
            result = _backend.extend(keys[0], tokens[0], 5000)
            assert type(result) is bool, result
        elif op == 2:
            result = _backend.release(keys[0], tokens[0])
            assert type(result) is bool, result
        elif op == 3:
            result = _backend.acquire_many(keys, tokens, 5000)
            assert type(result) is list and len(result) == n and all(type(r) is int for r in result), result
        elif op == 4:
            result = _backend.extend_many(keys, tokens, 5000)
            assert type(result) is list and len(result) == n and all(type(r) is bool for r in result), result
        else:
            result = _backend.release_many(keys, tokens)
            assert type(result) is list and len(result) == n and all(type(r) is bool for r in result), result
    except HotlockError:
        pass
    elapsed = time.monotonic() - start
    # EOF follows the reply at once, so nothing waits on the timeout; a retry may reconnect once.
    assert elapsed < 3 * TIMEOUT, f"the call took {elapsed:.2f} s"


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("aio", "sync"):
        raise SystemExit(__doc__)
    target = sys.argv.pop(1)
    if target == "sync":
        _setup_sync()
    argv = [sys.argv[0], "-max_len=4096", *sys.argv[1:]]
    atheris.Setup(argv, fuzz_aio if target == "aio" else fuzz_sync)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
