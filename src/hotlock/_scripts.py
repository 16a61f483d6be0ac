"""The Lua scripts, defined once and shared by every backend (the extension included).

Each backend sends them as EVALSHA with the SHA1s computed here; on NOSCRIPT it loads
the source and retries the same call once.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

from ._ident import TOKEN_BYTES

__all__ = [
    "ACQUIRE",
    "ACQUIRE_CHAIN",
    "ACQUIRE_POLL",
    "ACQUIRE_WAIT",
    "EXTEND",
    "KIND_CONFLICT",
    "PERMIT_MARK",
    "RELEASE",
    "RELEASE_SHARDED",
    "SCRIPTS",
    "WAITED",
    "Script",
    "held_value",
    "is_permit",
    "permit_ask",
]


class Script:
    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()

    def __repr__(self) -> str:
        return f"<Script {self.sha.decode()[:12]}>"


# A key held with a concurrency limit (lock(key, limit=N)) is a hash of permits where a
# plain lock is a string, under the same name, so the two kinds can never share a key: each
# script finds the other kind and refuses it (KIND_CONFLICT, or "not held"), never an error.
#   <token>  '<fence>:<deadline>' per permit: its fence and its expiry on the server's
#            clock in ms; a permit past its deadline is no longer held, and is deleted by
#            the next call that reads the hash (no sweeper)
#   f        the last fence handed out on this key: a new one is above it and above the
#            clock, so fences increase across permits taken in the same microsecond
#   w        a waiter asked to be woken by the next release (as '+' on a plain lock)
# The key's own TTL is never below its longest permit's; a release never shortens it (f
# must outlive every permit taken with it), so it goes when its last permit would expire.
# A permit's held value (what extend and release send) is its token, '#', then its fence:
# the '#' after the token (a plain lock's held value is the token alone) tells the two apart.
PERMIT_MARK = b"#"

# The acquire's reply when the key is held as the other kind (a plain lock where permits
# were asked for, or permits where a plain lock was): below any -(TTL in ms) it can return.
KIND_CONFLICT = -(2**52)

# Lua of the permit branches. Each sits inside its script's `if` for permits, so a plain
# lock's call defines and runs none of it. n is TOKEN_BYTES.
_NOW = "local function now_ms(t) return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end\n"
# Keeps the key's TTL at least ms.
_AT_LEAST = """local function at_least(ms)
  if redis.call('PTTL', KEYS[1]) < ms then redis.call('PEXPIRE', KEYS[1], ms) end
