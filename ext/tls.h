/* The TLS layer of the sync client, over hiredis's ssl.c and OpenSSL.
 *
 * Both builds of the extension include this header: hotlock._native_tls is compiled with
 * HOTLOCK_TLS=1 and links libssl; hotlock._native (and a build on the system libhiredis)
 * with HOTLOCK_TLS=0, where these functions are stubs that are never reached
 * (hotlock._connect.choose sends rediss:// to redis-py when HAS_TLS is 0). The .pyx is the same
 * for both. */
#ifndef HOTLOCK_TLS_H
#define HOTLOCK_TLS_H

#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <hiredis/hiredis.h>

#ifndef HOTLOCK_TLS
#define HOTLOCK_TLS 0
#endif

#define HOTLOCK_HAS_TLS HOTLOCK_TLS

/* hotlock_tls_handshake's outcomes. */
#define HOTLOCK_TLS_OK 0
#define HOTLOCK_TLS_REFUSED 1 /* verification or protocol failure: never retried */
#define HOTLOCK_TLS_LOST 2    /* the connection dropped or timed out mid-handshake */

#if HOTLOCK_TLS

#include <arpa/inet.h>
#include <errno.h>
#include <sys/ioctl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <hiredis/hiredis_ssl.h>

#ifndef SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED
#define SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED 1116 /* OpenSSL 1.1.1's; an older one never sends TLS 1.3 */
#endif

static inline const char *hotlock_openssl_version(void) { return OpenSSL_version(OPENSSL_VERSION); }

static void hotlock_tls_reason(char *out, size_t cap, const char *what) {
    unsigned long e = ERR_peek_last_error();
    const char *reason = e ? ERR_reason_error_string(e) : NULL;
    snprintf(out, cap, "%s: %s", what, reason ? reason : "unknown error");
    ERR_clear_error();
}

/* Called by OpenSSL when the server asks for a client certificate and none is configured:
 * marks the session (its app data), so that a connection the server then drops at once
 * can be told as "a client certificate is required" (under TLS 1.3 the server's verdict
 * comes after the handshake, and its alert may be lost to the reset that follows it). */
static int hotlock_tls_no_client_cert(SSL *ssl, X509 **x509, EVP_PKEY **pkey) {
    (void)x509;
    (void)pkey;
    SSL_set_app_data(ssl, (char *)1);
    return 0;
}

/* An SSL_CTX for one backend's settings, or NULL with the reason in err.
 * ca: a CA bundle file or directory, or NULL for OpenSSL's default paths (which honour
 * SSL_CERT_FILE and SSL_CERT_DIR, as Python's ssl module does). cert/key: the client
 * certificate chain and its key (key NULL: in the cert file). verify: 0 = none. */
static void *hotlock_tls_context(const char *ca, int ca_is_dir, const char *cert, const char *key, int verify,
                                 char *err, size_t cap) {
    SSL_CTX *ctx;
    ERR_clear_error();
    ctx = SSL_CTX_new(TLS_client_method());
    if (ctx == NULL) {
        hotlock_tls_reason(err, cap, "cannot create a TLS context");
        return NULL;
    }
    /* Python's ssl.create_default_context() floor; redis-server offers 1.2 and 1.3. */
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
#ifdef SSL_OP_IGNORE_UNEXPECTED_EOF
    /* A peer gone without close_notify (a restart, a cut) reads as an end of stream, as on
     * a plain socket: a lost connection, not a TLS failure. */
    SSL_CTX_set_options(ctx, SSL_OP_IGNORE_UNEXPECTED_EOF);
#endif
    SSL_CTX_set_verify(ctx, verify ? SSL_VERIFY_PEER : SSL_VERIFY_NONE, NULL);
    if (ca != NULL) {
        if (!SSL_CTX_load_verify_locations(ctx, ca_is_dir ? NULL : ca, ca_is_dir ? ca : NULL)) {
            hotlock_tls_reason(err, cap, "cannot load ssl_ca_certs");
            SSL_CTX_free(ctx);
            return NULL;
        }
    } else if (!SSL_CTX_set_default_verify_paths(ctx)) {
        hotlock_tls_reason(err, cap, "cannot load the system's CA certificates");
        SSL_CTX_free(ctx);
        return NULL;
    }
    if (cert == NULL) {
        SSL_CTX_set_client_cert_cb(ctx, hotlock_tls_no_client_cert);
    } else {
        if (!SSL_CTX_use_certificate_chain_file(ctx, cert)) {
            hotlock_tls_reason(err, cap, "cannot load ssl_certfile");
            SSL_CTX_free(ctx);
            return NULL;
        }
        if (!SSL_CTX_use_PrivateKey_file(ctx, key != NULL ? key : cert, SSL_FILETYPE_PEM)) {
            hotlock_tls_reason(err, cap, "cannot load ssl_keyfile");
            SSL_CTX_free(ctx);
            return NULL;
        }
        if (!SSL_CTX_check_private_key(ctx)) {
            hotlock_tls_reason(err, cap, "ssl_keyfile does not match ssl_certfile");
            SSL_CTX_free(ctx);
            return NULL;
        }
    }
    return ctx;
}

