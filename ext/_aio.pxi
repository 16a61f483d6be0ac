# The asyncio protocol under hotlock.aio's native backend (included from _native.pyx).
#
# One connection, any number of tasks: every command is formatted by hiredis
# (redisFormatCommandArgv) into a write buffer that is flushed once per loop iteration
# (loop.call_soon), so the commands of all tasks that ran in that iteration leave in one
# transport.write and pipeline without waiting on each other. Replies are parsed by
# hiredis's C reader and answer the waiting futures in FIFO order, which is Redis's own
# order on a connection. Only the public loop API is used (create_future, call_soon,
# call_at, time, transport.write/abort/close), so asyncio and uvloop run it unchanged.
#
# It knows bytes, ints and futures, and nothing of locks: retries, NOSCRIPT recovery and
# error wording live in src/hotlock/_exchange.py, reconnection in
# src/hotlock/backends/native_async.py.

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from posix.unistd cimport getpid as _aio_getpid

from hiredis cimport (
    REDIS_OK,
    REDIS_REPLY_ARRAY,
    REDIS_REPLY_ERROR,
    REDIS_REPLY_INTEGER,
    REDIS_REPLY_NIL,
    REDIS_REPLY_STATUS,
    REDIS_REPLY_STRING,
    freeReplyObject,
    redisFormatCommandArgv,
    redisFreeCommand,
    redisReader,
    redisReaderCreate,
    redisReaderFeed,
    redisReaderFree,
    redisReaderGetReply,
    redisReply,
)

import asyncio as _aio_asyncio
from collections import deque as _aio_deque


cdef extern from "compat.h" nogil:
    long long HOTLOCK_MAX_ELEMENTS
    void hotlock_reader_bound(redisReader *r, long long maxelements)
    size_t hotlock_reader_pending(const redisReader *r)


# What one reply may be: hotlock's replies are integers, short strings and short arrays;
# the largest are INFO and a cluster's slot map. Past these bounds the connection is
# dropped, not a buffer grown or an array allocated because a header said so.
cdef long long AIO_MAX_ELEMENTS = HOTLOCK_MAX_ELEMENTS  # as the sync reader's
cdef size_t AIO_MAX_PENDING = 16 << 20  # bytes of a reply still incomplete


cdef bytes _aio_arg(object arg):
    """One command argument as bytes: the backend passes bytes, and ints for TTLs and counts."""
    if type(arg) is bytes:
        return <bytes>arg
    if type(arg) is int:
        return b"%d" % arg
    raise TypeError(f"command arguments are bytes or int, not {type(arg).__name__}")


cdef int _aio_format(tuple args, bytearray out) except -1:
    """Append ``args`` to ``out`` as one RESP command, formatted by hiredis."""
    cdef Py_ssize_t argc = len(args), i, old
    cdef const char *argv_small[8]
    cdef size_t lens_small[8]
    cdef const char **argv = argv_small
    cdef size_t *lens = lens_small
    cdef char *cmd = NULL
    cdef long long length
    # The bytes objects stay referenced here while hiredis reads their buffers.
    cdef list keep = [_aio_arg(a) for a in args]
    if argc == 0:
        raise ValueError("empty command")
    if argc > 8:
        argv = <const char **>malloc(argc * sizeof(char *))
        lens = <size_t *>malloc(argc * sizeof(size_t))
        if argv == NULL or lens == NULL:
            free(argv)
            free(lens)
            raise MemoryError()
    try:
        for i in range(argc):
            argv[i] = PyBytes_AS_STRING(keep[i])
            lens[i] = <size_t>PyBytes_GET_SIZE(keep[i])
        length = redisFormatCommandArgv(&cmd, <int>argc, argv, lens)
        if length < 0 or cmd == NULL:
            raise MemoryError()
        try:
            old = PyByteArray_GET_SIZE(out)
            PyByteArray_Resize(out, old + <Py_ssize_t>length)
            memcpy(PyByteArray_AS_STRING(out) + old, cmd, <size_t>length)
        finally:
            redisFreeCommand(cmd)
    finally:
        if argv != argv_small:
            free(argv)
            free(lens)
    return 0


