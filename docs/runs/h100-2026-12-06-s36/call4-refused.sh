source tools/gpu/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 215 python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b --scheme q4_k_m --device cuda --out $OUT/capped-23gib-chunk256.json \
  --steps -n 128 --repeat 3 --replay-al 0 --context 262000 --prefill-chunk 256 --verify-budgets 22 --chunk-lengths none \
  --prefill-lengths none -ctk tq3_0 -ctv tq3_0 --gpu-memory 23GiB > $OUT/capped-23gib-chunk256.txt 2>&1; echo "rc $?"; grep -vE "^(compiled|building)" $OUT/capped-23gib-chunk256.txt | tail -12 | cut -c1-600
