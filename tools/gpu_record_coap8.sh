#!/usr/bin/env bash
# Run on the lent GPU machine (through the device tool): record COAP's 8-bit traces with
# bitsandbytes' CUDA kernel from the authors' CoapAdamW8bit (tools/record_coap_conv.py),
# then replay them (teacher-forced and closed loop, torch/jax/oracle on the CPU side of the
# comparison) and print the table. The machine has no network: carry, in the repository
# root, an ignored folder .gpu_carry with site/ (bitsandbytes 0.50.2 and tensorly 0.10.0
# unpacked from their wheels, keeping only bitsandbytes' CUDA 13.0 library so that the
# carry stays under the device's size limit) and coap_src/coap_torch (an export of
# bytedance/coap at deabc3a; never committed).
# The trace lands in $OUT/coap; the H200's is kept in tests/fixtures/parity/coap/.
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/coap"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
PYTHONPATH=.gpu_carry/site:.gpu_carry/coap_src:$PWD python3 tools/record_coap_conv.py --bits 8 \
  --device cuda "$OUT/coap" 2>&1 | grep -v "kernels-community" | tail -3
for t in "$OUT"/coap/conv_8bit_cuda_*.json; do
  PYTHONPATH=$PWD python3 -m xopt parity coap --trace "$t" --backends torch,jax,oracle \
    2>&1 | tee "$OUT/parity_$(basename "$t" .json).txt" | tail -12
done
