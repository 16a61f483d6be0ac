# The sync client: one redisContext per thread, the GIL released for every round trip.
#
# Why a connection per thread rather than a shared one behind a mutex or a pool: a
# redisContext is a single ordered stream of requests and replies, so a shared one would
# serialise every thread's round trips behind one lock held across network waits (and
# taking that lock without the GIL risks a deadlock with it). A per-thread context needs
# no locking at all on the hot path, and a thread's context dies with the thread
# (threading.local drops it). The cost is one Redis connection per thread that locks.

cdef extern from "<poll.h>" nogil:
    cdef struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    # poll() with a timespec, for the sub-millisecond first steps of the backoff (Python.h
    # defines _GNU_SOURCE, under which glibc declares it).
    int ppoll(pollfd *fds, unsigned long nfds, const timespec *tmo, const void *sigmask)
    enum:
        POLLIN


cdef inline void _sleep_fd(int fd, double ms) noexcept nogil:
    # The backoff sleep of a waiter with wake-ups (hotlock.backends.wakeup.Waiter): ms at most,
    # less when the subscriber writes fd; a wake is taken (read) here. A signal (EINTR)
    # ends it early, as _sleep_ms.
    cdef pollfd p
    cdef timespec ts
    cdef char buf[64]
    if ms < 0.0:
        ms = 0.0
    ts.tv_sec = <time_t>(ms / 1000.0)
    ts.tv_nsec = <long>((ms - <double>ts.tv_sec * 1000.0) * 1e6)
    p.fd = fd
    p.events = POLLIN
    p.revents = 0
    if ppoll(&p, 1, &ts, NULL) > 0:
        read(fd, buf, 64)


from cpython.pythread cimport PyThread_get_thread_ident
from cpython.ref cimport PyObject

cdef extern from "compat.h":
    object hotlock_weakref_target(object ref)

# How recently a connection must have been used for a resent command to skip its
# staleness poll() (see NativeBackend._ready).
cdef double _FRESH_S = 0.002

cdef const char *_S_EVALSHA = b"EVALSHA"
cdef const char *_S_ONE = b"1"
cdef const char *_S_SET = b"SET"
cdef const char *_S_IFEQ = b"IFEQ"
cdef const char *_S_PX = b"PX"
cdef const char *_S_DELIFEQ = b"DELIFEQ"
cdef const char *_S_DELEX = b"DELEX"

# NativeBackend._plain: what extend and release send (hotlock._dialect decides, at connect).
cdef enum:
    _PLAIN_NONE = 0  # the EXTEND/RELEASE scripts
    _PLAIN_DELIFEQ = 1  # SET key v IFEQ v PX ms; DELIFEQ key v (Valkey 9)
    _PLAIN_DELEX = 2  # SET key v IFEQ v PX ms; DELEX key IFEQ v (Redis 8.4+)


cdef class _Conn:
    """One thread's connection. Its context is touched only by its thread, with the GIL
    held, or without the GIL between `busy = True` and `busy = False`.

    While a call of its thread uses it (`calls` > 0), its context is freed only by that
    thread: close() from another thread marks it `doomed`, and the call drops it when it
    ends (_leave). A call may release the GIL at any point (a round trip, a connect, any
    Python code it runs), so a context freed from under it would be used after free."""

    cdef redisContext *ctx
    cdef void *ssl  # over rediss://, ctx's SSL object (owned by ctx); else NULL
    cdef bint answered  # a reply has arrived on ctx (see NativeBackend._lost)
    cdef unsigned long gen  # _fork_gen when it connected: another value means inherited
    cdef unsigned long epoch  # under Sentinel, the PrimaryWatch epoch it connected in
    cdef bint busy  # a round trip is in flight on ctx without the GIL
    cdef int calls  # calls of its thread using it now (nested: an undo inside an acquire)
    cdef bint doomed  # close() ran while a call used it: the call drops ctx when it ends
    cdef double used  # monotonic time its last round trip ended (see _ready)
    cdef double authed  # monotonic time it last sent AUTH (reauth_interval: see _ready)
    cdef bint piped  # its last round trip read more than one reply (see _ready)
    cdef object __weakref__

    def __dealloc__(self):
        _drop(self)


cdef void _drop(_Conn conn) noexcept:
    """Forget conn's context now, without sending a byte (never QUIT: a child must stay
    silent). Only for the thread that owns conn, or a conn no call is using (_close)."""
    cdef redisContext *ctx = conn.ctx
    conn.doomed = False
    if ctx is NULL:
        return
    conn.ctx = NULL
    conn.ssl = NULL
    if conn.busy and conn.gen != _fork_gen:
        # Inherited mid-round-trip: the thread that was using it did not survive the fork
        # and may have left the struct half-updated. Close our copy of the fd (the
        # parent's socket stays open: close() only drops this process's reference) and
        # leak the struct rather than walk it.
        if ctx.fd >= 0:
            close(ctx.fd)
        return
    # redisFree closes the fd and frees memory; it writes nothing, so it is safe in a
    # forked child too (the parent's socket stays open).
    redisFree(ctx)


cdef void _close(_Conn conn) noexcept:
    """close() from any thread: a connection a call of this process is using is left to
    that call, which drops it when it ends (_leave); any other is dropped now."""
    if (conn.calls > 0 or conn.busy) and conn.gen == _fork_gen:
        conn.doomed = True
    else:
        _drop(conn)


cdef inline void _enter(_Conn conn) noexcept:
    """A call starts using conn (see _Conn): pair with _leave in a finally."""
    conn.calls += 1


cdef inline void _leave(_Conn conn) noexcept:
    conn.calls -= 1
    if conn.calls == 0 and conn.doomed:
        _drop(conn)


cdef inline bint _stale(redisContext *ctx, void *ssl) noexcept nogil:
    # An idle connection must have nothing to read. If it has, the server closed it
    # (CLIENT KILL, timeout, restart) or sent something we did not ask for: reconnect
    # before sending rather than lose the next command, as redis-py's pool does. Over
    # TLS a readable socket may hold only session tickets: OpenSSL is asked.
    cdef pollfd p
    p.fd = ctx.fd
    p.events = POLLIN
    p.revents = 0
    if poll(&p, 1, 0) == 0:
        return False
    return ssl is NULL or hotlock_tls_idle_data(ssl, ctx.fd) != 0


cdef inline int _exchange(_Conn conn, redisReply **out, Py_ssize_t n) noexcept:
    """Flush the appended commands and read n replies into out, without the GIL.

    0 when all n arrived; -1 on an I/O error, a timeout (ctx.err says which) or a reply
    stream in doubt (hotlock_suspect_stream: a reply of a kind no command here asks for,
    or bytes left over once the n replies are read), which is handled as a lost reply:
    the connection is dropped, so a stray reply can never be read as the next command's.
    out[i] is a reply or NULL either way: the caller frees them. conn is in a call
    (_enter), so close() cannot free ctx meanwhile."""
    cdef redisContext *ctx = conn.ctx
    cdef Py_ssize_t i
    cdef int rc = 0
    for i in range(n):
        out[i] = NULL
    conn.busy = True
    with nogil:
        for i in range(n):
            if redisGetReply(ctx, <void **>&out[i]) != REDIS_OK:
                out[i] = NULL
                rc = -1
                break
        if rc == 0 and hotlock_suspect_stream(ctx, <const redisReply **>out, n):
            rc = -1
    conn.busy = False
    conn.used = _monotonic()
    conn.piped = n > 1
    if rc == 0:
        conn.answered = True
    return rc


cdef int _exchange_calls(_Conn conn, redisReply **out, Py_ssize_t total, const char *todo, Py_ssize_t n,
                         bint fenced, long long *values) noexcept:
    """_exchange for a round of NativeBackend._scripts: the replies of n calls in order
    (todo[i] 2: the acquire's _acquire_replies(fenced), 1: one, 0: none), then any after
    them (WAIT), total in all. A call whose replies end it the common way, as _scripts
    would take them (the acquire's fence or TAKEN, an integer reply; none of an odd kind),
    is decided as soon as they are read: values[i] is set and they are freed at once and
    left NULL in out, for _scripts to pass over. Freed as they come, a batch's replies
    reuse a few blocks of the allocator's per-size caches, as a C loop's do; held to the
    end, a hundred acquires' 1,600 small blocks overflowed those caches and glibc merged
    them back at the next large allocation, a fifth of the client's CPU in a lock_many.
    Which calls were decided here is not kept: after a failure (-1) _scripts resends
    todo as it was, and values are written again."""
    cdef redisContext *ctx = conn.ctx
    cdef Py_ssize_t i, j = 0, k, m
    cdef long long answer
    cdef int rc = 0, err = 0
    cdef bint odd
    for i in range(total):
        out[i] = NULL
    conn.busy = True
    with nogil:
        for i in range(n):
            if not todo[i]:
                continue
            k = _acquire_replies(fenced) if todo[i] == 2 else 1
            odd = False
            for m in range(k):
                if redisGetReply(ctx, <void **>&out[j + m]) != REDIS_OK:
                    out[j + m] = NULL
                    rc = -1
                    break
                odd = odd or hotlock_odd_reply(out[j + m])
            if rc != 0:
                break
            if odd:
                pass  # kept for hotlock_suspect_stream
            elif todo[i] == 2:
                answer = _acquire_read(out + j, fenced, &err)
                if answer > 0:
                    values[i] = answer
                    for m in range(k):
                        freeReplyObject(out[j + m])
                        out[j + m] = NULL
            elif out[j].type == REDIS_REPLY_INTEGER:
                values[i] = out[j].integer
                freeReplyObject(out[j])
                out[j] = NULL
            j += k
        if rc == 0:
            while j < total:
                if redisGetReply(ctx, <void **>&out[j]) != REDIS_OK:
                    out[j] = NULL
                    rc = -1
                    break
                j += 1
        if rc == 0 and hotlock_suspect_stream(ctx, <const redisReply **>out, total):
            rc = -1
    conn.busy = False
    conn.used = _monotonic()
    conn.piped = total > 1
    if rc == 0:
        conn.answered = True
    return rc


# The hot commands' wire form (RESP: *argc, then $len + bytes per argument) is written
# here and handed to hiredis whole. redisAppendCommandArgv formats each argument through
# sdscatfmt and grows its buffer step by step: ~3,900 instructions for an acquire's EVALSHA
# and ~1,900 for a release's, against ~250 here. Rare and handshake commands still go
# through hiredis (_append_args); tests/test_native.py compares the two byte for byte.
DEF _RESP_STACK = 2048


