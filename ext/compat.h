/* The differences between the hiredis builds and the CPython versions hotlock's extension
 * meets, in one place, so ext/_native.pyx compiles unchanged against each: the pinned
 * hiredis 1.x sources (plain, and with the TLS layer, ext/tls.h), a system libhiredis 0.14
 * or 1.x (the fallback), and CPython 3.10 to 3.13. */
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

/* A reply that did not arrive within the SO_RCVTIMEO set by redisSetTimeout. 1.x reports
 * REDIS_ERR_TIMEOUT where the socket says ETIMEDOUT; a plain read that times out (EAGAIN,
 * and every read on 0.14) is REDIS_ERR_IO with strerror(EAGAIN) as its errstr, and so is a
 * TLS read that times out in 1.x's ssl.c ("Resource temporarily unavailable"): all of
 * them are the same timeout to the caller. */
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

/* Bounds on what one connection's reader holds, for the async core (ext/_aio.pxi): at most
 * maxelements in one array (hiredis otherwise allocates what a "*<n>" header asks for, up to
 * 2^32-1 pointers) and, through hotlock_reader_pending, the bytes of a reply not yet complete.
 * 1.x has maxelements; 0.14 has no such field, and its array headers stay unbounded there. */
static inline void hotlock_reader_bound(redisReader *r, long long maxelements) {
#if HIREDIS_MAJOR >= 1
    r->maxelements = maxelements;
#else
    (void)r;
    (void)maxelements;
#endif
}

/* The bytes fed to the reader and not yet taken as a whole reply (both series have pos/len). */
static inline size_t hotlock_reader_pending(const redisReader *r) {
    return r->len - r->pos;
}

#endif
