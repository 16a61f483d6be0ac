# Cache.lock_many's and Cache.unlock_many's common case in one extension call each, as
# ext/_lease.pxi does for lock() and unlock(): per key, what the Python methods would
# check is checked here, the names and tokens are made here (the leases by _Taker._lease,
# so by Lease._fill), and the batch is sent
# through the same backend calls (NativeBackend._scripts / _release_many, or on a native
# cluster ClusterRouter.many) with the same what/err_key/retry rule.
#
# The common case: (lock_many) a list or tuple of 1.. str/bytes keys that key_bytes takes
# as they are, none twice, an int/float TTL that ttl_ms takes unchanged, no auto_extend
# nor max_hold; (unlock_many) a list or tuple of None and leases of _lease_cls taken on
# this cache's backend by this process, not auto-extended. Anything else (a bad key, a
# duplicate, a generator, a timedelta TTL, a lease of another cache, ...) runs the Python
# method with the arguments as given, before any byte is sent, so every error and message
# stays Python's. tests/test_native_batch.py holds the two paths to each other.

from cpython.list cimport PyList_GetSlice, PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_DECREF, Py_INCREF

cdef object _batch_cls = None  # the class the methods were made for (hotlock._fastpath.NativeCache)
cdef object _py_lock_many = None  # its Python lock_many and unlock_many: every other case
cdef object _py_unlock_many = None
cdef object _a_batch_take, _a_cache_backend  # Cache._take, Cache._backend (see _attribute)
cdef object _urandom = os.urandom  # as hotlock._ident.new_tokens draws a batch's tokens
cdef PyMethodDef _lock_many_def, _unlock_many_def


cdef inline object _new_list(Py_ssize_t n, object fill):
    """[fill] * n."""
    cdef object out = PyList_New(n)
    cdef Py_ssize_t i
    for i in range(n):
        Py_INCREF(fill)
        PyList_SET_ITEM(out, i, fill)
    return out


cdef bint _distinct(list names, Py_ssize_t n, Py_ssize_t p) except -1:
    """len(set(names)) == n for n stored names (bytes) that all begin with the same p
    bytes (the prefix and the brace), without building the set: an open-addressed table of
    indices by FNV-1a of what follows the prefix, the names compared byte for byte on a
    collision. A set hashed every whole name with SipHash and grew its table four times:
    about 4% of a lock_many(100)'s instructions."""
    cdef Py_ssize_t stack[512]
    cdef Py_ssize_t *table = stack
    cdef Py_ssize_t size = 16, i, at, kn
    cdef unsigned long long h
    cdef const unsigned char *s
    cdef const unsigned char *end
    cdef object other
    while size < 2 * n:
        size *= 2
    if size > 512:
        table = <Py_ssize_t *>malloc(size * sizeof(Py_ssize_t))
        if table is NULL:
            raise MemoryError()
    try:
        memset(table, 0xFF, size * sizeof(Py_ssize_t))  # -1: free
        for i in range(n):
            name = names[i]
            kn = PyBytes_GET_SIZE(name)
            s = <const unsigned char *>PyBytes_AS_STRING(name) + p
            end = <const unsigned char *>PyBytes_AS_STRING(name) + kn
            h = 14695981039346656037ULL
            while s < end:
                h = (h ^ s[0]) * 1099511628211ULL
                s += 1
            at = <Py_ssize_t>(h & <unsigned long long>(size - 1))
            while table[at] >= 0:
                other = names[table[at]]
                if PyBytes_GET_SIZE(other) == kn and memcmp(PyBytes_AS_STRING(other), PyBytes_AS_STRING(name),
                                                            <size_t>kn) == 0:
                    return False
                at = (at + 1) & (size - 1)
            table[at] = i
        return True
    finally:
        if table is not stack:
            free(table)


