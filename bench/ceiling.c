/* The C ceiling: hotlock's own commands sent from C over libhiredis.
 *
 *   ceiling HOST PORT MODE SECONDS SCRIPTDIR TAG [PORT...]
 *
 * MODE  cycle   acquire + release of a fresh key, one round trip each
 *       extend  extend of one held lock, one round trip each
 *       batch   100 acquires pipelined, then 100 releases pipelined (fresh keys)
 *
 * The acquire of a free key is what hotlock sends (hotlock._acquire): one transaction,
 * MULTI / SET key token NX PX ms / TIME / EXEC, written together, four replies read; the
 * fence is TIME's clock in microseconds. Every key here is fresh, so any reply but
 * [OK, [seconds, microseconds]] is a failure (hotlock would send the ACQUIRE script next;
 * this loop never has to). Extend and release are hotlock's EXTEND and RELEASE scripts
 * with the held value, which for a plain lock is the token alone (hotlock._scripts.held_value).
 * SCRIPTDIR holds extend.lua and release.lua, written by bench/ceiling.py from
 * hotlock._scripts at run time, so the Lua lives in one place only; they are loaded with
 * SCRIPT LOAD and called by the SHA1 the server returns. There is no Lua-free mode
 * (DELIFEQ, SET IFEQ): the comparison runs on a Redis that has neither.
 *
 * More PORTs make HOST:PORT and them the primaries of one Redis Cluster (batch only): each
 * key goes to its slot's primary (CRC16 and CLUSTER SLOTS, as hotlock routes), every
 * node's pipeline is written before any reply is read, and the node written last is read
 * first, as hotlock's cluster batch does: the floor for what a batch on a cluster costs the
 * client against one server, the same kernel work with no Python in it.
 *
 * Every acquisition takes a fresh 16-byte token from getrandom(2), as hotlock takes
 * one from os.urandom: the same work per cycle, so CPU per cycle compares fairly.
 * Prints one JSON line: operations, seconds, and the client's user and system CPU
 * seconds (getrusage) over the timed part only (after a short warm-up).
 *
 * CEILING_COUNT=N in the environment runs exactly N operations with no warm-up instead
 * of a timed loop: for instruction counts under callgrind (bench/profile_notes.md).
 *
 * Built with -DCEILING_TLS (bench/tls.py builds it so, on the pinned hiredis sources with
 * its ssl.c), CEILING_TLS_CA=FILE in the environment makes it speak TLS, verifying the
 * server's certificate against FILE and sending CEILING_TLS_NAME (default HOST) as SNI:
 * the C loop over TLS that hotlock's native TLS client is measured against (what is
 * checked at the handshake costs nothing per operation).
 */
#define _GNU_SOURCE
#include <hiredis.h>
#ifdef CEILING_TLS
#include <hiredis_ssl.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <time.h>

#define BATCH 100
#define TOKEN 16
#define KEYMAX 96
/* Check the clock once per CHUNK operations, as the Python loops do. */
#define CHUNK 16
#define MAXNODES 16
#define SLOTS 16384

static redisContext *ctx;                 /* the first node: every mode's connection */
static redisContext *nodes[MAXNODES];     /* on a cluster, every primary's */
static int nnodes = 1;
static unsigned char slot_node[SLOTS];    /* slot -> index in nodes */
static char sha_extend[41], sha_release[41];
static const char *tag;
static unsigned long serial;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu(int user) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    struct timeval tv = user ? ru.ru_utime : ru.ru_stime;
    return tv.tv_sec + tv.tv_usec / 1e6;
}

static void die(const char *what, redisReply *r) {
    fprintf(stderr, "ceiling: %s: %s\n", what, r ? (r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply")
                                                : (ctx->err ? ctx->errstr : "no reply"));
    exit(1);
}

static void load(const char *dir, const char *name, char *sha) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.lua", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(1);
    }
    static char text[65536];
    size_t n = fread(text, 1, sizeof text, f);
    fclose(f);
    for (int k = 0; k < nnodes; k++) {
        redisReply *r = redisCommand(nodes[k], "SCRIPT LOAD %b", text, n);
        if (!r || r->type != REDIS_REPLY_STRING || r->len != 40) die("SCRIPT LOAD", r);
        memcpy(sha, r->str, 41);
        freeReplyObject(r);
    }
}

