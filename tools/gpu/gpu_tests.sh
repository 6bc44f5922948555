#!/usr/bin/env bash
# The GPU test suite on a CUDA machine, one line per failure and the totals last:
#   bash tools/gpu/gpu_tests.sh            # the whole GPU suite (pytest -m gpu)
#   FAST=1 bash tools/gpu/gpu_tests.sh     # the quick subset to run after every change to code the GPU runs
#   SLOW=1 bash tools/gpu/gpu_tests.sh     # the rest (FAST=1 and SLOW=1 together are the whole suite)
# On the lent device (carry .whl, made by scripts/fetch_device_wheels.sh) source tools/gpu/device_env.sh first.
set -uo pipefail
cd "$(dirname "$0")/../.."
marker="gpu"
[ "${FAST:-0}" = 1 ] && marker="gpu and not slow"
[ "${SLOW:-0}" = 1 ] && marker="gpu and slow"
# -o addopts="": the project's -q would hide the totals line; --timeout: a hung test costs one test
# LOG=FILE keeps the full log (one line per test as it finishes, the 15 slowest last) for a run cut short
log=${LOG:-$(mktemp)}
# modules that hold no GPU test and import a test tool a GPU machine may lack: left out where it is missing,
# so that the totals count GPU tests only (CI, which installs the test extra, runs them)
ignore=()
for pair in openai:tests/serve/test_live.py openai:tests/serve/test_responses.py \
            schemathesis:tests/serve/test_schemathesis.py grimp:tests/test_architecture.py; do
    if ! python3 -c "import ${pair%%:*}" 2>/dev/null; then
        ignore+=(--ignore "${pair#*:}")
        echo "not collected (no ${pair%%:*} here): ${pair#*:}"
    fi
done
# WORKERS processes share the GPU (pytest-xdist, where installed): the suite is mostly Triton and NVRTC compiles
# and small launches, so 4 workers ran the whole of it in 231 s on an H200 (2026-12-01; 268 s with 189 tests on 2026-12-04); WORKERS=0: one process
# (worksteal, where this xdist has it: an idle worker takes queued tests from a busy one, so that a few long tests
# at the end of one worker's share do not set the end)
workers=()
if [ "${WORKERS:-4}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "${WORKERS:-4}")
    python3 -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" 2>/dev/null \
        && workers+=(--dist worksteal)
fi
python3 -m pytest -o addopts="" -p no:cacheprovider -p no:warnings -m "$marker" --timeout "${TEST_TIMEOUT:-120}" \
    -v -rfE --tb=short --durations=15 "${workers[@]}" "${ignore[@]}" ${@:-tests} > "$log" 2>&1
status=$?
grep -E "^(FAILED|ERROR) " "$log"
tail -n 1 "$log"
[ -n "${LOG:-}" ] || rm -f "$log"
exit $status
