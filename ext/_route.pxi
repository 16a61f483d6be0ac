# Redis Cluster's healthy case in the extension: the slot of a key, the slot-to-node table
# and the node's connection, so a call on a cluster whose map is fresh costs what it costs
# on one server.
#
# hotlock.backends.cluster keeps the rules. Its SlotMap is the one map (the redis-py transport
# needs it without the extension); on every replace() it hands the router a table of
# node numbers for the 16384 slots, and the router keeps each number's NativeBackend
# (the same link, with the same per-thread connections, that Route drives). A call here
# sends its commands to the nodes the table names and reads their replies. A reply that
# is no error is the answer. Anything else (an error reply: MOVED, ASK, TRYAGAIN,
# CLUSTERDOWN, NOSCRIPT, READONLY...; a lost reply; a node that could not be connected
# to) is handed, with the round as it went, to ClusterBackend.routed, whose Route goes on
# from there exactly as if it had sent that round itself: the same commands with the
# same tokens, and the one lost-reply retry still its own to spend (the fast path never
# resends). A stale map, or a slot or node the table does not know, goes to Route from
# the start.
#
# An ACQUIRE of a plain lock goes as hotlock._acquire's transaction (MULTI, SET NX PX,
# TIME, EXEC) to a node that takes it (the cluster backend says: set_transactions,
# refuse_multi), its four replies read here by hotlock._acquire.read's rules (_txn_read):
# the fence is the answer; SCRIPT sends the ACQUIRE script next, here (a batch: one more
# pipeline per node, for those keys only); MULTI refused alone tells the backend, which
# keeps that node on the script from then on; an error reply (MOVED on the queued SET,
# EXEC's EXECABORT behind it) goes to Route with the four replies, as the transaction
# (hotlock.backends.cluster.transaction_form).
#
# Each node has its own dialect (hotlock.backends.cluster: ClusterCore.set_node puts it on
# that node's NativeBackend), and an extend or release here reads it off the link it is
# sent on: SET IFEQ / DELIFEQ / DELEX where that node has them, the script elsewhere. A
# Lua-free miss (a waiter's mark is compared too) goes once more by script from here; a
# Lua-free error reply goes to Route as the command it was, which decides (a node that
# no longer knows the command: by script, and the node back on the scripts).

from libc.stdlib cimport calloc

from hotlock._scripts import RELEASE_SHARDED as _RELEASE_SHARDED

cdef bytes _SHA_RELEASE_SHARDED = _RELEASE_SHARDED.sha

# A batch key's entry in plains besides _PLAIN_*: sent as the transaction (and, after
# its round, answered SCRIPT: the script's pipeline takes it).
cdef enum:
    _RT_TXN = 8
    _RT_TXN_SCRIPT = 9


DEF _SLOTS = 16384
DEF _NO_NODE = 0xFFFF
DEF _MAX_RUNS = 64

cdef unsigned short _CRC16_TABLE[256]


cdef void _crc16_init() noexcept:
    # CRC16-XMODEM (polynomial 0x1021, initial 0), as hotlock.backends.cluster.crc16.
    cdef unsigned int crc, byte, bit
    for byte in range(256):
        crc = byte << 8
        for bit in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        _CRC16_TABLE[byte] = <unsigned short>(crc & 0xFFFF)


_crc16_init()


cdef inline unsigned int _crc16(const unsigned char *p, Py_ssize_t n) noexcept nogil:
    cdef unsigned int crc = 0
    cdef Py_ssize_t i
    for i in range(n):
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16_TABLE[((crc >> 8) ^ p[i]) & 0xFF]
    return crc


cdef inline unsigned int _slot_of(const char *key, Py_ssize_t n) noexcept nogil:
    """= hotlock.backends.cluster.key_slot: only what lies between the first '{' and the first '}'
    after it is hashed, when that is not empty."""
    cdef const char *start = <const char *>memchr(key, 123, <size_t>n)  # '{'
    cdef const char *end
    if start is not NULL:
        end = <const char *>memchr(start + 1, 125, <size_t>(key + n - start - 1))  # '}'
        if end is not NULL and end > start + 1:
            key = start + 1
            n = end - key
    return _crc16(<const unsigned char *>key, n) & (_SLOTS - 1)


def crc16(bytes data not None):
    """= hotlock.backends.cluster.crc16 (tests/test_cluster.py holds them to each other)."""
    return _crc16(<const unsigned char *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))