cdef object _take_many(_Taker taker, object keys, object ttl):
    """Cache.lock_many(keys, ttl): a Lock or None per key, or None when the call is not the
    common case (nothing has been sent then)."""
    cdef Py_ssize_t n = len(keys), i, p, kn
    cdef const char *s
    cdef long long ms
    cdef int overflow = 0
    cdef double d, sent
    cdef char *out
    cdef char *block
    cdef long long *values = NULL
    cdef bint is_list = False
    if n == 0:
        return None
    if type(keys) is list:
        # A copy, as key_list's list(keys): another thread may change the caller's list
        # while the round trip runs without the GIL, and the leases are made after it.
        keys = PyList_GetSlice(keys, 0, n)
        is_list = True
    # The TTL, as ttl_ms takes it unchanged (round() is half to even, as rint is).
    if type(ttl) is int:
        ms = PyLong_AsLongLongAndOverflow(ttl, &overflow)
        if overflow != 0 or not 0 < ms <= _MAX_TTL_MS // 1000:
            return None
        ms *= 1000
    elif type(ttl) is float and isfinite(PyFloat_AS_DOUBLE(ttl)):
        d = rint(PyFloat_AS_DOUBLE(ttl) * 1000.0)
        if not 0.0 < d <= <double>_MAX_TTL_MS:
            return None
        ms = <long long>d
    else:
        return None
    # Each key as key_bytes takes it, stored as hotlock._keys.stored(prefix, raw).
    p = PyBytes_GET_SIZE(taker._prefix)
    names = PyList_New(n)
    for i in range(n):
        key = (<list>keys)[i] if is_list else (<tuple>keys)[i]
        if type(key) is str:
            s = PyUnicode_AsUTF8AndSize(key, &kn)
            if s is NULL:
                PyErr_Clear()  # a lone surrogate: key_list says so
                return None
        elif type(key) is bytes:
            s = PyBytes_AS_STRING(key)
            kn = PyBytes_GET_SIZE(key)
        else:
            return None
        if kn == 0 or kn > _MAX_KEY:
            return None
        name = PyBytes_FromStringAndSize(NULL, p + kn + 2)
        out = PyBytes_AS_STRING(name)
        memcpy(out, PyBytes_AS_STRING(taker._prefix), p)
        out[p] = c'{'
        memcpy(out + p + 1, s, kn)
        out[p + 1 + kn] = c'}'
        Py_INCREF(name)
        PyList_SET_ITEM(names, i, name)
    # One stored name per raw key: the same key twice is a duplicate name too.
    if n > 1 and not _distinct(names, n, p):
        return None
    # The tokens: one os.urandom block cut in 16-byte pieces, as new_tokens(n).
    raw = _urandom(_TOKEN_BYTES * n)
    block = PyBytes_AS_STRING(raw)
    tokens = PyList_New(n)
    for i in range(n):
        token = PyBytes_FromStringAndSize(block + i * _TOKEN_BYTES, _TOKEN_BYTES)
        Py_INCREF(token)
        PyList_SET_ITEM(tokens, i, token)
    values = <long long *>malloc(n * sizeof(long long))
    if values is NULL:
        raise MemoryError()
    try:
        sent = _monotonic()
        if taker._router is not None:
            # ClusterBackend.acquire_many, retry_until() as the deadline.
            taker._router._many("acquire_many", _SHA_ACQUIRE, <list>names, <list>tokens, ms, taker._router._until(),
                                values)
        else:
            taker._backend._scripts(_SHA_ACQUIRE, names, tokens, n, ms, taker._backend._rule(0.0, True),
                                    "acquire_many", None, values)
        locks = PyList_New(n)
        for i in range(n):
            if values[i] > 0:
                lock = taker._lease((<list>keys)[i] if is_list else (<tuple>keys)[i], <bytes>(<list>names)[i],
                                    _held(<bytes>(<list>tokens)[i], values[i]), values[i], ms, sent)
            else:
                lock = None
            Py_INCREF(lock)
            PyList_SET_ITEM(locks, i, lock)
        return locks
    finally:
        free(values)


cdef object _lock_many_c(object self, PyObject **args, Py_ssize_t nargs, PyObject *kwnames):
    # Cache.lock_many(keys, ttl=DEFAULT_TTL, *, auto_extend=False, max_hold=None)
    cdef Py_ssize_t i
    cdef object keys, ttl = DEFAULT_TTL
    cdef bint got_ttl = nargs == 2
    if nargs < 1 or nargs > 2:
        return _as_given(_py_lock_many, self, args, nargs, kwnames)
    keys = <object>args[0]
    if got_ttl:
        ttl = <object>args[1]
    if kwnames is not NULL:
        for i in range(PyTuple_GET_SIZE(<object>kwnames)):
            name = <object>PyTuple_GET_ITEM(<object>kwnames, i)
            value = <object>args[nargs + i]
            if name == "ttl" and not got_ttl:
                ttl = value
                got_ttl = True
            elif not ((name == "auto_extend" and value is False) or (name == "max_hold" and value is None)):
                return _as_given(_py_lock_many, self, args, nargs, kwnames)
    if (type(keys) is list or type(keys) is tuple) and isinstance(self, _batch_cls):
        taker = _get(_a_batch_take, self)
        if type(taker) is _Taker:
            locks = _take_many(<_Taker>taker, keys, ttl)
            if locks is not None:
                return locks
    return _as_given(_py_lock_many, self, args, nargs, kwnames)