cdef inline char *_crlf(char *p) noexcept nogil:
    p[0] = 13
    p[1] = 10
    return p + 2


cdef inline size_t _resp_size(int argc, const size_t *lens) noexcept nogil:
    """An upper bound of the command's wire size."""
    cdef size_t total = 24  # "*" + up to 20 digits + CRLF, rounded up
    cdef int i
    for i in range(argc):
        total += 25 + lens[i]  # "$" + up to 20 digits + CRLF + the argument + CRLF
    return total


cdef size_t _resp(char *buf, int argc, const char **argv, const size_t *lens) noexcept nogil:
    """Write the command's wire form at buf (room for _resp_size); return its length."""
    cdef char *p = buf
    cdef int i
    p[0] = 42  # '*'
    p = _crlf(p + 1 + _decimal(p + 1, <unsigned long long>argc))
    for i in range(argc):
        p[0] = 36  # '$'
        p = _crlf(p + 1 + _decimal(p + 1, <unsigned long long>lens[i]))
        memcpy(p, argv[i], lens[i])
        p = _crlf(p + lens[i])
    return <size_t>(p - buf)


cdef inline int _append_resp(redisContext *ctx, int argc, const char **argv, const size_t *lens) noexcept:
    """= redisAppendCommandArgv(ctx, argc, argv, lens): the same bytes appended."""
    cdef char buf[_RESP_STACK]
    if _resp_size(argc, lens) > _RESP_STACK:  # a long key: hiredis formats it
        return redisAppendCommandArgv(ctx, argc, argv, lens)
    return redisAppendFormattedCommand(ctx, buf, _resp(buf, argc, argv, lens))


def _resp_pair(list args not None):
    """Test hook: (ours, hiredis's) wire form of one command given as bytes arguments."""
    cdef int n = len(args), i
    cdef const char *argv[16]
    cdef size_t lens[16]
    cdef char *cmd = NULL
    cdef long long length
    cdef bytes ours
    if n > 16:
        raise ValueError("at most 16 arguments")
    for i in range(n):
        argv[i] = PyBytes_AS_STRING(args[i])
        lens[i] = <size_t>PyBytes_GET_SIZE(args[i])
    ours = PyBytes_FromStringAndSize(NULL, _resp_size(n, lens))
    ours = ours[:_resp(PyBytes_AS_STRING(ours), n, argv, lens)]
    length = redisFormatCommandArgv(&cmd, n, argv, lens)
    if length < 0:
        raise MemoryError()
    theirs = cmd[:length]
    redisFreeCommand(cmd)
    return ours, theirs


cdef inline int _append_evalsha(redisContext *ctx, bytes sha, bytes key, bytes token, long long ms) noexcept:
    # EVALSHA sha 1 key token [ms]: ms < 0 means no TTL argument (release).
    cdef const char *argv[6]
    cdef size_t lens[6]
    cdef char num[24]
    argv[0] = _S_EVALSHA
    lens[0] = 7
    argv[1] = PyBytes_AS_STRING(sha)
    lens[1] = <size_t>PyBytes_GET_SIZE(sha)
    argv[2] = _S_ONE
    lens[2] = 1
    argv[3] = PyBytes_AS_STRING(key)
    lens[3] = <size_t>PyBytes_GET_SIZE(key)
    argv[4] = PyBytes_AS_STRING(token)
    lens[4] = <size_t>PyBytes_GET_SIZE(token)
    if ms < 0:
        return _append_resp(ctx, 5, argv, lens)
    argv[5] = num
    lens[5] = <size_t>_decimal(num, <unsigned long long>ms)  # ms >= 0 here
    # The arguments are copied into hiredis's output buffer here, so the bytes objects
    # need to live only until this returns.
    return _append_resp(ctx, 6, argv, lens)


cdef inline int _append_plain(redisContext *ctx, int plain, bytes key, bytes token, long long ms) noexcept:
    # The Lua-free extend (ms >= 0) and release (ms < 0): the commands of hotlock._dialect.
    cdef const char *argv[7]
    cdef size_t lens[7]
    cdef char num[24]
    cdef const char *k = PyBytes_AS_STRING(key)
    cdef size_t klen = <size_t>PyBytes_GET_SIZE(key)
    cdef const char *t = PyBytes_AS_STRING(token)
    cdef size_t tlen = <size_t>PyBytes_GET_SIZE(token)
    if ms >= 0:
        argv[0] = _S_SET; lens[0] = 3
        argv[1] = k; lens[1] = klen
        argv[2] = t; lens[2] = tlen
        argv[3] = _S_IFEQ; lens[3] = 4
        argv[4] = t; lens[4] = tlen
        argv[5] = _S_PX; lens[5] = 2
        argv[6] = num
        lens[6] = <size_t>_decimal(num, <unsigned long long>ms)  # ms >= 0 here
        return _append_resp(ctx, 7, argv, lens)
    if plain == _PLAIN_DELIFEQ:
        argv[0] = _S_DELIFEQ; lens[0] = 7
        argv[1] = k; lens[1] = klen
        argv[2] = t; lens[2] = tlen
        return _append_resp(ctx, 3, argv, lens)
    argv[0] = _S_DELEX; lens[0] = 5
    argv[1] = k; lens[1] = klen
    argv[2] = _S_IFEQ; lens[2] = 4
    argv[3] = t; lens[3] = tlen
    return _append_resp(ctx, 4, argv, lens)


# The transaction acquire of hotlock._acquire: MULTI, SET key token NX PX ms, TIME, EXEC,
# written as one piece (the constant three as they are on the wire), and its four replies
# decided in C by hotlock._acquire.read's rules (_txn_read), with no Python object made
# on the way to the fence. tests/unit/test_acquire.py holds the two to the same answers.
cdef const char *_W_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
cdef const char *_W_TIME = b"*1\r\n$4\r\nTIME\r\n"
cdef const char *_W_EXEC = b"*1\r\n$4\r\nEXEC\r\n"
cdef const char *_S_MULTI = b"MULTI"
cdef const char *_S_NX = b"NX"
cdef const char *_S_TIME = b"TIME"
cdef const char *_S_EXEC = b"EXEC"
cdef enum:
    _TXN_TAKEN = 1  # SET NX PX alone took the key: no fence (hotlock._acquire.TAKEN)
    _TXN_SCRIPT = 0  # the ACQUIRE script decides (hotlock._acquire.SCRIPT)
    _TXN_NO_MULTI = -1  # SCRIPT too, and MULTI was refused alone (hotlock._acquire.refused_multi)
    _TXN_ERROR = -2  # an error reply, handled as the script's would be


cdef inline void _txn_set_argv(const char **argv, size_t *lens, char *num, bytes key, bytes token,
                               long long ms) noexcept:
    argv[0] = _S_SET; lens[0] = 3
    argv[1] = PyBytes_AS_STRING(key); lens[1] = <size_t>PyBytes_GET_SIZE(key)
    argv[2] = PyBytes_AS_STRING(token); lens[2] = <size_t>PyBytes_GET_SIZE(token)
    argv[3] = _S_NX; lens[3] = 2
    argv[4] = _S_PX; lens[4] = 2
    argv[5] = num
    lens[5] = <size_t>_decimal(num, <unsigned long long>ms)  # ms > 0 for an acquire


cdef inline size_t _txn_size(bytes key, bytes token) noexcept:
    """An upper bound of the transaction's wire size (_txn_resp)."""
    return 15 + 14 + 14 + 24 + 6 * 25 + 3 + <size_t>PyBytes_GET_SIZE(key) + <size_t>PyBytes_GET_SIZE(token) + 2 + 2 + 20


cdef size_t _txn_resp(char *buf, bytes key, bytes token, long long ms) noexcept:
    """= hotlock._acquire.commands(key, token, ms) on the wire, at buf (room for _txn_size)."""
    cdef const char *argv[6]
    cdef size_t lens[6]
    cdef char num[24]
    cdef size_t n
    _txn_set_argv(argv, lens, num, key, token, ms)
    memcpy(buf, _W_MULTI, 15)
    n = 15 + _resp(buf + 15, 6, argv, lens)
    memcpy(buf + n, _W_TIME, 14)
    memcpy(buf + n + 14, _W_EXEC, 14)
    return n + 28


cdef size_t _acquire_resp(char *buf, bytes key, bytes token, long long ms, bint fenced) noexcept:
    """= hotlock._acquire.commands(key, token, ms, fenced) on the wire, at buf (room for
    _txn_size, which bounds both forms)."""
    cdef const char *argv[6]
    cdef size_t lens[6]
    cdef char num[24]
    if fenced:
        return _txn_resp(buf, key, token, ms)
    _txn_set_argv(argv, lens, num, key, token, ms)
    return _resp(buf, 6, argv, lens)


cdef int _append_txn(redisContext *ctx, bytes key, bytes token, long long ms) noexcept:
    """Append the transaction (four commands, four replies) in one piece."""
    cdef char buf[_RESP_STACK]
    cdef const char *argv[6]
    cdef size_t lens[6]
    cdef char num[24]
    if _txn_size(key, token) <= _RESP_STACK:
        return redisAppendFormattedCommand(ctx, buf, _txn_resp(buf, key, token, ms))
    # A long key: hiredis formats the SET.
    _txn_set_argv(argv, lens, num, key, token, ms)
    if (redisAppendFormattedCommand(ctx, _W_MULTI, 15) != REDIS_OK
            or redisAppendCommandArgv(ctx, 6, argv, lens) != REDIS_OK
            or redisAppendFormattedCommand(ctx, _W_TIME, 14) != REDIS_OK):
        return REDIS_ERR
    return redisAppendFormattedCommand(ctx, _W_EXEC, 14)


cdef inline int _append_acquire(redisContext *ctx, bytes key, bytes token, long long ms, bint fenced) noexcept:
    """The acquire of a free key: the transaction, or SET NX PX alone when not ``fenced``
    (connect(fences=False)); _acquire_replies(fenced) replies."""
    cdef const char *argv[6]
    cdef size_t lens[6]
    cdef char num[24]
    if fenced:
        return _append_txn(ctx, key, token, ms)
    _txn_set_argv(argv, lens, num, key, token, ms)
    return _append_resp(ctx, 6, argv, lens)


cdef inline int _acquire_replies(bint fenced) noexcept nogil:
    return 4 if fenced else 1


