source scripts/device_env.sh
export FLASHTREE_CACHE=/tmp/ftcache
python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu tests/kernels/test_mma.py -q --timeout 150 -rfE --tb=short 2>&1 | tail -8
timeout 200 python3 scripts/sweep_mma.py --out $OUT/sweep_mma.json --budget-s 170 > $OUT/sweep.txt 2>&1; cat $OUT/sweep.txt | tail -52
timeout 220 python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b --echo --scheme q4_k_m --device cuda --steps -n 8 --repeat 2 --replay-al 0 --prefill-lengths 1024 --enforce-eager --profile --out $OUT/profile.json > $OUT/profile.txt 2>&1; grep -A60 "profile of one" $OUT/profile.txt | head -60