static inline void hotlock_tls_context_free(void *ctx) {
    if (ctx != NULL)
        SSL_CTX_free((SSL_CTX *)ctx);
}

/* One more reference to ctx, dropped by hotlock_tls_context_free: a connect in progress
 * keeps the context it started with alive while another thread replaces it. */
static inline void hotlock_tls_context_ref(void *ctx) {
    if (ctx != NULL)
        SSL_CTX_up_ref((SSL_CTX *)ctx);
}

/* The end of the stream without close_notify, which OpenSSL 3 reports as an error. */
static int hotlock_tls_eof(unsigned long e) {
#ifdef SSL_R_UNEXPECTED_EOF_WHILE_READING
    return ERR_GET_LIB(e) == ERR_LIB_SSL && ERR_GET_REASON(e) == SSL_R_UNEXPECTED_EOF_WHILE_READING;
#else
    (void)e;
    return 0;
#endif
}

/* TLS over c's connected socket, under whatever SO_RCVTIMEO/SO_SNDTIMEO c has (the caller
 * sets the connect timeout). host is the name or IP literal the certificate must match
 * when check_host; it is sent as SNI when it is a name. On success *ssl_out is the SSL
 * object, now owned by c (redisFree frees it, without a close_notify). */
static int hotlock_tls_handshake(redisContext *c, void *ctx, const char *host, int check_host, void **ssl_out,
                                 char *err, size_t cap) {
    SSL *ssl;
    unsigned char addr[16];
    int is_ip = inet_pton(AF_INET, host, addr) == 1 || inet_pton(AF_INET6, host, addr) == 1;
    long verified;
    ERR_clear_error();
    ssl = SSL_new((SSL_CTX *)ctx);
    if (ssl == NULL) {
        hotlock_tls_reason(err, cap, "cannot create a TLS session");
        return HOTLOCK_TLS_REFUSED;
    }
    /* SNI carries names only (RFC 6066); the released hiredis checks no hostname, so the
     * expected name goes on the SSL object before the handshake, and OpenSSL fails the
     * handshake when the certificate does not match it (IP SANs for an address). */
    if (!is_ip && !SSL_set_tlsext_host_name(ssl, host)) {
        hotlock_tls_reason(err, cap, "cannot set the server name (SNI)");
        SSL_free(ssl);
        return HOTLOCK_TLS_REFUSED;
    }
    if (check_host) {
        int ok;
        if (is_ip) {
            ok = X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), host);
        } else {
            SSL_set_hostflags(ssl, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
            ok = SSL_set1_host(ssl, host);
        }
        if (!ok) {
            hotlock_tls_reason(err, cap, "cannot set the host to verify");
            SSL_free(ssl);
            return HOTLOCK_TLS_REFUSED;
        }
    }
    errno = 0;
    if (redisInitiateSSL(c, ssl) == REDIS_OK) {
        *ssl_out = ssl;
        return HOTLOCK_TLS_OK;
    }
    verified = SSL_get_verify_result(ssl);
    if (verified != X509_V_OK) {
        /* "hostname mismatch", "IP address mismatch", "unable to get local issuer
         * certificate", "certificate has expired", ... */
        snprintf(err, cap, "certificate verify failed: %s", X509_verify_cert_error_string(verified));
        ERR_clear_error();
        SSL_free(ssl);
        return HOTLOCK_TLS_REFUSED;
    }
    if (ERR_peek_last_error() != 0 && !hotlock_tls_eof(ERR_peek_last_error())) {
        /* An alert or a protocol error: a server that refused us ("tlsv1 alert ..."), or no
         * TLS at all on that port ("wrong version number", "packet length too long"). */
        unsigned long e = ERR_peek_last_error();
        const char *reason = ERR_reason_error_string(e);
        snprintf(err, cap, "TLS handshake failed: %s%s", reason ? reason : "unknown error",
                 ERR_GET_REASON(e) == SSL_R_WRONG_VERSION_NUMBER || ERR_GET_REASON(e) == SSL_R_PACKET_LENGTH_TOO_LONG
                     ? " (does that port speak TLS?)"
                     : "");
        ERR_clear_error();
        SSL_free(ssl);
        return HOTLOCK_TLS_REFUSED;
    }
    ERR_clear_error();
    /* The socket failed under the handshake: EOF, reset, or the timeout (EAGAIN). */
    if (errno == EAGAIN || errno == EWOULDBLOCK)
        snprintf(err, cap, "TLS handshake: no reply within the timeout (does that port speak TLS?)");
    else if (errno != 0)
        snprintf(err, cap, "TLS handshake: %s", strerror(errno));
    else
        snprintf(err, cap, "TLS handshake: the server closed the connection");
    SSL_free(ssl);
    return HOTLOCK_TLS_LOST;
}

