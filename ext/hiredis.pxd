# The part of the hiredis C API hotlock uses, with the library's own names.
#
# Declared from hiredis/hiredis.h as hiredis 0.14 and 1.x both define it; where the two
# differ, ext/compat.h smooths it over (never #if in the .pyx).

from posix.time cimport timeval


cdef extern from "hiredis/hiredis.h" nogil:
    enum:
        REDIS_OK
        REDIS_ERR
        REDIS_ERR_IO
        REDIS_ERR_EOF
        REDIS_ERR_PROTOCOL
        REDIS_ERR_OOM
        REDIS_ERR_OTHER

        REDIS_REPLY_STRING
        REDIS_REPLY_ARRAY
        REDIS_REPLY_INTEGER
        REDIS_REPLY_NIL
        REDIS_REPLY_STATUS
        REDIS_REPLY_ERROR

    ctypedef struct redisReply:
        int type
        long long integer
        size_t len
        char *str
        size_t elements
        redisReply **element

    ctypedef struct redisContext:
        int err
        char errstr[128]
        int fd

    redisContext *redisConnectWithTimeout(const char *ip, int port, const timeval tv)
    redisContext *redisConnectUnixWithTimeout(const char *path, const timeval tv)
    int redisSetTimeout(redisContext *c, const timeval tv)
    int redisEnableKeepAlive(redisContext *c)
    void redisFree(redisContext *c)

    # The reply reader and the command formatter, for the asyncio protocol (_aio.pxi),
    # which does its own I/O through the event loop.
    ctypedef struct redisReader:
        int err
        char errstr[128]

    redisReader *redisReaderCreate()
    void redisReaderFree(redisReader *r)
    int redisReaderFeed(redisReader *r, const char *buf, size_t len)
    int redisReaderGetReply(redisReader *r, void **reply)

    # int in 0.14, long long in 1.x: declared as the wider one, which holds both.
    long long redisFormatCommandArgv(char **target, int argc, const char **argv, const size_t *argvlen)
    void redisFreeCommand(char *cmd)

    int redisAppendCommandArgv(redisContext *c, int argc, const char **argv, const size_t *argvlen)
    int redisAppendFormattedCommand(redisContext *c, const char *cmd, size_t len)
    int redisGetReply(redisContext *c, void **reply)
    int redisBufferWrite(redisContext *c, int *done)
    void freeReplyObject(void *reply)
