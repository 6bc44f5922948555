source tools/gpu/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
LIMIT_TESTS=240 PARTS=fast-tests bash tools/gpu/device_figures.sh 2>&1 | tail -12
LIMIT_256K=190 PARTS=capped-256k-budget22 bash tools/gpu/device_figures.sh | tail -6
echo "== capped 23GiB"
timeout 150 python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b --scheme q4_k_m --device cuda --out $OUT/capped-23gib.json \
  --steps -n 128 --repeat 3 --replay-al 0 --context 262000 --prefill-chunk 512 --verify-budgets 22 --chunk-lengths none \
  --prefill-lengths none -ctk tq3_0 -ctv tq3_0 --gpu-memory 23GiB > $OUT/capped-23gib.txt 2>&1; echo "rc $?"; tail -6 $OUT/capped-23gib.txt
