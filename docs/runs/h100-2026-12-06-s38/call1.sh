# Session 38 call 1 (docs/runs/h100-2026-12-06-s37/next-call.sh, adapted): fla configs tuned only where none ship
# for this GPU; the fast GPU subset (weight pool + attention kind patches); #20's configuration under 24 GiB.
source tools/gpu/device_env.sh
gpu=$(python3 -c "import torch,re; print(re.sub(r'[^0-9A-Za-z]+','_',torch.cuda.get_device_name()).strip('_'))")
echo "== gpu $gpu"
if [ -d "src/flashtree/assets/fla-configs/$gpu" ]; then echo "== fla configs ship for $gpu"; fla=""
else
  timeout 120 python3 tools/gpu/extract_fla_configs.py --out "$OUT/fla-configs" > "$OUT/fla-configs.txt" 2>&1
  echo "== fla configs (rc $?)"; tail -3 "$OUT/fla-configs.txt"; ls "$OUT/fla-configs"
  fla="FLA_CACHE_MODE=fuzzy FLA_CONFIG_DIR=$OUT/fla-configs/$gpu"
fi
LIMIT_TESTS=240 PARTS=fast-tests bash tools/gpu/device_figures.sh
env $fla CAP=24 LIMIT_256K=220 PARTS=capped-256k-snapshot bash tools/gpu/device_figures.sh