def _acquire_wire(bytes key not None, bytes token not None, long long ms, bint fenced=True):
    """Test hook: the acquire's wire form as _acquire_resp writes it (compared with
    hiredis's form of hotlock._acquire.commands)."""
    cdef bytes ours = PyBytes_FromStringAndSize(NULL, _txn_size(key, token))
    return ours[:_acquire_resp(PyBytes_AS_STRING(ours), key, token, ms, fenced)]


cdef inline long long _clock_part(const redisReply *r) noexcept nogil:
    """One of TIME's two numbers: a decimal string (or an integer reply); -1 if neither."""
    cdef long long v = 0
    cdef size_t i
    cdef char c
    if r.type == REDIS_REPLY_INTEGER:
        return r.integer
    if (r.type != REDIS_REPLY_STRING and r.type != REDIS_REPLY_STATUS) or r.len == 0 or r.len > 18:
        return -1
    for i in range(r.len):
        c = r.str[i]
        if c < 48 or c > 57:
            return -1
        v = v * 10 + (c - 48)
    return v


cdef inline long long _fence_of(const redisReply *t) noexcept nogil:
    """= hotlock._acquire.fence_of: TIME's reply as the clock in microseconds; 0 if it is
    not [seconds, microseconds]."""
    cdef long long s, u
    if t.type != REDIS_REPLY_ARRAY or t.elements != 2:
        return 0
    s = _clock_part(t.element[0])
    u = _clock_part(t.element[1])
    if s <= 0 or u < 0 or u >= 1000000 or s > 9000000000000LL:
        return 0
    return s * 1000000 + u


cdef long long _txn_read(redisReply **r, int *err) noexcept nogil:
    """= hotlock._acquire.read over the transaction's four replies r[0..3]: the fence
    (> 0), _TXN_SCRIPT, _TXN_NO_MULTI, or _TXN_ERROR with *err the index of the error
    reply the call failed with (MULTI's NOAUTH/WRONGPASS, else SET's, TIME's or EXEC's, the
    first)."""
    cdef int i
    cdef redisReply *e
    cdef redisReply *taken
    if _auth_refused(r[0]):
        err[0] = 0
        return _TXN_ERROR
    if r[0].type == REDIS_REPLY_ERROR and r[1].type != REDIS_REPLY_ERROR:
        return _TXN_NO_MULTI
    for i in range(1, 4):
        if r[i].type == REDIS_REPLY_ERROR:
            err[0] = i
            return _TXN_ERROR
    e = r[3]
    if e.type == REDIS_REPLY_ARRAY and e.elements == 2:
        taken = e.element[0]
        if (taken.type == REDIS_REPLY_STATUS or taken.type == REDIS_REPLY_STRING) and taken.len == 2 \
                and taken.str[0] == 79 and taken.str[1] == 75:  # OK: the key is ours now
            return _fence_of(e.element[1])  # 0 (SCRIPT) for a clock of no known shape
    # nil (the key exists: held, ours after a lost reply, or permits), or a shape no
    # server sends: the script asks again, and its reply is checked.
    return _TXN_SCRIPT


cdef long long _acquire_read(redisReply **r, bint fenced, int *err) noexcept nogil:
    """= hotlock._acquire.read: the transaction's four replies (_txn_read), or SET NX PX's
    one when not ``fenced``: _TXN_TAKEN (OK), _TXN_SCRIPT (nil: the key exists; or a reply
    no server sends, which the script asks again), or _TXN_ERROR (*err 0)."""
    cdef redisReply *taken = r[0]
    if fenced:
        return _txn_read(r, err)
    if taken.type == REDIS_REPLY_ERROR:
        err[0] = 0
        return _TXN_ERROR
    if (taken.type == REDIS_REPLY_STATUS or taken.type == REDIS_REPLY_STRING) and taken.len == 2 \
            and taken.str[0] == 79 and taken.str[1] == 75:  # OK
        return _TXN_TAKEN
    return _TXN_SCRIPT


def _read_acquire(bytes resp not None, bint fenced=True):
    """Test hook: the acquire's replies given as RESP (four, or one when not ``fenced``),
    read by a hiredis reader and decided by _acquire_read: the fence (or 1, TAKEN), 0
    (SCRIPT), -1 (SCRIPT, MULTI refused alone) or the text of the error reply the call
    failed with."""
    cdef redisReader *reader = redisReaderCreate()
    cdef redisReply *r[4]
    cdef void *reply
    cdef int i, got = 0, err = 0, want = _acquire_replies(fenced)
    cdef long long answer
    if reader is NULL:
        raise MemoryError()
    try:
        if redisReaderFeed(reader, PyBytes_AS_STRING(resp), <size_t>PyBytes_GET_SIZE(resp)) != REDIS_OK:
            raise MemoryError()
        while got < want:
            reply = NULL
            if redisReaderGetReply(reader, &reply) != REDIS_OK:
                raise ValueError((<bytes>reader.errstr).decode("utf-8", "replace"))
            if reply is NULL:
                raise ValueError(f"{got} replies, not {want}")
            r[got] = <redisReply *>reply
            got += 1
        answer = _acquire_read(r, fenced, &err)
        if answer == _TXN_ERROR:
            return r[err].str[:r[err].len].decode("utf-8", "replace")
        return answer
    finally:
        for i in range(got):
            freeReplyObject(r[i])
        redisReaderFree(reader)


cdef int _append_args(redisContext *ctx, tuple args) except -1:
    """Append one command given as a tuple of bytes (handshake and rare commands)."""
    cdef Py_ssize_t n = len(args), i
    cdef const char **argv = <const char **>malloc(n * sizeof(char *))
    cdef size_t *lens = <size_t *>malloc(n * sizeof(size_t))
    cdef bytes arg
    try:
        if argv is NULL or lens is NULL:
            raise MemoryError()
        for i in range(n):
            arg = args[i]
            if arg is None:
                raise TypeError("a command's arguments are bytes")
            argv[i] = PyBytes_AS_STRING(arg)
            lens[i] = <size_t>PyBytes_GET_SIZE(arg)
        if redisAppendCommandArgv(ctx, <int>n, argv, lens) != REDIS_OK:
            raise MemoryError()
    finally:
        free(argv)
        free(lens)
    return 0


cdef inline bint _is_error(redisReply *r, const char *prefix, size_t n) noexcept nogil:
    return r.type == REDIS_REPLY_ERROR and r.len >= n and memcmp(r.str, prefix, n) == 0


cdef str _unexpected(str command, redisReply *r):
    """= hotlock.backends.redispy.UnexpectedReply's words for a reply of a kind ``command``
    never gets: an integer or nil shown, anything else only by its kind (it might echo a
    token, which no error message may hold)."""
    if r.type == REDIS_REPLY_INTEGER:
        shown = str(r.integer)
    elif r.type == REDIS_REPLY_NIL:
        shown = "None"
    else:
        shown = "a list" if r.type == REDIS_REPLY_ARRAY else "a bytes"
    return f"unexpected reply to {command}: {shown}"


cdef str _io_text(redisContext *ctx):
    if hotlock_timed_out(ctx):
        return "no reply within the timeout"
    text = (<bytes>ctx.errstr).decode("utf-8", "replace")
    return text or "connection lost"


# The lost-reply rule (docs/architecture.md), one per call and shared by every round trip the
# call makes, the connect handshake included: after a lost reply (I/O error or timeout,
# the connection dropped) the call tries once more, on a new connection, if at least 1 ms
# is left until `until`; the retry's round trips get what is left (at most one reply
# timeout) as their timeout, so the call still returns by `until`. What may be sent again:
# - the handshake (AUTH, SELECT, SCRIPT LOAD) and a script reload, always: they carry
#   nothing of the call, and running them twice changes nothing;
# - the call's own commands only when `resend`: an acquire with the same token (the
#   script counts "already my token" as success) and a release (a second run finds
#   nothing to do). Never INCRBY or SET NX: a resent INCRBY counts twice, a resent SET NX
#   answers "not set" for the value this call set; their lost reply is a CacheError.
cdef inline double _resend_until(double start, double wait_s, double timeout) noexcept nogil:
    """= hotlock._transient.resend_until: a call that may wait wait_s ends within
    max(wait, one reply timeout) plus one reply timeout, lost reply or not."""
    return start + (wait_s if wait_s > timeout else timeout) + timeout


def _resend_deadline(double start, double wait_s, double timeout):
    """Test hook: _resend_until, held to hotlock._transient.resend_until."""
    return _resend_until(start, wait_s, timeout)


cdef struct _Retry:
    double until  # a monotonic time: see NativeBackend._rule
    double limit  # > 0 once retrying: the timeout in effect for the retry's round trips
    bint resend  # the call's own commands may be sent twice
    bint spent  # the one retry has been used
    int transient  # resends after a transient reply (hotlock._transient) so far


cdef str _tried(str what, _Retry *rule):
    if rule.spent:
        what = f"{what} (retried after a lost reply)"
    if rule.transient:
        # The same words as every other path's (hotlock._transient.Retrying.tried).
        tried = _Retrying()
        tried.attempts = rule.transient
        what = tried.tried(what)
    return what


class _TransientReply(Exception):
    """A handshake command (SCRIPT LOAD on a loading server, say) got a transient reply:
    nothing of the call ran, and the connection is gone (see NativeBackend._reconnect).
    Its args: the reply's code (hotlock._transient.code), then the message to raise."""