end
"""
_PERMIT_ACQUIRE = (
    _NOW
    + _AT_LEAST
    + """local tok = string.sub(ARGV[1], 1, n)
  local limit = tonumber(string.sub(ARGV[1], n + 2))
  local all = redis.pcall('HGETALL', KEYS[1])
  if all.err then return @KIND_CONFLICT@ end
  local t = redis.call('TIME')
  local now, ms = now_ms(t), tonumber(ARGV[2])
  local held, soonest, last, fence = 0, 0, 0, nil
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    if #f == n then
      local c = string.find(v, ':', 1, true)
      local left = tonumber(string.sub(v, c + 1)) - now
      if left <= 0 then
        redis.call('HDEL', KEYS[1], f)
      elseif f == tok then
        fence = string.sub(v, 1, c - 1)
      else
        held = held + 1
        if soonest == 0 or left < soonest then soonest = left end
      end
    elseif f == 'f' then
      last = tonumber(v)
    end
  end
  local until_ms = string.format('%.0f', now + ms)
  if fence then
    redis.call('HSET', KEYS[1], tok, fence .. ':' .. until_ms@PERMIT_OWN_MARK@)
  else
    if held >= limit then
      @PERMIT_MARK@return -soonest
    end
    fence = string.format('%.0f', math.max(tonumber(t[1] .. string.rep('0', 6 - #t[2]) .. t[2]), last + 1))
    redis.call('HSET', KEYS[1], tok, fence .. ':' .. until_ms, 'f', fence@PERMIT_OWN_MARK@)
  end
  if #all == 0 then redis.call('PEXPIRE', KEYS[1], ms) else at_least(ms) end
  return tonumber(fence)
"""
)
# A plain acquire that met a hash: its last fence when none of its permits is live any
# more (the key is then taken as a plain lock), else KIND_CONFLICT.
_PERMITS_GONE = (
    _NOW
    + """local now = now_ms(redis.call('TIME'))
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local f, w = all[i], all[i + 1]
    if #f == n then
      if tonumber(string.sub(w, string.find(w, ':', 1, true) + 1)) > now then return @KIND_CONFLICT@ end
    elseif f == 'f' then
      floor = tonumber(w)
    end
  end
"""
)
# Publishes on the key's wake-up channel, <prefix>wake:{K} for KEYS[1] = <prefix>lock:{K}
# (the prefix has no '{', so the first '{' starts the tag; same slot). pcall: an ACL
# without the channel leaves the waiters to their backoff, never fails the release.
_WAKE = """local i = string.find(KEYS[1], '{', 1, true)
    if i and i > 5 then
      redis.pcall('@PUBLISH@', string.sub(KEYS[1], 1, i - 6) .. 'wake:' .. string.sub(KEYS[1], i), '')
    end"""
# The permit ARGV[1] names (token '#' fence, or a bare token: any fence), when it is live:
# its fence, and TIME; nil otherwise (an expired one is deleted).
_PERMIT_FIND = (
    _NOW
    + """local function permit_find()
  local v = redis.pcall('HGET', KEYS[1], string.sub(ARGV[1], 1, n))
  if type(v) ~= 'string' then return nil end
  if #ARGV[1] > n then
    local want = string.sub(ARGV[1], n + 2) .. ':'
    if string.sub(v, 1, #want) ~= want then return nil end
  end
  local t = redis.call('TIME')
  local c = string.find(v, ':', 1, true)
  if tonumber(string.sub(v, c + 1)) <= now_ms(t) then
    redis.call('HDEL', KEYS[1], string.sub(ARGV[1], 1, n))
    return nil
  end
  return string.sub(v, 1, c - 1), t
end
"""
)


# KEYS[1] lock key; ARGV[1] token (TOKEN_BYTES random bytes); ARGV[2] TTL in ms.
# A plain lock's value is its token alone: one key per lock, no fence state of its own,
# so it lives in the lock's slot and expires with the lock. A trailing '+' (WAITED) on a
# value means a waiter asked to be woken when it goes (see ACQUIRE_WAIT); extend and
# release accept it. The common acquire of a free key is not this script but the
# transaction of hotlock._acquire (SET NX, TIME: no Lua); this script serves every
# other case, and gives the same returns.
# Returns the fence (> 0) when the key now holds this token with a fresh TTL: the server's
# clock in microseconds (TIME) at this acquire, built from TIME's two strings so no Lua
# double is ever formatted (no exponent, no rounding); it is below 2^53, so the number
# returned is exact. A restart or FLUSHALL loses no order: the clock kept moving. The
# fence is not stored: nothing after the acquire needs it on the server. TIME in a script
# that writes needs effects replication, the only mode of Redis 7 and Valkey and the
# default since Redis 5 (6.2 included).
# - the key was free: taken.
# - it already held this token (a retry after a lost reply must not turn our own
#   acquire into a conflict): TTL refreshed, and a fence later than the lost reply's,
#   which no one saw.
# Otherwise (held) returns -(the holder's remaining TTL in ms) (<= -1), 0 when the
# holder's key has no TTL (not written by hotlock), or KIND_CONFLICT when it holds live
# permits. A hash of permits none of which is live any more (permits_gone: its last fence,
# or nil) is deleted and the key taken, with a fence above that hash's last one.
# With a limit, ARGV[1] is the token, '#', then the limit in decimal: a permit is taken
# when fewer than limit others are live (the same returns, -(the TTL left to the permit
# that expires first) when none is free, KIND_CONFLICT when the key is a plain lock); a
# retried acquire finds its own permit and takes no second place.
_ACQUIRE_FREE = """local n = @TOKEN_BYTES@
if #ARGV[1] > n then
  @PERMITS@end
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'table' then
  local floor = 0
  @PERMITS_GONE@  redis.call('DEL', KEYS[1])
  local t = redis.call('TIME')
  redis.call('SET', KEYS[1], ARGV[1]@OWN_MARK@, 'PX', ARGV[2])
  return math.max(tonumber(t[1] .. string.rep('0', 6 - #t[2]) .. t[2]), floor + 1)
end
if v == false then
  redis.call('SET', KEYS[1], ARGV[1]@OWN_MARK@, 'PX', ARGV[2])
elseif v == ARGV[1] or v == ARGV[1] .. '+' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  local t = redis.call('PTTL', KEYS[1])
  if t == -1 then return 0 end
  if t < 1 then return -1 end
  @MARK@return -t
end
local t = redis.call('TIME')
return tonumber(t[1] .. string.rep('0', 6 - #t[2]) .. t[2])"""


def _acquire(own_mark: str, mark: str, permit_own_mark: str, permit_mark: str) -> Script:
    permits = _PERMIT_ACQUIRE.replace("@PERMIT_OWN_MARK@", permit_own_mark).replace("@PERMIT_MARK@", permit_mark)
    return Script(
        _ACQUIRE_FREE.replace("@PERMITS@", permits)
        .replace("@PERMITS_GONE@", _PERMITS_GONE)
        .replace("@OWN_MARK@", own_mark)
        .replace("@MARK@", mark)
        .replace("@TOKEN_BYTES@", str(TOKEN_BYTES))
        .replace("@KIND_CONFLICT@", str(KIND_CONFLICT))
    )


ACQUIRE = _acquire("", "", "", "")

# ACQUIRE as an attempt after a failed one (a lock_wait's polls without wake-ups): the same
# script under the same SHA1, another object. A transport sends the transaction
# (hotlock._acquire) for ACQUIRE itself only: a key found held a moment ago is likely held
# still, and the transaction would find it so and send this script after it, a round trip
# more.
ACQUIRE_POLL = copy.copy(ACQUIRE)

# The waiting forms of ACQUIRE (lock_wait with wake-ups on; same KEYS, ARGV and returns).
# ACQUIRE_WAIT also marks a holder's value with a trailing '+' (SET ... KEEPTTL: the TTL and
# the token unchanged), so its release publishes on the wake-up channel;
# only a value with a TTL (written by hotlock) and not marked yet. pcall: a full server
# (OOM under noeviction) refusing the mark must not fail the attempt, which then polls.
# ACQUIRE_CHAIN is ACQUIRE_WAIT for a waiter that knows others wait on the same key in its
# process: the value it writes is marked from the start, so its own release wakes the next.
# On permits the mark is the hash's field w, set by a waiter that found no place free
# (and, chained, by the permit taken), taken by the release that publishes.
# A value of exactly n bytes is a bare token, whose last byte is random (it may be a '+'):
# only a longer one can carry the mark.
_MARK = "if #v == n or string.byte(v, -1) ~= 43 then redis.pcall('SET', KEYS[1], v .. '+', 'KEEPTTL') end\n"
_PERMIT_MARK = "redis.pcall('HSET', KEYS[1], 'w', '')\n      "
ACQUIRE_WAIT = _acquire("", _MARK, "", _PERMIT_MARK)
ACQUIRE_CHAIN = _acquire(" .. '+'", _MARK, ", 'w', ''", _PERMIT_MARK)

# The mark ACQUIRE_WAIT leaves on a value: a waiter is to be woken by its release.
WAITED = b"+"


def held_value(token: bytes, fence: int) -> bytes:
    """What extend and release send for a lease that ACQUIRE answered ``fence``: the
    token itself for a plain lock (its stored value), token '#' fence for a permit.

    For a permit, ``token`` is what its acquire sent (token '#' limit) or token '#'."""
    if len(token) == TOKEN_BYTES:
        return token
    return token[: TOKEN_BYTES + 1] + b"%d" % fence


def permit_ask(token: bytes, limit: int) -> bytes:
    """ACQUIRE's ARGV[1] for ``limit``: the token itself for a plain lock (limit 1), else
    the token, '#', the limit. held_value of it is the lease's held value either way."""
    return token if limit == 1 else token + PERMIT_MARK + b"%d" % limit


def is_permit(value: bytes) -> bool:
    """Whether a held value is a permit's (token '#' fence), not a plain lock's."""
    return value[TOKEN_BYTES : TOKEN_BYTES + 1] == PERMIT_MARK


# KEYS[1] lock key; ARGV[1] the held value (held_value); ARGV[2] TTL in ms.
# Returns 1 and sets the TTL to ARGV[2] from now (it never adds to what is left) when
# the key holds ARGV[1], marked by a waiter ('+') or not; returns 0 and changes nothing
# otherwise (a key of the other kind included). A permit's held value (token '#' fence)
# extends that permit, when live, to ARGV[2] from now, and the key's TTL to at least that.
EXTEND = Script(
    f"""local n = {TOKEN_BYTES}
if string.byte(ARGV[1], n + 1) == 35 then
  {_AT_LEAST}{_PERMIT_FIND}  local fence, t = permit_find()
  if fence == nil then return 0 end
  local ms = tonumber(ARGV[2])
  redis.call('HSET', KEYS[1], string.sub(ARGV[1], 1, n), fence .. ':' .. string.format('%.0f', now_ms(t) + ms))
  at_least(ms)
  return 1
end
local v = redis.pcall('GET', KEYS[1])
if v == ARGV[1] or v == ARGV[1] .. '+' then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0"""
)

# KEYS[1] lock key; ARGV[1] the held value (held_value), or for a permit a bare token
# (exactly TOKEN_BYTES bytes) whose acquire's reply never came, so its fence is unknown (an
# interrupted async acquisition released in the background).
# Returns 1 and deletes the key when it holds ARGV[1] (marked by a waiter or not); returns
# 0 and changes nothing otherwise (expired, taken over, a key of the other kind: never
# someone else's lock). A marked value ('+': a waiter asked to be woken) is announced on
# the key's wake-up channel, <prefix>wake:{K} for KEYS[1] = <prefix>lock:{K} (the prefix
# has no '{', so the first '{' starts the tag; same slot). An unmarked one, the
# uncontended release, publishes nothing. pcall: an ACL without the channel leaves the
# waiters to their backoff, never fails the release.
# A permit's held value (token '#' fence), or a bare token on a hash of permits, deletes
# that permit when live, and wakes a waiter that marked the hash.
_RELEASE = f"""local n = {TOKEN_BYTES}
if string.byte(ARGV[1], n + 1) ~= 35 then
  local v = redis.pcall('GET', KEYS[1])
  if type(v) == 'string' then
    if v == ARGV[1] or v == ARGV[1] .. '+' then
      redis.call('DEL', KEYS[1])
      if #v > n and string.byte(v, -1) == 43 then
        {_WAKE}
      end
      return 1
    end
    return 0
  end
  if v == false or #ARGV[1] ~= n then return 0 end
end
{_PERMIT_FIND}if permit_find() == nil then return 0 end
if redis.call('HDEL', KEYS[1], string.sub(ARGV[1], 1, n), 'w') == 2 then
  {_WAKE}
end
return 1"""
RELEASE = Script(_RELEASE.replace("@PUBLISH@", "PUBLISH"))
# RELEASE on a Redis Cluster: the wake-up goes out by sharded pub/sub (SPUBLISH, Redis 7+),
# to the subscribers of the lock's own shard only, where a PUBLISH would cross the whole
# cluster bus. The channel is in the lock's slot (the same hash tag), as SPUBLISH requires.
RELEASE_SHARDED = Script(_RELEASE.replace("@PUBLISH@", "SPUBLISH"))

SCRIPTS = (ACQUIRE, EXTEND, RELEASE, ACQUIRE_WAIT, ACQUIRE_CHAIN, RELEASE_SHARDED)
# ACQUIRE and its waiting forms, and EXTEND: what a WAIT rides behind under wait_replicas.
CONFIRMED = (ACQUIRE, ACQUIRE_POLL, ACQUIRE_WAIT, ACQUIRE_CHAIN, EXTEND)


def resent(replies: list[Any], missing: list[int], again: list[Any], n: int) -> None:
    """After NOSCRIPT, a batch's replies made whole: ``again`` holds the replies to its
    ``missing`` calls (of the first ``n``), sent once more after the scripts were loaded,
    then to the commands behind them (a WAIT), which rode behind them again. Only what did
    not run is sent again: a release that ran must not run twice. Every backend's."""
    for i, reply in zip(missing, again, strict=False):
        replies[i] = reply
    replies[n:] = again[len(missing) :]
