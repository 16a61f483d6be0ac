"""The native extension's Python side: which build of hotlock._native loads (the TLS one,
hotlock._native_tls, only where Python's ssl module runs on the libssl it links), and why
the native backend is not live when it is not."""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["backend_info", "native_aio", "native_module", "tls_refused"]


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
        if _tls_error is None and importlib.util.find_spec("hotlock._native_tls") is None:
            # Built on a system libhiredis, or without OpenSSL's headers (setup.py said so).
            _tls_error = (
                "this install has no TLS build (hotlock._native_tls): it was compiled on the system "
                "libhiredis (the pinned hiredis sources were neither there nor fetchable) or without "
                "OpenSSL's headers; the build said which"
            )
        if _tls_error is None:
            try:
                from .. import _native_tls as tls_mod
            except ImportError as exc:
                _tls_error = f"the TLS build did not import: {exc}"
            else:
                _native = tls_mod
                return _native, _native_error
        try:
            from .. import _native as mod
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


def native_aio() -> tuple[ModuleType | None, str | None]:
    """The extension when it carries the asyncio protocol, else None and why not."""
    native, why = native_module()
    if native is None:
        return None, why
    if not hasattr(native, "AioProtocol"):
        return None, "the extension was built without its asyncio protocol (ext/_aio.pxi)"
    return native, None


def backend_info() -> dict[str, str | None]:
    """Which backend connect() would use for a redis:// url, and why, when it is not native;
    the same for a rediss:// url; and the hiredis and OpenSSL the native client runs on.

    ``{"backend": "native" | "redis-py", "reason": None | str, "hiredis": version | None,
    "tls": "native" | "redis-py", "tls_reason": None | str, "openssl": version | None}``
    """
    native, why = native_module()
    tls_why = tls_refused()
    return {
        "backend": "redis-py" if native is None else "native",
        "reason": why,
        "hiredis": None if native is None else native.HIREDIS_VERSION,
        # rediss:// urls: native when the TLS build is loaded (it runs on the libssl of
        # Python's own ssl module, whose version is in "openssl"), else redis-py and why.
        "tls": "native" if native is not None and tls_why is None else "redis-py",
        "tls_reason": why if native is None else tls_why,
        "openssl": (native.OPENSSL_VERSION or None) if native is not None else None,
    }