def key_slot(bytes key not None):
    """= hotlock.backends.cluster.key_slot, and the server's CLUSTER KEYSLOT."""
    return _slot_of(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))


cdef extern from "<string.h>" nogil:
    const void *memchr(const void *s, int c, size_t n)


# What a single-key call sends (see ClusterRouter._one).
cdef enum:
    _EVAL = 0  # EVALSHA sha 1 key arg [ms]; an extend or release Lua-free where the node has it
    _SET_NX = 1  # SET key arg NX PX ms
    _INCR = 2  # INCRBY key ms
    _EVAL_SCRIPT = 3  # EVALSHA sha 1 key arg [ms], whatever the node has


cdef inline int _plain_of(NativeBackend link, bytes sha, bytes value) noexcept:
    """What an extend or release of ``value`` sends on ``link``: its _PLAIN_* when that node
    takes the Lua-free form, else _PLAIN_NONE (a permit always by script:
    hotlock._dialect.by_script)."""
    if link._plain == _PLAIN_NONE or (sha is not _SHA_EXTEND and sha is not _SHA_RELEASE_SHARDED):
        return _PLAIN_NONE
    if _permit(value):
        return _PLAIN_NONE
    return link._plain


cdef tuple _plain_command(int plain, bytes key, bytes value, long long ms):
    """= hotlock._dialect.extend_command (ms >= 0) / release_command, as _append_plain sends."""
    if ms >= 0:
        return (b"SET", key, value, b"IFEQ", value, b"PX", b"%d" % ms)
    if plain == _PLAIN_DELIFEQ:
        return (b"DELIFEQ", key, value)
    return (b"DELEX", key, b"IFEQ", value)


cdef inline ClusterRouter _router_of(object backend):
    """The router of a native ClusterBackend that has one (NativeLock.unlock/extend's fast
    path: a NativeLock's backend is a NativeBackend or a native ClusterBackend)."""
    router = getattr(backend, "_router", None)
    if type(router) is ClusterRouter and (<ClusterRouter>router)._cluster is backend:
        return <ClusterRouter>router
    return None


