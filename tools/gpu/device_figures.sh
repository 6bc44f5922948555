#!/usr/bin/env bash
# One device call (carry .whl) for the step, long-context and prefix-cache figures at the Qwen3.6-27B shape (the decisive
# `--echo` model: same shapes, types and bytes as a real Q4_K_M model), each part with its own limit.
# PARTS picks and orders them (default: steps-1k multi-turn steps-64k, ~500 s), e.g.
#   PARTS="fast-tests steps-profile" bash tools/gpu/device_figures.sh   (~400 s)
#   PARTS="tests diagnose sweep steps-1k" bash tools/gpu/device_figures.sh      (~330 s)
#   PARTS="multi-turn steps-64k" ...;  PARTS="steps-256k-tq3" LIMIT_256K=400 ...
#   PARTS="sweep-q6k sweep-attention-compare sweep-deltanet-tree" bash tools/gpu/device_figures.sh  (~420 s, carry .baseline)
# Results under $OUT; each part prints its table's tail.
source tools/gpu/device_env.sh
bench() {  # name, seconds, bench flags... (ECHO= builds the plain random model: a real file's untied layout)
  name=$1; limit=$2; shift 2
  timeout "$limit" python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b ${ECHO---echo} --scheme q4_k_m --device cuda \
      --out "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name (rc $?)"; tail -${TAIL:-18} "$OUT/$name.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for part in ${PARTS:-steps-1k multi-turn steps-64k}; do
  case $part in
    # the engine's GPU tests first (greedy identity, graphs), then kernels at real sizes; slowest listed
    tests) timeout "${LIMIT_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider -p no:warnings -m gpu --durations=12 \
               tests/engine tests/drafting tests/kernels tests/models tests/formats tests/parallel tests/bench tests/cli \
               tests/serve tests/train \
               > "$OUT/pytest.txt" 2>&1; echo "== gpu tests (rc $?)"; grep -E "^(FAILED|ERROR)|passed|failed|s call" "$OUT/pytest.txt" | tail -30 ;;
    diagnose) timeout 150 python3 benchmarks/diagnose_gpu.py --parts fla,agree --out "$OUT/diagnose.json" \
                  > "$OUT/diagnose.txt" 2>&1; echo "== diagnose (rc $?)"; tail -30 "$OUT/diagnose.txt" ;;
    sweep) timeout 150 python3 benchmarks/sweep_quant_matmul.py --types Q4_K,Q6_K --budget-s 100 \
               --out "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1; echo "== sweep (rc $?)"; tail -24 "$OUT/sweep.txt" ;;
    # the kernels that landed untimed on 2026-12-01 (third session): Q6_K float16 rows, the tree-attention
    # defaults against the kernel before them (carry .baseline: git show 3421ff9:src/flashtree/kernels/
    # tree_attention.py > .baseline/tree_attention.py), the DeltaNet tree kernel's launch shapes
    sweep-q6k) timeout 150 python3 benchmarks/sweep_mma_rows.py --types Q6_K --budget-s 120 --out "$OUT/rows_q6k.json" \
                   > "$OUT/rows_q6k.txt" 2>&1; echo "== sweep-q6k (rc $?)"; tail -16 "$OUT/rows_q6k.txt" ;;
    # Q4_K at 2-64 rows, qmh's launch shapes including one row tile at 3 and 4 CTAs per SM (MMAConfig.min_blocks)
    sweep-q4k) timeout 150 python3 benchmarks/sweep_mma_rows.py --types Q4_K --budget-s 120 --out "$OUT/rows_q4k.json" \
                   > "$OUT/rows_q4k.txt" 2>&1; echo "== sweep-q4k (rc $?)"; tail -26 "$OUT/rows_q4k.txt" ;;
    # Q4_K's wide matrices at 16/23/32 rows: one CTA an SM (the default since the twenty-eighth session) against the
    # two-tile ring before it and its other forms (benchmarks/sweep_mma_rows.py --one-cta)
    # the narrow matrices (FFN down, out projections) with K split over a thread-block cluster against the defaults
    sweep-narrow) timeout $(( ${BUDGET_NARROW:-190} + 60 )) python3 benchmarks/sweep_mma_rows.py --types Q4_K,Q6_K --narrow \
                      --matrices down,out --rows "${NARROW_ROWS:-16,23}" --budget-s "${BUDGET_NARROW:-190}" \
                      --out "$OUT/narrow.json" > "$OUT/narrow.txt" 2>&1
                  echo "== sweep-narrow (rc $?)"; grep -A12 summary "$OUT/narrow.txt" ;;
    # the LM head at 2-23 rows (the draft's, the verify's) with x resident or staged for many warps against the default
    sweep-resident) timeout $(( ${BUDGET_RESIDENT:-120} + 60 )) python3 benchmarks/sweep_mma_rows.py --types Q6_K --resident \
                        --matrices head --rows "${RESIDENT_ROWS:-2,8,16,23}" --budget-s "${BUDGET_RESIDENT:-120}" \
                        --out "$OUT/resident.json" > "$OUT/resident.txt" 2>&1
                    echo "== sweep-resident (rc $?)"; grep -A6 summary "$OUT/resident.txt" ;;
    sweep-one-cta) timeout $(( ${BUDGET_ONE_CTA:-110} + 60 )) python3 benchmarks/sweep_mma_rows.py --types Q4_K --one-cta \
                       --matrices gate+up,qkvz,q+gate --rows 16,23,32 --budget-s "${BUDGET_ONE_CTA:-110}" \
                       --out "$OUT/one_cta.json" > "$OUT/one_cta.txt" 2>&1
                   echo "== sweep-one-cta (rc $?)"; tail -11 "$OUT/one_cta.txt" ;;
    # CASES=T:ROWS:CACHE,... instead of the f16 model shapes, e.g. CASES=1:262144:tq3_0,23:65536:q8_0 BUDGET_COMPARE=200,
    # CANDIDATES="new default,splits x2" some of the sweep's COMPARED launches
    sweep-attention-compare) timeout $(( ${BUDGET_COMPARE:-110} + 60 )) python3 benchmarks/sweep_tree_attention.py --compare \
                   --baseline .baseline/tree_attention.py --budget-s "${BUDGET_COMPARE:-110}" ${CASES:+--cases "$CASES"} \
                   ${CANDIDATES:+--candidates "$CANDIDATES"} \
                   --out "$OUT/attention_compare.json" > "$OUT/attention_compare.txt" 2>&1
                   echo "== sweep-attention-compare (rc $?)"; tail -12 "$OUT/attention_compare.txt" ;;
    # the 27B verify's attention at 1K-8K rows with the engine's float32 query (thirtieth session, H100: fused 51.5 us
    # at 1K, normed apart 18.7): the compare candidates
    sweep-attention-verify) timeout 150 python3 benchmarks/sweep_tree_attention.py --compare --float32-query --budget-s 110 \
                                --cases 23:1024:bf16,23:8192:bf16,1:1024:bf16 --out "$OUT/attention_verify.json" \
                                > "$OUT/attention_verify.txt" 2>&1
                            echo "== sweep-attention-verify (rc $?)"; tail -5 "$OUT/attention_verify.txt" ;;
    # #20's attention over TQ3_0 / Q8_0 rows at 1K, 64K and 262K (decode and verify-22): the float16 pair decode
    # (the default) against main's kernel (.baseline, carry it: git show main:src/flashtree/kernels/tree_attention.py
    # > .baseline/tree_attention.py) and the float32 decode in the same file
    sweep-attention-tq3) timeout 280 python3 benchmarks/sweep_tree_attention.py --compare --budget-s 240 \
                             --baseline .baseline/tree_attention.py \
                             --cases 1:1024:tq3_0,23:1024:tq3_0,1:65536:tq3_0,23:65536:tq3_0,1:262144:tq3_0,23:262144:tq3_0,1:65536:q8_0,23:65536:q8_0 \
                             --candidates "new default,float32 TQ3 decode,32-row chunks 8 warps,2 warps splits x2,1 warp splits x2,1 warp splits x4,1 warp at use splits x2" \
                             --out "$OUT/attention_tq3.json" > "$OUT/attention_tq3.txt" 2>&1
                         echo "== sweep-attention-tq3 (rc $?)"; tail -10 "$OUT/attention_tq3.txt" ;;
    # a decode over quantized rows: the default against main's kernel (.baseline), or DECODE_CANDIDATES, e.g. the
    # twenty-fourth session's swapped launches (BUDGET_DECODE=210): "new default,swap 1 warp x2,swap 1 warp x2.5,
    # swap 2 warps pairs x2,swap 4 warps pairs x1.25,swap 4 warps pairs ahead,swap 4 warps x1.25"; next: "new default,
    # swap 1 warp 168 regs x3,swap 2 warps 96 regs x2.5,swap 2 warps pairs ahead x0.75,swap 2 warps pairs ahead x1"
    sweep-attention-decode) timeout $(( ${BUDGET_DECODE:-110} + 40 )) python3 benchmarks/sweep_tree_attention.py --compare \
                                --budget-s "${BUDGET_DECODE:-110}" --baseline .baseline/tree_attention.py \
                                --cases 1:1024:tq3_0,1:65536:tq3_0,1:262144:tq3_0,1:1024:q8_0,1:65536:q8_0,1:262144:q8_0 \
                                --candidates "${DECODE_CANDIDATES:-new default}" --out "$OUT/attention_decode.json" \
                                > "$OUT/attention_decode.txt" 2>&1
                            echo "== sweep-attention-decode (rc $?)"; tail -7 "$OUT/attention_decode.txt" ;;
    # one token over TQ3_0 rows: the CUDA C decode (the default from 4K rows) against the Triton decode at its launch
    sweep-decode-cuda) timeout $(( ${BUDGET_DECODE:-110} + 40 )) python3 benchmarks/sweep_tree_attention.py --compare \
                           --budget-s "${BUDGET_DECODE:-110}" --cuda-decode-from 0 \
                           --cases 1:1024:tq3_0,1:4096:tq3_0,1:16384:tq3_0,1:65536:tq3_0,1:262144:tq3_0 \
                           --candidates "new default,triton decode" --out "$OUT/decode_cuda.json" \
                           > "$OUT/decode_cuda.txt" 2>&1
                       echo "== sweep-decode-cuda (rc $?)"; tail -6 "$OUT/decode_cuda.txt" ;;
    # a tree of 23 (and 21: one slice of 128 query rows) tokens over TQ3_0 rows: the CUDA C verify
    # (kernels/attention_verify.cu) against Triton's verify with and without its tail tile (its default from / below
    # 16K rows)
    sweep-verify-cuda) timeout $(( ${BUDGET_VERIFY:-120} + 40 )) python3 benchmarks/sweep_tree_attention.py --compare \
                           --budget-s "${BUDGET_VERIFY:-120}" --cuda-verify-from 0 \
                           --cases 23:4096:tq3_0,23:16384:tq3_0,23:65536:tq3_0,23:262144:tq3_0,21:65536:tq3_0,21:262144:tq3_0 \
                           --candidates "new default,tail,no tail" --out "$OUT/verify_cuda.json" \
                           > "$OUT/verify_cuda.txt" 2>&1
                       echo "== sweep-verify-cuda (rc $?)"; tail -7 "$OUT/verify_cuda.txt" ;;
    # the CUDA C attention kernels' GPU tests (decode and verify over TQ3_0 rows), the slow ones included
    attention-cuda-tests) timeout "${LIMIT_TESTS:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf \
                              tests/kernels/test_attention_verify.py tests/kernels/test_attention_decode.py \
                              > "$OUT/attention_cuda_tests.txt" 2>&1
                          echo "== attention-cuda-tests (rc $?)"; grep -E "^FAILED|^E  |passed|failed" \
                              "$OUT/attention_cuda_tests.txt" | head -30 ;;
    # the slow GPU tests over 64K quantized rows (the thirty-second session's failure: a tail launch's partials sized
    # for every query row, 93 MB, past the test's bound on the kernel's memory)
    long-context-tests) timeout "${LIMIT_TESTS:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf \
                            tests/kernels/test_tree_attention.py -k long_context > "$OUT/long_context.txt" 2>&1
                        echo "== long-context-tests (rc $?)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/long_context.txt" \
                            | head -30 ;;
    # a verify's 10 rows past its 128-row tile in a launch of their own (`tail`, by default from 16K rows) against
    # the two-tile launch and main's kernel (.baseline), the 2-token decode's swapped 16-row tile, and the verify
    # tile's TQ3_0 rows as float16 pairs
    sweep-attention-tail) timeout $(( ${BUDGET_TAIL:-150} + 40 )) python3 benchmarks/sweep_tree_attention.py --compare \
                              --budget-s "${BUDGET_TAIL:-150}" --baseline .baseline/tree_attention.py \
                              --cases 23:1024:tq3_0,23:16384:tq3_0,23:65536:tq3_0,23:262144:tq3_0,23:65536:q8_0,23:262144:q8_0,2:65536:tq3_0 \
                              --candidates "new default,no tail,tail,tile pairs" --out "$OUT/attention_tail.json" \
                              > "$OUT/attention_tail.txt" 2>&1
                          echo "== sweep-attention-tail (rc $?)"; tail -8 "$OUT/attention_tail.txt" ;;
    # x's L2 re-reads against the weight stream, qmh's access pattern at the fused gate + up (~20 s)
    probe-x-traffic) timeout 90 python3 benchmarks/probe_x_traffic.py --out "$OUT/probe_x_traffic.json" \
                         > "$OUT/probe_x_traffic.txt" 2>&1; echo "== probe-x-traffic (rc $?)"; cat "$OUT/probe_x_traffic.txt" ;;
    sweep-draft-attention) timeout 120 python3 benchmarks/sweep_draft_attention.py --out "$OUT/draft_attention.json" ;;
    # with each CUDA-kernel row its phases (the phase-clock instance: us a CTA spends in each, median / max)
    sweep-deltanet-tree) timeout 120 python3 benchmarks/sweep_deltanet_tree.py --phases --out "$OUT/deltanet_tree.json" \
                   > "$OUT/deltanet_tree.txt" 2>&1; echo "== sweep-deltanet-tree (rc $?)"
                   grep -E "^(recurrent|chain|bushy|star|Traceback|[A-Za-z]*Error)" "$OUT/deltanet_tree.txt" | cut -c1-170
                   grep -E "^phases" "$OUT/deltanet_tree.txt" ;;
    # the commit's fold: 48 fold_path launches against one fold_layers launch, at each launch shape
    sweep-commit) timeout 90 python3 benchmarks/sweep_deltanet_tree.py --commit-only --out "$OUT/commit.json" \
                      > "$OUT/commit.txt" 2>&1; echo "== sweep-commit (rc $?)"; tail -12 "$OUT/commit.txt" ;;
    # fla's launch configurations tuned at the 27B prefill shapes, for src/flashtree/assets/fla-configs/
    # (a tarball: a call returns few files), and installed in this copy's assets for the parts after it
    fla-configs) timeout 200 python3 tools/gpu/extract_fla_configs.py --out "$OUT/fla-configs" > "$OUT/fla_configs.txt" 2>&1
                 echo "== fla-configs (rc $?)"; tail -5 "$OUT/fla_configs.txt"
                 tar czf "$OUT/fla-configs.tgz" -C "$OUT/fla-configs" . && mkdir -p src/flashtree/assets/fla-configs && cp -r "$OUT"/fla-configs/* src/flashtree/assets/fla-configs/
                 rm -rf "$OUT/fla-configs" ;;
    # time to first token after the weights are in memory, on empty kernel caches (a fresh machine) and again
    cold-start) rm -rf ~/.triton/cache ~/.cache/flashtree
                for start in cold warm; do
                    timeout 200 python3 tools/gpu/cold_start.py --profile "$OUT/cold_start_$start.prof" \
                        > "$OUT/cold_start_$start.txt" 2>&1
                    echo "== $start start (rc $?): $(tail -1 "$OUT/cold_start_$start.txt")"
                done ;;
    # the residual add + RMSNorm: the Triton kernel against the cluster kernel (kernels/add_rms_norm.cu) and variants
    norm) timeout 120 python3 benchmarks/bench_add_rms_norm.py --out "$OUT/add_rms_norm.json" > "$OUT/add_rms_norm.txt" 2>&1
          echo "== norm (rc $?)"; tail -10 "$OUT/add_rms_norm.txt" ;;
    # Q4_K's qmh on the wide matrices: the weight ring (the default from 9 rows) against the register-buffered
    # configurations before it and the ring's other shapes
    sweep-ring) timeout 170 python3 benchmarks/sweep_mma_rows.py --types Q4_K --ring --rows 9,16,23,32 \
                    --matrices gate+up,qkvz,q+gate,gate/up --budget-s 130 --out "$OUT/ring.json" > "$OUT/ring.txt" 2>&1
                echo "== sweep-ring (rc $?)"; grep -A40 "^summary" "$OUT/ring.txt" ;;
    # Q6_K's qmh (FFN down, LM head) against its weight-ring forms (compiled offline without spills, 2026-12-04)
    sweep-q6k-ring) timeout 170 python3 benchmarks/sweep_mma_rows.py --types Q6_K --ring --rows 16,23,32 \
                        --matrices down,head --budget-s 130 --out "$OUT/ring_q6k.json" > "$OUT/ring_q6k.txt" 2>&1
                    echo "== sweep-q6k-ring (rc $?)"; grep -A20 "^summary" "$OUT/ring_q6k.txt" ;;
    # the 1K step with the Triton add + RMSNorm, then with the cluster kernel (same model build each)
    # the MLP's SiLU(gate) * up in the gate + up matmul's epilogue (GluLinear) against the separate silu_mul launch
    steps-glu-ab) for glu in 0 1; do
                      FLASHTREE_GLU=$glu bench "steps-glu$glu" "${LIMIT_1K:-150}" --steps -n 32 --repeat 5 --replay-al 0 \
                          --context 1024 --prefill-lengths 1024 ${PROFILE:+--profile}
                  done ;;
    # the 1K step with every switch in AB_ENV off, then on (default: the GLU epilogue and the CUDA C tree verify, the
    # twenty-fifth and twenty-sixth sessions' changes); PROFILE=1 adds --profile (which kernel gained what)
    steps-ab) for on in 0 1; do
                  (for var in ${AB_ENV:-FLASHTREE_GLU FLASHTREE_TREE_CUDA}; do export "$var=$on"; done
                   bench "steps-ab$on" "${LIMIT_1K:-150}" --steps -n 32 --repeat 5 --replay-al 0 --context 1024 \
                       --prefill-lengths 1024 ${PROFILE:+--profile})
              done ;;
    # the same A/B on AR, verify-22 and the one-graph step only (no other budget, chunk or prefill row: ~45 s a side)
    steps-ab-short) for on in 0 1; do
                        (for var in ${AB_ENV:-FLASHTREE_GLU FLASHTREE_TREE_CUDA}; do export "$var=$on"; done
                         bench "steps-ab$on" "${LIMIT_1K:-150}" --steps -n 32 --repeat 5 --replay-al 0 --context 1024 \
                             --verify-budgets 22 --chunk-lengths none --prefill-lengths none ${PROFILE:+--profile})
                    done ;;
    steps-norm-ab) for cluster in 0 1; do
                       FLASHTREE_CLUSTER_NORM=$cluster bench "steps-norm-cluster$cluster" "${LIMIT_1K:-150}" --steps -n 32 \
                           --repeat 5 --replay-al 0 --context 1024 --prefill-lengths 1024
                   done ;;
    # the 1K step without and with programmatic dependent launch (kernels/cuda_functions.py)
    steps-pdl-ab) for pdl in 0 1; do
                      FLASHTREE_PDL=$pdl bench "steps-pdl$pdl" "${LIMIT_1K:-150}" --steps -n 32 --repeat 5 --replay-al 0 \
                          --context 1024 --prefill-lengths 1024
                  done ;;
    sweep-attention) timeout "${LIMIT_SWEEP_ATTN:-150}" python3 benchmarks/sweep_tree_attention.py --budget-s "${BUDGET_SWEEP_ATTN:-120}" \
               --out "$OUT/sweep_attention.json" > "$OUT/sweep_attention.txt" 2>&1
               echo "== sweep-attention (rc $?)"; tail -10 "$OUT/sweep_attention.txt" ;;
    # issue #16's table: every quantized type at the 27B shapes, rows 1-32, floor and bf16 cuBLAS in the same run
    kernel-table) timeout "${LIMIT_KERNELS:-240}" python3 -m flashtree.cli.main bench --kernels --out "$OUT/kernels.json" \
                  > "$OUT/kernels.txt" 2>&1
                echo "== kernel-table (rc $?)"; grep -E '^(Q|IQ)[0-9]|TB/s' "$OUT/kernels.txt" | cut -c1-90 ;;
    # the FAST GPU subset: run it first after any change to code the GPU runs
    fast-tests) LOG="$OUT/gpu_tests.log" FAST=1 timeout "${LIMIT_TESTS:-270}" bash tools/gpu/gpu_tests.sh tests ;;
    steps-1k) bench steps-1k 200 --steps -n 128 --repeat 10 --context 1024 --prefill-chunk 2048 \
                  --prefill-lengths 1024,13000 ;;
    # steps-1k and its profiles in one run (the one-graph step's tree + walk + commit by kernel; ~130 s)
    steps-1k-profile) TAIL=60 bench steps-1k-profile 260 --steps -n 128 --repeat 10 --context 1024 --prefill-chunk 2048 \
                          --prefill-lengths 1024,13000 --profile ;;
    # where a step's time goes: the AR step eager and replayed, the draft step, the verify, verify + commit
    steps-profile) TAIL=120 bench steps-profile 200 --steps -n 16 --repeat 5 --replay-al 0 --prefill-lengths 1024 \
                       --profile ;;
    # the same over 64K rows of TQ3_0 cache (issue #20: what the step spends outside the attention kernel)
    steps-profile-64k-tq3) ECHO= TAIL=120 bench steps-profile-64k-tq3 "${LIMIT_64K:-200}" --steps -n 16 --repeat 3 \
                       --replay-al 0 --context 65536 --prefill-chunk 2048 --prefill-lengths 1024 -ctk tq3_0 -ctv tq3_0 \
                       --profile ;;
    # the demo pair on HumanEval (speculative against AR) and the GPU fidelity rows beside transformers
    demo) timeout 170 python3 -m flashtree.cli.main bench --device cuda --dataset humaneval --prompts 20 -n 256 \
              --out "$OUT/demo.json" > "$OUT/demo.txt" 2>&1; echo "== demo (rc $?)"; tail -12 "$OUT/demo.txt" ;;
    demo-no-adaptive) timeout 170 python3 -m flashtree.cli.main bench --device cuda --dataset humaneval --prompts 20 -n 256 \
              --no-adaptive --out "$OUT/demo_no_adaptive.json" > "$OUT/demo_no_adaptive.txt" 2>&1
              echo "== demo, adaptive off (rc $?)"; tail -8 "$OUT/demo_no_adaptive.txt" ;;
    # the whole GPU suite in 4 workers (231 s on 2026-12-01, fourth session)
    gpu-suite) LOG="$OUT/gpu_tests.log" timeout "${LIMIT_TESTS:-330}" bash tools/gpu/gpu_tests.sh tests
               grep -A16 "slowest" "$OUT/gpu_tests.log" | head -16 ;;
    fidelity) timeout 120 python3 -m flashtree.cli.main bench --fidelity --device cuda --dtypes float32,bfloat16 \
                  --prompts 4 --peers --out "$OUT/fidelity.json" > "$OUT/fidelity.txt" 2>&1
              echo "== fidelity (rc $?)"; tail -8 "$OUT/fidelity.txt" ;;
    # issue #19's test models: the GPU suite's random targets (tests/models/test_qwen35.py VARIANTS: Q8_0 at the tiny
    # shape, Q4_K_M and every other type at K = 256, where the tensor-core kernels run); the demo target is `fidelity`
    fidelity-tiny) for variant in q8_0 q4_k_m mixed-types; do
                       model="$OUT/$variant.gguf"
                       python3 -c "import sys; from tests.models.test_qwen35 import VARIANTS; from flashtree.models.synthetic import write_synthetic_gguf as w; w(sys.argv[1], **VARIANTS[sys.argv[2]])" "$model" "$variant"
                       timeout 100 python3 -m flashtree.cli.main bench --fidelity --model "$model" --device cuda \
                           --dtypes float32,bfloat16 --prompts 4 --out "$OUT/fidelity-$variant.json" \
                           > "$OUT/fidelity-$variant.txt" 2>&1
                       echo "== fidelity $variant (rc $?)"; tail -5 "$OUT/fidelity-$variant.txt"
                       rm -f "$model"
                   done ;;
    multi-turn) TAIL=12 bench multi-turn 300 --multi-turn -n 32 ;;  # an untimed session, then 5 per setting
    steps-64k) bench steps-64k "${LIMIT_64K:-200}" --steps -n 32 --repeat 10 --replay-al 0 --context 65536 \
                   --prefill-chunk 2048 --prefill-lengths "${PREFILL_64K:-131072}" ;;
    # memory: the plain model (the echo model's tied head is a second 0.31 GiB copy); chunks of 512 rows
    # take the dequantize + cuBLAS prefill path (384 would go through the slower skinny kernels)
    # the 1K reference of the long-context rows (issue #20: their step times over these, same run, same model)
    # the 27B AR step, verify and the 13K prefill without the replay (issue #17's prefill bar after a change)
    steps-1k-prefill) bench steps-1k-prefill 150 --steps -n 32 --repeat 5 --replay-al 0 --context 1024 --prefill-chunk 2048 \
                          --prefill-lengths 13000 ;;
    steps-1k-short) ECHO= TAIL=${PROFILE:+150} bench steps-1k-short "${LIMIT_1K:-150}" --steps -n 32 --repeat 5 \
                        --replay-al 0 --context 1024 --prefill-lengths 1024 ${PROFILE:+--profile} ;;
    steps-64k-q8) ECHO= bench steps-64k-q8 "${LIMIT_64K:-200}" --steps -n 32 --repeat 5 --replay-al 0 --context 65536 \
                      --prefill-chunk 2048 --prefill-lengths 1024 -ctk q8_0 -ctv q8_0 ;;
    steps-64k-tq3) ECHO= bench steps-64k-tq3 "${LIMIT_64K:-200}" --steps -n 32 --repeat 5 --replay-al 0 --context 65536 \
                       --prefill-chunk 2048 --prefill-lengths 1024 -ctk tq3_0 -ctv tq3_0 ;;
    # issue #20's 24 GiB card: 27B + the bf16 draft + 262K tokens of TQ3_0 under the cap; peak_footprint in the JSON is
    # the number held against 23.0 GiB (docs/LONG_CONTEXT.md)
    capped-256k-bf16) ECHO= bench capped-256k-bf16 "${LIMIT_256K:-420}" --steps -n 128 --repeat 3 --replay-al 0 \
                          --context 262000 --prefill-chunk 512 --prefill-lengths 1024 -ctk tq3_0 -ctv tq3_0 \
                          --gpu-memory 24GiB ;;
    # issue #20's configuration alone: the 262K context and budget-22 decoding (verify 22, draft, tree, walk, commit,
    # the one-graph step), no other budget or prefill row; footprint_by_phase_GiB in the JSON, under 24 GiB
    capped-256k-budget22) ECHO= bench capped-256k-budget22 "${LIMIT_256K:-300}" --steps -n 128 --repeat 3 \
                              --replay-al 0 --context 262000 --prefill-chunk 512 --verify-budgets 22 \
                              --chunk-lengths none --prefill-lengths none -ctk tq3_0 -ctv tq3_0 --gpu-memory 24GiB ;;
    # the same configuration under CAP GiB (default 24) with CHUNK-token prefill chunks (default 512), the allocator's
    # block stacks kept: what is reserved, live and kept free after each phase, the snapshot at the first out-of-memory
    # or at the end ($OUT/snapshot-*.pickle; python -m flashtree.bench.memory_snapshot FILE prints its tables)
    capped-256k-snapshot) ECHO= TAIL=60 bench "capped-256k-${CAP:-24}gib-c${CHUNK:-512}" "${LIMIT_256K:-300}" --steps \
                              -n 128 --repeat 3 --replay-al 0 --context 262000 --prefill-chunk "${CHUNK:-512}" \
                              --verify-budgets 22 --chunk-lengths none --prefill-lengths none -ctk tq3_0 -ctv tq3_0 \
                              --gpu-memory "${CAP:-24}GiB" \
                              --memory-snapshot "$OUT/snapshot-${CAP:-24}gib-c${CHUNK:-512}.pickle" ;;
    # PROFILE=1: and where the 262K step, verify and a 512-token prefill chunk spend their GPU time (`--profile`)
    steps-256k-tq3) ECHO= TAIL=${PROFILE:+150} bench steps-256k-tq3 "${LIMIT_256K:-300}" --steps -n 8 --repeat 3 \
                        --replay-al 0 --context 262000 --prefill-chunk 512 --prefill-lengths 1024 -ctk tq3_0 -ctv tq3_0 \
                        ${PROFILE:+--profile} ;;
    *) echo "unknown part $part" ;;
  esac
done