cdef object _aio_reply(redisReply *r, object error_class, bint *alien):
    """A hiredis reply as Python: bytes, int, None, list, or an ``error_class`` instance.

    ``alien`` is set when the reply or any element of it is of a type RESP2 has not (a
    push, an attribute, a map, a double...): this connection never asked for RESP3, so
    such a reply means the stream is not the one the waiters expect."""
    cdef size_t i
    if r.type == REDIS_REPLY_STRING or r.type == REDIS_REPLY_STATUS:
        return PyBytes_FromStringAndSize(r.str, <Py_ssize_t>r.len)
    if r.type == REDIS_REPLY_INTEGER:
        return r.integer
    if r.type == REDIS_REPLY_NIL:
        return None
    if r.type == REDIS_REPLY_ERROR:
        # Returned, not raised: the caller decides (NOSCRIPT is recovered, READONLY drops
        # the connection), and in a pipeline one error must not hide the other replies.
        return error_class(PyBytes_FromStringAndSize(r.str, <Py_ssize_t>r.len).decode("utf-8", "replace"))
    if r.type == REDIS_REPLY_ARRAY:
        return [_aio_reply(r.element[i], error_class, alien) for i in range(r.elements)]
    alien[0] = True
    return None


cdef bint _aio_odd(const redisReply *r) noexcept:
    """A reply, or an element of one, of a type RESP2 has not (see _aio_reply's alien)."""
    cdef size_t i
    if hotlock_odd_reply(r):
        return True
    if r.type == REDIS_REPLY_ARRAY:
        for i in range(r.elements):
            if _aio_odd(r.element[i]):
                return True
    return False


cdef class _AioWaiter:
    """One future and the replies it takes: 1 for a command, n for a pipeline."""

    cdef object fut
    cdef Py_ssize_t want
    cdef list got  # None for a single command
    # Acquires (AioCore.acquire): the first `txns` answers are each `per` replies
    # kept here as hiredis gave them until the last, then decided in C (_acquire_read) into
    # one answer, with no Python object made for any of them on the way to the fence.
    cdef Py_ssize_t txns
    cdef int per  # each acquire's replies: 4 (the transaction) or 1 (SET NX PX alone, fences off)
    cdef bint single  # the one answer is the future's result, not a list of them
    cdef int held
    cdef redisReply *four[4]

    def __dealloc__(self):
        cdef int i
        for i in range(self.held):
            freeReplyObject(self.four[i])
        self.held = 0


cdef inline bint _in_txn(_AioWaiter w):
    """Whether w's next reply is one of a transaction's (see _AioWaiter.txns)."""
    return w.txns > 0 and len(w.got) < w.txns


