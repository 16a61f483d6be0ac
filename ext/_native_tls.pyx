# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# hotlock._native_tls: the same extension as hotlock._native, compiled with hiredis's TLS
# layer (setup.py defines HOTLOCK_TLS=1 for it and links the system libssl). One set of
# sources for both builds: everything that differs sits behind ext/tls.h.
include "_native.pyx"
