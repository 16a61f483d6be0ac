# The native cycle's Python-facing calls in one extension call each: Cache.lock's
# common case (the key and TTL checks for the common types, the token, the acquire and the
# Lock itself, with no Python frame between), and Lock.unlock's and Lock.extend's (below).
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
from cpython.ref cimport PyObject, Py_DECREF, Py_INCREF, Py_XDECREF, Py_XINCREF
from libc.math cimport isfinite, rint

from types import MemberDescriptorType

from hotlock import _ident
from hotlock._scripts import permit_ask
from hotlock._validate import DEFAULT_TTL, MAX_KEY_BYTES, MAX_LIMIT, MAX_TTL_MS, key_bytes, ttl_ms


cdef extern from "Python.h":
    # Only the fields read here.
    ctypedef struct _Type "PyTypeObject":
        Py_ssize_t tp_basicsize
        Py_ssize_t tp_itemsize
        Py_ssize_t tp_dictoffset
        Py_ssize_t tp_weaklistoffset
        PyObject *(*tp_alloc)(_Type *, Py_ssize_t)
    ctypedef struct PyMemberDef:
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member
    const char *PyUnicode_AsUTF8AndSize(object, Py_ssize_t *) noexcept


cdef Py_ssize_t _MAX_KEY = MAX_KEY_BYTES
cdef long long _MAX_TTL_MS = MAX_TTL_MS
cdef long long _MAX_LIMIT = MAX_LIMIT
# The fields a new lease gets from its acquisition; Lease.__init__ sets the same ones.
cdef tuple _OWN = ("_backend", "key", "_name", "_token", "fence", "_ttl_ms", "_pid", "_deadline", "_since")
DEF _MAX_SLOTS = 64


cdef dict _slot_offsets(cls_object):
    """Every slot of a lease class and its offset in the object; TypeError unless the
    class has plain __slots__ only (no __dict__, no __weakref__, no property over a slot)."""
    cdef _Type *cls = <_Type *><PyObject *>cls_object
    offsets = {}
    for klass in cls_object.__mro__:
        for slot in klass.__dict__.get("__slots__", ()):
            descr = klass.__dict__[slot]
            if type(descr) is not MemberDescriptorType:
                raise TypeError(f"{slot} is not a plain slot")
            offsets[slot] = (<PyMemberDescrObject *><PyObject *>descr).d_member.offset
    # Only slots, no __dict__ or __weakref__: then every field is one of the offsets.
    if (cls.tp_itemsize or cls.tp_dictoffset or cls.tp_weaklistoffset or len(offsets) > _MAX_SLOTS
            or <Py_ssize_t>(len(offsets) * sizeof(PyObject *) + sizeof(PyObject)) != cls.tp_basicsize):
        raise TypeError(f"{cls_object.__name__} must have __slots__ only")
    return offsets


cdef inline void _put(char *obj, Py_ssize_t offset, object value) noexcept:
    """Fill an empty (NULL) slot of a just-allocated object."""
    Py_INCREF(value)
    (<PyObject **>(obj + offset))[0] = <PyObject *>value


# This process's pid, as getpid() says: read at import and, in every forked child, at the
# fork itself (pthread_atfork, before any Python code runs there). A lease is this
# process's when its _pid has this value: what Lease compares with hotlock._ident.pid,
# which the child's after-fork hook sets to the same value a moment later. A dict lookup
# of _ident.pid cost ~170 instructions per call.
cdef long _my_pid = getpid()
cdef object _my_pid_object = _my_pid  # a PyLong of it, for the leases _Taker builds
cdef long _my_pid_object_is = _my_pid


cdef void _lease_after_fork() noexcept nogil:
    global _my_pid
    _my_pid = getpid()


pthread_atfork(NULL, NULL, _lease_after_fork)


cdef inline object _pid_now():
    """_my_pid as a Python int (made again only in a forked child)."""
    global _my_pid_object, _my_pid_object_is
    if _my_pid_object_is != _my_pid:
        _my_pid_object = _my_pid
        _my_pid_object_is = _my_pid
    return _my_pid_object