/* Whether an idle TLS connection has something to read that is not TLS housekeeping: an
 * application record (stale data), a close or an error. A TLS 1.3 server sends session
 * tickets right after the handshake, which make the socket readable with no reply in
 * them; a non-blocking peek lets OpenSSL take those and report nothing. */
static int hotlock_tls_idle_data(void *ssl_, int fd) {
    SSL *ssl = (SSL *)ssl_;
    char byte;
    int n, e, on = 1, off = 0;
    if (SSL_pending(ssl) > 0)
        return 1;
    /* The sync client's sockets are blocking (hiredis's REDIS_BLOCK): non-blocking for the
     * peek only. FIONBIO rather than fcntl: under Python.h's _FILE_OFFSET_BITS=64, fcntl
     * is glibc 2.28's fcntl64, which would raise the wheel's manylinux floor. */
    if (ioctl(fd, FIONBIO, &on) < 0)
        return 1;
    n = SSL_peek(ssl, &byte, 1);
    e = SSL_get_error(ssl, n);
    ioctl(fd, FIONBIO, &off);
    ERR_clear_error();
    if (n > 0)
        return 1;
    return !(e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE);
}

/* After a failed read or write on a TLS connection: nonzero, with the reason in err, when
 * OpenSSL recorded a TLS-level failure (the server's alert, such as a client certificate
 * it requires and did not get, or a protocol error) rather than a lost connection; or,
 * when first_use (no reply has arrived on it yet), when the server asked for a client
 * certificate that is not configured and then dropped the connection. */
static int hotlock_tls_failure(void *ssl, int first_use, char *err, size_t cap) {
    unsigned long e = ERR_peek_last_error();
    const char *reason;
    if (e == 0 || ERR_GET_LIB(e) != ERR_LIB_SSL || hotlock_tls_eof(e)) {
        ERR_clear_error();
        if (first_use && ssl != NULL && SSL_get_app_data((SSL *)ssl) != NULL) {
            snprintf(err, cap, "the server closed the TLS session at once after asking for a client certificate, "
                               "and none is configured (ssl_certfile)");
            return 1;
        }
        return 0;
    }
    reason = ERR_reason_error_string(e);
    /* The hint goes by OpenSSL's reason code, not its words: TLS 1.3's certificate_required alert. */
    snprintf(err, cap, "the TLS session failed: %s%s", reason ? reason : "unknown error",
             ERR_GET_REASON(e) == SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED
                 ? " (the server requires a client certificate: ssl_certfile)"
                 : "");
    ERR_clear_error();
    return 1;
}

#else /* HOTLOCK_TLS */

static inline const char *hotlock_openssl_version(void) { return ""; }
static inline void *hotlock_tls_context(const char *ca, int ca_is_dir, const char *cert, const char *key, int verify,
                                        char *err, size_t cap) {
    (void)ca; (void)ca_is_dir; (void)cert; (void)key; (void)verify;
    snprintf(err, cap, "this build has no TLS");
    return NULL;
}
static inline void hotlock_tls_context_free(void *ctx) { (void)ctx; }
static inline void hotlock_tls_context_ref(void *ctx) { (void)ctx; }
static inline int hotlock_tls_handshake(redisContext *c, void *ctx, const char *host, int check_host, void **ssl_out,
                                        char *err, size_t cap) {
    (void)c; (void)ctx; (void)host; (void)check_host; (void)ssl_out;
    snprintf(err, cap, "this build has no TLS");
    return HOTLOCK_TLS_REFUSED;
}
static inline int hotlock_tls_idle_data(void *ssl, int fd) { (void)ssl; (void)fd; return 1; }
static inline int hotlock_tls_failure(void *ssl, int first_use, char *err, size_t cap) {
    (void)ssl; (void)first_use; (void)err; (void)cap;
    return 0;
}

#endif /* HOTLOCK_TLS */

#endif
