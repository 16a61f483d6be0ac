# cython: language_level=3, cdivision=True
# hotlock._native_tls: the same extension as hotlock._native, compiled with hiredis's TLS
# layer (setup.py defines HOTLOCK_TLS=1 for it and links the system libssl). One set of
# sources for both builds: everything that differs sits behind ext/tls.h. The directives
# above are _native.pyx's (an included file's own header is not read): bounds checks stay
# on but for the functions proven safe, in both builds alike.
include "_native.pyx"
