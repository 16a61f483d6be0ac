"""hotlock._native_tls: hotlock._native built with TLS (ext/_native_tls.pyx), the same interface."""

from ._native import *  # noqa: F403
from ._native import HAS_TLS as HAS_TLS
from ._native import HIREDIS_VERSION as HIREDIS_VERSION
from ._native import OPENSSL_VERSION as OPENSSL_VERSION
