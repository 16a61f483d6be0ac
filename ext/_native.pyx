# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""hotlock._native: the Backend protocol over libhiredis, the GIL released in all I/O.

C owns the bytes here (STYLE habit 1): the extension speaks bytes keys, bytes tokens and
integer milliseconds. The Lua scripts and their SHA1s come from hotlock._scripts, the
backoff constants from hotlock._backoff, the errors from hotlock._config.cache_error:
each defined once, in Python.

Parts: _clock.pxi (clock, jitter, the backoff schedule), _sync.pxi (the sync client and
NativeBackend), _aio.pxi (the asyncio protocol under hotlock.aio).
"""

import os
import threading
import weakref

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from libc.math cimport ldexp
from libc.stdio cimport snprintf
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, nanosleep, timespec, timeval
from posix.types cimport suseconds_t, time_t
from posix.unistd cimport close, getpid

from hiredis cimport *

from hotlock import _backoff
from hotlock._config import cache_error
from hotlock._scripts import ACQUIRE, EXTEND, RELEASE, SCRIPTS, held_value
from hotlock._sentinel import PrimaryWatch
from hotlock.errors import CacheError


cdef extern from "compat.h" nogil:
    const char *HOTLOCK_HIREDIS_VERSION
    int HOTLOCK_HAS_TLS
    int hotlock_timed_out(const redisContext *c)


HIREDIS_VERSION = (<bytes>HOTLOCK_HIREDIS_VERSION).decode()
HAS_TLS = bool(HOTLOCK_HAS_TLS)

cdef bytes _SHA_ACQUIRE = ACQUIRE.sha
cdef bytes _SHA_EXTEND = EXTEND.sha
cdef bytes _SHA_RELEASE = RELEASE.sha
cdef tuple _SOURCES = tuple([s.source for s in SCRIPTS])
cdef tuple _SHAS = tuple([s.sha for s in SCRIPTS])

include "_clock.pxi"
include "_sync.pxi"
include "_aio.pxi"