cdef class ClusterRouter:
    """The native cluster backend's fast path (see the top of this file): made by
    ClusterBackend(router=ClusterRouter) as router(cluster, slot_map)."""

    cdef unsigned short _node[_SLOTS]  # slot -> node number, _NO_NODE for none
    # The same map as runs of slots on one node, when it has at most _MAX_RUNS of them (a
    # cluster's usual few ranges): a batch's keys fall on random slots, and the 32 KB table
    # misses the cache at most of them (on a busy machine, about 5% of a routed batch's
    # client CPU), where these few bytes stay cached. _runs == 0: the table is used.
    cdef unsigned short _run_end[_MAX_RUNS]  # the last slot of each run, ascending
    cdef unsigned short _run_node[_MAX_RUNS]  # its node number
    cdef int _runs
    cdef list _links  # node number -> its link (a NativeBackend), None until opened
    cdef list _addresses  # node number -> (host, port), as Route names nodes
    cdef object _map  # the SlotMap: while it is stale, every call goes to Route
    cdef object _cluster  # the ClusterBackend that takes what is handed back
    cdef double _timeout
    cdef bint _txn_on  # an ACQUIRE goes as the transaction (connect() chose "auto")
    cdef frozenset _no_txn  # the node numbers that refused MULTI: their acquires by script

    def __init__(self, cluster not None, slot_map not None):
        memset(self._node, 0xFF, sizeof(self._node))
        self._set_runs()
        self._links = []
        self._addresses = []
        self._map = slot_map
        self._cluster = cluster
        self._timeout = cluster.timeout
        self._txn_on = False
        self._no_txn = frozenset()

    def set_transactions(self, bint on):
        """Whether an ACQUIRE of a plain lock goes as the transaction (ClusterCore.transacts_any)."""
        self._txn_on = on

    def refuse_multi(self, Py_ssize_t number):
        """Node ``number`` refused MULTI: its acquires by script from now on."""
        self._no_txn = self._no_txn | {number}  # replaced whole, as _links

    cdef inline bint _transacts(self, unsigned short number, bytes sha, bytes token):
        """= ClusterCore.transacts for a call sent here: an ACQUIRE of a plain lock, on a
        node that takes the transaction."""
        return (self._txn_on and sha is _SHA_ACQUIRE and PyBytes_GET_SIZE(token) == _TOKEN_BYTES
                and not (self._no_txn and number in self._no_txn))

    def set_map(self, bytes table not None, list addresses not None, list links not None):
        """The slot map as SlotMap.node_table gives it, each number's address and link."""
        if PyBytes_GET_SIZE(table) != sizeof(self._node):
            raise ValueError("a node table has 16384 uint16 entries")
        if len(links) != len(addresses):
            raise ValueError("one link (or None) per address")
        memcpy(self._node, PyBytes_AS_STRING(table), sizeof(self._node))
        self._set_runs()
        self._addresses = list(addresses)
        self._links = list(links)

    cdef void _set_runs(self) noexcept:
        cdef int runs = 0
        cdef unsigned int slot
        for slot in range(_SLOTS):
            if slot == _SLOTS - 1 or self._node[slot + 1] != self._node[slot]:
                if runs == _MAX_RUNS:
                    self._runs = 0
                    return
                self._run_end[runs] = <unsigned short>slot
                self._run_node[runs] = self._node[slot]
                runs += 1
        self._runs = runs

    cdef inline unsigned short _node_of(self, unsigned int slot) noexcept nogil:
        """self._node[slot]."""
        cdef int i, k = 0
        if self._runs == 0:
            return self._node[slot]
        for i in range(self._runs):  # the runs before the slot's, counted without a branch
            k += slot > self._run_end[i]
        return self._run_node[k]

    def node_of_slot(self, unsigned int slot):
        """Test hook: the node number of ``slot`` by the runs (or the table), and by the table."""
        if slot >= _SLOTS:
            raise ValueError("a slot is < 16384")
        return self._node_of(slot), self._node[slot]

    def set_link(self, Py_ssize_t number, link not None):
        """The link of node ``number``, once the backend has opened it."""
        if not 0 <= number < _NO_NODE:
            raise ValueError(f"a node number is 0 to {_NO_NODE - 1}, not {number}")
        links = list(self._links)
        while len(links) <= number:
            links.append(None)
        links[number] = link
        self._links = links  # replaced whole: a reader holds either list

    def node(self, bytes key not None):
        """(address, link) of the key's node by the table, or None where the call must go
        to Route from the start (a stale map, an unserved slot, a link not opened yet)."""
        cdef unsigned short number = self._number(key)
        if number == _NO_NODE:
            return None
        link = self._links[number]
        return None if link is None else (self._addresses[number], link)

    cdef inline unsigned short _number(self, bytes key):
        """The key's node number by the table, or _NO_NODE. Its callers index self._links and
        self._addresses with it right after, with no Python code between (map.stale, a
        property, runs before), so a set_map from another thread cannot shorten them."""
        if self._map.stale:
            return _NO_NODE
        return self._table_number(key, min(len(self._links), len(self._addresses)))

    cdef inline unsigned short _table_number(self, bytes key, Py_ssize_t known) noexcept:
        """_number without the map's staleness, which a batch asks once for all its keys;
        ``known``: how many node numbers have an address and a link slot."""
        cdef unsigned short number = self._node_of(_slot_of(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)))
        return number if number < known else _NO_NODE

    def group(self, list keys not None):
        """[(address, link, [key indexes])] by node, in first-seen order, for a batch the
        async backend sends itself; None where it must go to Route from the start."""
        cdef Py_ssize_t i, n = len(keys)
        cdef unsigned short number
        where = {}
        for i in range(n):
            key = keys[i]
            if type(key) is not bytes:
                raise TypeError("keys must be bytes")
            number = self._number(<bytes>key)
            if number == _NO_NODE:
                return None
            entry = where.get(number)
            if entry is None:
                link = self._links[number]
                if link is None:
                    return None
                entry = where[number] = (self._addresses[number], link, [])
            (<list>(<tuple>entry)[2]).append(i)
        return list(where.values())

    def taker(self, bytes lock_prefix not None, type lease_class not None):
        """Cache.lock's one-call path on this cluster (ext/_lease.pxi's _Taker)."""
        return _Taker(self._cluster, lock_prefix, lease_class, self)

    # -- one key ----------------------------------------------------------------------

    def script(self, str what, bytes sha not None, bytes key not None, bytes token not None, long long ms, until,
               bint transaction=True):
        """EVALSHA sha 1 key token [ms] (ms < 0: none); ``until`` (time.monotonic) as
        Route's retry_until: None when a lost reply is never resent. ``transaction``
        False: an ACQUIRE goes as the script whatever the node takes (ACQUIRE_POLL)."""
        return self._one(_EVAL if transaction else _EVAL_SCRIPT, what, sha, key, token, ms,
                         -1.0 if until is None else <double>until)

    def set_nx(self, bytes key not None, bytes value not None, long long ms):
        # Never resent after a lost reply, as on one server.
        return self._one(_SET_NX, "set_nx", None, key, value, ms, -1.0)

    def incr(self, bytes key not None, long long amount):
        return self._one(_INCR, "incr", None, key, None, amount, -1.0)

    cdef inline double _until(self):
        # ClusterCore.retry_until(0): a call that may be resent ends within two reply timeouts.
        return _monotonic() + 2.0 * self._timeout

    cdef object _one(self, int kind, str what, bytes sha, bytes key, bytes arg, long long ms, double until):
        cdef unsigned short number = self._number(key)
        cdef NativeBackend link
        cdef _Conn conn
        cdef _Retry rule
        cdef redisReply *rs[4]
        cdef redisReply *r = NULL
        cdef int rc, i
        cdef int plain = _PLAIN_NONE
        cdef bint missed = False
        cdef bint txn = False
        cdef Py_ssize_t count = 1
        cdef long long answer = 0
        cdef int err = 0  # _txn_read's index of the error reply (Route reads all four)
        outcome = None
        refused = ""
        found = None if number == _NO_NODE else self._links[number]
        if type(found) is not NativeBackend:
            return self._handed(kind, what, sha, key, arg, ms, until, None)
        link = <NativeBackend>found
        address = self._addresses[number]
        if kind == _EVAL:
            plain = _plain_of(link, sha, arg)
            txn = self._transacts(number, sha, arg)
            if txn:
                plain = _RT_TXN
                count = 4
        conn = link._conn()
        # A resent call skips the staleness poll on a just-used connection, as on one
        # server (NativeBackend._ready); here Route does the resend.
        rule = link._rule(0.0, until >= 0.0)
        _enter(conn)
        try:
            try:
                link._ready(conn, what, key, &rule)
            except CacheError as exc:  # not connected: nothing was sent
                link._settle(conn, &rule)
                return self._handed(kind, what, sha, key, arg, ms, until, (address, exc), plain)
            if txn:
                rc = _append_txn(conn.ctx, key, arg, ms)
            elif plain != _PLAIN_NONE:
                rc = _append_plain(conn.ctx, plain, key, arg, ms)
            elif kind == _EVAL or kind == _EVAL_SCRIPT:
                rc = _append_evalsha(conn.ctx, sha, key, arg, ms)
            else:
                rc = _append_args(conn.ctx, self._command(kind, sha, key, arg, ms))
            if rc != REDIS_OK:
                _drop(conn)
                raise MemoryError()
            rc = _exchange(conn, rs, count)
            link._settle(conn, &rule)
            if rc != 0:
                for i in range(count):
                    if rs[i] is not NULL:
                        freeReplyObject(rs[i])
                return self._handed(kind, what, sha, key, arg, ms, until, (address, LinkLost(link._lost(conn))),
                                    plain)
        finally:
            _leave(conn)
        if txn:
            try:
                answer = _txn_read(rs, &err)
                if answer > 0:
                    return answer
                if answer == _TXN_ERROR:
                    outcome = (address, [_py_reply(rs[i]) for i in range(4)])
                elif answer == _TXN_NO_MULTI:
                    refused = str(_py_reply(rs[0]))
            finally:
                for i in range(4):
                    freeReplyObject(rs[i])
            if answer == _TXN_ERROR:
                return self._handed(kind, what, sha, key, arg, ms, until, outcome, plain)
            if answer == _TXN_NO_MULTI:
                self._cluster.refuse_multi(address, refused)
            # SCRIPT: the key exists (held, ours after a lost reply, permits), or MULTI was
            # refused: the script decides, on the same node.
            return self._one(_EVAL_SCRIPT, what, sha, key, arg, ms, until)
        r = rs[0]
        try:
            if plain != _PLAIN_NONE and r.type != REDIS_REPLY_ERROR:
                # SET IFEQ: OK or nil; DELIFEQ/DELEX: 1 or 0.
                if r.type == REDIS_REPLY_STATUS or (r.type == REDIS_REPLY_INTEGER and r.integer == 1):
                    return 1
                missed = True
            elif r.type == REDIS_REPLY_INTEGER:
                return r.integer
            elif r.type != REDIS_REPLY_ERROR:
                return _py_reply(r)
            else:
                outcome = (address, [_py_reply(r)])
        finally:
            freeReplyObject(r)
        if missed:
            # The whole value is compared, a waiter's mark ('+') too: once more by script,
            # which accepts it and announces the release (only under contention, or for a
            # lock already lost), as on one server.
            return self._one(_EVAL_SCRIPT, what, sha, key, arg, ms, until)
        return self._handed(kind, what, sha, key, arg, ms, until, outcome, plain)

    cdef tuple _command(self, int kind, bytes sha, bytes key, bytes arg, long long ms):
        """The command _one sends, as Route sends it."""
        if kind == _SET_NX:
            return (b"SET", key, arg, b"NX", b"PX", b"%d" % ms)
        if kind == _INCR:
            return (b"INCRBY", key, b"%d" % ms)
        if ms < 0:
            return (b"EVALSHA", sha, b"1", key, arg)
        return (b"EVALSHA", sha, b"1", key, arg, b"%d" % ms)

    cdef object _handed(self, int kind, str what, bytes sha, bytes key, bytes arg, long long ms, double until,
                        object outcome, int plain=_PLAIN_NONE):
        # Route is given the command as it was sent (Lua-free, the transaction, or the
        # script), to read its replies.
        first = None if outcome is None else ({outcome[0]: [0]}, [outcome])
        if plain == _RT_TXN:
            command = (b"MULTI", key, arg, b"%d" % ms)  # hotlock.backends.cluster.transaction_form
        elif plain != _PLAIN_NONE:
            command = _plain_command(plain, key, arg, ms)
        else:
            command = self._command(kind, sha, key, arg, ms)
        results = self._cluster.routed(what, [key], [command], None if until < 0.0 else until, first, kind == _EVAL)
        return results[0]

    # -- the native call paths of ext/_lease.pxi -------------------------------------------

    cdef long long _acquire(self, bytes key, bytes token, long long ms) except? -1:
        return self._one(_EVAL, "acquire", _SHA_ACQUIRE, key, token, ms, self._until())

    cdef int _release(self, bytes key, bytes token) except -1:
        return self._one(_EVAL, "release", _SHA_RELEASE_SHARDED, key, token, -1, self._until()) != 0

    cdef int _extend(self, bytes key, bytes token, long long ms) except -1:
        # Not resent: a lost extend reply is a CacheError, as on one server.
        return self._one(_EVAL, "extend", _SHA_EXTEND, key, token, ms, -1.0) != 0

    # -- batches ------------------------------------------------------------------------

    def many(self, str what, bytes sha not None, list keys not None, list tokens not None, long long ms, until):
        """EVALSHA sha 1 key token [ms] for every key: grouped by node, every node's
        commands written before any reply is read (one round trip of wall time), each
        key's integer result in the keys' order. What is not a clean answer from every
        node goes to Route with the round as it went."""
        cdef Py_ssize_t n, i
        cdef long long *values
        # Copies: the batch reads them again after its round trip, which runs without the
        # GIL, when another thread may empty or change the caller's lists.
        keys = list(keys)
        tokens = list(tokens)
        n = len(keys)
        if len(tokens) != n:
            raise ValueError("keys and tokens differ in length")
        for i in range(n):
            if type(keys[i]) is not bytes or type(tokens[i]) is not bytes:
                raise TypeError("keys and tokens must be bytes")
        if n == 0:
            return []
        values = <long long *>malloc(n * sizeof(long long))
        if values is NULL:
            raise MemoryError()
        try:
            self._many(what, sha, keys, tokens, ms, -1.0 if until is None else <double>until, values)
            return [values[i] for i in range(n)]
        finally:
            free(values)

    cdef int _many(self, str what, bytes sha, list keys, list tokens, long long ms, double until,
                   long long *values, bint txn=True) except -1:
        """many() into values[i], for 1 or more keys and tokens that are bytes (many() and
        the batch paths of ext/_batch.pxi make sure). A Lua-free entry that went through
        counts 1. An ACQUIRE goes as the transaction where the node takes it (``txn``:
        not the script's own round after it), the keys it answered SCRIPT then as the
        script, in one more round of this (one pipeline per node, for those only)."""
        cdef Py_ssize_t n = len(keys), i, j, k, m = 0, nlinks, known
        cdef unsigned short number
        cdef unsigned short *nodes = NULL  # each key's node number
        cdef Py_ssize_t *place = NULL  # node number -> its position among the nodes used, or -1
        cdef unsigned short *used = NULL  # position -> node number, in first-seen order
        # The keys' indexes grouped by node, in the keys' order within a node: the node at
        # position k has order[start[k]] up to order[start[k + 1]].
        cdef Py_ssize_t *order = NULL
        cdef Py_ssize_t *start = NULL
        cdef redisReply **replies = NULL  # each key's replies: key i's at 4 * i, up to 4 of them
        cdef long long answer
        cdef int err = 0
        cdef Py_ssize_t scripted = 0
        cdef long long *again = NULL
        cdef char *plains = NULL  # each key's _PLAIN_*: Lua-free on its node, or the script
        cdef redisContext **ctxs = NULL  # per position: its context, NULL where nothing was sent
        cdef int *rcs = NULL  # per position: REDIS_OK, or the write or read failed
        cdef _Retry *rules = NULL
        cdef redisReply *r
        cdef NativeBackend link
        cdef _Conn conn
        cdef bint clean = True
        cdef bint sending = False
        links = self._links
        addresses = self._addresses
        nlinks = len(links)
        known = min(nlinks, len(addresses))
        conns = []  # per position: its _Conn
        outcomes = []  # per position: None (answered), or the exception that kept it from its replies
        nodes = <unsigned short *>malloc(n * sizeof(unsigned short))
        order = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
        replies = <redisReply **>calloc(4 * n, sizeof(redisReply *))
        plains = <char *>calloc(n, 1)
        place = <Py_ssize_t *>malloc((nlinks + 1) * sizeof(Py_ssize_t))
        used = <unsigned short *>malloc((nlinks + 1) * sizeof(unsigned short))
        start = <Py_ssize_t *>calloc(nlinks + 2, sizeof(Py_ssize_t))
        ctxs = <redisContext **>calloc(nlinks + 1, sizeof(redisContext *))
        rcs = <int *>calloc(nlinks + 1, sizeof(int))
        rules = <_Retry *>malloc((nlinks + 1) * sizeof(_Retry))
        try:
            if (nodes is NULL or order is NULL or replies is NULL or plains is NULL or place is NULL
                    or used is NULL or start is NULL or ctxs is NULL or rcs is NULL or rules is NULL):
                raise MemoryError()
            for k in range(nlinks):
                place[k] = -1
            if self._map.stale:  # asked once: no Python code runs in the loop below
                return self._many_handed(what, sha, keys, tokens, ms, until, None, NULL, values, txn)
            for i in range(n):
                number = self._table_number(<bytes>keys[i], known)
                if number == _NO_NODE or type(links[number]) is not NativeBackend:
                    return self._many_handed(what, sha, keys, tokens, ms, until, None, NULL, values, txn)
                nodes[i] = number
                plains[i] = <char>_plain_of(<NativeBackend>links[number], sha, <bytes>tokens[i])
                if txn and self._transacts(number, sha, <bytes>tokens[i]):
                    plains[i] = _RT_TXN
                if place[number] < 0:
                    place[number] = m
                    used[m] = number
                    m += 1
                start[place[number] + 2] += 1
            # A counting sort: start[k + 2] holds node k's count; summed, start[k + 1] is
            # where node k's keys begin, and it is moved on as they are placed, so that it
            # ends where node k + 1's begin (start[0] stays 0, start[m] ends n).
            for k in range(2, m + 1):
                start[k] += start[k - 1]
            for i in range(n):
                k = place[nodes[i]]
                order[start[k + 1]] = i
                start[k + 1] += 1
            # Every node's commands are appended, then written, then every reply read, with
            # the GIL released once for all of it.
            sending = True
            for k in range(m):
                link = <NativeBackend>links[used[k]]
                conn = link._conn()
                _enter(conn)  # left in the finally below, once per entry of conns
                conns.append(conn)
                outcomes.append(None)
                rules[k] = link._rule(0.0, until >= 0.0)
                try:
                    link._ready(conn, what, None, &rules[k])
                except CacheError as exc:  # not connected: nothing was sent
                    outcomes[k] = exc
                    continue
                for j in range(start[k], start[k + 1]):
                    i = order[j]
                    if plains[i] == _RT_TXN:
                        rcs[k] = _append_txn(conn.ctx, <bytes>keys[i], <bytes>tokens[i], ms)
                    elif plains[i]:
                        rcs[k] = _append_plain(conn.ctx, plains[i], <bytes>keys[i], <bytes>tokens[i], ms)
                    else:
                        rcs[k] = _append_evalsha(conn.ctx, sha, <bytes>keys[i], <bytes>tokens[i], ms)
                    if rcs[k] != REDIS_OK:
                        raise MemoryError()
                # Every connection is in a call (_enter) from here: a close() while a
                # later node connects (the GIL released) marks it doomed rather than
                # freeing the context under us.
                ctxs[k] = conn.ctx
            for k in range(m):
                if ctxs[k] is not NULL:
                    (<_Conn>conns[k]).busy = True
            with nogil:
                _many_round(ctxs, rcs, m, order, start, plains, replies)
            # Every connection off busy before anything that may raise (_lost may).
            for k in range(m):
                if ctxs[k] is not NULL:
                    conn = <_Conn>conns[k]
                    conn.busy = False
                    if rcs[k] == REDIS_OK:
                        conn.used = _monotonic()
                        conn.piped = True
                        conn.answered = True
            sending = False
            for k in range(m):
                if ctxs[k] is NULL:
                    continue  # outcomes[k] says why
                link = <NativeBackend>links[used[k]]
                conn = <_Conn>conns[k]
                if rcs[k] != REDIS_OK:
                    outcomes[k] = LinkLost(link._lost(conn))
                link._settle(conn, &rules[k])
            for k in range(m):
                if outcomes[k] is not None:
                    clean = False
            if clean:
                for i in range(n):
                    r = replies[4 * i]
                    if plains[i] == _RT_TXN:
                        answer = _txn_read(&replies[4 * i], &err)
                        if answer > 0:
                            values[i] = answer
                            continue
                        if answer == _TXN_ERROR:
                            clean = False
                            break
                        if answer == _TXN_NO_MULTI:
                            self._cluster.refuse_multi(addresses[nodes[i]], str(_py_reply(r)))
                        plains[i] = _RT_TXN_SCRIPT  # the script's round decides
                        scripted += 1
                    elif plains[i]:
                        # Lua-free: OK (SET IFEQ) or 1 is done; a miss or an error is Route's.
                        if r.type != REDIS_REPLY_STATUS and not (r.type == REDIS_REPLY_INTEGER and r.integer == 1):
                            clean = False
                            break
                        values[i] = 1
                    elif r.type == REDIS_REPLY_INTEGER:
                        values[i] = r.integer
                    else:
                        clean = False
                        break
            if clean and scripted:
                again = <long long *>malloc(scripted * sizeof(long long))
                if again is NULL:
                    raise MemoryError()
                idxs = [i for i in range(n) if plains[i] == _RT_TXN_SCRIPT]
                try:
                    self._many(what, sha, [keys[i] for i in idxs], [tokens[i] for i in idxs], ms, until, again,
                               False)
                except CacheError:
                    # As Route undoes a failed call's acquires: the keys the transactions took.
                    taken = [i for i in range(n) if plains[i] != _RT_TXN_SCRIPT and values[i] > 0]
                    if taken:
                        try:
                            self._cluster.release_many([keys[i] for i in taken],
                                                       [_held(<bytes>tokens[i], values[i]) for i in taken])
                        except CacheError:
                            pass
                    raise
                for j in range(scripted):
                    values[<Py_ssize_t>idxs[j]] = again[j]
            if clean:
                return 0
            groups = {}
            first = []
            for k in range(m):
                idxs = [order[j] for j in range(start[k], start[k + 1])]
                groups[addresses[used[k]]] = idxs
                if outcomes[k] is not None:
                    first.append((addresses[used[k]], outcomes[k]))
                else:
                    got = []
                    for i in idxs:
                        if plains[i] == _RT_TXN or plains[i] == _RT_TXN_SCRIPT:
                            got.extend([_py_reply(replies[4 * i + j]) for j in range(4)])
                        else:
                            got.append(_py_reply(replies[4 * i]))
                    first.append((addresses[used[k]], got))
            return self._many_handed(what, sha, keys, tokens, ms, until, (groups, first), plains, values, txn)
        except BaseException:
            if sending:
                # Commands appended or out on some nodes whose replies will not be read:
                # those connections are out of step, and are dropped.
                for k in range(len(conns)):
                    (<_Conn>conns[k]).busy = False
                    if outcomes[k] is None:
                        _drop(<_Conn>conns[k])
            raise
        finally:
            for conn in conns:
                _leave(conn)
            if replies is not NULL:
                for i in range(4 * n):
                    if replies[i] is not NULL:
                        freeReplyObject(replies[i])
            free(replies)
            free(again)
            free(nodes)
            free(order)
            free(place)
            free(used)
            free(start)
            free(ctxs)
            free(rcs)
            free(rules)
            free(plains)

    cdef int _many_handed(self, str what, bytes sha, list keys, list tokens, long long ms, double until,
                          object first, const char *plains, long long *values, bint txn) except -1:
        # Each key's command as it was sent (plains: Lua-free or not), for Route to read its
        # reply; its results into values (Route answers True/False for a Lua-free one).
        cdef Py_ssize_t i
        if ms < 0:
            commands = [(b"EVALSHA", sha, b"1", k, t) for k, t in zip(keys, tokens)]
        else:
            num = b"%d" % ms
            commands = [(b"EVALSHA", sha, b"1", k, t, num) for k, t in zip(keys, tokens)]
        if plains is not NULL:
            for i in range(len(keys)):
                if plains[i] == _RT_TXN or plains[i] == _RT_TXN_SCRIPT:
                    commands[i] = (b"MULTI", keys[i], tokens[i], num)  # hotlock.backends.cluster.transaction_form
                elif plains[i]:
                    commands[i] = _plain_command(plains[i], keys[i], tokens[i], ms)
        results = self._cluster.routed(what, keys, commands, None if until < 0.0 else until, first, txn)
        if len(results) != len(keys):
            raise ValueError(f"{what}: one result per key")
        for i in range(len(keys)):
            r = results[i]
            values[i] = <long long>r if isinstance(r, int) else (1 if r else 0)
        return 0


