/* The differences between hiredis 0.14 and 1.x, and between CPython versions, that hotlock's
 * extension meets, in one place, so ext/_native.pyx compiles unchanged against all of them. */
#ifndef HOTLOCK_COMPAT_H
#define HOTLOCK_COMPAT_H

#include <Python.h>
#include <errno.h>
#include <string.h>
#include <hiredis/hiredis.h>

#define HOTLOCK_STR_(x) #x
#define HOTLOCK_STR(x) HOTLOCK_STR_(x)
/* Both series define HIREDIS_MAJOR/MINOR/PATCH in hiredis.h. */
#define HOTLOCK_HIREDIS_VERSION \
    HOTLOCK_STR(HIREDIS_MAJOR) "." HOTLOCK_STR(HIREDIS_MINOR) "." HOTLOCK_STR(HIREDIS_PATCH)

/* TLS lives in a separate library (hiredis_ssl) from 1.0 on, and 0.14 has none. This build
 * links plain libhiredis only, so rediss:// goes to the redis-py backend on every version
 * (hotlock._backend.choose reads HAS_TLS). */
#define HOTLOCK_HAS_TLS 0

/* A reply that did not arrive within the SO_RCVTIMEO set by redisSetTimeout: 1.x reports
 * REDIS_ERR_TIMEOUT; 0.14 reports REDIS_ERR_IO with strerror(EAGAIN) as its errstr. */
static inline int hotlock_timed_out(const redisContext *c) {
#ifdef REDIS_ERR_TIMEOUT
    if (c->err == REDIS_ERR_TIMEOUT)
        return 1;
#endif
    return c->err == REDIS_ERR_IO &&
           (strcmp(c->errstr, strerror(EAGAIN)) == 0 || strcmp(c->errstr, strerror(EWOULDBLOCK)) == 0);
}

/* A weak reference's target as a new reference, or None once it is dead; NULL with an error
 * set if ref is not a weak reference. PyWeakref_GetObject (a borrowed reference) is
 * deprecated from CPython 3.13 and removed in 3.15; PyWeakref_GetRef, its replacement,
 * exists only from 3.13. */
static inline PyObject *hotlock_weakref_target(PyObject *ref) {
    PyObject *obj;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyWeakref_GetRef(ref, &obj) < 0)
        return NULL;
    if (obj == NULL)
        Py_RETURN_NONE;
    return obj;
#else
    obj = PyWeakref_GetObject(ref);
    Py_XINCREF(obj);
    return obj;
#endif
}

#endif
