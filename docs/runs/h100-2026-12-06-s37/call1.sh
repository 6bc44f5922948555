source tools/gpu/device_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/bench/test_memory_snapshot.py > "$OUT/call1-snapshot-test.log" 2>&1
echo "== snapshot gpu test (rc $?)"; tail -3 "$OUT/call1-snapshot-test.log"
CAP=24 LIMIT_256K=235 PARTS=capped-256k-snapshot bash tools/gpu/device_figures.sh
CAP=23 LIMIT_256K=200 PARTS=capped-256k-snapshot bash tools/gpu/device_figures.sh
