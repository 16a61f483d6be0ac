# Cache.lock's common case in one extension call (issue 9): the key and TTL checks for the
# common types, the token, the acquire and the Lock itself, with no Python frame between.
#
# Python still owns the API. Only what hotlock._validate accepts unchanged is handled
# here: a str or bytes key of 1..MAX_KEY_BYTES UTF-8 bytes, an int TTL of whole seconds in
# range, a finite float TTL that rounds into range. Any other key or TTL goes to key_bytes
# or ttl_ms themselves, which return the same value or raise their own error, so no
# message lives here. tests/test_native.py checks the two paths agree.

from cpython.exc cimport PyErr_Clear
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.ref cimport PyObject, Py_DECREF, Py_INCREF, Py_XINCREF
from libc.math cimport isfinite, rint

from types import MemberDescriptorType

from hotlock import _ident
from hotlock._validate import MAX_KEY_BYTES, MAX_TTL_MS, key_bytes, ttl_ms


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
# The fields a new lease gets from its acquisition; Lease.__init__ sets the same ones.
cdef tuple _OWN = ("_backend", "key", "_name", "_token", "fence", "_ttl_ms", "_pid", "_deadline", "_since")
DEF _MAX_SLOTS = 64


cdef inline void _put(char *obj, Py_ssize_t offset, object value) noexcept:
    """Fill an empty (NULL) slot of a just-allocated object."""
    Py_INCREF(value)
    (<PyObject **>(obj + offset))[0] = <PyObject *>value


cdef class _Taker:
    """One cache's Cache.lock as one call: NativeBackend.taker(prefix, template).take.

    A lease is built without a Python __init__: allocated, every slot copied from the
    template (a Lock the cache made the ordinary way, so a slot someone adds to Lease with
    a default in __init__ gets that default here too), then the acquisition's own fields
    written in. tests/test_native.py compares such a lock with one Lease.__init__ made."""

    cdef NativeBackend _backend
    cdef bytes _prefix  # the cache's lock prefix: prefix + b"lock:"
    cdef object _template
    cdef _Type *_cls
    cdef Py_ssize_t _n_rest
    cdef Py_ssize_t _rest[_MAX_SLOTS]  # the template's slots copied as they are (_meter, ...)
    cdef Py_ssize_t _own[9]  # the offsets of _OWN's slots, in that order
    cdef dict _ident_globals  # hotlock._ident's: "pid" is rebound in a forked child
    cdef object _pop  # hotlock._ident's token pool, popleft

    def __cinit__(self, NativeBackend backend, bytes prefix not None, template not None):
        cls_object = type(template)  # kept alive by the template
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
            raise TypeError(f"{type(template).__name__} must have __slots__ only")
        self._backend = backend
        self._prefix = prefix
        self._template = template
        self._cls = cls
        for i, slot in enumerate(_OWN):
            self._own[i] = offsets.pop(slot)
        self._n_rest = 0
        for offset in offsets.values():
            self._rest[self._n_rest] = offset
            self._n_rest += 1
        self._ident_globals = vars(_ident)
        self._pop = _ident._pool.popleft

    def take(self, key, ttl):
        """Cache.lock(key, ttl): the Lock, or the acquire's result (<= 0) when held elsewhere."""
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
        sent = _monotonic()
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
        # As Lease.__init__: the held value is token + fence digits; the TTL runs from
        # when the acquire was sent.
        _put(obj, self._own[0], self._backend)
        _put(obj, self._own[1], key)
        _put(obj, self._own[2], name)
        _put(obj, self._own[3], held)
        _put(obj, self._own[4], fence)
        _put(obj, self._own[5], ms)
        _put(obj, self._own[6], self._ident_globals["pid"])
        _put(obj, self._own[7], sent + <double>ms / 1000.0)
        _put(obj, self._own[8], sent)
        return lease
