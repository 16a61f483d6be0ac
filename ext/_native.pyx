# cython: language_level=3, cdivision=True
"""hotlock._native: the Backend protocol over libhiredis, the GIL released in all I/O.

C owns the bytes here (Python owns the policy): the extension speaks bytes keys, bytes tokens and
integer milliseconds. The Lua scripts and their SHA1s come from hotlock._scripts, the
backoff constants from hotlock._backoff, the AUTH command from hotlock._credentials, the
errors from hotlock._config.cache_error: each defined once, in Python.

Parts: _clock.pxi (clock, jitter, the backoff schedule), _sync.pxi (the sync client and
NativeBackend), _route.pxi (a Redis Cluster's healthy case routed in C over NativeBackend
links), _aio.pxi (the asyncio protocol under hotlock.aio), _lease.pxi (Cache.lock's
common case in one call), _batch.pxi (Cache.lock_many's and unlock_many's).
"""

import logging
import os
import threading
import weakref

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from libc.math cimport ldexp
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcmp, memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, nanosleep, timespec, timeval
from posix.types cimport suseconds_t, time_t
from posix.unistd cimport close, getpid, read

from hiredis cimport *

from hotlock import _backoff
from hotlock._acquire import warn_refused
from hotlock._config import command_name, naming_commands, naming_optional, tls_files_stamp
from hotlock._credentials import auth_args, auth_command, reauth_command
from hotlock._dialect import COMMAND_PROBE, UNDETECTED, by_script, script_serves
from hotlock._ident import TOKEN_BYTES
from hotlock._keys import wake_channel
from hotlock._scripts import ACQUIRE, ACQUIRE_CHAIN, ACQUIRE_WAIT, EXTEND, RELEASE, SCRIPTS, held_value
from hotlock._sentinel import PrimaryWatch
from hotlock._transient import Retrying as _Retrying
from hotlock._transient import code as _transient_code
from hotlock._transient import pause_s as _transient_pause
from hotlock._waiting import POLL_FIRST
from hotlock.backends.wakeup import slot as _wakeup_slot
from hotlock.errors import CacheError, LinkLost, ReplyError, Unreplicated, cache_error, unconfirmed_extends, unreplicated

_log = logging.getLogger("hotlock")


cdef extern from "compat.h" nogil:
    const char *HOTLOCK_HIREDIS_VERSION
    int hotlock_timed_out(const redisContext *c)
    void hotlock_harden(redisContext *c)
    int hotlock_suspect_stream(redisContext *c, const redisReply **replies, Py_ssize_t n)
    int hotlock_odd_reply(const redisReply *r)
    int hotlock_doubt(redisContext *c, const char *why)
    int hotlock_leftover(redisContext *c)


# The TLS layer (ext/tls.h): real in hotlock._native_tls, stubs in hotlock._native.
cdef extern from "tls.h" nogil:
    int HOTLOCK_HAS_TLS
    int HOTLOCK_TLS_OK
    int HOTLOCK_TLS_REFUSED
    int HOTLOCK_TLS_LOST
    const char *hotlock_openssl_version()
    void *hotlock_tls_context(const char *ca, int ca_is_dir, const char *cert, const char *key, int verify,
                              char *err, size_t cap)
    void hotlock_tls_context_free(void *ctx)
    void hotlock_tls_context_ref(void *ctx)
    int hotlock_tls_handshake(redisContext *c, void *ctx, const char *host, int check_host, void **ssl_out,
                              char *err, size_t cap)
    int hotlock_tls_idle_data(void *ssl, int fd)
    int hotlock_tls_failure(void *ssl, int first_use, char *err, size_t cap)


HIREDIS_VERSION = (<bytes>HOTLOCK_HIREDIS_VERSION).decode()
HAS_TLS = bool(HOTLOCK_HAS_TLS)
# The OpenSSL this build runs on (OpenSSL_version()), "" without TLS: hotlock.backends.native
# compares it with Python's ssl.OPENSSL_VERSION.
OPENSSL_VERSION = (<bytes>hotlock_openssl_version()).decode()

cdef Py_ssize_t _TOKEN_BYTES = TOKEN_BYTES
cdef bytes _SHA_ACQUIRE = ACQUIRE.sha
cdef bytes _SHA_EXTEND = EXTEND.sha
cdef bytes _SHA_RELEASE = RELEASE.sha
cdef long _POLL_FIRST = POLL_FIRST
cdef bytes _SHA_ACQUIRE_WAIT = ACQUIRE_WAIT.sha
cdef bytes _SHA_ACQUIRE_CHAIN = ACQUIRE_CHAIN.sha
cdef tuple _SOURCES = tuple([s.source for s in SCRIPTS])
cdef tuple _SHAS = tuple([s.sha for s in SCRIPTS])


cdef const char *_PAIRS = (b"00010203040506070809101112131415161718192021222324252627282930313233343536373839"
                           b"40414243444546474849505152535455565758596061626364656667686970717273747576777879"
                           b"8081828384858687888990919293949596979899")


def held_value(bytes token not None, long long fence):
    """= hotlock._scripts.held_value(token, fence): the token itself for a plain lock,
    token '#' fence for a permit. tests/test_native.py checks it against the Python
    definition."""
    return _held(token, fence)


cdef inline int _decimal(char *out, unsigned long long v) noexcept nogil:
    """Write v in decimal at out (room for 20 digits); return how many were written. The
    held value's fence and every TTL argument: snprintf("%lld") costs ~900 instructions,
    this ~60."""
    cdef char digits[20]
    cdef int i = 20
    cdef unsigned int d
    # Two digits per division (a fence has 16): half the divisions of one at a time.
    while v >= 100:
        d = <unsigned int>(v % 100)
        v = v // 100
        i -= 2
        digits[i] = _PAIRS[2 * d]
        digits[i + 1] = _PAIRS[2 * d + 1]
    if v >= 10:
        i -= 2
        digits[i] = _PAIRS[2 * v]
        digits[i + 1] = _PAIRS[2 * v + 1]
    else:
        i -= 1
        digits[i] = <char>(48 + v)
    memcpy(out, digits + i, 20 - i)
    return 20 - i


cdef bytes _held(bytes token, long long fence):
    cdef char digits[20]
    if fence <= 0:
        raise ValueError("a fence is > 0")
    cdef Py_ssize_t n = PyBytes_GET_SIZE(token)
    if n == _TOKEN_BYTES:
        return token  # a plain lock: its stored value is its token
    # A permit (its acquire argument token '#' limit): token '#', then the fence in decimal;
    # Python's general bytes formatting of a 16-digit int costs about 1,600 instructions,
    # this about a quarter of that.
    cdef int n_digits = _decimal(digits, <unsigned long long>fence)
    if n > _TOKEN_BYTES + 1:
        n = _TOKEN_BYTES + 1
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n + n_digits)
    cdef char *p = PyBytes_AS_STRING(out)
    memcpy(p, PyBytes_AS_STRING(token), n)
    memcpy(p + n, digits, n_digits)
    return out


include "_clock.pxi"
include "_sync.pxi"
include "_route.pxi"
include "_aio.pxi"
include "_lease.pxi"
include "_batch.pxi"
