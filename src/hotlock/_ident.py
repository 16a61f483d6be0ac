"""Lock tokens and the current pid: cheap on the hot path, and right across fork.

A token is 16 bytes from os.urandom, drawn from a pool refilled 256 at a time (one
syscall instead of one per lock). The pid is kept here rather than asked of the kernel
on every call. A forked child gets its own pid and an empty pool: it must never hand
out a token its parent also holds.
"""

from __future__ import annotations

import os
import struct
from collections import deque

__all__ = ["TOKEN_BYTES", "new_token", "new_tokens", "pid"]

TOKEN_BYTES = 16
_REFILL = 256

# deque.popleft() and extend() are atomic under the GIL: two threads never pop the same
# token, and two threads refilling at once only add more distinct tokens.
_pool: deque[bytes] = deque()
# A refill's block cut into tokens in C: a generator slicing it cost ~1,200 instructions
# per token, as much as the rest of a native acquire's Python-facing work.
_cut = struct.Struct(f"{TOKEN_BYTES}s" * _REFILL).unpack
pid = os.getpid()


def new_token() -> bytes:
    try:
        return _pool.popleft()
    except IndexError:
        tokens: tuple[bytes, ...] = _cut(os.urandom(TOKEN_BYTES * _REFILL))
        _pool.extend(tokens[1:])
        return tokens[0]


def new_tokens(n: int) -> list[bytes]:
    block = os.urandom(TOKEN_BYTES * n)
    return [block[i : i + TOKEN_BYTES] for i in range(0, len(block), TOKEN_BYTES)]


def _after_fork_in_child() -> None:
    global pid
    pid = os.getpid()
    _pool.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