cdef class AioCore:
    """The connection state; AioProtocol adds asyncio.Protocol as a base for the loop's sake."""

    cdef redisReader *_reader
    cdef object _loop
    cdef object _transport
    cdef object _waiters  # deque of _AioWaiter, in the order their commands were written
    cdef bytearray _wbuf  # commands formatted this loop iteration, not yet written
    cdef Py_ssize_t _unflushed  # how many waiters at the tail of _waiters are still in _wbuf
    cdef bint _flush_scheduled
    cdef object _timer
    cdef object _lost  # a future, done at connection_lost (see lost())
    cdef double _timeout
    cdef double _progress_at
    cdef bint _closed
    cdef bint _retiring  # retire(): closed to new commands, open until the written ones have replies
    cdef bint _timed_out
    cdef str _why  # why this side gave up on the connection, when it did
    cdef object _reply_error
    cdef object _not_sent
    cdef readonly int pid
    # _fork_gen when made: another value means this is a forked child and the socket the
    # parent's (a counter read, where getpid() would be a system call per command).
    cdef unsigned long _gen
    # transport.write calls so far: the coalescing of one loop iteration's commands into
    # one write is the point of this protocol, and tests hold it to that.
    cdef readonly unsigned long long writes
    # The error reply of a MULTI refused alone (an acquire answered -1), for the backend's warning.
    cdef readonly str multi_refusal

    def __cinit__(self, loop, double timeout, reply_error, not_sent):
        self._reader = redisReaderCreate()
        if self._reader == NULL:
            raise MemoryError()
        hotlock_reader_bound(self._reader, AIO_MAX_ELEMENTS)
        self._loop = loop
        self._lost = loop.create_future()
        self._timeout = timeout
        self._reply_error = reply_error
        self._not_sent = not_sent
        self._waiters = _aio_deque()
        self._wbuf = bytearray()
        # Closed until connection_made: nothing may be queued for a socket not yet there.
        self._closed = True
        self.pid = _aio_getpid()
        self._gen = _fork_gen

    def __dealloc__(self):
        if self._reader != NULL:
            redisReaderFree(self._reader)
            self._reader = NULL

    # -- sending ----------------------------------------------------------------------

    def usable(self):
        """Open, and opened by this process (a forked child never writes to its parent's socket)."""
        return not self._closed and self._gen == _fork_gen

    def execute(self, *args):
        """Send one command; a future for its reply."""
        cdef _AioWaiter w = _AioWaiter.__new__(_AioWaiter)
        w.fut = self._loop.create_future()
        w.want = 1
        if self._closed or self._gen != _fork_gen:
            w.fut.set_exception(self._not_sent("the connection is closed"))
            return w.fut
        _aio_format(args, self._wbuf)
        self._queue(w)
        return w.fut

    def acquire(self, bytes key not None, bytes token not None, long long ms, bint fenced=True):
        """The transaction acquire of hotlock._acquire (SET NX PX alone when not
        ``fenced``); a future for its answer: the fence (> 0; 1 without a fence), 0 (the
        ACQUIRE script is to decide), -1 (that too, and MULTI was refused alone:
        multi_refusal says how), or the error reply the call failed with."""
        return self._txn([key], [token], ms, None, True, fenced)

    def acquire_many(self, list keys not None, list tokens not None, long long ms, tuple trailer=None,
                     bint fenced=True):
        """acquire() for each key, in one write, ``trailer`` (a WAIT) last; a future for the
        list of the answers, then the trailer's reply."""
        return self._txn(keys, tokens, ms, trailer, False, fenced)

    cdef object _txn(self, list keys, list tokens, long long ms, tuple trailer, bint single, bint fenced):
        cdef _AioWaiter w = _AioWaiter.__new__(_AioWaiter)
        cdef Py_ssize_t n = len(keys), i, old, size = 0
        cdef char *at
        w.fut = self._loop.create_future()
        w.txns = n
        w.per = _acquire_replies(fenced)
        w.want = n + (trailer is not None)
        w.single = single
        w.got = []
        if len(tokens) != n:
            raise ValueError("keys and tokens differ in length")
        for i in range(n):
            if type(keys[i]) is not bytes or type(tokens[i]) is not bytes:
                raise TypeError("keys and tokens must be bytes")
            size += _txn_size(<bytes>keys[i], <bytes>tokens[i])
        if self._closed or self._gen != _fork_gen:
            w.fut.set_exception(self._not_sent("the connection is closed"))
            return w.fut
        if w.want == 0:
            w.fut.set_result([])
            return w.fut
        cdef bytearray formatted = bytearray()
        if trailer is not None:
            _aio_format(trailer, formatted)  # first: a bad argument leaves nothing half-queued
        old = PyByteArray_GET_SIZE(self._wbuf)
        PyByteArray_Resize(self._wbuf, old + size)
        at = PyByteArray_AS_STRING(self._wbuf) + old
        for i in range(n):
            at += _acquire_resp(at, <bytes>keys[i], <bytes>tokens[i], ms, fenced)
        PyByteArray_Resize(self._wbuf, <Py_ssize_t>(at - PyByteArray_AS_STRING(self._wbuf)))
        self._wbuf += formatted
        self._queue(w)
        return w.fut

    def pipeline(self, list commands):
        """Send several commands back to back; a future for the list of their replies."""
        cdef _AioWaiter w = _AioWaiter.__new__(_AioWaiter)
        cdef tuple command
        w.fut = self._loop.create_future()
        w.want = len(commands)
        w.got = []
        if self._closed or self._gen != _fork_gen:
            w.fut.set_exception(self._not_sent("the connection is closed"))
            return w.fut
        if w.want == 0:
            w.fut.set_result([])
            return w.fut
        # Format all first: a bad argument must leave nothing half-queued.
        cdef bytearray formatted = bytearray()
        for command in commands:
            _aio_format(command, formatted)
        self._wbuf += formatted
        self._queue(w)
        return w.fut

    cdef _queue(self, _AioWaiter w):
        if not self._waiters:
            # The reply clock starts when the connection goes from idle to busy.
            self._progress_at = self._loop.time()
            if self._timer is None:
                self._timer = self._loop.call_at(self._progress_at + self._timeout, self._check_timeout)
        self._waiters.append(w)
        self._unflushed += 1
        if not self._flush_scheduled:
            # Coalesce: everything queued until the loop runs its callbacks goes in one write.
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self):
        self._flush_scheduled = False
        if self._closed or self._unflushed == 0 or self._gen != _fork_gen:
            # Closing: connection_lost will fail the unwritten waiters as "not sent".
            return
        data = self._wbuf
        # A fresh buffer: the transport may keep a view of the one it was given.
        self._wbuf = bytearray()
        self._unflushed = 0
        self.writes += 1
        self._transport.write(data)

    # -- receiving --------------------------------------------------------------------

    def data_received(self, data):
        cdef void *reply = NULL
        cdef bint alien = False
        cdef bytes chunk = data if type(data) is bytes else bytes(data)
        if self._closed and self._why is not None:
            # Given up on already (a reply not asked for, say): whatever else was in the
            # transport's buffer belongs to no one.
            return
        if redisReaderFeed(self._reader, PyBytes_AS_STRING(chunk), <size_t>PyBytes_GET_SIZE(chunk)) != REDIS_OK:
            self._broken("the reply buffer could not grow")
            return
        self._progress_at = self._loop.time()
        while True:
            if redisReaderGetReply(self._reader, &reply) != REDIS_OK:
                self._broken(f"protocol error: {(<bytes>self._reader.errstr).decode('utf-8', 'replace')}")
                return
            if reply == NULL:
                if hotlock_reader_pending(self._reader) > AIO_MAX_PENDING:
                    self._broken(f"a reply larger than {AIO_MAX_PENDING} bytes")
                elif self._retiring and not self._waiters and self._transport is not None:
                    self._transport.close()  # retired, and every written command answered
                return
            if len(self._waiters) > self._unflushed and _in_txn(<_AioWaiter>self._waiters[0]):
                # A transaction's reply: kept, and decided in C with its last.
                if _aio_odd(<redisReply *>reply):
                    freeReplyObject(reply)
                    self._broken("a reply of a type this connection never asked for (RESP3)")
                    return
                if not self._txn_reply(<_AioWaiter>self._waiters[0], <redisReply *>reply):
                    continue
                value = self._answer(<_AioWaiter>self._waiters[0])
                if not self._deliver(value):
                    self._broken("a reply came that no command was waiting for")
                    return
                continue
            try:
                value = _aio_reply(<redisReply *>reply, self._reply_error, &alien)
            finally:
                freeReplyObject(reply)
            if alien:
                # A RESP3 push or attribute, or a reply no RESP2 command gets: not the
                # reply the oldest waiter expects, and handing it over would shift every
                # later reply onto the wrong waiter.
                self._broken("a reply of a type this connection never asked for (RESP3)")
                return
            if not self._deliver(value):
                self._broken("a reply came that no command was waiting for")
                return

    cdef bint _txn_reply(self, _AioWaiter w, redisReply *reply) noexcept:
        """Keep one of an acquire's replies; True once it has them all (w.per)."""
        w.four[w.held] = reply
        w.held += 1
        return w.held == w.per

    cdef object _answer(self, _AioWaiter w):
        """The replies w holds, decided (see acquire) and let go of."""
        cdef int err = 0, i
        cdef long long answer
        cdef redisReply *r
        answer = _acquire_read(w.four, w.per == 4, &err)
        try:
            if answer == _TXN_ERROR:
                r = w.four[err]
                return self._reply_error(PyBytes_FromStringAndSize(r.str, <Py_ssize_t>r.len).decode("utf-8", "replace"))
            if answer == _TXN_NO_MULTI:
                r = w.four[0]
                self.multi_refusal = PyBytes_FromStringAndSize(r.str, <Py_ssize_t>r.len).decode("utf-8", "replace")
            return answer
        finally:
            for i in range(w.held):
                freeReplyObject(w.four[i])
            w.held = 0

    cdef bint _deliver(self, object value) except -1:
        cdef _AioWaiter w
        if len(self._waiters) <= self._unflushed:
            return False
        w = <_AioWaiter>self._waiters[0]
        if w.got is None:
            self._waiters.popleft()
            # A cancelled waiter still takes its reply off the wire; it is just dropped.
            if not w.fut.done():
                w.fut.set_result(value)
            return True
        w.got.append(value)
        if len(w.got) == w.want:
            self._waiters.popleft()
            if not w.fut.done():
                w.fut.set_result(w.got[0] if w.single else w.got)
        return True

    def _check_timeout(self):
        self._timer = None
        if (self._closed and not self._retiring) or not self._waiters:
            return
        now = self._loop.time()
        if len(self._waiters) == self._unflushed:
            # Nothing written is waiting, only commands about to be flushed: their clock
            # starts now. (Stopping the timer here would leave them with none at all.)
            self._progress_at = now
        # Redis answers a connection in order, so "no reply byte for `timeout` while a
        # written command waits" is exactly "the oldest command got no reply in time".
        due = self._progress_at + self._timeout
        if now >= due:
            self._timed_out = True
            self._broken("no reply within the timeout")
            return
        self._timer = self._loop.call_at(due, self._check_timeout)

    cdef _broken(self, str why):
        """Give up on the connection: its replies can no longer be matched to commands."""
        self._closed = True
        if self._why is None:
            self._why = why
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport):
        self._transport = transport
        self._closed = False

    def eof_received(self):
        # The server closed (CLIENT KILL, restart, timeout): stop queueing on this
        # connection now, before connection_lost, so new commands go to a new one.
        self._closed = True
        return False

    def connection_lost(self, exc):
        cdef Py_ssize_t i, written
        cdef _AioWaiter w
        self._closed = True
        if not self._lost.done():
            self._lost.set_result(None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        written = len(self._waiters) - self._unflushed
        if self._why is not None:
            what = self._why
        elif exc is not None:
            what = f"connection lost: {exc}"
        else:
            what = "connection closed by the server"
        waiters = self._waiters
        self._waiters = _aio_deque()
        self._wbuf = bytearray()
        self._unflushed = 0
        for i in range(len(waiters)):
            w = <_AioWaiter>waiters[i]
            if w.fut.done():
                continue
            if i >= written:
                # Never handed to the transport: safe to send again on a new connection.
                w.fut.set_exception(self._not_sent(what))
            elif self._timed_out:
                w.fut.set_exception(TimeoutError(what))
            else:
                w.fut.set_exception(ConnectionError(what))

    def pause_writing(self):
        # The transport buffers what it cannot send yet; commands are small and each one
        # has a waiter bounded by the reply timeout, so there is nothing to throttle.
        pass

    def resume_writing(self):
        pass

    # -- lifetime ---------------------------------------------------------------------

    def close(self):
        """Close after writing what is queued; waiters still pending fail at connection_lost.

        In a forked child the socket is the parent's: nothing queued here is written to it
        and it is not closed (the parent's connection goes on); the child's waiters fail
        now, as "not sent"."""
        if self._gen != _fork_gen:
            self._closed = True
            self._forget("closed in a forked child: the connection is the parent's")
            return
        self._flush()
        self._closed = True
        if self._transport is not None:
            self._transport.close()

    def lost(self):
        """A future done once the transport has let go of its socket (connection_lost): a
        TLS close is over only after its close_notify exchange, a round trip later."""
        return self._lost

    cdef _forget(self, str why):
        """Fail every waiter as not sent and drop the queue, touching no socket."""
        cdef _AioWaiter w
        waiters = self._waiters
        self._waiters = _aio_deque()
        self._wbuf = bytearray()
        self._unflushed = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for w in waiters:
            if not w.fut.done():
                w.fut.set_exception(self._not_sent(why))

    def retire(self):
        """Take no new command (a transient reply: the next goes on a new connection, see
        hotlock._transient), and close once every command already queued has its reply:
        the other tasks' calls on this connection lose nothing."""
        if self._gen != _fork_gen:
            self.close()
            return
        self._flush()
        self._closed = True
        self._retiring = True
        if not self._waiters and self._transport is not None:
            self._transport.close()

    def abort(self):
        """Drop the connection now (READONLY: a demoted primary is not to be used again)."""
        self._closed = True
        if self._gen != _fork_gen:
            # The parent's socket: left alone; the child's waiters would otherwise wait on
            # a connection_lost that never comes to this copy.
            self._forget("dropped in a forked child: the connection is the parent's")
            return
        if self._transport is not None:
            self._transport.abort()


class AioProtocol(AioCore, _aio_asyncio.Protocol):
    """hotlock.aio's native connection. asyncio.Protocol as a base so the loop sees a protocol."""

    __slots__ = ()
