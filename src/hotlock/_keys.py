"""The key layout under the prefix: one place, shared by the sync and async caches and the
command line (documented in docs/key-layout.md).

A user key K is stored as ``<prefix><space>{K}``: K wrapped in a Redis Cluster hash tag.
So everything the library keeps for one user key (the lock, its wake-up channel, and the
once:/count: keys of the same K) hashes to one slot, while different user keys spread
over every slot. The wrapping is always applied, which keeps the layout one-to-one (no
two user keys share a stored key). A ``}`` inside K ends the tag early: the slot is then
decided by K up to its first ``}``, which is how a user co-locates keys on purpose
(``tenant-7}:a`` and ``tenant-7}:b`` share a slot).
"""

from __future__ import annotations

__all__ = [
    "COUNT_SPACE",
    "LOCK_SPACE",
    "ONCE_SPACE",
    "WAKE_SPACE",
    "check_prefix",
    "stored",
    "user_key",
    "wake_channel",
]

LOCK_SPACE = b"lock:"
ONCE_SPACE = b"once:"
COUNT_SPACE = b"count:"
# Not a key: the pub/sub channel a release announces a waited-on lock's end on (_scripts.RELEASE).
WAKE_SPACE = b"wake:"


def stored(space_prefix: bytes, key: bytes) -> bytes:
    """The Redis key for user key ``key`` (bytes, validated) under ``prefix + space``."""
    return space_prefix + b"{" + key + b"}"


def wake_channel(lock_name: bytes) -> bytes:
    """The wake-up channel of the lock stored at ``lock_name`` (``<prefix>lock:{K}`` gives
    ``<prefix>wake:{K}``, the same hash slot); _scripts.RELEASE derives it the same way:
    the prefix has no brace, so the first ``{`` starts the tag."""
    i = lock_name.index(b"{")
    return lock_name[: i - len(LOCK_SPACE)] + WAKE_SPACE + lock_name[i:]


def user_key(space_prefix: bytes, name: bytes) -> bytes | None:
    """The user key a stored key was made from, or None if ``name`` is not one of ours."""
    if not name.startswith(space_prefix):
        return None
    tagged = name[len(space_prefix) :]
    if len(tagged) < 3 or tagged[:1] != b"{" or tagged[-1:] != b"}":
        return None
    return tagged[1:-1]


def check_prefix(prefix: bytes) -> bytes:
    """A prefix with a brace would move the hash tag into the prefix and put every lock
    in one cluster slot: refuse it before any I/O."""
    if b"{" in prefix or b"}" in prefix:
        raise ValueError("prefix must not contain '{' or '}' (the key layout puts a hash tag after it)")
    return prefix
