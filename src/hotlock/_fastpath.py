"""The native backend's fast paths, bound in one place: the cache and lock classes
connect() chooses when the backend is the native one.

``NativeCache.lock``, ``NativeLock.unlock`` and ``NativeLock.extend`` are extension
functions (ext/_lease.pxi) that do the common case in one call, and so are
``NativeCache.lock_many`` and ``NativeCache.unlock_many`` (ext/_batch.pxi): what the
Python method would check, checked in C, the command sent from there, and (for lock and
lock_many) each new lease made as ``object.__new__`` and filled by ``Lease._fill``, the one
place a lease's fields are set; the leases are read and written only through their
attributes. Every other case (another backend, auto_extend or max_hold, a bad argument,
a released, inherited, lost or auto-extended lock) is handed, with its arguments as given,
to the Python method it stands for: ``Cache.lock``, ``Lock.unlock``, ``Lock.extend``,
``Cache.lock_many``, ``Cache.unlock_many``.
tests/test_native_lease.py holds the two paths to the same results and errors.

Without the extension these classes are their bases unchanged, and connect() never
chooses them.
"""

from __future__ import annotations

from ._cache import Cache
from ._lock import TAKEN, Lock
from ._metered import MeteredCache
from .backends.native import native_module

__all__ = ["MeteredNativeCache", "NativeCache", "NativeLock"]

_native, _ = native_module()


class NativeLock(Lock):
    """A Lock of the native backend: unlock() and extend() in one extension call."""

    __slots__ = ()


class NativeCache(Cache):
    """A Cache of the native backend: lock(), lock_many() and unlock_many() in one extension
    call each; its leases are NativeLocks."""

    __slots__ = ()
    _lease_class = NativeLock


if _native is not None:
    NativeLock.unlock, NativeLock.extend = _native.lease_methods(NativeLock, Lock.unlock, Lock.extend, TAKEN)  # type: ignore[method-assign]
    NativeCache.lock = _native.cache_lock(NativeCache, Cache.lock)  # type: ignore[method-assign]
    NativeCache.lock_many, NativeCache.unlock_many = _native.cache_batch(  # type: ignore[method-assign]
        NativeCache, Cache.lock_many, Cache.unlock_many
    )


class MeteredNativeCache(MeteredCache, NativeCache):
    """A MeteredCache of the native backend: it measures the one-call lock()."""

    __slots__ = ()
    _plain_lock = staticmethod(NativeCache.lock)
