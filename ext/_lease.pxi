# The native cycle's Python-facing calls in one extension call each: Cache.lock's
# common case (the key and TTL checks for the common types, the token, the acquire and the
# Lock, whose fields Lease._fill sets), and Lock.unlock's and Lock.extend's (below).
#
# Python still owns the API. Only what hotlock._validate accepts unchanged is handled
# here: a str or bytes key of 1..MAX_KEY_BYTES UTF-8 bytes, an int TTL of whole seconds in
# range, a finite float TTL that rounds into range. Any other key or TTL goes to key_bytes
# or ttl_ms themselves (Cache.lock) or to the Python method (unlock, extend), which return
# the same value or raise their own error, so no message lives here.
# tests/test_native_lease.py checks the two paths agree.

from cpython.exc cimport PyErr_Clear
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.long cimport PyLong_AsLongAndOverflow, PyLong_AsLongLongAndOverflow
from cpython.object cimport Py_TYPE, PyTypeObject
from cpython.ref cimport PyObject
from libc.math cimport isfinite, rint

from hotlock import _ident
from hotlock._scripts import permit_ask
from hotlock._validate import DEFAULT_TTL, MAX_KEY_BYTES, MAX_LIMIT, MAX_TTL_MS, key_bytes, ttl_ms


cdef extern from "Python.h":
    ctypedef struct _Type "PyTypeObject"
    const char *PyUnicode_AsUTF8AndSize(object, Py_ssize_t *) noexcept


cdef Py_ssize_t _MAX_KEY = MAX_KEY_BYTES
cdef long long _MAX_TTL_MS = MAX_TTL_MS
cdef long long _MAX_LIMIT = MAX_LIMIT
cdef tuple _NO_ARGS = ()


# This process's pid, as getpid() says: read at import and, in every forked child, at the
# fork itself (pthread_atfork, before any Python code runs there). A lease is this
# process's when its _pid has this value: what Lease compares with hotlock._ident.pid,
# which the child's after-fork hook sets to the same value a moment later. A dict lookup
# of _ident.pid cost ~170 instructions per call.
cdef long _my_pid = getpid()


cdef void _lease_after_fork() noexcept nogil:
    global _my_pid
    _my_pid = getpid()


pthread_atfork(NULL, NULL, _lease_after_fork)


