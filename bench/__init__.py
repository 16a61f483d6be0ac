"""hotlock's benchmarks: ``python -m bench`` compares hotlock with its peers and a C ceiling.

See bench/README.md. Not part of ``make test`` (pytest's testpaths is tests/).
"""
