# The monotonic clock, the sleep, the jitter source and the backoff schedule of the C
# acquire_wait loop. The schedule mirrors hotlock._backoff.delay_ms line for line (its
# constants are read from there at import); tests/test_native.py checks the two agree.

cdef extern from "<pthread.h>" nogil:
    ctypedef void (*_fork_hook)() noexcept nogil
    int pthread_atfork(_fork_hook prepare, _fork_hook parent, _fork_hook child)


cdef double _BASE_MS = _backoff.BASE_MS
cdef double _CAP_MS = _backoff.CAP_MS

# Bumped in every forked child (pthread_atfork, so forks that bypass os.fork count too).
# A connection made under another generation belongs to the parent and is never used.
cdef unsigned long _fork_gen = 0

# The jitter source: a splitmix64 sequence. Each acquire_wait takes a seed from here with
# the GIL held; the loop then draws from its own copy without the GIL. Seeded from
# os.urandom, never from the lock token (the token is a bearer secret, and sleep lengths
# can be observed from outside).
cdef unsigned long long _rng_state = int.from_bytes(os.urandom(8), "little")


cdef inline double _monotonic() noexcept nogil:
    # CLOCK_MONOTONIC is what time.monotonic() reads on Linux, so sent_at compares with it.
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


cdef inline unsigned long long _splitmix64(unsigned long long *state) noexcept nogil:
    state[0] += 0x9E3779B97F4A7C15ULL
    cdef unsigned long long z = state[0]
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline double _uniform(unsigned long long *state) noexcept nogil:
    # The top 53 bits as a double in [0, 1), as random.random() draws.
    return <double>(_splitmix64(state) >> 11) * (1.0 / 9007199254740992.0)


cdef void _after_fork_child() noexcept nogil:
    global _fork_gen, _rng_state
    _fork_gen += 1
    # Without this a parent's forked workers would all draw the same jitter and poll a
    # contended key in lockstep: the thing full jitter exists to prevent.
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    _rng_state ^= (<unsigned long long>getpid() << 32) ^ <unsigned long long>ts.tv_nsec
    _splitmix64(&_rng_state)


pthread_atfork(NULL, NULL, _after_fork_child)


cdef inline double _delay(long attempt, double u, double remaining_ms, long long holder_ttl_ms,
                          double cap_ms) noexcept nogil:
    # = _backoff.delay_ms: full jitter below min(cap, base * 2**min(attempt, 32)), cut to
    # the holder's remaining TTL when known (> 0) and to the time left before the deadline.
    cdef double ceiling = _BASE_MS * ldexp(1.0, attempt if attempt < 32 else 32)
    if cap_ms < ceiling:
        ceiling = cap_ms
    cdef double d = u * ceiling
    if holder_ttl_ms > 0 and <double>holder_ttl_ms < d:
        d = <double>holder_ttl_ms
    if remaining_ms < d:
        d = remaining_ms
    return d if d > 0.0 else 0.0


cdef inline void _sleep_ms(double ms) noexcept nogil:
    # A signal cuts the sleep short (EINTR): the loop then checks for Python signal
    # handlers (Ctrl-C) and the deadline before the next attempt, which is what we want.
    if ms <= 0.0:
        return
    cdef timespec ts
    ts.tv_sec = <time_t>(ms / 1000.0)
    ts.tv_nsec = <long>((ms - <double>ts.tv_sec * 1000.0) * 1e6)
    nanosleep(&ts, NULL)


def _delay_ms(long attempt, double u, double remaining_ms, long long holder_ttl_ms, double cap_ms=_CAP_MS):
    """Test hook: the C schedule, to compare with hotlock._backoff.delay_ms."""
    return _delay(attempt, u, remaining_ms, holder_ttl_ms, cap_ms)


def _monotonic_now():
    """Test hook: the clock acquire_wait stamps sent_at with."""
    return _monotonic()
