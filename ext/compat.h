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

/* The most elements an aggregate reply may declare, on the sync and the async readers.
 * hiredis 1.x allows 2^32 - 1, so a hostile "*4294967295" makes it allocate 32 GB of
 * pointers before a byte of them arrives; no reply hotlock asks for comes near this
 * (CLUSTER SLOTS has one element per slot range, at most 16384). */
#define HOTLOCK_MAX_ELEMENTS (1LL << 20)

/* Bounds a reader: at most maxelements in one array. 1.x has maxelements; 0.14 has no such
 * field, and its array headers stay unbounded there. */
static inline void hotlock_reader_bound(redisReader *r, long long maxelements) {
#if HIREDIS_MAJOR >= 1
    r->maxelements = maxelements;
#else
    (void)r;
    (void)maxelements;
#endif
}

/* The bytes fed to a reader and not yet taken as a whole reply (both series have pos/len). */
static inline size_t hotlock_reader_pending(const redisReader *r) {
    return r->len - r->pos;
}

/* A new sync context's reader bounded, and RESP3 pushes handed back as replies instead of
 * freed in silence by 1.x's default push handler: hotlock speaks RESP2 and asks for no
 * push, so one is a sign of a stream in doubt (hotlock_suspect_stream). */
static inline void hotlock_harden(redisContext *c) {
    hotlock_reader_bound(c->reader, HOTLOCK_MAX_ELEMENTS);
#if HIREDIS_MAJOR >= 1
    redisSetPushCallback(c, NULL);
#endif
}

/* Whether a reply is of a kind none of hotlock's RESP2 commands gets: a RESP3 map, set,
 * attribute, push, double, boolean, big number or verbatim string. */
static inline int hotlock_odd_reply(const redisReply *r) {
    int t = r->type;
    return t != REDIS_REPLY_STRING && t != REDIS_REPLY_ARRAY && t != REDIS_REPLY_INTEGER &&
           t != REDIS_REPLY_NIL && t != REDIS_REPLY_STATUS && t != REDIS_REPLY_ERROR;
}

/* Mark the context's reply stream as in doubt: a protocol error, which callers report as a
 * lost reply, so that the connection is dropped rather than reused. Returns 1. */
static inline int hotlock_doubt(redisContext *c, const char *why) {
    c->err = REDIS_ERR_PROTOCOL;
    snprintf(c->errstr, sizeof(c->errstr), "%s", why);
    return 1;
}

/* Bytes left unread once a round trip's replies are read: an extra reply, which would
 * otherwise be taken for the answer to the next command. */
static inline int hotlock_leftover(redisContext *c) {
    if (hotlock_reader_pending(c->reader) == 0)
        return 0;
    return hotlock_doubt(c, "the server sent more replies than commands");
}

/* After a round trip's n replies: whether the reply stream is in doubt (an odd reply, or
 * bytes left over); if so the context's error says why. A NULL entry is a reply already
 * taken and freed as it was read (_exchange_calls), which was of no odd kind. */
static inline int hotlock_suspect_stream(redisContext *c, const redisReply **replies, Py_ssize_t n) {
    Py_ssize_t i;
    for (i = 0; i < n; i++)
        if (replies[i] != NULL && hotlock_odd_reply(replies[i]))
            return hotlock_doubt(c, "the server sent a reply of a kind no command asked for");
    return hotlock_leftover(c);
}

#endif
