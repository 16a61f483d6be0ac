"""The pure-Python backend on redis-py: where the extension is not built, and for TLS
when the linked hiredis has none.

redis-py's own retries are off (``Retry(NoBackoff(), 0)``) and its timeouts on: the
library owns its retries, so a blackholed server costs one reply timeout, not ten.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, NoScriptError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from ._backend import ServerConfig, cache_error
from ._backoff import poll
from ._scripts import ACQUIRE, EXTEND, RELEASE, SCRIPTS, Script

__all__ = ["RedisPyBackend"]

T = TypeVar("T")

# The errors after which a request may or may not have reached the server.
_AMBIGUOUS = (RedisConnectionError, RedisTimeoutError, OSError)


class RedisPyBackend:
    name = "redis-py"

    def __init__(self, config: ServerConfig) -> None:
        self.server = config.display
        kwargs: dict[str, Any] = {
            "username": config.username,
            "password": config.password,
            "db": config.db,
            "socket_timeout": config.timeout,
            "socket_connect_timeout": config.connect_timeout,
            "socket_keepalive": True,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }
        # CLIENT SETINFO on every connect is a round trip (and an ACL permission) we don't
        # need; redis-py 7+ turns it off with driver_info=None, older ones with lib_name=None.
        if "driver_info" in inspect.signature(redis.Redis.__init__).parameters:
            kwargs["driver_info"] = None
        else:
            kwargs["lib_name"] = kwargs["lib_version"] = None
        if config.unix_path is not None:
            self._redis = redis.Redis(unix_socket_path=config.unix_path, **kwargs)
        else:
            self._redis = redis.Redis(host=config.host, port=config.port, ssl=config.tls, **kwargs)
        self._load_scripts()

    # -- plumbing ---------------------------------------------------------------------

    def _call(self, what: str, key: bytes | None, fn: Callable[[], T], retry_lost_reply: bool = False) -> T:
        try:
            return fn()
        except _AMBIGUOUS as exc:
            if not retry_lost_reply:
                raise self._error(what, key, exc) from exc
            # The reply was lost and the command may have run. Send it once more as it
            # was (an acquire with the same token: the script counts "already my token"
            # as success), so the outcome is neither a stranded key nor a false conflict.
            try:
                return fn()
            except (RedisError, OSError) as again:
                raise self._error(f"{what} (retried after a lost reply)", key, again) from again
        except (RedisError, OSError) as exc:
            raise self._error(what, key, exc) from exc

    def _error(self, what: str, key: bytes | None, exc: BaseException) -> Exception:
        if isinstance(exc, ReadOnlyError):
            # A demoted primary: drop every connection so the next call finds the new one.
            self._redis.connection_pool.disconnect()
        return cache_error(f"{what} failed: {_describe(exc)}", self.server, key)

    def _load_scripts(self) -> None:
        for script in SCRIPTS:
            self._call("SCRIPT LOAD", None, lambda s=script: self._redis.script_load(s.source))  # type: ignore[misc]

    def _evalsha(self, script: Script, key: bytes, *args: bytes | int) -> Any:
        try:
            return self._redis.execute_command("EVALSHA", script.sha, 1, key, *args)
        except NoScriptError:
            # Restart, SCRIPT FLUSH or failover emptied the script cache: load all and retry once.
            self._load_scripts()
            return self._redis.execute_command("EVALSHA", script.sha, 1, key, *args)

    def _pipeline(self, script: Script, keys: list[bytes], tokens: list[bytes], *args: int) -> list[Any]:
        def run() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for key, token in zip(keys, tokens, strict=True):
                pipe.execute_command("EVALSHA", script.sha, 1, key, token, *args)
            return pipe.execute(raise_on_error=False)

        replies = run()
        if any(isinstance(r, NoScriptError) for r in replies):
            self._load_scripts()
            replies = run()
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    # -- the Backend interface --------------------------------------------------------

    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int:
        return int(self._call("acquire", key, lambda: self._evalsha(ACQUIRE, key, token, ttl_ms), True))

    def acquire_wait(self, key: bytes, token: bytes, ttl_ms: int, wait_ms: int) -> tuple[int, float]:
        return poll(lambda: self.acquire(key, token, ttl_ms), wait_ms)

    def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        replies = self._call("acquire_many", None, lambda: self._pipeline(ACQUIRE, keys, tokens, ttl_ms), True)
        return [int(r) for r in replies]

    def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        return bool(self._call("extend", key, lambda: self._evalsha(EXTEND, key, token, ttl_ms)))

    def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        replies = self._call("extend_many", None, lambda: self._pipeline(EXTEND, keys, tokens, ttl_ms))
        return [bool(r) for r in replies]

    def release(self, key: bytes, token: bytes) -> bool:
        return bool(self._call("release", key, lambda: self._evalsha(RELEASE, key, token)))

    def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        replies = self._call("release_many", None, lambda: self._pipeline(RELEASE, keys, tokens))
        return [bool(r) for r in replies]

    def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        return bool(self._call("set_nx", key, lambda: self._redis.set(key, value, nx=True, px=ttl_ms)))

    def incr(self, key: bytes, amount: int) -> int:
        return int(self._call("incr", key, lambda: self._redis.incrby(key, amount)))

    def info(self) -> dict[str, str] | None:
        try:
            raw = self._redis.execute_command("INFO")
        except NoPermissionError:
            return None
        except RedisError as exc:
            raise cache_error(f"INFO failed: {_describe(exc)}", self.server) from exc
        if isinstance(raw, dict):
            return {str(k): str(v) for k, v in raw.items()}
        return {}

    def close(self) -> None:
        self._redis.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, RedisTimeoutError):
        return "no reply within the timeout"
    if isinstance(exc, ResponseError):
        return f"the server replied {exc}"
    return str(exc) or type(exc).__name__