cdef class _Taker:
    """One cache's Cache.lock as one call: NativeBackend.taker(prefix, lease_class), called
    by cache_lock (below).

    The lease is Python's (hotlock._lock.Lease): made here as ``object.__new__(cls)`` (cls
    the cache's Cache._lease_class) and filled by Lease._fill, the one place a
    new lease's fields are set, which Lease.__init__ calls too. Only the held value is
    formatted here (_held), as the acquire needs it anyway. tests/test_native_lease.py
    compares such a lock with one Lease.__init__ made."""

    cdef NativeBackend _backend  # one server: its backend; on a cluster None
    cdef ClusterRouter _router  # on a cluster (ClusterRouter.taker): its fast path; else None
    cdef object _owner  # the backend every lease holds (on a cluster, the ClusterBackend)
    cdef bytes _prefix  # the cache's lock prefix: prefix + b"lock:"
    cdef type _cls  # the class of the leases made (hotlock._fastpath.NativeLock)
    cdef object _fill  # its _fill (Lease._fill), a plain function: called by vectorcall
    cdef object _pop  # hotlock._ident's token pool, popleft
    cdef object _ms  # the last TTL in ms as an int, handed to every lease taken with it
    cdef long long _ms_value

    def __cinit__(self, backend not None, bytes prefix not None, type lease_class not None, ClusterRouter router=None):
        if router is None:
            self._backend = <NativeBackend?>backend
        self._router = router
        self._owner = backend
        self._prefix = prefix
        self._cls = lease_class  # Cache._lease_class: Lock, or its metered or native subclass
        self._fill = self._cls._fill
        self._pop = _ident._pool.popleft

    cdef object _take(self, key, ttl, long long limit):
        """Cache.lock(key, ttl, limit=limit): the Lock, or the acquire's result (<= 0) when
        held elsewhere."""
        cdef const char *s = NULL
        cdef Py_ssize_t n = 0, p
        cdef long long ms, fence
        cdef int overflow = 0
        cdef double d, sent
        cdef char *out
        raw = None
        # The key, as key_bytes encodes it.
        if type(key) is str:
            s = PyUnicode_AsUTF8AndSize(key, &n)
            if s is NULL:
                PyErr_Clear()  # a lone surrogate: key_bytes says so
        elif type(key) is bytes:
            s = PyBytes_AS_STRING(key)
            n = PyBytes_GET_SIZE(key)
        if s is NULL or n == 0 or n > _MAX_KEY:
            raw = key_bytes(key)
            s = PyBytes_AS_STRING(raw)
            n = PyBytes_GET_SIZE(raw)
        # The TTL, as ttl_ms converts it (round() is half to even, as rint is).
        if type(ttl) is int:
            ms = PyLong_AsLongLongAndOverflow(ttl, &overflow)
            if overflow == 0 and 0 < ms <= _MAX_TTL_MS // 1000:
                ms *= 1000
            else:
                ms = ttl_ms(ttl)
        elif type(ttl) is float and isfinite(PyFloat_AS_DOUBLE(ttl)):
            d = rint(PyFloat_AS_DOUBLE(ttl) * 1000.0)
            ms = <long long>d if 0.0 < d <= <double>_MAX_TTL_MS else ttl_ms(ttl)
        else:
            ms = ttl_ms(ttl)
        # The stored key: hotlock._keys.stored(prefix, raw), prefix + b"{" + raw + b"}".
        p = PyBytes_GET_SIZE(self._prefix)
        name = PyBytes_FromStringAndSize(NULL, p + n + 2)
        out = PyBytes_AS_STRING(name)
        memcpy(out, PyBytes_AS_STRING(self._prefix), p)
        out[p] = c'{'
        memcpy(out + p + 1, s, n)
        out[p + 1 + n] = c'}'
        try:
            token = self._pop()
        except IndexError:
            token = _ident.new_token()  # the pool is empty: it refills
        if limit != 1:
            token = permit_ask(token, limit)  # the lease's held value is then token '#' fence
        sent = _monotonic()
        if self._router is not None:
            fence = self._router._acquire(name, token, ms)
        else:
            self._backend._scripts(_SHA_ACQUIRE, name, token, 1, ms, self._backend._rule(0.0, True),
                                   "acquire", name, &fence)
        if fence <= 0:
            return fence
        return self._lease(key, name, _held(token, fence), fence, ms, sent)

    cdef object _lease(self, key, bytes name, bytes held, long long fence, long long ms, double sent):
        """A new lease of the cache's class: its fields as Lease._fill sets them."""
        # object.__new__(cls), without looking the method up: the lease class has no
        # __new__ of its own, so this is object's, which only allocates.
        lease = (<PyTypeObject *>self._cls).tp_new(self._cls, <PyObject *>_NO_ARGS, NULL)
        if self._ms is None or self._ms_value != ms:
            self._ms = ms
            self._ms_value = ms
        self._fill(lease, self._owner, key, name, held, fence, self._ms, sent)
        return lease


# Cache.lock, Lock.unlock and Lock.extend's common case, one extension call each:
# hotlock._cache and hotlock._lock put these on their classes in place of their own
# methods, and hand those here as the way for every other case.
#
# Each is a method descriptor over a METH_FASTCALL C function (what a method of a C type
# is), not a Cython def: it sees the arguments as given, before any parsing, so whatever
# it does not take as is (a keyword it does not know, a missing or extra argument, an
# unusual value) is passed on untouched to the Python method, whose own TypeError, checks
# and messages then apply; and a call costs no argument tuple or dict.
#
# The common case: (lock) a str/bytes key and int/float TTL on a NativeBackend, without
# auto_extend or max_hold; (unlock, extend) a lock of this process on a NativeBackend,
# not released, not known lost, without auto_extend, and (extend) a TTL of None, an int
# or a float that ttl_ms takes unchanged. There the Python methods would check exactly
# what is checked here, send the same command, write the same fields and call the same
# metrics hooks. Anything else (another backend, a forked child, a released lock, a bad
# TTL, an auto-extended lease) runs the Python method itself, so every error and message
# and the renewer's bookkeeping stay Python's. tests/test_native_lease.py
# holds the two paths to each other.

