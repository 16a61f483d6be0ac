"""Tokens come from a pool: they must stay unique across threads and across fork."""

from __future__ import annotations

import os
import threading

from hotlock import _ident


def test_tokens_are_unique_across_threads() -> None:
    seen: list[list[bytes]] = []

    def draw() -> None:
        seen.append([_ident.new_token() for _ in range(5000)])

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tokens = [t for batch in seen for t in batch] + _ident.new_tokens(1000)
    assert all(len(t) == _ident.TOKEN_BYTES for t in tokens)
    assert len(set(tokens)) == len(tokens)


def test_a_forked_child_never_draws_its_parents_tokens() -> None:
    _ident.new_token()  # the pool now holds tokens the parent will hand out next
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        payload = b"".join(_ident.new_token() for _ in range(300)) + _ident.pid.to_bytes(4, "big")
        os.write(write, payload)
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    child = {data[i : i + 16] for i in range(0, 300 * 16, 16)}
    parent = {_ident.new_token() for _ in range(300)}
    assert len(child) == 300 and not child & parent
    assert int.from_bytes(data[-4:], "big") == pid != _ident.pid == os.getpid()
