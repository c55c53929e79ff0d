#!/usr/bin/env bash
# Sanitizer builds of native_cpu's library, run on the conformance suite.
#
#   plugins/native_cpu/sanitizers/run.sh address PYTHON [check arguments...]
#   plugins/native_cpu/sanitizers/run.sh thread
#
# address: builds the library with AddressSanitizer + UndefinedBehaviorSanitizer
#   (CMake option ATTN_NATIVE_CPU_SANITIZE=address) and runs
#   `attn-backends check native_cpu` on it under PYTHON (a venv's python with the
#   plugin installed), libasan preloaded; any out-of-bounds access, use after
#   free or undefined behaviour aborts the run.
# thread: builds the kernels with ThreadSanitizer into a C++ driver
#   (race_check.cc) and runs it: races and 1-vs-2-thread differences fail.
# Build trees go to plugins/native_cpu/build-sanitize/MODE (ignored by git), out of
# build/, which `make dist` deletes (make test runs the two side by side).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
plugin="$(cd "$here/.." && pwd)"
mode="${1:?usage: run.sh address PYTHON [check arguments...] | run.sh thread}"
shift
build="$plugin/build-sanitize/$mode"
# An absolute path to the venv's python (not resolved past its symlink: the venv's
# own one has jax): CMake runs it from the build tree, where a relative path such as
# make's .venv/bin/python names nothing, and FindPython then picks another Python.
absolute() { echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; }
case "$mode" in
address)
    python="$(absolute "${1:?run.sh address: give the python of a venv with the plugin installed}")"
    shift
    cmake -S "$plugin" -B "$build" -DATTN_NATIVE_CPU_SANITIZE=address \
        -DPython_EXECUTABLE="$python" -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
    cmake --build "$build" -j 2 > /dev/null
    asan="$(${CXX:-c++} -print-file-name=libasan.so)"
    # libstdc++ too: ASan's __cxa_throw interceptor must find the real one at
    # start-up, and CPython does not link libstdc++ (jaxlib throws C++
    # exceptions while it imports). Python and jaxlib are not instrumented:
    # their leaks at exit are not ours (detect_leaks=0).
    stdcxx="$(${CXX:-c++} -print-file-name=libstdc++.so.6)"
    LD_PRELOAD="$asan $stdcxx" ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" \
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
        "$python" "$here/run_suite.py" "$build/libattn_native_cpu.so" "$@"
    ;;
thread)
    python="$(absolute "${1:-$(command -v python3)}")"
    cmake -S "$plugin" -B "$build" -DATTN_NATIVE_CPU_SANITIZE=thread \
        -DPython_EXECUTABLE="$python" -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
    cmake --build "$build" -j 2 --target attn_native_cpu_race_check > /dev/null
    TSAN_OPTIONS="halt_on_error=1" "$build/attn_native_cpu_race_check"
    ;;
*)
    echo "run.sh: mode must be address or thread, got '$mode'" >&2; exit 2 ;;
esac
