"""The Lua scripts, defined once and shared by every backend (the extension included).

Each backend sends them as EVALSHA with the SHA1s computed here; on NOSCRIPT it loads
the source and retries the same call once.
"""

from __future__ import annotations

import hashlib

from ._ident import TOKEN_BYTES

__all__ = [
    "ACQUIRE",
    "ACQUIRE_CHAIN",
    "ACQUIRE_WAIT",
    "EXTEND",
    "RELEASE",
    "RELEASE_SHARDED",
    "SCRIPTS",
    "WAITED",
    "Script",
    "held_value",
]


class Script:
    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()

    def __repr__(self) -> str:
        return f"<Script {self.sha.decode()[:12]}>"


# KEYS[1] lock key; ARGV[1] token (TOKEN_BYTES random bytes); ARGV[2] TTL in ms.
# The key's value is the token followed by the fence in ASCII decimal: one key per lock,
# no fence state of its own, so it lives in the lock's slot and expires with the lock.
# A trailing '+' (WAITED) on a value means a waiter asked to be woken when it goes (see
# ACQUIRE_WAIT): the fence never includes it, and extend and release accept it.
# Returns the fence (> 0) when the key now holds this token with a fresh TTL:
# - it was free: the fence is the server's clock in microseconds (TIME), built from
#   TIME's two strings so no Lua double is ever formatted (no exponent, no rounding);
#   it is below 2^53, so the number returned is exact. A restart or FLUSHALL loses no
#   order: the clock kept moving. TIME before a write needs effects replication, the
#   only mode of Redis 7 and Valkey and the default since Redis 5 (6.2 included);
#   a server set to replicate scripts verbatim refuses the SET (an error, never a fence).
# - it already held this token (a retry after a lost reply must not turn our own
#   acquire into a conflict): the fence stored with it, TTL refreshed.
# Otherwise (held) returns -(the holder's remaining TTL in ms) (<= -1), or 0 when the
# holder's key has no TTL (not written by hotlock).
_ACQUIRE_FREE = """local v = redis.call('GET', KEYS[1])
if v == false then
  local t = redis.call('TIME')
  local f = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
  redis.call('SET', KEYS[1], ARGV[1] .. f{own_mark}, 'PX', ARGV[2])
  return tonumber(f)
end
local n = #ARGV[1]
if #v > n and string.sub(v, 1, n) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local e = -1
  if string.byte(v, -1) == 43 then e = -2 end
  return tonumber(string.sub(v, n + 1, e))
end
local t = redis.call('PTTL', KEYS[1])
if t == -1 then return 0 end
if t < 1 then return -1 end
{mark}return -t"""

ACQUIRE = Script(_ACQUIRE_FREE.format(own_mark="", mark=""))

# The waiting forms of ACQUIRE (lock_wait with wake-ups on; same KEYS, ARGV and returns).
# ACQUIRE_WAIT also marks a holder's value with a trailing '+' (SET ... KEEPTTL: the TTL and
# the token + fence prefix unchanged), so its release publishes on the wake-up channel;
# only a value with a TTL (written by hotlock) and not marked yet. pcall: a full server
# (OOM under noeviction) refusing the mark must not fail the attempt, which then polls.
# ACQUIRE_CHAIN is ACQUIRE_WAIT for a waiter that knows others wait on the same key in its
# process: the value it writes is marked from the start, so its own release wakes the next.
_MARK = "if string.byte(v, -1) ~= 43 then redis.pcall('SET', KEYS[1], v .. '+', 'KEEPTTL') end\n"
ACQUIRE_WAIT = Script(_ACQUIRE_FREE.format(own_mark="", mark=_MARK))
ACQUIRE_CHAIN = Script(_ACQUIRE_FREE.format(own_mark=" .. '+'", mark=_MARK))

# The mark ACQUIRE_WAIT leaves on a value: a waiter is to be woken by its release.
WAITED = b"+"


def held_value(token: bytes, fence: int) -> bytes:
    """The value ACQUIRE stored for ``token`` with ``fence``: what extend and release compare."""
    return token + b"%d" % fence


# KEYS[1] lock key; ARGV[1] the held value (token + fence); ARGV[2] TTL in ms.
# Returns 1 and sets the TTL to ARGV[2] from now (it never adds to what is left) when
# the key holds ARGV[1], marked by a waiter ('+') or not; returns 0 and changes nothing otherwise.
EXTEND = Script(
    """local v = redis.call('GET', KEYS[1])
if v == ARGV[1] or v == ARGV[1] .. '+' then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0"""
)

# KEYS[1] lock key; ARGV[1] the held value (token + fence), or a bare token (exactly
# TOKEN_BYTES bytes) whose acquire's reply never came, so its fence is unknown (an
# interrupted async acquisition released in the background).
# Returns 1 and deletes the key when it holds ARGV[1] (marked by a waiter or not), or that
# bare token followed by a fence; returns 0 and changes nothing otherwise (expired, taken
# over: never someone else's lock). A marked value ('+': a waiter asked to be woken) is
# announced on the key's wake-up channel, <prefix>wake:{K} for KEYS[1] = <prefix>lock:{K}
# (the prefix has no '{', so the first '{' starts the tag; same slot). An unmarked one,
# the uncontended release, publishes nothing. pcall: an ACL without the channel leaves
# the waiters to their backoff, never fails the release.
_RELEASE = f"""local v = redis.call('GET', KEYS[1])
local n = {TOKEN_BYTES}
if v == ARGV[1] or (v and (v == ARGV[1] .. '+' or (#ARGV[1] == n and #v > n and string.sub(v, 1, n) == ARGV[1]))) then
  redis.call('DEL', KEYS[1])
  if string.byte(v, -1) == 43 then
    local i = string.find(KEYS[1], '{{', 1, true)
    if i and i > 5 then
      redis.pcall('@PUBLISH@', string.sub(KEYS[1], 1, i - 6) .. 'wake:' .. string.sub(KEYS[1], i), '')
    end
  end
  return 1
end
return 0"""
RELEASE = Script(_RELEASE.replace("@PUBLISH@", "PUBLISH"))
# RELEASE on a Redis Cluster: the wake-up goes out by sharded pub/sub (SPUBLISH, Redis 7+),
# to the subscribers of the lock's own shard only, where a PUBLISH would cross the whole
# cluster bus. The channel is in the lock's slot (the same hash tag), as SPUBLISH requires.
RELEASE_SHARDED = Script(_RELEASE.replace("@PUBLISH@", "SPUBLISH"))

SCRIPTS = (ACQUIRE, EXTEND, RELEASE, ACQUIRE_WAIT, ACQUIRE_CHAIN, RELEASE_SHARDED)
