source tools/gpu/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/kernels/test_attention_decode.py tests/kernels/test_attention_verify.py -k "model_call" > $OUT/call3-q8-tests.log 2>&1; echo "rc $?"; grep -E "^(FAILED|ERROR|E  )|passed|failed" $OUT/call3-q8-tests.log | tail -12
