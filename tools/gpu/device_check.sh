#!/usr/bin/env bash
# One device call after a change to code the GPU runs (carry .whl, made by scripts/fetch_device_wheels.sh):
# the fast GPU tests, the 27B-shape steps with the eager step's kernel profile, and the demo pair's
# speculative-against-AR token identity. Each part has its own time limit; results under $OUT.
source tools/gpu/device_env.sh
export FLASHTREE_CACHE=/tmp/ftcache
t=$(date +%s); LOG=$OUT/gpu_tests.log FAST=${FAST:-1} timeout "${TESTS_TIMEOUT:-240}" bash tools/gpu/gpu_tests.sh \
    ${TEST_ARGS:-tests --continue-on-collection-errors}; echo "gpu tests rc=$? in $(( $(date +%s) - t )) s"
if [ "${STEPS:-1}" = 1 ]; then
  timeout "${STEPS_TIMEOUT:-260}" python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b --echo --scheme q4_k_m \
      --device cuda --steps -n 16 --repeat 5 --replay-al 0 ${STEPS_ARGS:---prefill-lengths 1024,13000 --profile} \
      --out "$OUT/steps.json" > "$OUT/steps.txt" 2>&1
  grep -vE "^\s+[0-9]+ +[0-9.]+  " "$OUT/steps.txt" | tail -40
fi
if [ "${DEMO:-1}" = 1 ]; then
  timeout "${DEMO_TIMEOUT:-150}" python3 -m flashtree.cli.main bench --device cuda --dataset humaneval --prompts 20 \
      -n 256 --out "$OUT/demo.json" > "$OUT/demo.txt" 2>&1; tail -6 "$OUT/demo.txt"
fi
