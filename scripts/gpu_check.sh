#!/usr/bin/env bash
# selfspec's GPU check in one run (docs/gpu.md), from the repository root on the GPU machine:
#   scripts/gpu_check.sh            # writes $OUT (or out/gpu): gpu_check.md, gpu_check.json, ...
# It needs the model parts in gpu_parts/ (selfspec models pack smollm2-135m-instruct
# --part-mib 48 --out gpu_parts) and python with torch (CUDA), transformers, gguf, accelerate.
# No network. Bounded to about 7.5 minutes: the cuda-marked tests (60 s at most), then
# scripts/gpu_check.py (stops starting work after 390 s, killed at 420 s).
set -u
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export SELFSPEC_HOME="${SELFSPEC_HOME:-$PWD/gpu_work/home}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__)" 2>&1
} > "$OUT/environment.txt"
timeout 60 python -m pytest -q -p no:cacheprovider -m cuda tests/executor/test_gpu.py \
  > "$OUT/pytest-cuda.txt" 2>&1 || echo "cuda tests: exit $?" >> "$OUT/pytest-cuda.txt"
timeout 420 python scripts/gpu_check.py --out "$OUT" --parts gpu_parts \
  --model-dir gpu_work/smollm2 --budget-s 390 "$@"
status=$?
echo "gpu_check.py exit $status" >> "$OUT/environment.txt"
exit $status