cdef extern from "Python.h":
    ctypedef struct PyMethodDef:
        const char *ml_name
        void *ml_meth
        int ml_flags
        const char *ml_doc
    object PyDescr_NewMethod(_Type *cls, PyMethodDef *method)
    object PyObject_Vectorcall(object callable, PyObject **args, size_t nargsf, PyObject *kwnames)
    enum:
        METH_FASTCALL
        METH_KEYWORDS

from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

cdef object _lease_cls = None  # the class the methods were made for (hotlock._fastpath.NativeLock)
cdef object _py_unlock = None  # its Python unlock and extend: every other case
cdef object _py_extend = None
cdef object _taken = None  # hotlock._lock.TAKEN: why an extend that found another token says the lock is lost

cdef object _cache_cls = None  # hotlock._fastpath.NativeCache
cdef object _py_lock = None  # its Python lock: every other case

# The leases and caches are plain Python objects (hotlock._lock.Lease, hotlock._cache.Cache):
# the one-call paths read and write their attributes through the descriptor each class has
# for each name (a slot's member descriptor, or whatever the class puts there), as
# `obj.<name>` does, less looking the name up in the class on every call. They are found
# once, by name, in lease_methods and cache_lock; nothing here knows an object's layout.
cdef object _a_backend, _a_name, _a_token, _a_pid, _a_auto, _a_meter, _a_loss, _a_ttl, _a_deadline
cdef object _a_take  # Cache._take: the cache's _Taker, or None


cdef inline object _get(object descr, object obj):
    """obj.<descr's name>."""
    return Py_TYPE(descr).tp_descr_get(descr, obj, type(obj))


cdef inline int _set(object descr, object obj, object value) except -1:
    """obj.<descr's name> = value."""
    return Py_TYPE(descr).tp_descr_set(descr, obj, value)


cdef object _attribute(object cls, str name):
    """What cls's attribute lookup finds for name: a data descriptor (a slot's), which
    _get and _set call."""
    for klass in cls.__mro__:
        descr = klass.__dict__.get(name)
        if descr is not None:
            if <void *>Py_TYPE(descr).tp_descr_get is NULL or <void *>Py_TYPE(descr).tp_descr_set is NULL:
                raise TypeError(f"{cls.__name__}.{name} is not a slot")
            return descr
    raise TypeError(f"{cls.__name__} has no {name}")

cdef PyMethodDef _lock_def, _unlock_def, _extend_def
cdef list _docs = []  # keeps the ml_doc strings alive


cdef object _as_given(object method, object self, PyObject **args, Py_ssize_t nargs, PyObject *kwnames):
    """method(self, *args, **kwargs) with the arguments exactly as the caller gave them."""
    cdef Py_ssize_t nkw = 0 if kwnames is NULL else PyTuple_GET_SIZE(<object>kwnames)
    cdef PyObject *stack[16]
    cdef Py_ssize_t i
    if nargs + nkw < 16:
        stack[0] = <PyObject *>self
        for i in range(nargs + nkw):
            stack[i + 1] = args[i]
        return PyObject_Vectorcall(method, stack, <size_t>(nargs + 1), kwnames)
    given = [<object>args[i] for i in range(nargs)]
    named = {<object>PyTuple_GET_ITEM(<object>kwnames, i): <object>args[nargs + i] for i in range(nkw)}
    return method(self, *given, **named)


cdef object _lock_c(object self, PyObject **args, Py_ssize_t nargs, PyObject *kwnames):
    # Cache.lock(key, ttl=DEFAULT_TTL, *, auto_extend=False, max_hold=None, limit=1)
    cdef Py_ssize_t i
    cdef object key, ttl = DEFAULT_TTL
    cdef long long limit = 1
    cdef bint got_ttl = nargs == 2
    if nargs < 1 or nargs > 2:
        return _as_given(_py_lock, self, args, nargs, kwnames)
    key = <object>args[0]
    if got_ttl:
        ttl = <object>args[1]
    if kwnames is not NULL:
        # Only a ttl=..., auto_extend=False, max_hold=None or limit=<an int limit_int takes
        # as it is> keyword keeps the common case.
        for i in range(PyTuple_GET_SIZE(<object>kwnames)):
            name = <object>PyTuple_GET_ITEM(<object>kwnames, i)
            value = <object>args[nargs + i]
            if name == "ttl" and not got_ttl:
                ttl = value
                got_ttl = True
            elif name == "limit" and type(value) is int and 1 <= value <= _MAX_LIMIT:
                limit = value
            elif not ((name == "auto_extend" and value is False) or (name == "max_hold" and value is None)):
                return _as_given(_py_lock, self, args, nargs, kwnames)
    if isinstance(self, _cache_cls):
        taker = _get(_a_take, self)
        if type(taker) is _Taker:
            lock = (<_Taker>taker)._take(key, ttl, limit)
            if type(lock) is int:
                raise self._not_acquired(key, lock, None, limit)
            return lock
    return _as_given(_py_lock, self, args, nargs, kwnames)


