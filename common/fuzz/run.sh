#!/usr/bin/env bash
# Builds and runs the `request_path` fuzz target (the server's request path over
# cleave-common: frames, reassembly, envelope, the cut's spec, decoding) for SECONDS
# (default 60), on one core. Needs a nightly toolchain, cargo-fuzz (`cargo install
# cargo-fuzz`), the project venv's libtorch (`make setup`) and the digits test bundle
# (`make test-bundles`; another bundle with CLEAVE_FUZZ_BUNDLE). Never part of CI. The
# corpus grows in corpus/request_path, crashes land in artifacts/request_path, and the
# run's libFuzzer log is kept in artifacts/request_path.log.
#
#     common/fuzz/run.sh 600
set -euo pipefail

seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
    echo "usage: $0 SECONDS (a positive number of seconds)" >&2
    exit 2
fi
cd "$(dirname "$0")"
root="$(cd ../.. && pwd)"
# torch-sys takes libtorch from the venv's PyTorch (as the Makefile does); the build
# script bakes its directory into the binaries' rpath.
export LIBTORCH_USE_PYTORCH=1 PATH="$root/.venv/bin:$PATH"
target=request_path

# AddressSanitizer (cargo fuzz's default) covers our Rust code; libtorch is not instrumented
# but loads and runs under it. Should a libtorch build not, `-s none` (and the same below)
# keeps libFuzzer's coverage and Rust's own checks.
cargo +nightly fuzz build "$target"
mkdir -p "corpus/$target" "artifacts/$target"
if [ -z "$(ls -A "corpus/$target")" ]; then
    # A debug build: the seeds are a few small payloads, and its dependencies build much
    # faster than optimised ones (libtorch's wrapper included).
    cargo +nightly run --quiet --example seeds -- "corpus/$target"
fi

echo "== $target: ${seconds}s"
status=0
# -print_final_stats: executions and time at the end; -rss_limit_mb: requests are capped at
# 64 KiB of tensors (libtorch and the sanitizer take ~0.5-1 GiB), so anything near this is a bug.
if ! cargo +nightly fuzz run "$target" "corpus/$target" -- \
    -max_total_time="$seconds" -print_final_stats=1 -rss_limit_mb=2048 >"artifacts/$target.log" 2>&1; then
    echo "   $target FAILED: see common/fuzz/artifacts/$target.log and artifacts/$target/"
    status=1
fi
grep -E '^Done|stat::|^#[0-9]+.*DONE' "artifacts/$target.log" | sed 's/^/   /' || true
echo "   corpus: $(ls "corpus/$target" | wc -l) inputs"
exit $status
