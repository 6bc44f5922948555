# Sourced by the tools/gpu/device_*.sh calls: the carried wheels (.whl, scripts/fetch_device_wheels.sh) into
# /tmp/site, the import path, unbuffered output, and the results folder $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
