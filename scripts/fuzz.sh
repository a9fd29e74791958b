#!/usr/bin/env bash
# Build the libFuzzer targets in fuzz/ on the stable toolchain and run each for a
# bounded time, printing the executions each made. See docs/testing.md.
#
#   scripts/fuzz.sh                       # every target, 20 s each (what CI runs)
#   FEWERBYTES_FUZZ_SECONDS=600 scripts/fuzz.sh pool_open   # one target, longer
#   scripts/fuzz.sh --build               # build only
#   scripts/fuzz.sh --list                # the target names
#
# No cargo-fuzz and no nightly: cargo-fuzz's `--sanitizer none` build is plain
# `cargo build` with SanitizerCoverage turned on through -Cpasses/-Cllvm-args, which
# stable rustc accepts. libfuzzer-sys compiles libFuzzer itself (needs g++).
#
# Environment:
#   FEWERBYTES_FUZZ_SECONDS   seconds per target (default 20)
#   FEWERBYTES_FUZZ_SUMMARY   file to append one summary line per target to
#   FEWERBYTES_FUZZ_ARGS      extra libFuzzer flags (e.g. "-jobs=2 -workers=2")
# New inputs that reach new coverage go to fuzz/corpus/<target>/ (git ignores all
# but the committed seed-* files); a crash is saved under fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS=(superblock page journal_sector catalog location pool_open nbd_handshake nbd_requests)
seconds=${FEWERBYTES_FUZZ_SECONDS:-20}
summary=${FEWERBYTES_FUZZ_SUMMARY:-/dev/null}
triple=$(rustc -vV | sed -n 's/^host: //p')

build_only=0
case "${1:-}" in
    --list) printf '%s\n' "${TARGETS[@]}"; exit 0 ;;
    --build) build_only=1; shift ;;
esac
selected=("$@")
((${#selected[@]})) || selected=("${TARGETS[@]}")

# What `cargo fuzz build --sanitizer none` passes, less its nightly-only extras.
# --target keeps these flags off build scripts and proc macros (they would need
# libFuzzer's symbols to link); --cfg fuzzing matches cargo-fuzz.
export RUSTFLAGS="-Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares \
--cfg fuzzing"
bins=()
for t in "${selected[@]}"; do bins+=(--bin "$t"); done
echo "fuzz.sh: building ${selected[*]} for $triple"
cargo build --release --locked --manifest-path fuzz/Cargo.toml --target "$triple" "${bins[@]}"
((build_only)) && exit 0

failed=0
for t in "${selected[@]}"; do
    corpus=fuzz/corpus/$t
    artifacts=fuzz/artifacts/$t
    mkdir -p "$corpus" "$artifacts"
    log=$(mktemp -t "fewerbytes-fuzz-$t.XXXXXX")
    # The NBD targets put their socket under TMPDIR: one directory per run, removed after.
    scratch=$(mktemp -d -t "fewerbytes-fuzz-$t.XXXXXX")
    status=0
    start=$(date +%s)
    # -timeout: one input running 10 s is a hang. -rss_limit_mb: the process's whole
    # memory (single allocations are bounded inside the targets, see fuzz/src/lib.rs).
    # -max_len: the largest seed is a 53 KiB pool image; room to grow past it.
    # shellcheck disable=SC2086
    TMPDIR=$scratch "fuzz/target/$triple/release/$t" "$corpus" \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=131072 \
        -artifact_prefix="$artifacts/" -print_final_stats=1 ${FEWERBYTES_FUZZ_ARGS:-} \
        >"$log" 2>&1 || status=$?
    elapsed=$(( $(date +%s) - start ))
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    if [[ $status -eq 0 ]]; then
        line=$(printf 'fuzz %-16s %10s executions in %ss, no crash' "$t" "${runs:-?}" "$elapsed")
    else
        failed=$((failed + 1))
        artifact=$(sed -n 's/^.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)
        # From the first sign of trouble: the panic, the oversized allocation, or
        # libFuzzer's own report (a timeout, the RSS limit).
        awk '/panicked at|^fuzz: allocation|ERROR: libFuzzer|ALARM: working on/{p=1} p' "$log" |
            grep -v '^#[0-9]' | head -80 >&2 || true
        ((status > 128)) && echo "fuzz.sh: $t was killed by signal $((status - 128))" >&2
        if [[ -n $artifact && -f $artifact ]]; then
            # So a crash seen only in CI's log can be replayed (docs/testing.md).
            echo "fuzz.sh: the input, gzip | base64 (decode: base64 -d | gunzip > crash):" >&2
            gzip -9c "$artifact" | base64 -w0 >&2
            echo >&2
        fi
        line=$(printf 'fuzz %-16s FAILED (exit %s) after %ss: %s' "$t" "$status" "$elapsed" "${artifact:-see the log above}")
    fi
    rm -rf "$log" "$scratch"
    echo "$line"
    echo "$line" >>"$summary"
done
exit $((failed > 0))