cdef class NativeBackend:
    """The Backend protocol over libhiredis (see hotlock.backends.Backend)."""

    name = "native"

    cdef readonly str server
    cdef object _config
    cdef bytes _host  # TCP host, or the unix socket path when _unix
    cdef int _port
    cdef bint _unix
    cdef object _watch  # under Sentinel, the PrimaryWatch asked at each connect; else None
    cdef tuple _auth  # the url's AUTH command, or None (see _connect)
    cdef object _provider  # connect(credential_provider=...), asked at each connect; or None
    cdef double _reauth  # reauth_interval in seconds: AUTH re-sent on a live connection; 0: never
    cdef tuple _select  # the SELECT command, or None
    cdef list _naming  # CLIENT SETNAME / SETINFO (hotlock._config.naming_commands)
    cdef timeval _connect_tv
    cdef timeval _reply_tv
    cdef double _timeout
    cdef long long _wait_replicas
    cdef long long _wait_timeout_ms
    cdef bytes _wait_num  # WAIT's arguments, kept alive for _wait_argv
    cdef bytes _wait_ms
    cdef const char *_wait_argv[3]
    cdef size_t _wait_lens[3]
    cdef object _local  # threading.local: .conn is this thread's _Conn
    cdef object _last  # a weakref to the connection of the thread that called last (see _conn)
    cdef unsigned long _last_thread
    cdef object _conns  # weakref.WeakSet of every _Conn, for close()
    cdef readonly object dialect  # hotlock._dialect.Dialect, set by connect() (use_dialect)
    cdef int _plain  # _PLAIN_*: what extend and release send
    # The acquire of a free key goes as the transaction (hotlock._acquire): the dialect's
    # transaction, until the server refuses MULTI alone (then False for good: _refuse_multi).
    cdef bint _txn
    cdef bint _multi_refused
    cdef readonly bint fenced  # connect(fences=...): the transaction, or SET NX PX alone
    # What an extend passes _scripts as its plain: -1 (the dialect's), or _PLAIN_NONE under
    # wait_replicas, where the script takes a waiter's mark and permits as they are, so one
    # write carries every extend of a call and the one WAIT behind them.
    cdef int _extend_as
    cdef readonly object _wakeups  # hotlock.backends.wakeup.Slot (the wake-up subscriber), or None: wakeups=False
    cdef void *_ssl_ctx  # rediss://: the SSL_CTX every new connection's handshake uses; else NULL
    cdef bint _check_host  # rediss://: the certificate must name the host connected to (or _server_name)
    cdef bytes _server_name  # rediss:// with ssl_server_name: the name checked and sent as SNI; else None
    cdef object _tls_options  # rediss://: the TLSOptions _ssl_ctx was made from
    cdef object _tls_stamp  # rediss://: their files' tls_files_stamp when _ssl_ctx was made

    def __dealloc__(self):
        hotlock_tls_context_free(self._ssl_ctx)
        self._ssl_ctx = NULL

    def __init__(self, config):
        cdef char err[256]
        if config.tls:
            if not HOTLOCK_HAS_TLS:
                # hotlock._connect.choose sends rediss:// to redis-py on a build without TLS.
                raise ValueError("this build of hotlock._native has no TLS")
            self._tls_setup(config.ssl, config.display, err)
        self.server = config.display
        self._config = config
        self._watch = PrimaryWatch(config.primary) if getattr(config, "sentinels", ()) else None
        self._unix = config.unix_path is not None
        self._host = os.fsencode(config.unix_path) if self._unix else config.host.encode("idna")
        self._port = config.port
        # An ACL user with nopass still authenticates by name (hotlock._credentials.auth_args).
        self._auth = auth_args(config.username, config.password)
        self._provider = getattr(config, "credential_provider", None)
        self._reauth = getattr(config, "reauth_interval", 0.0)
        self._select = (b"SELECT", str(config.db).encode()) if config.db else None
        self._naming = naming_commands(config)
        self._connect_tv = _timeval(config.connect_timeout)
        self._reply_tv = _timeval(config.timeout)
        self._timeout = config.timeout
        self._wait_replicas = getattr(config, "wait_replicas", 0)
        self._wait_timeout_ms = round(getattr(config, "wait_timeout", 0.5) * 1000)
        self._wait_num = str(self._wait_replicas).encode()
        self._wait_ms = str(self._wait_timeout_ms).encode()
        self._wait_argv[0] = b"WAIT"
        self._wait_lens[0] = 4
        self._wait_argv[1] = self._wait_num
        self._wait_lens[1] = len(self._wait_num)
        self._wait_argv[2] = self._wait_ms
        self._wait_lens[2] = len(self._wait_ms)
        self._local = threading.local()
        self._conns = weakref.WeakSet()
        self.dialect = UNDETECTED  # the scripts, until connect() has detected the server
        self._plain = _PLAIN_NONE
        self._txn = False
        self._multi_refused = False
        self.fenced = True
        self._extend_as = _PLAIN_NONE if self._wait_replicas else -1
        self._wakeups = _wakeup_slot(config)
        # Connect now: a configured but unreachable server is a CacheError at connect().
        cdef _Retry rule = self._rule(0.0, False)
        cdef _Conn conn = self._conn()
        self._ready(conn, "connect", None, &rule)
        self._settle(conn, &rule)

    cdef int _tls_setup(self, object options, str server, char *err) except -1:
        """The SSL_CTX of options (hotlock._config.TLSOptions), before any I/O."""
        cdef void *made
        stamp = tls_files_stamp(options)
        made = self._tls_context(options, err)
        if made is NULL:
            raise cache_error(f"connect failed: {(<bytes>err).decode('utf-8', 'replace')}", server)
        self._ssl_ctx = made
        self._tls_options = options
        self._tls_stamp = stamp
        self._check_host = options.check_host
        self._server_name = options.server_name.encode("idna") if options.server_name is not None else None
        return 0

    cdef void *_tls_current(self) except? NULL:
        """The SSL_CTX for a new connection, made again first when ssl_ca_certs, ssl_certfile
        or ssl_keyfile changed on disk since (a rotated certificate is picked up by the next
        connection, no restart; three stat() per new connection, no reload when unchanged).
        Files caught half-written (a key that does not match its certificate yet) leave the
        current context in use, and the next connection looks again. Runs with the GIL, so
        two threads never swap it at once; the caller takes its own reference (a connect in
        progress on the old one keeps it alive)."""
        cdef char err[256]
        cdef void *made
        cdef void *old
        stamp = tls_files_stamp(self._tls_options)
        if stamp != self._tls_stamp:
            made = self._tls_context(self._tls_options, err)
            if made is not NULL:
                old = self._ssl_ctx
                self._ssl_ctx = made
                self._tls_stamp = stamp
                hotlock_tls_context_free(old)
        return self._ssl_ctx

    cdef void *_tls_context(self, object options, char *err) except? NULL:
        cdef bytes ca = os.fsencode(options.ca_certs) if options.ca_certs is not None else None
        cdef bytes cert = os.fsencode(options.certfile) if options.certfile is not None else None
        cdef bytes key = os.fsencode(options.keyfile) if options.keyfile is not None else None
        cdef bint ca_dir = ca is not None and os.path.isdir(ca)
        return hotlock_tls_context(
            <const char *>ca if ca is not None else NULL, ca_dir,
            <const char *>cert if cert is not None else NULL,
            <const char *>key if key is not None else NULL,
            options.verify, err, 256)

    # -- connections --------------------------------------------------------------------

    cdef inline _Conn _conn(self):
        # The thread that calls is most often the one that called last: one compare
        # instead of threading.local's attribute lookup. The slot is a weak reference, so
        # a finished thread's connection still dies with its threading.local entry. A
        # thread ident is reused once its thread has ended, so a hit could hand over a
        # dead thread's connection not yet freed; that is still safe, since no live
        # thread can be using it (the dead thread had no call in flight).
        cdef unsigned long me = PyThread_get_thread_ident()
        if me == self._last_thread and self._last is not None:
            last = hotlock_weakref_target(self._last)
            if last is not None:
                return <_Conn>last
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = _Conn()
            self._local.conn = conn
            self._conns.add(conn)
        self._last = weakref.ref(conn)
        self._last_thread = me
        return <_Conn>conn

    cdef inline _Retry _rule(self, double wait_s, bint resend):
        """A call's lost-reply rule (see _Retry), resent until _resend_until from now."""
        cdef _Retry rule
        rule.until = _resend_until(_monotonic(), wait_s, self._timeout)
        rule.limit = 0.0
        rule.resend = resend
        rule.spent = False
        rule.transient = 0
        return rule

    cdef bint _transient_pause(self, _Conn conn, _Retry *rule, str code) except -1:
        """After a transient reply (the command did not run; hotlock._transient): drop the
        connection it came on (READONLY: every connection of this backend, the other
        threads' included, which their calls drop as they end), sleep the backoff that
        hotlock._transient gives, the GIL released, and cap the next round trips at what
        is left. False when the call's own timeout leaves no time for another try."""
        cdef double pause_ms
        if code == "READONLY":
            for other in list(self._conns):
                if other is not conn:
                    _close(<_Conn>other)
        if conn.ctx is not NULL:
            _drop(conn)
        # Pauses end by the call's own timeout (rule.until less the one reply timeout
        # kept for the last try), as on every path.
        pause = _transient_pause(rule.transient, rule.until - self._timeout - _monotonic())
        if pause is None:
            return False
        rule.transient += 1
        pause_ms = <double>pause * 1000.0
        with nogil:
            _sleep_ms(pause_ms)
        left = rule.until - _monotonic()
        rule.limit = left if left < self._timeout else self._timeout
        return True

    cdef bint _may_retry(self, _Retry *rule) noexcept:
        """After a lost reply: whether the call tries once more (see _Retry); if so, the
        retry's timeout goes in rule.limit."""
        cdef double left
        if rule.spent:
            return False
        left = rule.until - _monotonic()
        if left < 0.001:
            return False
        rule.spent = True
        rule.limit = left if left < self._timeout else self._timeout
        return True

    cdef inline void _settle(self, _Conn conn, _Retry *rule) noexcept:
        """Give conn back its reply timeout once a call that retried is done with it."""
        if rule.limit > 0.0 and conn.ctx is not NULL:
            redisSetTimeout(conn.ctx, self._reply_tv)

    cdef inline int _ready(self, _Conn conn, str what, bytes key, _Retry *rule) except -1:
        """Make conn's context usable: drop an inherited, broken or stale one, connect.

        While rule.limit > 0 (a retry after a lost reply) the connect and reply timeouts
        are capped at it, until the caller _settles: a retry gets only what is left.

        A call whose commands are resent after a lost reply (rule.resend: acquire,
        release) skips the staleness poll() (a system call per command) on a connection
        whose last round trip ended under _FRESH_S ago: a server that closed it in that
        window costs the same one reconnect, found at the read instead of before the
        write, and the resend (same token) hides it from the caller; the price is that
        this resend is then spent. Calls never resent (extend, set_nx, incr) always poll,
        and so does any call after a pipeline (conn.piped): a reply that a server sends
        beyond a pipeline's count arrives after the last one the client reads, and the poll
        finds it (one in the same packet as the last reply is found by _exchange itself)."""
        if conn.ctx is not NULL and (conn.gen != _fork_gen or conn.ctx.err or (
                not (rule.resend and not conn.piped and _monotonic() - conn.used < _FRESH_S)
                and _stale(conn.ctx, conn.ssl))):
            _drop(conn)
        elif conn.ctx is not NULL and self._watch is not None and conn.epoch != self._watch.refresh():
            # The sentinels name another primary: the old one may still take writes until
            # it is demoted, so no more on this connection.
            _drop(conn)
        elif self._reauth > 0.0 and conn.ctx is not NULL and _monotonic() - conn.authed >= self._reauth:
            # reauth_interval: AUTH again before this call's commands (refused or lost, the
            # connection is dropped, and the connect below asks the provider anew).
            self._reauthenticate(conn)
        if conn.ctx is NULL:
            self._reconnect(conn, what, key, rule)
        elif rule.limit > 0.0:
            redisSetTimeout(conn.ctx, _timeval(rule.limit))
        return 0

    cdef int _reconnect(self, _Conn conn, str what, bytes key, _Retry *rule) except -1:
        """Connect conn under the call's rule: a lost handshake reply and a transient reply
        to the handshake (it sent nothing of the call) connect again while the rule allows."""
        while True:
            try:
                lost = self._connect(conn, _tried(what, rule), key, rule.limit)
            except _TransientReply as exc:
                if self._transient_pause(conn, rule, exc.args[0]):
                    continue
                raise cache_error(f"{_tried(what, rule)} failed: {exc.args[1]}", self.server, key) from None
            if lost is None:
                return 0
            # The handshake's reply was lost: it sent nothing of the call, so any call
            # may connect again under its rule.
            if not self._may_retry(rule):
                if self._ssl_ctx is NULL and not self._unix and rule.spent and (
                        "reset by peer" in lost or "closed the connection" in lost):
                    # A TLS port hangs up on plaintext at its first bytes, every time.
                    lost += " (if that port speaks TLS, the url must be rediss://)"
                raise cache_error(f"{_tried(what, rule)} failed: {lost}", self.server, key)

    cdef str _connect(self, _Conn conn, str what, bytes key, double limit):
        """Connect and send the handshake. None when ready; the text of a lost handshake
        reply (the connection dropped); raises when the server cannot be reached or refuses."""
        cdef redisContext *ctx
        # The credentials: the provider's answer now (before any socket, so its failure, a
        # CacheError naming it, leaves nothing open), else the url's.
        cdef tuple auth = self._auth if self._provider is None else auth_command(self._config)
        cdef bytes host_bytes = self._host
        cdef int port = self._port
        if self._watch is not None:
            # Whatever the sentinels name as the primary now, so a reconnect follows a failover.
            address = self._watch.address()
            host_bytes = address[0].encode("idna")
            port = address[1]
        cdef const char *host = host_bytes
        # The name the certificate must carry, sent as SNI: ssl_server_name, else the host.
        cdef bytes name_bytes = self._server_name if self._server_name is not None else host_bytes
        cdef const char *name = name_bytes
        cdef bint unix = self._unix
        cdef timeval ctv = self._connect_tv
        cdef timeval rtv = self._reply_tv
        cdef void *ssl_ctx = self._tls_current() if self._ssl_ctx is not NULL else NULL
        cdef bint check_host = self._check_host
        cdef void *ssl = NULL
        cdef int tls = HOTLOCK_TLS_OK
        cdef char tls_err[256]
        if limit > 0.0:
            if limit < self._timeout:
                rtv = _timeval(limit)
            if limit < <double>ctv.tv_sec + <double>ctv.tv_usec * 1e-6:
                ctv = _timeval(limit)
        hotlock_tls_context_ref(ssl_ctx)  # dropped below: another thread may replace it meanwhile
        with nogil:
            if unix:
                ctx = redisConnectUnixWithTimeout(host, ctv)
            else:
                ctx = redisConnectWithTimeout(host, port, ctv)
            if ctx is not NULL and not ctx.err and ssl_ctx is not NULL:
                # The handshake runs under the connect timeout (on every read and write
                # of the socket), the name to verify and send as SNI set beforehand.
                redisSetTimeout(ctx, ctv)
                tls = hotlock_tls_handshake(ctx, ssl_ctx, name, check_host, &ssl, tls_err, 256)
            if ctx is not NULL and not ctx.err and tls == HOTLOCK_TLS_OK:
                # A reply timeout on every read and write (SO_RCVTIMEO/SO_SNDTIMEO), so no
                # nogil section blocks forever on a blackholed server.
                redisSetTimeout(ctx, rtv)
                hotlock_harden(ctx)
                if not unix:
                    # Notice a peer that vanished without a FIN (a dead host, a dropped
                    # NAT entry) on connections that sit idle between locks.
                    redisEnableKeepAlive(ctx)
        hotlock_tls_context_free(ssl_ctx)  # the SSL object, if made, holds a reference of its own
        if ctx is NULL:
            raise MemoryError()
        if tls != HOTLOCK_TLS_OK:
            text = (<bytes>tls_err).decode("utf-8", "replace")
            redisFree(ctx)
            if tls == HOTLOCK_TLS_LOST:
                # Cut or timed out mid-handshake: nothing of the call was sent, so it may
                # connect again under its rule, as after a lost handshake reply.
                return text
            # A certificate that does not verify, a refusal, no TLS on the port: the same
            # again would fail the same way, so never retried and never downgraded.
            raise cache_error(f"{what} failed: {text}", self.server, key)
        if ctx.err:
            text = _io_text(ctx)
            redisFree(ctx)
            raise cache_error(f"{what} failed: cannot connect: {text}", self.server, key)
        conn.ctx = ctx
        conn.ssl = ssl
        conn.answered = False
        conn.gen = _fork_gen
        if self._watch is not None:
            conn.epoch = self._watch.epoch
        # AUTH, the connection's name, SELECT and every SCRIPT LOAD in one round trip, so
        # the first EVALSHA after a (re)connect or a failover never pays for a NOSCRIPT.
        commands = []
        if auth is not None:
            commands.append(auth)
        commands += self._naming
        if self._select is not None:
            commands.append(self._select)
        lost = self._send(conn, commands, what, key)
        conn.authed = _monotonic()
        return lost

    cdef int _reauthenticate(self, _Conn conn) except -1:
        """AUTH again on conn, with what the provider says now (reauth_interval), no
        reconnect. A refusal (WRONGPASS) or a lost reply drops conn: the caller's connect
        then asks the provider again."""
        cdef redisReply *r = NULL
        conn.authed = _monotonic()
        auth = reauth_command(self._config)  # None also when the provider failed (logged)
        if auth is None:
            return 0
        _append_args(conn.ctx, auth)
        if _exchange(conn, &r, 1) != 0:
            if r is not NULL:
                freeReplyObject(r)
            self._lost(conn)
            return 0
        if r.type == REDIS_REPLY_ERROR:
            _drop(conn)
        freeReplyObject(r)
        return 0

    cdef str _send(self, _Conn conn, list commands, str what, bytes key):
        """Send commands + SCRIPT LOAD of every script in one round trip. None when all
        succeeded; the text of a lost reply (the connection dropped); raises on an error reply."""
        cdef Py_ssize_t n, i
        cdef redisReply **replies
        cdef redisReply *r
        cdef list names = [command_name(c) for c in commands] + ["SCRIPT LOAD"] * len(_SOURCES)
        try:
            for args in commands:
                _append_args(conn.ctx, args)
            for source in _SOURCES:
                _append_args(conn.ctx, (b"SCRIPT", b"LOAD", source))
        except BaseException:
            _drop(conn)  # half a pipeline appended: never sent
            raise
        n = len(names)
        replies = <redisReply **>malloc(n * sizeof(redisReply *))
        if replies is NULL:
            _drop(conn)
            raise MemoryError()
        try:
            if _exchange(conn, replies, n) != 0:
                return f"{names[0]}: {self._lost(conn)}"
            for i in range(n):
                r = replies[i]
                if r.type == REDIS_REPLY_ERROR and i < len(commands) and naming_optional(commands[i]):
                    continue  # CLIENT SETINFO on a server before 7.2, or an ACL without it
                if r.type == REDIS_REPLY_ERROR:
                    text = self._reply_error(conn, r)
                    # Unusable (wrong password, no such db, no SCRIPT permission): drop it
                    # so the next call starts from a fresh connect.
                    _drop(conn)
                    code = _transient_code(r.str[:r.len])
                    if code is not None:
                        raise _TransientReply(code, f"{names[i]}: {text}")
                    refusal = "authentication failed: " if names[i] == "AUTH" else ""
                    raise cache_error(f"{what} failed: {refusal}{names[i]}: {text}", self.server, key)
                if i >= n - len(_SOURCES) and (
                    r.type != REDIS_REPLY_STRING or r.str[:r.len] != _SHAS[i - (n - len(_SOURCES))]
                ):
                    _drop(conn)
                    raise cache_error(f"{what} failed: SCRIPT LOAD returned an unexpected SHA1", self.server, key)
        finally:
            for i in range(n):
                if replies[i] is not NULL:
                    freeReplyObject(replies[i])
            free(replies)
        return None

    cdef str _reply_error(self, _Conn conn, redisReply *r):
        """The text of an error reply; a READONLY one (a demoted primary) drops the connection."""
        text = r.str[:r.len].decode("utf-8", "replace")
        if _is_error(r, b"READONLY", 8):
            # Writes must go to the new primary: reconnect next time (through the same
            # address, where a proxy or Sentinel-updated DNS points at it).
            _drop(conn)
        return f"the server replied {text}"

    cdef str _lost(self, _Conn conn):
        """The text of an I/O error or timeout; the connection is dropped (its state is unknown).

        Over TLS, a failure OpenSSL recorded (the server's alert: a client certificate it
        requires and did not get, say) is no lost reply: a CacheError, never retried."""
        cdef char err[256]
        cdef bint refused = conn.ssl is not NULL and hotlock_tls_failure(conn.ssl, not conn.answered, err, 256)
        text = _io_text(conn.ctx)
        _drop(conn)
        if refused:
            raise cache_error((<bytes>err).decode("utf-8", "replace"), self.server)
        return text

    # -- scripts ----------------------------------------------------------------------------

    cdef int _scripts(self, bytes sha, object keys, object tokens, Py_ssize_t n, long long ms,
                      _Retry rule, str what, bytes err_key, long long *values, int plain=-1,
                      bint txn=True) except -1:
        """EVALSHA sha 1 key token [ms] for n keys, appended together and read together:
        one round trip. ``keys``/``tokens`` are one bytes each when n == 1 (the hot path,
        no list), else lists. Each integer reply goes to values[i].

        NOSCRIPT (restart, SCRIPT FLUSH, failover): load every script and send again only
        the calls that did not run (a release that ran must not run twice). A lost reply
        follows the call's rule (see _Retry): a lost handshake or reload reply reconnects
        and goes on; a lost reply to the calls sends them once more as they were when
        rule.resend. Under wait_replicas a WAIT rides in the same write as the acquires
        or the extends; too few replicas undoes them (see _undo).

        On a server with compare-and-set (self._plain), extend and release go as plain
        commands (_append_plain) through this same loop: the same batching and lost-reply
        rule; SET IFEQ's OK/nil reply counts as 1/0, and NOSCRIPT cannot come. A plain
        command refused with an error code the script serves (_script_serves) counts as
        0, missed: the caller sends the calls that missed again by script, and only those
        (a release that ran, run again, says 0 for the key it freed).

        The ACQUIRE script of a plain token (not a permit's ask) goes as the transaction
        of hotlock._acquire where the dialect has it (self._txn; ``txn`` False keeps this
        call on the script: lock_wait's attempts after its first): four replies, read by
        _txn_read. A call it leaves to the script stays to do and goes as EVALSHA ACQUIRE
        in the next round, on the same connection, with a WAIT of its own under
        wait_replicas; an error reply is handled as the script's would be. A lost reply
        resends the transaction (same token: a SET NX that ran finds the key, and the
        script then finds its own token)."""
        cdef redisReply *one[5]
        # What each call sends next: 0 nothing (done), 1 its script or plain command, 2 the transaction.
        cdef char one_todo[1]
        cdef redisReply **replies = one
        cdef char *todo = one_todo
        cdef redisReply *r
        cdef bint single = n == 1 and type(keys) is bytes
        # The acquire is ACQUIRE or one of its waiting forms: anything but extend and release.
        cdef bint acquire = sha is not _SHA_EXTEND and sha is not _SHA_RELEASE
        # WAIT confirms the writes made before it on its own connection: behind acquires and
        # extends (a renewal the replicas never saw renews nothing after a failover).
        cdef bint wait = self._wait_replicas > 0 and sha is not _SHA_RELEASE
        cdef bint reloaded = False
        cdef bint reauthed = False  # the one reconnect after NOAUTH/WRONGPASS is spent
        cdef bint unexpected = False  # a reply of a kind its command never gets: the connection is dropped
        # The fewest replicas a WAIT confirmed, over the rounds that decided a call (-1: none yet).
        cdef long long replicas = -1
        cdef Py_ssize_t i, j, k, sent, calls, missing, refused, scripted
        cdef int rc, err = 0
        cdef long long answer
        cdef bint took
        cdef _Conn conn = self._conn()
        if plain < 0:  # extend and release as the dialect says; an acquire's Lua-free form is the transaction
            plain = self._plain if not acquire else _PLAIN_NONE
        txn = txn and self._txn and sha is _SHA_ACQUIRE
        if not single:
            replies = <redisReply **>malloc((4 * n + 1) * sizeof(redisReply *))
            todo = <char *>malloc(n)
            if replies is NULL or todo is NULL:
                free(replies)
                free(todo)
                raise MemoryError()
        if not txn:
            memset(todo, 1, n)
        elif single:
            todo[0] = 2 if PyBytes_GET_SIZE(<bytes>tokens) == _TOKEN_BYTES else 1
        else:
            for i in range(n):
                todo[i] = 2 if PyBytes_GET_SIZE(<bytes>(<list>tokens)[i]) == _TOKEN_BYTES else 1
        _enter(conn)
        try:
            while True:
                self._ready(conn, what, err_key, &rule)
                sent = 0
                calls = 0
                for i in range(n):
                    if todo[i] == 2:
                        if _append_acquire(conn.ctx, <bytes>keys if single else <bytes>(<list>keys)[i],
                                           <bytes>tokens if single else <bytes>(<list>tokens)[i], ms,
                                           self.fenced) != REDIS_OK:
                            _drop(conn)
                            raise MemoryError()
                        sent += _acquire_replies(self.fenced)
                        calls += 1
                    elif todo[i]:
                        if plain:
                            rc = _append_plain(conn.ctx, plain, <bytes>keys if single else <bytes>(<list>keys)[i],
                                               <bytes>tokens if single else <bytes>(<list>tokens)[i], ms)
                        elif single:
                            rc = _append_evalsha(conn.ctx, sha, <bytes>keys, <bytes>tokens, ms)
                        else:
                            rc = _append_evalsha(conn.ctx, sha, <bytes>(<list>keys)[i],
                                                 <bytes>(<list>tokens)[i], ms)
                        if rc != REDIS_OK:
                            _drop(conn)
                            raise MemoryError()
                        sent += 1
                        calls += 1
                if wait and redisAppendCommandArgv(conn.ctx, 3, self._wait_argv, self._wait_lens) != REDIS_OK:
                    _drop(conn)
                    raise MemoryError()
                if _exchange_calls(conn, replies, sent + wait, todo, n, self.fenced, values) != 0:
                    for j in range(sent + wait):
                        if replies[j] is not NULL:
                            freeReplyObject(replies[j])
                    text = self._lost(conn)
                    if rule.resend and self._may_retry(&rule):
                        continue
                    raise cache_error(f"{_tried(what, &rule)} failed: {text}", self.server, err_key)
                # A transaction's four replies come in one piece as a single command's reply
                # does (the server answers them together): only a pipeline of calls makes
                # the next call poll for a reply beyond the count (see _ready).
                conn.piped = calls + wait > 1
                error = None
                transient = None
                no_multi = None
                took = False
                missing = 0
                refused = 0
                scripted = 0
                j = 0
                for i in range(n):
                    if not todo[i]:
                        continue
                    if replies[j] is NULL:
                        # Decided as it was read (_exchange_calls): values[i] is set.
                        j += _acquire_replies(self.fenced) if todo[i] == 2 else 1
                        todo[i] = 0
                        took = True
                        continue
                    if todo[i] == 2:
                        k = _acquire_replies(self.fenced)
                        answer = _acquire_read(replies + j, self.fenced, &err)
                        r = NULL
                        if answer > 0:
                            values[i] = answer
                            todo[i] = 0
                            took = True
                        elif answer == _TXN_ERROR:
                            r = replies[j + err]
                        else:
                            todo[i] = 1  # the script decides, next round
                            scripted += 1
                            if answer == _TXN_NO_MULTI and no_multi is None:
                                no_multi = replies[j].str[:replies[j].len].decode("utf-8", "replace")
                    else:
                        k = 1
                        r = replies[j]
                        if r.type == REDIS_REPLY_INTEGER:
                            values[i] = r.integer
                            todo[i] = 0
                            took = True
                            r = NULL
                        elif plain and (r.type == REDIS_REPLY_STATUS or r.type == REDIS_REPLY_NIL):
                            values[i] = r.type == REDIS_REPLY_STATUS  # SET IFEQ: OK (extended) or nil
                            todo[i] = 0
                            took = True
                            r = NULL
                    if r is NULL:
                        pass
                    elif not reloaded and _is_error(r, b"NOSCRIPT", 8):
                        missing += 1
                    elif not reauthed and _auth_refused(r):
                        refused += 1
                    elif r.type == REDIS_REPLY_ERROR and _transient_code(r.str[:r.len]) is not None:
                        # It did not run: resent (todo[i] stays) after _transient_pause.
                        if transient is None:
                            transient = (_transient_code(r.str[:r.len]),
                                         f"the server replied {r.str[:r.len].decode('utf-8', 'replace')}",
                                         keys if single else keys[i])
                    elif plain != _PLAIN_NONE and r.type == REDIS_REPLY_ERROR and _script_serves(r):
                        # A Lua-free command refused with a code the script serves: missed,
                        # and the caller sends it again by script.
                        values[i] = 0
                        todo[i] = 0
                    elif error is None and r.type != REDIS_REPLY_ERROR:
                        unexpected = True
                        command = "EVALSHA" if not plain else "SET" if sha is _SHA_EXTEND else (
                            "DELIFEQ" if plain == _PLAIN_DELIFEQ else "DELEX")
                        error = (_unexpected(command, r), keys if single else keys[i])
                    elif error is None:
                        error = (self._reply_error(conn, r), keys if single else keys[i])
                    while k > 0:
                        freeReplyObject(replies[j])
                        j += 1
                        k -= 1
                if wait:
                    r = replies[sent]
                    if r.type == REDIS_REPLY_INTEGER:
                        # A round that decided nothing wrote nothing of ours for it to confirm
                        # (every transaction left to the script, say).
                        if took and (replicas < 0 or r.integer < replicas):
                            replicas = r.integer
                    elif error is None and r.type != REDIS_REPLY_ERROR:
                        unexpected = True
                        error = (_unexpected("WAIT", r), err_key)
                    elif error is None and not (refused and _auth_refused(r)):
                        error = (self._reply_error(conn, r), err_key)
                    freeReplyObject(r)
                if no_multi is not None:
                    self._refuse_multi(no_multi)
                if error is not None:
                    if unexpected:
                        _drop(conn)
                    raise cache_error(f"{what} failed: {error[0]}", self.server, error[1])
                if refused:
                    # NOAUTH/WRONGPASS: this connection is not authenticated (credentials
                    # rotated, the server forgot it), so nothing ran. A new connection asks
                    # the provider again, and what was refused goes once more on it.
                    reauthed = True
                    _drop(conn)
                    continue
                if transient is not None:
                    if not self._transient_pause(conn, &rule, transient[0]):
                        raise cache_error(f"{_tried(what, &rule)} failed: {transient[1]}", self.server, transient[2])
                    continue  # on a new connection, whose handshake loads the scripts
                if missing == 0:
                    if scripted == 0:
                        break
                    continue  # the calls the transaction left to the script
                reloaded = True
                try:
                    lost = self._send(conn, [], what, err_key)
                except _TransientReply as exc:
                    if not self._transient_pause(conn, &rule, exc.args[0]):
                        raise cache_error(f"{_tried(what, &rule)} failed: {exc.args[1]}", self.server, err_key) from None
                    continue
                # A lost reload reply: the reconnect's handshake loads the scripts, and
                # only the calls that did not run go again.
                if lost is not None and not self._may_retry(&rule):
                    raise cache_error(f"{_tried(what, &rule)} failed: {lost}", self.server, err_key)
        finally:
            self._settle(conn, &rule)
            _leave(conn)
            if not single:
                free(replies)
                free(todo)
        if wait and replicas < self._wait_replicas:
            self._undo(keys, tokens, n, values, replicas, what, err_key, acquire)
        return 0

    cdef int _undo(self, object keys, object tokens, Py_ssize_t n, long long *values, long long replicas,
                   str what, bytes err_key, bint acquire) except -1:
        """Under wait_replicas: release what too few replicas confirmed, then raise: an
        acquire's CacheError (the caller holds nothing), or Unreplicated for extends that
        ran (their leases are lost; an extend that found the key gone wrote nothing to
        confirm). Released rather than left to the TTL either way: the caller is told it
        holds nothing, so nobody should wait for a key no one holds."""
        if n == 1 and type(keys) is bytes:
            keys = [keys]
            tokens = [tokens]
        held = [i for i in range(n) if values[i] > 0]
        if not acquire and not held:
            return 0
        if held:
            try:
                # If the undo fails too, the keys expire by their TTL; the caller hears about the replicas.
                self.release_many([keys[i] for i in held],
                                  [held_value(tokens[i], values[i]) if acquire else tokens[i] for i in held])
            except CacheError:
                pass
        if not acquire:
            raise unconfirmed_extends(what, [values[i] > 0 for i in range(n)], replicas, self._wait_replicas,
                                      self._wait_timeout_ms)
        raise cache_error(unreplicated(what, replicas, self._wait_replicas, self._wait_timeout_ms),
                          self.server, err_key)

    cdef list _many(self, bytes sha, list keys, list tokens, long long ms, bint resend, str what,
                    int plain=-1):
        """Each key's value."""
        cdef Py_ssize_t n, i
        cdef long long *values
        # Copies of the caller's lists: _scripts reads them again after each round trip,
        # which runs without the GIL, when another thread may empty or change the originals.
        keys = list(keys)
        tokens = list(tokens)
        n = len(keys)
        if len(tokens) != n:
            raise ValueError("keys and tokens differ in length")
        for i in range(n):
            if type(keys[i]) is not bytes or type(tokens[i]) is not bytes:
                raise TypeError("keys and tokens must be bytes")
        if n == 0:
            return []
        values = <long long *>malloc(n * sizeof(long long))
        if values is NULL:
            raise MemoryError()
        try:
            self._scripts(sha, keys, tokens, n, ms, self._rule(0.0, resend), what, None, values, plain)
            return [values[i] for i in range(n)]
        finally:
            free(values)

    # -- other commands -------------------------------------------------------------------

    cdef object _command(self, tuple args, str what, bytes key):
        """Send one command; its reply as Python (int, bytes, None, or a _ReplyError). A lost
        handshake reply is retried (see _Retry); the command itself is never sent twice:
        set_nx and incr are not safe to send twice."""
        cdef redisReply *r = NULL
        cdef _Conn conn = self._conn()
        cdef _Retry rule = self._rule(0.0, False)
        cdef bint reauthed = False
        _enter(conn)
        try:
            while True:
                self._ready(conn, what, key, &rule)
                _append_args(conn.ctx, args)
                if _exchange(conn, &r, 1) != 0:
                    raise cache_error(f"{_tried(what, &rule)} failed: {self._lost(conn)}", self.server, key)
                if not reauthed and _auth_refused(r):
                    # Not run (NOAUTH/WRONGPASS): once more on a new connection, which asks
                    # the credential provider again (see _scripts).
                    reauthed = True
                    freeReplyObject(r)
                    r = NULL
                    _drop(conn)
                    continue
                code = _transient_code(r.str[:r.len]) if r.type == REDIS_REPLY_ERROR else None
                if code is not None:
                    # It did not run, so even SET NX and INCRBY may go again (hotlock._transient).
                    text = f"the server replied {r.str[:r.len].decode('utf-8', 'replace')}"
                    freeReplyObject(r)
                    r = NULL
                    if not self._transient_pause(conn, &rule, code):
                        raise cache_error(f"{_tried(what, &rule)} failed: {text}", self.server, key)
                    continue
                break
            self._settle(conn, &rule)
            return self._py_command_reply(conn, r)
        finally:
            if r is not NULL:
                freeReplyObject(r)
            _leave(conn)

    cdef object _py_command_reply(self, _Conn conn, redisReply *r):
        """_command's reply as Python."""
        cdef size_t i
        if r.type == REDIS_REPLY_INTEGER:
            return r.integer
        if r.type == REDIS_REPLY_STRING or r.type == REDIS_REPLY_STATUS:
            return r.str[:r.len]
        if r.type == REDIS_REPLY_NIL:
            return None
        if r.type == REDIS_REPLY_ARRAY:
            # COMMAND INFO: each element's presence is all hotlock asks of it.
            return [r.element[i].type != REDIS_REPLY_NIL for i in range(r.elements)]
        return _ReplyError(self._reply_error(conn, r), _is_error(r, b"NOPERM", 6))

    # -- the Backend interface ------------------------------------------------------------

    def taker(self, bytes lock_prefix not None, type lease_class not None):
        """Cache.lock's common case as one call for one cache (ext/_lease.pxi): the _Taker
        that Cache keeps in its _take slot for hotlock._native.cache_lock."""
        return _Taker(self, lock_prefix, lease_class)

    def acquire(self, bytes key not None, bytes token not None, long long ttl_ms):
        cdef long long value
        self._scripts(_SHA_ACQUIRE, key, token, 1, ttl_ms, self._rule(0.0, True), "acquire", key, &value)
        return value

    def acquire_wait(self, bytes key not None, bytes token not None, long long ttl_ms, long long wait_ms):
        """hotlock.backends.wakeup.wait in C: attempts until acquired or wait_ms has passed, on the
        _backoff schedule; after the first POLL_FIRST attempts each attempt marks the lock
        and each sleep is cut short by a wake-up from the release.

        The GIL is released during every round trip and every sleep (then a ppoll() on this
        thread's wake-up fd); between them the loop holds it to run Python signal handlers
        (Ctrl-C ends a long wait) and to read the subscriber's state for this key."""
        cdef double deadline = _monotonic() + <double>wait_ms / 1000.0
        # One deadline for every attempt's retry; each attempt may retry once by it.
        cdef _Retry rule = self._rule(<double>wait_ms / 1000.0, True)
        cdef double sent, remaining_ms, sleep_ms
        cdef long attempt = 0
        cdef long long result
        cdef unsigned long long rng
        cdef bytes sha = _SHA_ACQUIRE
        cdef bint acquired = False
        cdef int fd = -1
        hub = waiter = current = watched = None
        channel = b""
        seq = 0
        global _rng_state
        rng = _splitmix64(&_rng_state)  # a private stream for this wait (GIL held here)
        try:
            while True:
                if attempt == _POLL_FIRST and hub is not None:
                    # Mark from this attempt on; join only if it fails (see _wakeup.wait).
                    channel = wake_channel(key)
                    watched = hub.subscribed(channel)
                    seq = 0 if watched is None else watched.seq
                    sha = _SHA_ACQUIRE_CHAIN if watched is not None and watched.waiters else _SHA_ACQUIRE_WAIT
                sent = _monotonic()
                # The transaction for the first attempt only: a key held then is likely held
                # still, and the script decides that in one round trip.
                self._scripts(sha, key, token, 1, ttl_ms, rule, "acquire", key, &result, -1, attempt == 0)
                if result > 0:
                    acquired = True
                    return result, sent, attempt + 1  # the fence, and the attempts made
                remaining_ms = (deadline - _monotonic()) * 1000.0
                if remaining_ms <= 0.0:
                    return result, sent, attempt + 1
                if attempt == 0 and self._wakeups is not None:
                    hub = self._wakeups.get()  # start the subscriber now, so it is connected when this wait joins
                elif attempt == _POLL_FIRST and hub is not None:
                    waiter = hub.join(channel)
                    if waiter is not None:
                        fd = waiter.fd
                        current = waiter.entry
                        if current is not watched:
                            # Subscribed after the attempt was sent: try again now. Still
                            # being subscribed: the confirmation wakes the first waiter.
                            seq = current.seq - 1 if current.confirmed else current.seq
                # Held: result is -(the holder's PTTL), or 0 when unknown; the sleep ends by then.
                # (A reply below -_MAX_TTL_MS is no PTTL: negating LLONG_MIN is undefined.)
                sleep_ms = _delay(attempt, _uniform(&rng), remaining_ms, -result if result >= -_MAX_TTL_MS else 0,
                                  _CAP_MS)
                attempt += 1
                if waiter is None:
                    with nogil:
                        _sleep_ms(sleep_ms)
                else:
                    if current.seq == seq:  # no message came while the attempt was out
                        with nogil:
                            _sleep_fd(fd, sleep_ms)
                    seq = current.seq
                    sha = _SHA_ACQUIRE_CHAIN if len(current.waiters) > 1 else _SHA_ACQUIRE_WAIT
                PyErr_CheckSignals()
        finally:
            if waiter is not None:
                hub.leave(waiter, acquired)

    def acquire_many(self, list keys not None, list tokens not None, long long ttl_ms):
        return self._many(_SHA_ACQUIRE, keys, tokens, ttl_ms, True, "acquire_many")

    def extend(self, bytes key not None, bytes token not None, long long ttl_ms):
        return <bint>self._extend(key, token, ttl_ms)

    cdef int _extend(self, bytes key, bytes token, long long ttl_ms) except -1:
        """extend(), also Lock.extend's one-call path (ext/_lease.pxi): 1 if extended, else 0."""
        # Not resent: a lost extend reply is a CacheError; the caller retries while valid_for() lasts.
        # A permit's value goes by script: hotlock._dialect.by_script.
        cdef long long value
        cdef int plain = _PLAIN_NONE if _permit(token) else self._extend_as
        self._scripts(_SHA_EXTEND, key, token, 1, ttl_ms, self._rule(0.0, False), "extend", key, &value, plain)
        if value == 0 and plain and self._plain != _PLAIN_NONE:
            # SET IFEQ compares the whole value: a lock a waiter marked ('+') is extended
            # by the script, which accepts the mark (only under contention, or when lost);
            # so is one SET IFEQ was refused on (OOM, WRONGTYPE: _script_serves).
            self._scripts(_SHA_EXTEND, key, token, 1, ttl_ms, self._rule(0.0, False), "extend", key, &value,
                          _PLAIN_NONE)
        return value != 0

    def extend_many(self, list keys not None, list tokens not None, long long ttl_ms):
        plain = _PLAIN_NONE if _any_by_script(tokens) else self._extend_as
        values = self._many(_SHA_EXTEND, keys, tokens, ttl_ms, False, "extend_many", plain)
        if plain and self._plain != _PLAIN_NONE:
            values = self._by_script(_SHA_EXTEND, keys, tokens, ttl_ms, False, "extend_many", values)
        return [v != 0 for v in values]

    def release(self, bytes key not None, bytes token not None):
        return <bint>self._release(key, token)

    cdef int _release(self, bytes key, bytes token) except -1:
        """release(), also Lock.unlock's one-call path (ext/_lease.pxi): 1 if released, else 0."""
        # A lost release reply is retried: the second try finds the key gone (False) or
        # still ours (releases it), and either way the caller sees no error.
        # A permit's value goes by script: hotlock._dialect.by_script.
        cdef long long value
        cdef int plain = _PLAIN_NONE if _permit(token) else -1
        self._scripts(_SHA_RELEASE, key, token, 1, -1, self._rule(0.0, True), "release", key, &value, plain)
        if value == 0 and plain and self._plain != _PLAIN_NONE:
            # DELIFEQ/DELEX compare the whole value: a lock a waiter marked ('+') is
            # released by the script, which accepts the mark and wakes the waiter (only
            # under contention, or when the lock was lost anyway).
            self._scripts(_SHA_RELEASE, key, token, 1, -1, self._rule(0.0, True), "release", key, &value,
                          _PLAIN_NONE)
        return value != 0

    def release_many(self, list keys not None, list tokens not None):
        return [v != 0 for v in self._release_many(keys, tokens)]

    cdef list _release_many(self, list keys, list tokens):
        """release_many(), also Cache.unlock_many's one-call path (ext/_batch.pxi): each
        key's value, nonzero where released."""
        plain = _PLAIN_NONE if _any_by_script(tokens) else -1
        values = self._many(_SHA_RELEASE, keys, tokens, -1, True, "release_many", plain)
        if plain and self._plain != _PLAIN_NONE:
            values = self._by_script(_SHA_RELEASE, keys, tokens, -1, True, "release_many", values)
        return values

    cdef list _by_script(self, bytes sha, list keys, list tokens, long long ms, bint resend, str what, list values):
        """After a Lua-free batch: the entries it missed (0) once more by script, which
        accepts a waiter's mark ('+') where SET IFEQ and DELIFEQ/DELEX compare whole values."""
        missed = [i for i in range(len(values)) if values[i] == 0]
        if missed:
            again = self._many(sha, [keys[i] for i in missed], [tokens[i] for i in missed], ms, resend, what,
                               _PLAIN_NONE)
            for i, v in zip(missed, again):
                values[i] = v
        return values

    def set_nx(self, bytes key not None, bytes value not None, long long ttl_ms):
        reply = self._command((b"SET", key, value, b"NX", b"PX", str(ttl_ms).encode()), "set_nx", key)
        if isinstance(reply, _ReplyError):
            raise cache_error(f"set_nx failed: {reply.text}", self.server, key)
        if reply is not None and reply != b"OK":
            # Not SET NX's OK or nil: shown by its kind only, as every path shows one.
            raise cache_error("set_nx failed: unexpected reply to SET", self.server, key)
        return reply is not None

    def incr(self, bytes key not None, long long amount):
        reply = self._command((b"INCRBY", key, str(amount).encode()), "incr", key)
        if isinstance(reply, _ReplyError):
            raise cache_error(f"incr failed: {reply.text}", self.server, key)
        if type(reply) is not int:
            raise cache_error("incr failed: unexpected reply", self.server, key)
        return reply

    def info(self):
        reply = self._command((b"INFO",), "INFO", None)
        if isinstance(reply, _ReplyError):
            if reply.noperm:
                return None  # an ACL that refuses INFO: connect() logs that it went unchecked
            raise cache_error(f"INFO failed: {reply.text}", self.server)
        if type(reply) is not bytes:
            raise cache_error("INFO failed: unexpected reply", self.server)
        fields = {}
        for line in reply.decode("utf-8", "replace").splitlines():
            if line and not line.startswith("#"):
                name, sep, value = line.partition(":")
                if sep:
                    fields[name] = value
        return fields

    def command_info(self):
        """COMMAND INFO DELIFEQ DELEX: which of them the server has, or None when it or its ACL refuses COMMAND."""
        reply = self._command(COMMAND_PROBE, "COMMAND INFO", None)
        if isinstance(reply, _ReplyError):
            return None  # NOPERM, or a proxy without COMMAND: the version decides
        return reply if type(reply) is list else None

    def use_dialect(self, dialect):
        self.dialect = dialect
        self._plain = {"DELIFEQ": _PLAIN_DELIFEQ, "DELEX": _PLAIN_DELEX}.get(dialect.release, _PLAIN_NONE)
        self._txn = dialect.transaction and not self._multi_refused
        self.fenced = dialect.fenced

    cdef int _refuse_multi(self, str text) except -1:
        """MULTI was refused alone (an ACL without it, a proxy): every later acquire goes
        by script (hotlock._acquire.refused_multi), said once."""
        self._txn = False
        if not self._multi_refused:
            self._multi_refused = True
            warn_refused(self.server, text)
        return 0

    def close(self):
        """Drop every thread's connection (a later call reconnects, as on redis-py)."""
        if self._wakeups is not None:
            self._wakeups.close()
        for conn in list(self._conns):
            _close(<_Conn>conn)

    def __repr__(self):
        return f"<hotlock._native.NativeBackend server={self.server}>"

    # -- a cluster node's link (hotlock.backends.cluster.Link) -------------------------------------
    # The cluster backend routes in Python and sends through these: link_send writes this
    # thread's commands for one node and returns at once, so the caller can write to
    # every node before it reads any (a batch over three shards costs one round trip).

    def link_send(self, list commands not None):
        """Append ``commands`` (tuples of bytes) on this thread's context and write them all.
        A connect failure is a CacheError (nothing was sent); an I/O error, LinkLost."""
        cdef _Conn conn = self._conn()
        cdef int done = 0
        cdef int rc = REDIS_OK
        # The connect handshake under the one lost-reply rule, as every call's (a lost
        # handshake reply is retried once within its budget).
        cdef _Retry rule = self._rule(0.0, False)
        cdef redisContext *ctx
        _enter(conn)
        try:
            self._ready(conn, "connect", None, &rule)
            self._settle(conn, &rule)
            for args in commands:
                if _append_args(conn.ctx, args) != 0:
                    raise MemoryError()
            ctx = conn.ctx
            conn.busy = True
            with nogil:
                while not done and rc == REDIS_OK:
                    rc = redisBufferWrite(ctx, &done)
            conn.busy = False
            if rc != REDIS_OK:
                raise LinkLost(self._lost(conn))
            if conn.doomed:
                # Written, but the replies will not be read: _leave drops the connection.
                raise LinkLost("the cache was closed meanwhile")
            return None
        except BaseException:
            # Commands appended or written whose replies will not be read: out of step.
            _drop(conn)
            raise
        finally:
            _leave(conn)

    def link_recv(self, object handle, Py_ssize_t n, object timeout):
        """Read n replies on this thread's context (within ``timeout`` s when given): ints,
        bytes, None, lists, and ReplyError for error replies. LinkLost on an I/O error."""
        cdef _Conn conn = self._conn()
        cdef redisReply **replies
        cdef Py_ssize_t i
        if n < 0:
            raise ValueError("n must not be negative")
        if conn.ctx is NULL:
            raise LinkLost("connection lost")
        replies = <redisReply **>calloc(n + 1, sizeof(redisReply *))
        if replies is NULL:
            raise MemoryError()
        _enter(conn)
        try:
            if timeout is not None:
                redisSetTimeout(conn.ctx, _timeval(min(<double>timeout, self._timeout)))
            if _exchange(conn, replies, n) != 0:
                raise LinkLost(self._lost(conn))
            if timeout is not None:
                redisSetTimeout(conn.ctx, self._reply_tv)
            return [_py_reply(replies[i]) for i in range(n)]
        finally:
            _leave(conn)
            for i in range(n):
                if replies[i] is not NULL:
                    freeReplyObject(replies[i])
            free(replies)

    def link_close(self):
        self.close()

    def link_drop(self):
        """The calling thread's connection let go of (NOAUTH on this node: the next one
        authenticates anew, asking the credential provider again)."""
        _close(self._conn())