cdef inline bint _plain_held(object lease, object owner, object name, object token) except -1:
    """The common case unlock and extend share: a lease of _lease_cls itself (the caller
    checks) on a NativeBackend or a native cluster, whose owner, name and token (read once
    by the caller) are as Lease made them, with a held value, taken by this process, not
    auto-extended. A metered lease is one too: its hooks (hotlock._metered.Meter) are
    called here as the Python methods call them, so connect(metrics=...) keeps the
    one-call path."""
    cdef int overflow = 0
    if not ((type(owner) is NativeBackend or _router_of(owner) is not None)
            and type(name) is bytes and type(token) is bytes and PyBytes_GET_SIZE(token) > 0):
        return False
    pid = _get(_a_pid, lease)
    return (type(pid) is int and PyLong_AsLongAndOverflow(pid, &overflow) == _my_pid and overflow == 0
            and _get(_a_auto, lease) is None)


cdef object _unlock_c(object self, PyObject **args, Py_ssize_t nargs, PyObject *kwnames):
    # Lock.unlock()
    cdef bint released
    if nargs != 0 or kwnames is not NULL or type(self) is not _lease_cls:
        return _as_given(_py_unlock, self, args, nargs, kwnames)
    # Read once, and held here: the round trip releases the GIL, and another thread may
    # unlock this lock (emptying its token) meanwhile.
    owner = _get(_a_backend, self)
    name = _get(_a_name, self)
    token = _get(_a_token, self)
    if not _plain_held(self, owner, name, token):
        return _as_given(_py_unlock, self, args, nargs, kwnames)
    meter = _get(_a_meter, self)
    try:
        # A CacheError keeps the token, as unlock() does.
        if type(owner) is NativeBackend:
            released = (<NativeBackend>owner)._release(<bytes>name, <bytes>token)
        else:
            released = _router_of(owner)._release(<bytes>name, <bytes>token)
    except CacheError as error:
        if meter is not None:  # metrics hook
            meter.failed(self, "release", error)
        raise
    _set(_a_token, self, b"")
    if meter is not None:  # metrics hook: Meter.released, its common case written out
        if released:
            try:
                meter._released(self.key, _monotonic() - self._since)
            except Exception:
                meter.raised()
        else:
            meter.released(self, False)
    return released


