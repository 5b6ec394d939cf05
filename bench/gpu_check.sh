#!/usr/bin/env bash
# GPU checklist (issue 30): the benchmark sections of bench/gpu_check.py (speculation and
# piecewise graphs too), the GPU tests, then the skinny matmul sweep and block-FP8
# checkpoints served as float8 (bench/gpu_fp8_blocks.py).
# Usage: bash bench/gpu_check.sh [OUTDIR]   (default bench/results); CHECK_S bounds
# gpu_check.py in seconds (default 300), TESTS_S the tests (default: what is left of BUDGET_S
# = 570 s, one 10-minute device call, less 130 s for the sweeps, 240 at most). Wheels for
# what the machine lacks: `bash bench/gpu_wheels.sh` here puts them in .whl/ (and CI's test
# references in .whl/ref/).
set -u
cd "$(dirname "$0")/.."
out=${1:-bench/results}
mkdir -p "$out"
install() {  # wheels dir, target
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$2" "$1"/*.whl
}
if ls .whl/*.whl >/dev/null 2>&1; then
  install .whl /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
if ls .whl/ref/*.whl >/dev/null 2>&1 && install .whl/ref /tmp/ref \
    && PYTHONPATH=/tmp/ref:${PYTHONPATH:-} python3 -c "import transformers, xgrammar, torch"; then
  export PYTHONPATH=/tmp/ref:${PYTHONPATH:-}
else
  echo "no usable reference wheels in .whl/ref: the machine's own transformers"
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
  triton.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())")
stamp=$(date -u +%Y-%m-%d)
# CHECK_S bounds the benchmark sections (default 300 s); their JSON is rewritten after each
# section, so a cut run keeps what finished, and its log is kept beside it
timeout "${CHECK_S:-300}" python3 bench/gpu_check.py --out "$out/gpu-$card-$stamp.json" \
  ${QUICK:+--quick} 2>&1 | tee "$out/gpu-check-$card-$stamp.log" | tail -c 6000
# the tests next (the last run's failures and what no GPU has run first): what is left of BUDGET_S (default 570 s: one 10-minute device call) less
# 130 s for the two sweeps after them, 240 s at most, unless TESTS_S says otherwise
left=$(( ${BUDGET_S:-570} - SECONDS - 130 ))
tests_s=${TESTS_S:-$(( left < 240 ? (left < 30 ? 30 : left) : 240 ))}
echo "tests bounded at ${tests_s} s (${SECONDS} s spent)"
# SIGINT at the bound: pytest still names the failures so far (a plain kill printed only dots)
timeout -s INT -k 20 "$tests_s" python3 -m pytest -q --maxfail=60 -rf --tb=short -p no:cacheprovider --timeout 120 \
  tests/models/test_state_models.py tests/engine/test_kv_disk_tier.py tests/engine/test_kv_host_tier.py \
  tests/engine/test_kv_transfer.py \
  tests/attention/test_triton_attention.py tests/layers/test_triton_ops.py tests/worker/test_piecewise_graphs.py tests/layers/test_fused_moe.py tests/worker/test_platforms.py tests/quantization/test_triton_kernels.py \
  tests/lora/test_lora_triton.py::test_kernels_equal_the_reference \
  tests/quantization/test_fp8_blocks.py tests/quantization/test_quantized_models.py::test_quantize_tool_round_trip \
  tests/models/test_models.py tests/engine/test_engine_equivalence.py \
  tests/attention/test_attention.py tests/models/test_moe.py tests/attention/test_mla.py tests/sample/test_sampling.py tests/spec_decode/test_spec_decode.py tests/worker/test_async_scheduling.py \
  tests/spec_decode/test_spec_decode_eagle.py::test_eagle_beside_decode_graphs tests/spec_decode/test_spec_decode_mtp.py::test_mtp_in_cuda_graph_buckets \
  tests/spec_decode/test_spec_decode_eagle3.py::test_eagle3_in_cuda_graph_buckets \
  2>&1 | tee "$out/gpu-tests-$card-$stamp.log" | grep -vE '^\s*$' | tail -40
# evidence for what is off by default: the skinny matmul, block-FP8 kept as float8
timeout 40 python3 bench/gemv_sweep.py --out "$out/gemv-sweep-$card-$stamp.json"
left=$(( ${BUDGET_S:-570} - SECONDS ))
timeout $(( left < 90 ? (left < 20 ? 20 : left) : 90 )) python3 bench/gpu_fp8_blocks.py \
  --out "$out/gpu-fp8-blocks-$card-$stamp.json"