cdef object _unlock_many_c(object self, PyObject **args, Py_ssize_t nargs, PyObject *kwnames):
    # Cache.unlock_many(locks)
    cdef Py_ssize_t n, i, m = 0
    cdef Py_ssize_t *live = NULL
    cdef long long *released = NULL  # on a cluster, each live lease's result
    cdef int overflow = 0
    cdef bint is_list
    cdef ClusterRouter router = None
    if nargs != 1 or kwnames is not NULL or not isinstance(self, _batch_cls):
        return _as_given(_py_unlock_many, self, args, nargs, kwnames)
    locks = <object>args[0]
    is_list = type(locks) is list
    if not is_list and type(locks) is not tuple:
        return _as_given(_py_unlock_many, self, args, nargs, kwnames)
    owner = _get(_a_cache_backend, self)
    if type(owner) is not NativeBackend:
        router = _router_of(owner)
        if router is None:
            return _as_given(_py_unlock_many, self, args, nargs, kwnames)
    if is_list:
        # A copy, as _live's list(locks): another thread may change the caller's list while
        # the round trip runs without the GIL, and the locks are read again after it.
        locks = PyList_GetSlice(locks, 0, len(locks))
    n = len(locks)
    live = <Py_ssize_t *>malloc((n + 1) * sizeof(Py_ssize_t))
    if live is NULL:
        raise MemoryError()
    try:
        names = []
        tokens = []
        for i in range(n):
            lock = (<list>locks)[i] if is_list else (<tuple>locks)[i]
            if lock is None:
                continue
            # A lease of this cache's backend, of this process, not auto-extended (the
            # Python method's forget() is then nothing): else it is the Python method's.
            if type(lock) is not _lease_cls or _get(_a_backend, lock) is not owner:
                return _as_given(_py_unlock_many, self, args, nargs, kwnames)
            pid = _get(_a_pid, lock)
            name = _get(_a_name, lock)
            token = _get(_a_token, lock)
            if (type(pid) is not int
                    or PyLong_AsLongAndOverflow(pid, &overflow) != _my_pid or overflow != 0
                    or _get(_a_auto, lock) is not None
                    or type(name) is not bytes or type(token) is not bytes):
                return _as_given(_py_unlock_many, self, args, nargs, kwnames)
            if PyBytes_GET_SIZE(token) == 0:
                continue  # released already: nothing is sent for it
            names.append(name)
            tokens.append(token)
            live[m] = i
            m += 1
        out = _new_list(n, False)
        if m == 0:
            return out
        # A CacheError keeps every token, as unlock_many does.
        values = None
        if router is None:
            values = (<NativeBackend>owner)._release_many(names, tokens)
            if len(values) != m:
                raise ValueError("release_many: one result per key")
        else:
            # ClusterBackend.release_many: RELEASE_SHARDED, retry_until() as the deadline.
            released = <long long *>malloc(m * sizeof(long long))
            if released is NULL:
                raise MemoryError()
            router._many("release_many", _SHA_RELEASE_SHARDED, names, tokens, -1, router._until(), released)
        for i in range(m):
            lock = (<list>locks)[live[i]] if is_list else (<tuple>locks)[live[i]]
            _set(_a_token, lock, b"")
            ok = True if (values[i] if released is NULL else released[i]) else False
            Py_INCREF(ok)
            Py_DECREF((<list>out)[live[i]])
            PyList_SET_ITEM(out, live[i], ok)
        return out
    finally:
        free(live)
        free(released)


def cache_batch(cls not None, lock_many not None, unlock_many not None):
    """(lock_many, unlock_many) of cls (hotlock._fastpath.NativeCache) with the common case in
    one call; every other case goes to the given Python methods. Call after lease_methods
    (the lease class comes from there)."""
    global _batch_cls, _py_lock_many, _py_unlock_many, _a_batch_take, _a_cache_backend
    if _lease_cls is None:
        raise RuntimeError("lease_methods first")
    _a_batch_take = _attribute(cls, "_take")
    _a_cache_backend = _attribute(cls, "_backend")
    _batch_cls, _py_lock_many, _py_unlock_many = cls, lock_many, unlock_many
    return (_method(cls, &_lock_many_def, <void *>_lock_many_c, lock_many),
            _method(cls, &_unlock_many_def, <void *>_unlock_many_c, unlock_many))