cdef object _py_reply(redisReply *r):
    if r.type == REDIS_REPLY_INTEGER:
        return r.integer
    if r.type == REDIS_REPLY_STRING or r.type == REDIS_REPLY_STATUS:
        return r.str[:r.len]
    if r.type == REDIS_REPLY_NIL:
        return None
    if r.type == REDIS_REPLY_ARRAY:
        return [_py_reply(r.element[i]) for i in range(r.elements)]
    if r.type == REDIS_REPLY_ERROR:
        return ReplyError(r.str[:r.len].decode("utf-8", "replace"))
    return None


cdef inline bint _auth_refused(redisReply *r) noexcept nogil:
    # = hotlock._credentials.is_auth_refusal: this connection is not authenticated.
    return _is_error(r, b"NOAUTH", 6) or _is_error(r, b"WRONGPASS", 9)


cdef inline bint _permit(bytes value) noexcept:
    """A permit's held value: token '#' fence (hotlock._scripts.PERMIT_MARK)."""
    return PyBytes_GET_SIZE(value) > _TOKEN_BYTES and PyBytes_AS_STRING(value)[_TOKEN_BYTES] == 35


cdef bint _any_by_script(list values) except -1:
    """= hotlock._dialect.by_script(values) (a permit's value among them),
    without a Python frame per value; anything but bytes is left to by_script itself."""
    cdef Py_ssize_t i
    for i in range(len(values)):
        value = values[i]
        if type(value) is not bytes:
            return by_script(values)
        if _permit(<bytes>value):
            return True
    return False


cdef bint _script_serves(redisReply *r) except -1:
    """Whether a Lua-free extend or release refused with the error reply r runs again as
    the script: hotlock._dialect.script_serves, asked of the reply's own text (its code
    first): OOM (SET is refused at maxmemory under noeviction, the EXTEND script's PEXPIRE
    is not; running an extend twice is harmless, the TTL is set from now) or WRONGTYPE
    (the key now holds permits; the script finds no lock of ours there)."""
    return script_serves(r.str[:r.len].decode("utf-8", "replace"))


cdef class _ReplyError:
    cdef readonly str text
    cdef readonly bint noperm

    def __cinit__(self, str text, bint noperm):
        self.text = text
        self.noperm = noperm


cdef timeval _timeval(double seconds):
    # Never below 1 ms: a zero timeval is "no timeout" to hiredis and to the socket, so a
    # timeout rounded down to it would wait for ever (connect() refuses less than 1 ms;
    # this covers what is left of a budget).
    cdef timeval tv
    if not seconds >= 0.001:
        seconds = 0.001
    tv.tv_sec = <time_t>seconds
    tv.tv_usec = <suseconds_t>((seconds - <double>tv.tv_sec) * 1e6)
    return tv