/* CRC16-XMODEM of the key's hash tag (or of the whole key), as Redis Cluster slots keys. */
static unsigned slot_of(const char *key, size_t n) {
    static unsigned short table[256];
    if (!table[1])
        for (unsigned b = 0; b < 256; b++) {
            unsigned c = b << 8;
            for (int i = 0; i < 8; i++) c = (c & 0x8000) ? (c << 1) ^ 0x1021 : c << 1;
            table[b] = (unsigned short)c;
        }
    const char *open = memchr(key, '{', n);
    if (open) {
        const char *close = memchr(open + 1, '}', (size_t)(key + n - open - 1));
        if (close && close > open + 1) key = open + 1, n = (size_t)(close - open - 1);
    }
    unsigned crc = 0;
    for (size_t i = 0; i < n; i++) crc = ((crc << 8) & 0xFFFF) ^ table[((crc >> 8) ^ (unsigned char)key[i]) & 0xFF];
    return crc & (SLOTS - 1);
}

/* slot_node from CLUSTER SLOTS: each range's primary, by its port among the ones given. */
static void map_slots(char **ports) {
    redisReply *r = redisCommand(ctx, "CLUSTER SLOTS");
    if (!r || r->type != REDIS_REPLY_ARRAY) die("CLUSTER SLOTS", r);
    memset(slot_node, 0xFF, sizeof slot_node);
    for (size_t i = 0; i < r->elements; i++) {
        redisReply *range = r->element[i];
        long long port = range->element[2]->element[1]->integer;
        for (int k = 0; k < nnodes; k++)
            if (atoll(ports[k]) == port)
                for (long long s = range->element[0]->integer; s <= range->element[1]->integer; s++)
                    slot_node[s] = (unsigned char)k;
    }
    freeReplyObject(r);
    for (int s = 0; s < SLOTS; s++)
        if (slot_node[s] == 0xFF) die("a slot no given port serves", NULL);
}

static void token(unsigned char *buf, size_t n) {
    if (getrandom(buf, n, 0) != (ssize_t)n) {
        perror("getrandom");
        exit(1);
    }
}

static size_t next_key(char *key) {
    return (size_t)snprintf(key, KEYMAX, "hotlock:lock:bench:c:%s:%lu", tag, serial++);
}

/* EVALSHA sha 1 key held-value [ttl]: the held value of a plain lock is its token. */
static void append_script(redisContext *c, const char *sha, const char *key, size_t keylen, const unsigned char *tok,
                          int with_ttl) {
    const char *argv[6] = {"EVALSHA", sha, "1", key, (const char *)tok, "30000"};
    size_t lens[6] = {7, 40, 1, keylen, TOKEN, 5};
    if (redisAppendCommandArgv(c, with_ttl ? 6 : 5, argv, lens) != REDIS_OK) die("append", NULL);
}

/* The acquire: MULTI, SET key token NX PX 30000, TIME, EXEC, appended together so they
   leave in one write (hiredis writes its whole buffer before reading a reply). */
static void append_acquire(redisContext *c, const char *key, size_t keylen, const unsigned char *tok) {
    static const char *multi[1] = {"MULTI"}, *time_[1] = {"TIME"}, *exec[1] = {"EXEC"};
    static const size_t multi_len[1] = {5}, time_len[1] = {4}, exec_len[1] = {4};
    const char *set[6] = {"SET", key, (const char *)tok, "NX", "PX", "30000"};
    size_t set_len[6] = {3, keylen, TOKEN, 2, 2, 5};
    if (redisAppendCommandArgv(c, 1, multi, multi_len) != REDIS_OK ||
        redisAppendCommandArgv(c, 6, set, set_len) != REDIS_OK ||
        redisAppendCommandArgv(c, 1, time_, time_len) != REDIS_OK ||
        redisAppendCommandArgv(c, 1, exec, exec_len) != REDIS_OK)
        die("append", NULL);
}

static redisReply *reply(redisContext *c) {
    redisReply *r;
    if (redisGetReply(c, (void **)&r) != REDIS_OK) die("reply", NULL);
    return r;
}

static int is_status(const redisReply *r, const char *text, size_t n) {
    return r->type == REDIS_REPLY_STATUS && r->len == n && !memcmp(r->str, text, n);
}

