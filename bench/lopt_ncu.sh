#!/bin/bash
# Nsight Compute on the learned-optimizer kernels (ViT-B/16's shapes, the third eager step),
# then the Triton path's golden-trace parity on the GPU. Run from the repository root on
# the device; writes its reports' text pages under $OUT.
#   bash bench/lopt_ncu.sh
export PYTHONUNBUFFERED=1 XOPT_VELO_COMPILE_GLUE=0
cd "$(dirname "$0")/.."
git log -1 --format=%h 2>/dev/null; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv; ncu --version | tail -1
N="ncu --clock-control none --set full --import-source no"
R=/tmp/ncu; mkdir -p $R
timeout 200 $N -k regex:'sfc_fold_(fused|stats)|stats1_kernel' --launch-skip 6 --launch-count 3 -o $R/sfc -f \
  python3 bench/lopt_ncu.py --method small_fc_lopt > $OUT/sfc_run.txt 2>&1; echo sfc rc $?
ncu --import $R/sfc.ncu-rep --page details > $OUT/sfc_details.txt 2>&1
ncu --import $R/sfc.ncu-rep --page source --csv --print-source sass -k regex:sfc_fold_fused > $OUT/sfc_sass.csv 2>&1; echo src rc $?
timeout 200 $N -k regex:'velo_(stats|fused)_kernel' --launch-skip 8 --launch-count 4 -o $R/velo -f \
  python3 bench/lopt_ncu.py --method velo > $OUT/velo_run.txt 2>&1; echo velo rc $?
ncu --import $R/velo.ncu-rep --page details > $OUT/velo_details.txt 2>&1
ncu --import $R/velo.ncu-rep --page source --csv --print-source sass -k regex:velo_fused > $OUT/velo_sass.csv 2>&1
unset XOPT_VELO_COMPILE_GLUE
for m in small_fc_lopt velo; do timeout 150 python3 -m xopt parity $m --impl triton --device cuda --backends torch --quiet; echo parity $m rc $?; done > $OUT/parity.txt 2>&1
ls -la $OUT; tail -5 $OUT/parity.txt
