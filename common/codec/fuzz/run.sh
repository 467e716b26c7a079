#!/usr/bin/env bash
# Builds and runs every fuzz target of the payload decoder for SECONDS each (default 60),
# one after the other, on one core. Needs a nightly toolchain and cargo-fuzz
# (`cargo install cargo-fuzz`). Never part of CI: it is for people, and it takes as long as
# it is told to. Corpora grow in corpus/TARGET, crashes land in artifacts/TARGET; each run's
# libFuzzer log is kept in artifacts/TARGET.log.
#
#     common/codec/fuzz/run.sh 300
set -euo pipefail

seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
    echo "usage: $0 SECONDS (a positive number of seconds per target)" >&2
    exit 2
fi
cd "$(dirname "$0")"
targets=(payload_decoder payload_mutator)

cargo +nightly fuzz build
if [ -z "$(ls -A corpus/payload_decoder 2>/dev/null)" ]; then
    cargo +nightly run --quiet --release --example seeds -- corpus/payload_decoder
fi

status=0
mkdir -p artifacts
for target in "${targets[@]}"; do
    mkdir -p "corpus/$target" "artifacts/$target"
    echo "== $target: ${seconds}s"
    # -print_final_stats: executions and time at the end; -rss_limit_mb: declared sizes are
    # capped at 1 MiB by the targets' limit, so anything near this is a bug.
    if ! cargo +nightly fuzz run "$target" "corpus/$target" -- \
        -max_total_time="$seconds" -print_final_stats=1 -rss_limit_mb=2048 >"artifacts/$target.log" 2>&1; then
        echo "   $target FAILED: see common/codec/fuzz/artifacts/$target.log and artifacts/$target/"
        status=1
    fi
    grep -E '^Done|stat::number_of_executed_units|stat::peak_rss_mb|^#[0-9]+.*DONE' "artifacts/$target.log" | sed 's/^/   /' || true
    echo "   corpus: $(ls "corpus/$target" | wc -l) inputs"
done
exit $status
