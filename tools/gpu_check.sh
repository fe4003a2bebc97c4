#!/usr/bin/env bash
# Run on the lent GPU machine (through the device tool): the whole test suite on its
# torch/jax versions, plus AdamW's, small_fc_lopt's and VeLO's parity on the GPU
# (torch on CUDA; jax takes the GPU by default). Logs land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
python3 -c "import sys, torch, jax, optax, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'jax', jax.__version__, 'optax', optax.__version__, 'numpy', numpy.__version__, jax.devices())" | tee -a "$OUT/device.txt"
python3 -m pytest tests parity_tests -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -40
python3 -m xopt parity adamw --device cuda --backends torch,oracle,original --quiet \
  --json "$OUT/parity_cuda.json" 2>&1 | tee "$OUT/parity_cuda.txt" | tail -30
for m in small_fc_lopt velo; do
  python3 -m xopt parity $m --device cuda --backends torch,jax,oracle --quiet \
    --json "$OUT/parity_${m}_cuda.json" 2>&1 | tee "$OUT/parity_${m}_cuda.txt" | tail -14
done
# the Triton learned-optimizer kernels: their tests on CUDA, parity with --impl triton, and
# the step benchmark (bench/lopt_step.py; results go to bench/RESULTS.md by hand)
python3 -m pytest tests/test_kernels_lopt.py -q -rs -p no:cacheprovider 2>&1 \
  | tee "$OUT/pytest_kernels.log" | tail -20
for m in small_fc_lopt velo; do
  python3 -m xopt parity $m --impl triton --device cuda --backends torch,oracle --quiet \
    --json "$OUT/parity_${m}_triton.json" 2>&1 | tee "$OUT/parity_${m}_triton.txt" | tail -8
done
python3 bench/lopt_step.py --out "$OUT/lopt_step.json" 2>&1 | tee "$OUT/lopt_step.log" | tail -40
# the low-rank methods, CompAct and POET-X on CUDA (torch on the GPU, jax on the GPU)
for m in galore flora coap compact poet; do
  python3 -m xopt parity $m --device cuda --quiet \
    --json "$OUT/parity_${m}_cuda.json" 2>&1 | tee "$OUT/parity_${m}_cuda.txt" | tail -4
done
