#!/usr/bin/env bash
# Nsight Compute on the tensor-core kernels (benchmarks/ncu_mma.py; default the 27B Q4_K gate/up matrix at 1, 2 and 23
# rows; NCU_MMA_ARGS="--type Q6_K --shape 5120x17408 --rows 1,23" another, NCU_COUNT launches profiled): the full
# report, its raw metrics and the machine code with stall samples under $OUT (NCU_NAME the files' stem), then per
# launch the time, active warps, issue activity, L1 / L2 hit rates and bytes, and the largest stall reasons (per
# issued instruction). One device call, ~45 s. NCU_KERNEL (a regex, default ^qm) and NCU_SCRIPT (default
# benchmarks/ncu_mma.py) profile another kernel, e.g. NCU_KERNEL=tq3_verify NCU_SCRIPT=tools/gpu/run_verify_once.py.
source tools/gpu/device_env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1); echo "ncu: $NCU"
NAME=${NCU_NAME:-mma}
timeout 300 $NCU --clock-control none --set full -k regex:"${NCU_KERNEL:-^qm}" -c ${NCU_COUNT:-9} -f -o $OUT/$NAME \
    python3 ${NCU_SCRIPT:-benchmarks/ncu_mma.py} \
    ${NCU_MMA_ARGS:-} > $OUT/${NAME}_run.txt 2>&1; echo "ncu rc $?"; tail -3 $OUT/${NAME}_run.txt
$NCU --import $OUT/$NAME.ncu-rep --page details > $OUT/${NAME}_details.txt 2>&1
$NCU --import $OUT/$NAME.ncu-rep --page raw --csv > $OUT/${NAME}_raw.csv 2>&1
if [ -z "${NCU_KERNEL:-}" ]; then
    $NCU --import $OUT/$NAME.ncu-rep --page source --print-source sass --csv -k regex:_t3_ > $OUT/${NAME}_sass_t3.csv 2>&1
    $NCU --import $OUT/$NAME.ncu-rep --page source --print-source sass --csv -k regex:qmv > $OUT/${NAME}_sass_qmv.csv 2>&1
else
    $NCU --import $OUT/$NAME.ncu-rep --page source --print-source sass --csv > $OUT/${NAME}_sass.csv 2>&1
fi
NCU_NAME=$NAME python3 - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/" + os.environ.get("NCU_NAME", "mma") + "_raw.csv")))
head = rows[0]; data = [r for r in rows[2:] if len(r) == len(head)]
col = {h: i for i, h in enumerate(head)}
want = ["gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__warps_active.avg.pct_of_peak_sustained_active",
        "launch__registers_per_thread", "launch__occupancy_limit_registers", "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "l1tex__t_sector_hit_rate.pct", "lts__t_sector_hit_rate.pct", "smsp__average_warp_latency_per_inst_issued.ratio",
        "lts__t_bytes.sum", "dram__bytes_read.sum", "l1tex__t_bytes.sum"]
for r in data:
    name = r[col["Kernel Name"]][:40]
    print(name, " ".join(f"{w.split('.')[0].split('__')[1][:22]}={r[col[w]]}" for w in want if w in col))
    stalls = [(h, r[i]) for h, i in col.items() if h.startswith("smsp__average_warps_issue_stalled_") and h.endswith("_per_issue_active.ratio")]
    vals = []
    for h, v in stalls:
        try: vals.append((float(v), h.replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", "")))
        except ValueError: pass
    vals.sort(reverse=True)
    print("   stalls/issue:", ", ".join(f"{n} {v:.2f}" for v, n in vals[:8]))
PY
