#!/usr/bin/env bash
# Cross-builds ellm's C kernels with their test driver (wheels/cross_test.c) and runs it
# where this machine cannot run the wheels: aarch64 under qemu-aarch64, Windows under
# wine64. `host` builds the same for this machine, with the thread pool's portable
# condition-variable path forced (the one macOS takes).
#
#   wheels/cross.sh aarch64|windows|host
#
# Every C file is compiled with -Wall -Wextra -Werror (and the project's
# -Wno-unused-parameter: thread-pool tasks take arguments they may not use). The driver
# checks every SIMD level against the scalar one; on aarch64 it runs on three emulated
# CPUs: cortex-a53 (plain NEON), cortex-a76 (+ dotprod) and max (+ i8mm), and on `max`
# it forces each extension set in turn; on an x86-64 host it also builds the host driver
# and checks that every NEON variant's quantized linear outputs are the bits of this
# machine's AVX2 level (30 checks). Ends with "N passed, M failed" (exit 1 on any
# failure). Debian packages: gcc-aarch64-linux-gnu qemu-user gcc-mingw-w64-x86-64 wine64.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET="${1:-}"
BUILD="$ROOT/build/cross-$TARGET"
CMAKE="${CMAKE:-$(command -v cmake || echo "$ROOT/.venv/bin/cmake")}"  # tests/run.sh's venv has one
need() { command -v "$1" >/dev/null || { echo "missing $1 (apt-get install $2)" >&2; exit 2; }; }

common=(-S "$ROOT" -B "$BUILD" -DELLM_KERNELS_ONLY=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS=-Werror)
case "$TARGET" in
    aarch64)
        need aarch64-linux-gnu-gcc gcc-aarch64-linux-gnu
        need qemu-aarch64 qemu-user
        "$CMAKE" "${common[@]}" -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
            -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc >/dev/null ;;
    windows)
        need x86_64-w64-mingw32-gcc gcc-mingw-w64-x86-64
        # Debian's wine64 package puts its wine64 in /usr/lib/wine
        WINE="$(command -v wine64 || echo /usr/lib/wine/wine64)"
        [[ -x "$WINE" ]] || { echo "missing wine64 (apt-get install wine64)" >&2; exit 2; }
        "$CMAKE" "${common[@]}" -DCMAKE_SYSTEM_NAME=Windows -DCMAKE_SYSTEM_PROCESSOR=AMD64 \
            -DCMAKE_C_COMPILER=x86_64-w64-mingw32-gcc \
            "-DCMAKE_EXE_LINKER_FLAGS=-static-libgcc" "-DCMAKE_SHARED_LINKER_FLAGS=-static-libgcc" >/dev/null ;;
    host)
        "$CMAKE" "${common[@]}" "-DCMAKE_C_FLAGS=-Werror -DELLM_THREADPOOL_CONDVAR" >/dev/null ;;
    *)
        echo "usage: $0 aarch64|windows|host" >&2
        exit 2 ;;
esac
nice "$CMAKE" --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" >"$BUILD/build.log" 2>&1 \
    || { cat "$BUILD/build.log" >&2; echo "1 failed: the $TARGET build (see above)" >&2; exit 1; }

# Runs the driver once per configuration; sums the counts of the "N passed, M failed" lines.
passed=0 failed=0
run() {
    local label="$1"; shift
    echo "== $label: $*"
    local out rc=0
    out="$("$@" 2>&1 | tr -d '\r'; exit "${PIPESTATUS[0]}")" || rc=$?  # (wine: CRLF)
    LAST_OUT="$out"
    printf '%s\n' "$out" | grep -v '^PASSED\|^HASH' || true
    local last
    last="$(printf '%s\n' "$out" | tail -n 1)"
    if [[ "$last" =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]]; then
        passed=$((passed + BASH_REMATCH[1])); failed=$((failed + BASH_REMATCH[2]))
        [[ $rc == 0 || ${BASH_REMATCH[2]} != 0 ]] || failed=$((failed + 1))
    else
        echo "FAILED $label: the driver ended without its summary (exit $rc)"
        failed=$((failed + 1))
    fi
}

case "$TARGET" in
    aarch64)
        SYSROOT="${SYSROOT:-/usr/aarch64-linux-gnu}"
        # neon_detection: the extensions each CPU model has (dispatch.c reads HWCAP)
        run "cortex-a53 (Armv8.0)" qemu-aarch64 -L "$SYSROOT" -cpu cortex-a53 "$BUILD/cross_test" --expect-neon=0
        run "cortex-a76 (Armv8.2 + dotprod)" qemu-aarch64 -L "$SYSROOT" -cpu cortex-a76 "$BUILD/cross_test" --expect-neon=1
        run "max (+ i8mm)" qemu-aarch64 -L "$SYSROOT" -cpu max "$BUILD/cross_test" --expect-neon=3 --hashes
        neon_hashes="$LAST_OUT"
        # The quantized dots sum as the x86 kernels do, so each NEON variant must give this
        # machine's AVX2 bits (same seeded inputs): the host driver (build/cross-host, as
        # `cross.sh host` builds it) prints its levels' hashes.
        if [[ "$(uname -m)" == x86_64 ]]; then
            HOST_BUILD="$ROOT/build/cross-host"
            "$CMAKE" -S "$ROOT" -B "$HOST_BUILD" -DELLM_KERNELS_ONLY=ON -DCMAKE_BUILD_TYPE=Release \
                "-DCMAKE_C_FLAGS=-Werror -DELLM_THREADPOOL_CONDVAR" >/dev/null
            nice "$CMAKE" --build "$HOST_BUILD" -j "$(nproc 2>/dev/null || echo 2)" >"$HOST_BUILD/build.log" 2>&1 \
                || { cat "$HOST_BUILD/build.log" >&2; echo "FAILED the host build"; failed=$((failed + 1)); }
            x86_hashes="$("$HOST_BUILD/cross_test" --hashes 2>/dev/null | grep '^HASH' || true)"
            echo "== NEON bits vs this machine's AVX2 (quantized linear, 20 tokens)"
            if ! grep -q '^HASH q4_0 avx2 ' <<<"$x86_hashes"; then
                echo "FAILED bits: no AVX2 hashes from $HOST_BUILD/cross_test (this CPU lacks AVX2?)"
                failed=$((failed + 1))
            else
                for type in q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k; do
                    want="$(awk -v t="$type" '$2 == t && $3 == "avx2" {print $4}' <<<"$x86_hashes")"
                    for variant in neon neon+dotprod neon+dotprod+i8mm; do
                        got="$(awk -v t="$type" -v v="$variant" '$2 == t && $3 == v {print $4}' <<<"$neon_hashes")"
                        if [[ -n "$want" && "$got" == "$want" ]]; then
                            passed=$((passed + 1))
                        else
                            echo "FAILED bits_${type}_equals_avx2 [$variant]: ${got:-none} vs ${want:-none}"
                            failed=$((failed + 1))
                        fi
                    done
                done
            fi
        fi ;;
    windows)
        export WINEPREFIX="${WINEPREFIX:-$BUILD/wineprefix}" WINEDEBUG=-all
        run "wine64" "$WINE" "$BUILD/cross_test.exe" ;;
    host)
        run "host (condition-variable thread pool)" "$BUILD/cross_test" ;;
esac
echo "$passed passed, $failed failed"
[[ $failed == 0 ]]