cdef void _many_round(redisContext **ctxs, int *rcs, Py_ssize_t m, const Py_ssize_t *order,
                      const Py_ssize_t *start, const char *plains, redisReply **replies) noexcept nogil:
    """One round trip of a batch over m nodes, without the GIL (their connections busy):
    write each context's pipeline, then read each one's replies (the keys order[start[k]]
    up to order[start[k + 1]]) into their keys' places (key i's at 4 * i: four for a
    transaction, plains[i] _RT_TXN, else one). A NULL context is skipped; rcs[k] ends
    REDIS_ERR when node k's write or read failed (an I/O error or timeout) or its reply
    stream is in doubt."""
    cdef Py_ssize_t k, j, c, count, at
    cdef int done
    for k in range(m):
        if ctxs[k] is not NULL:
            done = 0
            while not done and rcs[k] == REDIS_OK:
                rcs[k] = redisBufferWrite(ctxs[k], &done)
    # Read the node written last first: with the servers sharing cores its replies come
    # last, and the others' are then waiting, so the client sleeps once per round trip
    # rather than once per node (the wall time is the same).
    for k in range(m - 1, -1, -1):
        if ctxs[k] is NULL or rcs[k] != REDIS_OK:
            continue
        for j in range(start[k], start[k + 1]):
            count = 4 if plains[order[j]] == _RT_TXN else 1
            for c in range(count):
                at = 4 * order[j] + c
                if redisGetReply(ctxs[k], <void **>&replies[at]) != REDIS_OK:
                    replies[at] = NULL
                    rcs[k] = REDIS_ERR
                    break
                if hotlock_odd_reply(replies[at]):
                    hotlock_doubt(ctxs[k], "the server sent a reply of a kind no command asked for")
                    rcs[k] = REDIS_ERR
                    break
            if rcs[k] != REDIS_OK:
                break
        # A stream in doubt is a lost reply (see _exchange).
        if rcs[k] == REDIS_OK and hotlock_leftover(ctxs[k]):
            rcs[k] = REDIS_ERR
