# Session 38 call 2: the two attention tests call 1 ran with the old helper signature; H100 fla configs as one tar.
source tools/gpu/device_env.sh
gpu=$(python3 -c "import torch,re; print(re.sub(r'[^0-9A-Za-z]+','_',torch.cuda.get_device_name()).strip('_'))")
echo "== gpu $gpu"
LOG="$OUT/attention_tests.log" FAST=1 timeout 200 bash tools/gpu/gpu_tests.sh tests/kernels/test_attention_decode.py \
    tests/kernels/test_attention_verify.py tests/models/test_weight_pool.py
echo "== attention + weight pool GPU tests (rc $?)"
if [ ! -d "src/flashtree/assets/fla-configs/$gpu" ]; then
  timeout 150 python3 tools/gpu/extract_fla_configs.py --out "$OUT/cfg" > "$OUT/fla-configs.txt" 2>&1
  echo "== fla configs (rc $?)"; tail -1 "$OUT/fla-configs.txt"
  tar -C "$OUT/cfg" -cf "$OUT/fla-configs.tar" . && rm -rf "$OUT/cfg"
fi