/* A decimal reply of TIME (no sign, no more than 18 digits), or -1. */
static long long digits(const redisReply *r) {
    if (r->type != REDIS_REPLY_STRING || r->len == 0 || r->len > 18) return -1;
    long long v = 0;
    for (size_t i = 0; i < r->len; i++) {
        if (r->str[i] < '0' || r->str[i] > '9') return -1;
        v = v * 10 + (r->str[i] - '0');
    }
    return v;
}

/* The four replies of append_acquire: +OK, +QUEUED, +QUEUED, then EXEC's [OK, [s, us]];
   the fence, seconds * 1e6 + microseconds (hotlock._acquire.fence_of). The key is fresh,
   so anything else is a failure. */
static long long read_acquire(redisContext *c) {
    redisReply *r = reply(c);
    if (!is_status(r, "OK", 2)) die("MULTI", r);
    freeReplyObject(r);
    for (int i = 0; i < 2; i++) {
        r = reply(c);
        if (!is_status(r, "QUEUED", 6)) die(i ? "TIME" : "SET NX PX", r);
        freeReplyObject(r);
    }
    r = reply(c);
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2) die("EXEC", r);
    if (r->element[0]->type == REDIS_REPLY_NIL) die("acquire found a fresh key held", NULL);
    const redisReply *clock = r->element[1];
    if (!is_status(r->element[0], "OK", 2) || clock->type != REDIS_REPLY_ARRAY || clock->elements != 2) die("EXEC", r);
    long long seconds = digits(clock->element[0]), micros = digits(clock->element[1]);
    if (seconds <= 0 || micros < 0 || micros >= 1000000) die("TIME in EXEC", r);
    freeReplyObject(r);
    return seconds * 1000000 + micros;
}

static long long reply_int(redisContext *c) {
    redisReply *r = reply(c);
    if (r->type != REDIS_REPLY_INTEGER) die("EVALSHA", r);
    long long v = r->integer;
    freeReplyObject(r);
    return v;
}

static void one_cycle(void) {
    char key[KEYMAX];
    unsigned char tok[TOKEN];
    size_t kl = next_key(key);
    token(tok, TOKEN);
    append_acquire(ctx, key, kl, tok);
    read_acquire(ctx);
    append_script(ctx, sha_release, key, kl, tok, 0);
    if (reply_int(ctx) != 1) die("release did not release", NULL);
}

static char held_key[KEYMAX];
static size_t held_len;
static unsigned char held_tok[TOKEN];

static void one_extend(void) {
    append_script(ctx, sha_extend, held_key, held_len, held_tok, 1);
    if (reply_int(ctx) != 1) die("extend lost the lock", NULL);
}

/* Each node's pipeline written, then the replies read, the node written last first. */
static void flush_nodes(void) {
    for (int k = 0; k < nnodes; k++) {
        int done = 0;
        while (!done)
            if (redisBufferWrite(nodes[k], &done) != REDIS_OK) die("write", NULL);
    }
}

static void one_batch(void) {
    static char keys[BATCH][KEYMAX];
    static size_t lens[BATCH];
    static unsigned char toks[BATCH][TOKEN];
    static int at[BATCH]; /* each key's node */
    token(&toks[0][0], sizeof toks); /* one draw for the batch, as lock_many does */
    for (int i = 0; i < BATCH; i++) {
        lens[i] = next_key(keys[i]);
        at[i] = nnodes == 1 ? 0 : slot_node[slot_of(keys[i], lens[i])];
        append_acquire(nodes[at[i]], keys[i], lens[i], toks[i]);
    }
    flush_nodes();
    for (int k = nnodes - 1; k >= 0; k--)
        for (int i = 0; i < BATCH; i++)
            if (at[i] == k) read_acquire(nodes[k]);
    for (int i = 0; i < BATCH; i++) append_script(nodes[at[i]], sha_release, keys[i], lens[i], toks[i], 0);
    flush_nodes();
    for (int k = nnodes - 1; k >= 0; k--)
        for (int i = 0; i < BATCH; i++)
            if (at[i] == k && reply_int(nodes[k]) != 1) die("batch release did not release", NULL);
}