cdef class _Taker:
    """One cache's Cache.lock as one call: NativeBackend.taker(prefix, template), called by
    cache_lock (below).

    A lease is built without a Python __init__: allocated, every slot copied from the
    template (a Lock the cache made the ordinary way, so a slot someone adds to Lease with
    a default in __init__ gets that default here too), then the acquisition's own fields
    written in. tests/test_native.py compares such a lock with one Lease.__init__ made."""

    cdef NativeBackend _backend  # one server: its backend; on a cluster None
    cdef ClusterRouter _router  # on a cluster (ClusterRouter.taker): its fast path; else None
    cdef object _owner  # the backend every lease holds (on a cluster, the ClusterBackend)
    cdef bytes _prefix  # the cache's lock prefix: prefix + b"lock:"
    cdef object _template
    cdef _Type *_cls
    cdef Py_ssize_t _n_rest
    cdef Py_ssize_t _rest[_MAX_SLOTS]  # the template's slots copied as they are (_meter, ...)
    cdef Py_ssize_t _own[9]  # the offsets of _OWN's slots, in that order
    cdef object _pop  # hotlock._ident's token pool, popleft
    cdef object _ms  # the last TTL in ms as an int, handed to every lease taken with it
    cdef long long _ms_value
    cdef bint _fenced  # the backend's connect(fences=...): False makes every lease's fence 0

    def __cinit__(self, backend not None, bytes prefix not None, template not None, ClusterRouter router=None):
        cls_object = type(template)  # kept alive by the template
        cdef _Type *cls = <_Type *><PyObject *>cls_object
        offsets = _slot_offsets(cls_object)
        if router is None:
            self._backend = <NativeBackend?>backend
        self._router = router
        self._owner = backend
        self._fenced = backend.fenced  # set with the dialect, before any cache has a taker
        self._prefix = prefix
        self._template = template
        self._cls = cls
        for i, slot in enumerate(_OWN):
            self._own[i] = offsets.pop(slot)
        self._n_rest = 0
        for offset in offsets.values():
            self._rest[self._n_rest] = offset
            self._n_rest += 1
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
        cdef PyObject *made = self._cls.tp_alloc(self._cls, 0)  # zeroed, GC-tracked
        cdef PyObject *v
        cdef char *obj
        cdef char *template = <char *><PyObject *>self._template
        cdef Py_ssize_t i
        if made is NULL:
            raise MemoryError()
        lease = <object>made
        Py_DECREF(lease)  # tp_alloc's reference: `lease` holds one now
        obj = <char *>made
        for i in range(self._n_rest):
            v = (<PyObject **>(template + self._rest[i]))[0]
            Py_XINCREF(v)
            (<PyObject **>(obj + self._rest[i]))[0] = v
        # As Lease.__init__: the held value is the token (a permit's: token '#' fence); the TTL runs from
        # when the acquire was sent.
        _put(obj, self._own[0], self._owner)
        _put(obj, self._own[1], key)
        _put(obj, self._own[2], name)
        _put(obj, self._own[3], held)
        _put(obj, self._own[4], fence if self._fenced else 0)
        if self._ms is None or self._ms_value != ms:
            self._ms = ms
            self._ms_value = ms
        _put(obj, self._own[5], self._ms)
        _put(obj, self._own[6], _pid_now())
        _put(obj, self._own[7], sent + <double>ms / 1000.0)
        _put(obj, self._own[8], sent)
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

cdef object _lease_cls = None  # the class the methods were made for (hotlock._lock.Lock)
cdef object _py_unlock = None  # its Python unlock and extend: every other case
cdef object _py_extend = None
cdef object _taken = None  # hotlock._lock.TAKEN: why an extend that found another token says the lock is lost
# Slot offsets in a _lease_cls object (see _slot_offsets).
cdef Py_ssize_t _at_backend, _at_name, _at_token, _at_pid, _at_auto, _at_meter, _at_loss, _at_ttl, _at_deadline

cdef object _cache_cls = None  # hotlock._cache.Cache
cdef object _py_lock = None  # its Python lock: every other case
cdef Py_ssize_t _at_take  # the offset of Cache._take: the cache's _Taker, or None

cdef PyMethodDef _lock_def, _unlock_def, _extend_def
cdef list _docs = []  # keeps the ml_doc strings alive


cdef inline PyObject *_slot(object obj, Py_ssize_t offset) noexcept:
    return (<PyObject **>((<char *><PyObject *>obj) + offset))[0]


cdef inline void _store(object obj, Py_ssize_t offset, object value) noexcept:
    """obj.<slot> = value, as a slot assignment does (the old value's reference dropped)."""
    cdef PyObject **field = <PyObject **>((<char *><PyObject *>obj) + offset)
    cdef PyObject *old = field[0]
    Py_INCREF(value)
    field[0] = <PyObject *>value
    Py_XDECREF(old)


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
    cdef PyObject *taker
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
        taker = _slot(self, _at_take)
        if taker is not NULL and type(<object>taker) is _Taker:
            lock = (<_Taker><object>taker)._take(key, ttl, limit)
            if type(lock) is int:
                raise self._not_acquired(key, lock, None, limit)
            return lock
    return _as_given(_py_lock, self, args, nargs, kwnames)


cdef inline bint _plain_held(object lease) noexcept:
    """The common case unlock and extend share: a lease of _lease_cls itself on a
    NativeBackend, with a held value, taken by this process, not auto-extended. A metered
    lease is one too: its hooks (hotlock._metered.Meter) are called here as the Python
    methods call them, so connect(metrics=...) keeps the one-call path."""
    cdef PyObject *backend
    cdef PyObject *name
    cdef PyObject *token
    cdef PyObject *pid
    cdef int overflow = 0
    if type(lease) is not _lease_cls:
        return False
    backend = _slot(lease, _at_backend)
    name = _slot(lease, _at_name)
    token = _slot(lease, _at_token)
    pid = _slot(lease, _at_pid)
    return (backend is not NULL
            and (type(<object>backend) is NativeBackend or _router_of(<object>backend) is not None)
            and name is not NULL and type(<object>name) is bytes
            and token is not NULL and type(<object>token) is bytes and PyBytes_GET_SIZE(<object>token) > 0
            and pid is not NULL and type(<object>pid) is int
            and PyLong_AsLongAndOverflow(<object>pid, &overflow) == _my_pid and overflow == 0
            and _slot(lease, _at_auto) == <PyObject *>None
            and _slot(lease, _at_meter) is not NULL)


