"""The Lua scripts, defined once and shared by every backend (the extension included).

Each backend sends them as EVALSHA with the SHA1s computed here; on NOSCRIPT it loads
the source and retries the same call once.
"""

from __future__ import annotations

import hashlib

__all__ = ["ACQUIRE", "EXTEND", "RELEASE", "SCRIPTS", "Script"]


class Script:
    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()

    def __repr__(self) -> str:
        return f"<Script {self.sha.decode()[:12]}>"


# KEYS[1] lock key; ARGV[1] token; ARGV[2] TTL in ms.
# Returns 0 when the key now holds ARGV[1] with a fresh TTL: it was free, or it already
# held this token (a retry after a lost reply must not turn our own acquire into a
# conflict). Otherwise returns the holder's remaining TTL in ms (at least 1, so 0 stays
# "acquired"), or -1 if the holder's key has no TTL (not written by hotlock).
ACQUIRE = Script(
    """local v = redis.call('GET', KEYS[1])
if v == false or v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 0
end
local t = redis.call('PTTL', KEYS[1])
if t == -1 then return -1 end
if t < 1 then return 1 end
return t"""
)

# KEYS[1] lock key; ARGV[1] token; ARGV[2] TTL in ms.
# Returns 1 and sets the TTL to ARGV[2] from now (it never adds to what is left) when
# the key holds ARGV[1]; returns 0 and changes nothing otherwise.
EXTEND = Script(
    """if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0"""
)

# KEYS[1] lock key; ARGV[1] token.
# Returns 1 and deletes the key when it holds ARGV[1]; returns 0 and changes nothing
# otherwise (expired, taken over: never someone else's lock).
RELEASE = Script(
    """if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0"""
)

SCRIPTS = (ACQUIRE, EXTEND, RELEASE)