cdef object _extend_c(object self, PyObject **args, Py_ssize_t nargs, PyObject *kwnames):
    # Lock.extend(ttl=None)
    cdef long long ms
    cdef int overflow = 0
    cdef double d, sent
    cdef object ttl = None
    if kwnames is NULL:
        if nargs == 1:
            ttl = <object>args[0]
        elif nargs != 0:
            return _as_given(_py_extend, self, args, nargs, kwnames)
    elif nargs == 0 and PyTuple_GET_SIZE(<object>kwnames) == 1 and <object>PyTuple_GET_ITEM(<object>kwnames, 0) == "ttl":
        ttl = <object>args[0]  # extend(ttl=...)
    else:
        return _as_given(_py_extend, self, args, nargs, kwnames)
    if type(self) is not _lease_cls:
        return _as_given(_py_extend, self, args, nargs, kwnames)
    owner = _get(_a_backend, self)
    name = _get(_a_name, self)
    token = _get(_a_token, self)
    if not _plain_held(self, owner, name, token) or _get(_a_loss, self) is not None:
        return _as_given(_py_extend, self, args, nargs, kwnames)
    # The TTL as Lease._extend_ms takes it: the one it holds, or ttl_ms's common cases.
    kept = ttl is None
    if kept:
        held_ms = _get(_a_ttl, self)
        if type(held_ms) is not int:
            return _as_given(_py_extend, self, args, nargs, kwnames)
        ms = PyLong_AsLongLongAndOverflow(held_ms, &overflow)
        if overflow != 0 or not 0 < ms <= _MAX_TTL_MS:
            return _as_given(_py_extend, self, args, nargs, kwnames)
    elif type(ttl) is int:
        ms = PyLong_AsLongLongAndOverflow(ttl, &overflow)
        if overflow != 0 or not 0 < ms <= _MAX_TTL_MS // 1000:
            return _as_given(_py_extend, self, args, nargs, kwnames)
        ms *= 1000
    elif type(ttl) is float and isfinite(PyFloat_AS_DOUBLE(ttl)):
        d = rint(PyFloat_AS_DOUBLE(ttl) * 1000.0)
        if not 0.0 < d <= <double>_MAX_TTL_MS:
            return _as_given(_py_extend, self, args, nargs, kwnames)
        ms = <long long>d
    else:
        return _as_given(_py_extend, self, args, nargs, kwnames)
    # Not auto-extended and not known lost: _extend_ms would raise nothing here (a plain
    # lease past its deadline may still be extended).
    meter = _get(_a_meter, self)
    sent = _monotonic()
    try:
        if type(owner) is NativeBackend:
            ok = (<NativeBackend>owner)._extend(<bytes>name, <bytes>token, ms)
        else:
            ok = _router_of(owner)._extend(<bytes>name, <bytes>token, ms)
    except Unreplicated as short:  # wait_replicas: the extend ran, too few replicas confirmed it
        raise self._unreplicated(short, sent) from None
    except CacheError as error:
        if meter is not None:  # metrics hook
            meter.failed(self, "extend", error)
        raise
    if meter is not None:  # metrics hook
        meter.extended(self, ok)
    if ok:
        # Lease._extended(True, ms, sent) written out: a Python frame costs more than the
        # rest of this call's Python-facing work.
        if not kept:  # the same TTL (the common extend) is the same int
            _set(_a_ttl, self, ms)
        _set(_a_deadline, self, sent + <double>ms / 1000.0)
        return None
    self._extended(False, ms, sent)
    raise self._lost(_taken)


cdef object _method(object cls, PyMethodDef *method, void *function, object python):
    """A method descriptor of cls calling function, named and documented as python (its
    signature, without annotations, as the __text_signature__ help() and inspect read)."""
    import inspect

    signature = inspect.signature(python)
    bare = signature.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()],
        return_annotation=inspect.Signature.empty)
    text = str(bare).replace("(self, ", "($self, /, ", 1).replace("(self)", "($self, /)", 1)
    name = python.__name__.encode()
    doc = f"{python.__name__}{text}\n--\n\n{inspect.getdoc(python) or ''}".encode()
    _docs.extend((name, doc))
    method.ml_name = name
    method.ml_meth = function
    method.ml_flags = METH_FASTCALL | METH_KEYWORDS
    method.ml_doc = doc
    return PyDescr_NewMethod(<_Type *><PyObject *>cls, method)


def cache_lock(cls not None, lock not None):
    """The lock() of cls (hotlock._fastpath.NativeCache) with the common case in one call; every
    other case goes to the given Python method."""
    global _cache_cls, _py_lock, _a_take
    _a_take = _attribute(cls, "_take")
    _cache_cls, _py_lock = cls, lock
    return _method(cls, &_lock_def, <void *>_lock_c, lock)


def lease_methods(cls not None, unlock not None, extend not None, str taken not None):
    """(unlock, extend) for cls (hotlock._fastpath.NativeLock) with the common case in C; every other
    case goes to the given Python methods."""
    global _lease_cls, _py_unlock, _py_extend, _taken
    global _a_backend, _a_name, _a_token, _a_pid, _a_auto, _a_meter, _a_loss, _a_ttl, _a_deadline
    _a_backend = _attribute(cls, "_backend")
    _a_name = _attribute(cls, "_name")
    _a_token = _attribute(cls, "_token")
    _a_pid = _attribute(cls, "_pid")
    _a_auto = _attribute(cls, "_auto")
    _a_meter = _attribute(cls, "_meter")
    _a_loss = _attribute(cls, "_loss")
    _a_ttl = _attribute(cls, "_ttl_ms")
    _a_deadline = _attribute(cls, "_deadline")
    _lease_cls, _py_unlock, _py_extend, _taken = cls, unlock, extend, taken
    return (_method(cls, &_unlock_def, <void *>_unlock_c, unlock),
            _method(cls, &_extend_def, <void *>_extend_c, extend))
