"""The one interface every backend speaks, and the one place a backend is chosen.

A backend knows bytes keys (already prefixed), bytes tokens and integer milliseconds,
and nothing of the public API. It raises CacheError for every Redis failure; it never
reports a failure as contention.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Protocol

from ._config import ServerConfig
from ._dialect import Dialect

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

__all__ = ["BACKEND_NAMES", "Backend", "Named", "choose", "native_module", "open_backend", "tls_refused"]


class Named(Protocol):
    """What every backend, sync or async, tells about itself."""

    name: str  # "native", "redis-py" or "memory"
    server: str  # the server as shown in logs and errors, without credentials

    # The server's dialect (_dialect), set by connect() through use_dialect: what extend
    # and release send. Read-only here: cache.server_info shows it.
    @property
    def dialect(self) -> Dialect: ...


class Backend(Named, Protocol):
    # acquire/acquire_many return the fence (> 0) when acquired, and otherwise (<= 0)
    # -(the holder's remaining TTL in ms), or 0 when it is unknown: the contract of
    # _scripts.ACQUIRE. The key then holds _scripts.held_value(token, fence), which is
    # the token extend/extend_many/release/release_many are given.
    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int: ...

    # Polls acquire with the _backoff schedule until it succeeds or wait_ms has passed.
    # Returns the last acquire result and the time.monotonic() at which that attempt was
    # sent (the lease's TTL runs from then).
    def acquire_wait(self, key: bytes, token: bytes, ttl_ms: int, wait_ms: int) -> tuple[int, float]: ...

    def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]: ...
    def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool: ...
    def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]: ...
    def release(self, key: bytes, token: bytes) -> bool: ...
    def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]: ...
    def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool: ...
    def incr(self, key: bytes, amount: int) -> int: ...

    # The server's INFO fields, or None when an ACL refuses INFO.
    def info(self) -> dict[str, str] | None: ...

    # COMMAND INFO DELIFEQ DELEX (_dialect.COMMAND_PROBE): the raw reply, or None when the
    # server or its ACL refuses COMMAND. Then use_dialect(the detected dialect), once.
    def command_info(self) -> list[object] | None: ...
    def use_dialect(self, dialect: Dialect) -> None: ...
    def close(self) -> None: ...


_native: ModuleType | None = None
_native_error: str | None = None
_tls_error: str | None = None
_native_checked = False


def _mapped_libssl() -> str | None:
    """The path of the libssl.so.3 mapped into this process, if one is."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").partition("/")[2]
                if path and os.path.basename(path).startswith("libssl.so.3"):
                    return "/" + path
    except OSError:
        pass
    return None


def _tls_build_refused() -> str | None:
    """None when hotlock._native_tls may be loaded, else why not.

    The TLS build links the shared libssl.so.3, so it may run only where Python's own ssl
    module already runs on that library: the dynamic loader then hands the extension the
    copy already loaded, and the process keeps one OpenSSL. A Python with its own OpenSSL
    (python-build-standalone links it in statically, conda ships another), or none, gets
    the plain build, and rediss:// runs on redis-py, over the ssl module.
    """
    if os.environ.get("HOTLOCK_NATIVE_TLS") == "0":
        return "HOTLOCK_NATIVE_TLS=0 is set"
    try:
        import ssl
    except ImportError as exc:
        return f"Python's ssl module did not import: {exc}"
    path = _mapped_libssl()
    if path is None:
        return f"Python's ssl module ({ssl.OPENSSL_VERSION}) does not run on a shared libssl.so.3"
    import ctypes

    # Already mapped: CDLL hands back that same copy, it loads no second one.
    lib = ctypes.CDLL(path)
    lib.OpenSSL_version.restype = ctypes.c_char_p
    lib.OpenSSL_version.argtypes = [ctypes.c_int]
    loaded = (lib.OpenSSL_version(0) or b"").decode("ascii", "replace")
    if loaded != ssl.OPENSSL_VERSION:
        return f"Python's ssl module runs on {ssl.OPENSSL_VERSION}, not on the loaded {path} ({loaded})"
    return None


def native_module() -> tuple[ModuleType | None, str | None]:
    """The native extension and None, or None and why it is not live (the ImportError text kept).

    hotlock._native_tls (the same client with TLS) when Python's ssl module runs on the
    libssl it links, else hotlock._native; tls_refused() says why TLS is not native."""
    global _native, _native_error, _tls_error, _native_checked
    if not _native_checked:
        _native_checked = True
        if os.environ.get("HOTLOCK_PURE_PYTHON"):
            _native_error = "HOTLOCK_PURE_PYTHON is set"
            return _native, _native_error
        _tls_error = _tls_build_refused()
        if _tls_error is None and importlib.util.find_spec(f"{__package__}._native_tls") is None:
            # Built on a system libhiredis, or without OpenSSL's headers (setup.py said so).
            _tls_error = "this install has no TLS build (hotlock._native_tls)"
        if _tls_error is None:
            try:
                from . import _native_tls as tls_mod
            except ImportError as exc:
                _tls_error = f"the TLS build did not import: {exc}"
            else:
                _native = tls_mod
                return _native, _native_error
        try:
            from . import _native as mod
        except ImportError as exc:
            _native_error = f"the extension did not import: {exc}"
        else:
            _native = mod
    return _native, _native_error


def tls_refused() -> str | None:
    """Why rediss:// does not run natively (None when it does, or when nothing is native)."""
    native, _ = native_module()
    if native is None or native.HAS_TLS:
        return None
    return _tls_error or f"the linked hiredis {native.HIREDIS_VERSION} has no TLS"


BACKEND_NAMES = ("native", "redis-py")


def choose(config: ServerConfig, requested: str | None) -> tuple[str, str | None]:
    """The backend to open for ``config`` and, when it is not native, why.

    Native when the extension imported and HOTLOCK_PURE_PYTHON is unset; redis-py
    otherwise, and for TLS when the loaded build has none (see native_module).
    """
    native, why = native_module()
    if requested == "redis-py":
        return "redis-py", "asked for by connect(backend='redis-py')"
    if native is None:
        if requested == "native":
            raise ValueError(f"backend='native' is not available: {why}")
        return "redis-py", why
    if config.tls and not native.HAS_TLS:
        return "redis-py", f"{tls_refused()}, and the url is rediss://"
    return "native", None


def open_backend(config: ServerConfig, requested: str | None) -> tuple[Backend, str | None]:
    name, why = choose(config, requested)
    if config.seeds:
        # A cluster: the same transports, one link per primary, routed by hotlock._cluster.
        from ._cluster import ClusterBackend, Link

        router = None
        if name == "native":
            native, _ = native_module()
            assert native is not None
            opener: Callable[[ServerConfig], Link] = native.NativeBackend
            router = native.ClusterRouter  # the healthy case routed in C, over the same links
        else:
            from ._redispy import RedisPyLink

            opener = RedisPyLink
        return ClusterBackend(config, name, opener, router), why
    if name == "native":
        native, _ = native_module()
        assert native is not None
        backend: Backend = native.NativeBackend(config)
    else:
        from ._redispy import RedisPyBackend  # lazily: the native path never pays for `import redis`

        backend = RedisPyBackend(config)
    return backend, why