cdef object _unlock_c(object self, PyObject **args, Py_ssize_t nargs, PyObject *kwnames):
    # Lock.unlock()
    cdef bytes name, token
    cdef bint released
    if nargs != 0 or kwnames is not NULL or not _plain_held(self):
        return _as_given(_py_unlock, self, args, nargs, kwnames)
    # Owned references: the round trip releases the GIL, and another thread may unlock
    # this lock (emptying its token) meanwhile.
    owner = <object>_slot(self, _at_backend)
    name = <bytes><object>_slot(self, _at_name)
    token = <bytes><object>_slot(self, _at_token)
    meter = <object>_slot(self, _at_meter)
    try:
        # A CacheError keeps the token, as unlock() does.
        if type(owner) is NativeBackend:
            released = (<NativeBackend>owner)._release(name, token)
        else:
            released = _router_of(owner)._release(name, token)
    except CacheError as error:
        if meter is not None:  # metrics hook
            meter.failed(self, "release", error)
        raise
    _store(self, _at_token, b"")
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
    cdef bytes name, token
    cdef PyObject *held_ms
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
    if not _plain_held(self) or _slot(self, _at_loss) != <PyObject *>None:
        return _as_given(_py_extend, self, args, nargs, kwnames)
    # The TTL as Lease._extend_ms takes it: the one it holds, or ttl_ms's common cases.
    kept = None
    if ttl is None:
        held_ms = _slot(self, _at_ttl)
        if held_ms is NULL or type(<object>held_ms) is not int:
            return _as_given(_py_extend, self, args, nargs, kwnames)
        kept = <object>held_ms
        ms = PyLong_AsLongLongAndOverflow(kept, &overflow)
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
    owner = <object>_slot(self, _at_backend)
    name = <bytes><object>_slot(self, _at_name)
    token = <bytes><object>_slot(self, _at_token)
    meter = <object>_slot(self, _at_meter)
    sent = _monotonic()
    try:
        if type(owner) is NativeBackend:
            ok = (<NativeBackend>owner)._extend(name, token, ms)
        else:
            ok = _router_of(owner)._extend(name, token, ms)
    except Unreplicated as short:  # wait_replicas: the extend ran, too few replicas confirmed it
        raise self._unreplicated(short, sent) from None
    except CacheError as error:
        if meter is not None:  # metrics hook
            meter.failed(self, "extend", error)
        raise
    if meter is not None:  # metrics hook
        meter.extended(self, ok)
    if ok:
        # Lease._extended(True, ms, sent)
        if kept is None:
            # A new int only when the TTL changed (the same TTL is the common extend).
            held_ms = _slot(self, _at_ttl)
            if (held_ms is NULL or type(<object>held_ms) is not int
                    or PyLong_AsLongLongAndOverflow(<object>held_ms, &overflow) != ms or overflow != 0):
                _store(self, _at_ttl, ms)
        _store(self, _at_deadline, sent + <double>ms / 1000.0)
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
    global _cache_cls, _py_lock, _at_take
    descr = next((k.__dict__["_take"] for k in cls.__mro__ if "_take" in k.__dict__), None)
    if type(descr) is not MemberDescriptorType:
        raise TypeError("_take is not a plain slot")
    _at_take = (<PyMemberDescrObject *><PyObject *>descr).d_member.offset
    _cache_cls, _py_lock = cls, lock
    return _method(cls, &_lock_def, <void *>_lock_c, lock)


def lease_methods(cls not None, unlock not None, extend not None, str taken not None):
    """(unlock, extend) for cls (hotlock._fastpath.NativeLock) with the common case in C; every other
    case goes to the given Python methods."""
    global _lease_cls, _py_unlock, _py_extend, _taken
    global _at_backend, _at_name, _at_token, _at_pid, _at_auto, _at_meter, _at_loss, _at_ttl, _at_deadline
    offsets = _slot_offsets(cls)
    _at_backend = offsets["_backend"]
    _at_name = offsets["_name"]
    _at_token = offsets["_token"]
    _at_pid = offsets["_pid"]
    _at_auto = offsets["_auto"]
    _at_meter = offsets["_meter"]
    _at_loss = offsets["_loss"]
    _at_ttl = offsets["_ttl_ms"]
    _at_deadline = offsets["_deadline"]
    _lease_cls, _py_unlock, _py_extend, _taken = cls, unlock, extend, taken
    return (_method(cls, &_unlock_def, <void *>_unlock_c, unlock),
            _method(cls, &_extend_def, <void *>_extend_c, extend))