int main(int argc, char **argv) {
    if (argc < 7 || argc - 6 > MAXNODES) {
        fprintf(stderr, "usage: ceiling HOST PORT cycle|extend|batch SECONDS SCRIPTDIR TAG [PORT...]\n");
        return 2;
    }
    const char *mode = argv[3];
    double seconds = atof(argv[4]);
    tag = argv[6];
    void (*op)(void);
    if (!strcmp(mode, "cycle")) op = one_cycle;
    else if (!strcmp(mode, "extend")) op = one_extend;
    else if (!strcmp(mode, "batch")) op = one_batch;
    else {
        fprintf(stderr, "ceiling: unknown mode %s\n", mode);
        return 2;
    }
    if (argc > 7 && op != one_batch) {
        fprintf(stderr, "ceiling: a cluster (more ports) runs the batch mode only\n");
        return 2;
    }
    struct timeval tv = {2, 0};
    /* argv[2] and the extra ports: the same host, one node each */
    char *ports[MAXNODES];
    ports[0] = argv[2];
    nnodes = argc - 6;
    for (int k = 1; k < nnodes; k++) ports[k] = argv[6 + k];
    for (int k = 0; k < nnodes; k++) {
        nodes[k] = redisConnectWithTimeout(argv[1], atoi(ports[k]), tv);
        if (!nodes[k] || nodes[k]->err) {
            fprintf(stderr, "ceiling: connect: %s\n", nodes[k] ? nodes[k]->errstr : "out of memory");
            return 1;
        }
        redisSetTimeout(nodes[k], tv); /* a reply timeout, so the loop can never hang */
    }
    ctx = nodes[0];
    if (nnodes > 1) map_slots(ports);
#ifdef CEILING_TLS
    const char *ca = getenv("CEILING_TLS_CA");
    if (ca) {
        const char *name = getenv("CEILING_TLS_NAME") ? getenv("CEILING_TLS_NAME") : argv[1];
        redisSSLContextError err = REDIS_SSL_CTX_NONE;
        redisInitOpenSSL();
        redisSSLContext *ssl = redisCreateSSLContext(ca, NULL, NULL, NULL, name, &err);
        if (!ssl) {
            fprintf(stderr, "ceiling: TLS context: %s\n", redisSSLContextGetError(err));
            return 1;
        }
        redisSetTimeout(ctx, tv);
        if (redisInitiateSSLWithContext(ctx, ssl) != REDIS_OK) {
            fprintf(stderr, "ceiling: TLS handshake: %s\n", ctx->errstr);
            return 1;
        }
    }
#endif
    load(argv[5], "extend", sha_extend);
    load(argv[5], "release", sha_release);
    if (op == one_extend) {
        held_len = (size_t)snprintf(held_key, KEYMAX, "hotlock:lock:bench:c:%s:held", tag);
        token(held_tok, TOKEN);
        append_acquire(ctx, held_key, held_len, held_tok);
        read_acquire(ctx);
    }

    const char *count = getenv("CEILING_COUNT");
    long ops = 0;
    double u0, s0, t0, t1, u1, s1;
    if (count) {
        ops = atol(count);
        u0 = cpu(1), s0 = cpu(0), t0 = now();
        for (long i = 0; i < ops; i++) op();
    } else {
        double warm = seconds / 5 < 0.2 ? seconds / 5 : 0.2;
        double end = now() + warm;
        while (now() < end)
            for (int i = 0; i < CHUNK; i++) op();
        u0 = cpu(1), s0 = cpu(0), t0 = now();
        end = t0 + seconds;
        do {
            for (int i = 0; i < CHUNK; i++) op();
            ops += CHUNK;
        } while (now() < end);
    }
    t1 = now();
    u1 = cpu(1), s1 = cpu(0);

    if (op == one_extend) {
        append_script(ctx, sha_release, held_key, held_len, held_tok, 0);
        reply_int(ctx);
    }
    printf("{\"mode\": \"%s\", \"ops\": %ld, \"seconds\": %.6f, \"user\": %.6f, \"sys\": %.6f, \"batch\": %d}\n", mode,
           ops, t1 - t0, u1 - u0, s1 - s0, op == one_batch ? BATCH : 1);
    for (int k = 0; k < nnodes; k++) redisFree(nodes[k]);
    return 0;
}
