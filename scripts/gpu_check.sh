#!/usr/bin/env bash
# The CUDA/NCCL checks and GPU timings, in one run on a machine with one NVIDIA GPU (CI has none).
# Every step is bounded; the logs go to $OUT (or ./gpu-check): bash scripts/gpu_check.sh
# ONLY=NAME[,NAME...] runs just those steps (the whole script takes longer than one 600 s device call):
#   ONLY=refresh-pieces bash scripts/gpu_check.sh
set -u
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
step() {  # step NAME SECONDS CMD...: one bounded check, its log in $OUT/NAME.log, its exit status on one line
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 0; fi
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-6}" "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
ONE="--set pipeline.stages=1 --nproc-per-node 1"
# one NCCL worker on the GPU: each optimizer, K-FAC every step, bf16
step first-order 120 $PY -m pipefisher train --config configs/small.yaml $ONE --steps 30 --eval-every 10
step muon 120 $PY -m pipefisher train --config configs/small.yaml $ONE --steps 30 --set optim.name=muon
step kfac 120 $PY -m pipefisher train --config configs/small.yaml $ONE --steps 30 --mode kfac
step kfac-bf16 120 $PY -m pipefisher train --config configs/small.yaml $ONE --steps 30 --mode kfac \
  --set train.precision=bf16
step muon-kfac-bf16 120 $PY -m pipefisher train --config configs/small.yaml $ONE --steps 30 --mode kfac \
  --set optim.name=muon --set train.precision=bf16
# two workers on one GPU: NCCL cannot put two ranks on one device; what does the user see?
step two-ranks-one-gpu 120 $PY -m pipefisher train --config configs/tiny.yaml --nproc-per-node 2 --steps 5
# step time and peak memory, fp32/bf16 x recompute, BERT-Base on one GPU (docs/real-training.md)
TAIL=8 step compute-bert-base 240 $PY scripts/bench_compute.py --config configs/bert-base.yaml --stages 1 \
  --mode kfac --steps 12
# the whole curvature refresh against it in pieces, 1024- and 4096-wide factors (docs/benchmarks.md, "A refresh
# in pieces"): seconds on one GPU
TAIL=13 step refresh-pieces 90 $PY scripts/bench_refresh.py --device cuda --sizes 1024,4096 --pieces 2,4,8,16 --repeat 5
