# The next session's first device call, prepared in the thirty-seventh (copy it to tools/gpu/.call1.sh and carry it
# with .whl). First, on main: git am docs/runs/h100-2026-12-06-s37/000*.patch  (the weight pool and the attention
# kind change, neither yet run on a GPU), then this call (~520 s):
#  1. fla's chunked kernels tuned at the 27B shapes on this GPU (no configurations ship for the H100: a fresh H100
#     autotunes in the first prefill, and 3.24 GiB sat outside the allocator in the thirty-seventh session's call 1);
#     copy $OUT/fla-configs/<GPU>/ to src/flashtree/assets/fla-configs/<GPU>/ afterwards;
#  2. the fast GPU subset (the patches change code every CUDA model load runs);
#  3. issue #20's configuration under 24 GiB with the allocator snapshot, fla reading the configurations just tuned.
source tools/gpu/device_env.sh
timeout 120 python3 tools/gpu/extract_fla_configs.py --out "$OUT/fla-configs" > "$OUT/fla-configs.txt" 2>&1
echo "== fla configs (rc $?)"; tail -3 "$OUT/fla-configs.txt"; ls "$OUT/fla-configs"
LIMIT_TESTS=240 PARTS=fast-tests bash tools/gpu/device_figures.sh
gpu=$(ls "$OUT/fla-configs" | head -1)
FLA_CACHE_MODE=fuzzy FLA_CONFIG_DIR="$OUT/fla-configs/$gpu" CAP=24 LIMIT_256K=220 PARTS=capped-256k-snapshot \
    bash tools/gpu/device_figures.sh
