# Session 38 call 3 (little device time left): the GPU tests of what the draft-dtype change touches (the proposer's
# head through Qwen35Model.head_for, the draft's dtype in load_draft): engine, models, drafting and bench GPU tests.
source tools/gpu/device_env.sh
LOG="$OUT/gpu_tests.log" FAST=1 timeout 170 bash tools/gpu/gpu_tests.sh tests/engine tests/models tests/drafting tests/bench
echo "== rc $?"
