#!/usr/bin/env bash
# Runs cleave-common's tests of tensor memory seen as bytes (`tensor_memory`, the one unsafe
# module over tensors, and `wire`, which sends and fills tensors through it) under
# AddressSanitizer: a read or write outside a tensor's memory, or after it is freed, stops
# the run with a report. Needs a nightly toolchain and the project venv's libtorch (`make
# setup`); libtorch itself is not instrumented but loads and runs under it. Never part of
# CI (a nightly build of its own, minutes).
#
#     common/asan.sh            # tensor_memory and wire
#     common/asan.sh FILTER     # another test filter
set -euo pipefail
cd "$(dirname "$0")/.."
export LIBTORCH_USE_PYTORCH=1 PATH="$PWD/.venv/bin:$PATH"
# The target named explicitly keeps build scripts and proc macros uninstrumented; a target
# directory of its own keeps the instrumented build apart from the usual one.
export RUSTFLAGS="-Zsanitizer=address" RUSTDOCFLAGS="-Zsanitizer=address" ASAN_OPTIONS="detect_leaks=0"
target="$(rustc +nightly -vV | sed -n 's/^host: //p')"
filters=("${@:-tensor_memory}")
[ $# -eq 0 ] && filters+=(wire)
for filter in "${filters[@]}"; do
    cargo +nightly test -q --release --target "$target" --target-dir target/asan -p cleave-common --lib -- "$filter"
done
