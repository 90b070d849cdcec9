#!/usr/bin/env bash
# The prepared GPU check (issue 30), run from the repository root on a machine with a CUDA torch
# (or give the root as $1); logs and JSON go to $OUT (default benchmarks/results/gpu_check/).
# Each part has its own timeout, so what finished comes back:
#   1. pytest -m cuda (CUDA tests; each has a CPU twin in the normal suite);
#   2. the README's main job on the GPU (digits, built-in CNN, bf16), beside 1, eager and
#      with --compile (the steps under torch.compile, inductor);
#   3. a CPU smoke subset of the suite on this machine's torch (the declared floor is tested);
#   4. benchmarks/latency_prediction.py on the GPU (issue 32, point 3): the latency table's
#      prediction against the shrunk model timed whole, bf16, batch 32, as CUDA graphs (eager
#      BERT-base at batch 32 is launch-bound: every target was refused there, 2026-11-30);
#   5. benchmarks/gpu_profile.py: where a masked step's time goes (off unless PROFILE_MODELS);
#   6. benchmarks/gpu.py per standard network: overhead, memory, host syncs, throughput,
#      latency, and (a) and (b) with the forward under torch.compile (masks.compiled); last,
#      if time is left, an LSTM's (its units gathered step by step, against cuDNN's kernel).
# GPU_SPECS="model:seconds:flag,flag:tag ..." chooses the gpu.py runs; LATENCY_MODELS the
# latency_prediction ones (empty: skipped), LATENCY_FORMS / LATENCY_TARGETS / LATENCY_BATCH its
# forms, targets and batch; PROFILE_MODELS the profiled ones (empty: skipped); T_* the limits.
# T_ALL (default 570 s) bounds the whole script, so that it fits one 600 s device command: a
# part gets what is left of it when that is less than its own limit, and is skipped with under
# 30 s left.
# $OUT holds all.log, logs.tgz (every part's own log, packed after each part: a device
# command brings back at most 8 files) and each part's JSON.
# DRY=1 rehearses it on a machine with no GPU (about 3 minutes on 2 cores): every part runs as
# it would on the device, on the CPU at check sizes (gpu.py --quick, latency_prediction on
# MobileNetV3 in the compile form), into $OUT (default /tmp/gpu_check_dry), so that a part that
# broke is found before device time is spent on it. PY names the Python (default python3).
set -u
cd "${1:-.}" || exit 1
PY=${PY:-python3}
# a path as given is made absolute: the main jobs run from a folder of their own
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac
if [ "${DRY:-0}" = 1 ]; then
  OUT=${OUT:-/tmp/gpu_check_dry} DEVICE=cpu LATENCY_DEVICE=cpu LATENCY_DTYPE=float32 QUICK=--quick
  LATENCY_FORMS=${LATENCY_FORMS-compile} LATENCY_MODELS=${LATENCY_MODELS-mobilenet_v3}
  LATENCY_BATCH=${LATENCY_BATCH:-8} LATENCY_TARGETS=${LATENCY_TARGETS:-90%}
  GPU_SPECS=${GPU_SPECS-bert_base:200:--compiled-steps:bert resnet50:180:--compiled-steps:resnet50 lstm:60::lstm}
fi
OUT=${OUT:-benchmarks/results/gpu_check}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
log=$OUT/all.log
logs=$(mktemp -d)
start=$SECONDS
say() { echo "$@" | tee -a "$log"; }
pack() { tar -czf "$OUT/logs.tgz.part" -C "$logs" . && mv -f "$OUT/logs.tgz.part" "$OUT/logs.tgz"; }
# the part's limit $1, cut to what is left of T_ALL (10 s kept for packing the logs)
limit() {
  local t=$1 left=$(( ${T_ALL:-570} - (SECONDS - start) - 10 ))
  [ "$left" -lt "$t" ] && t=$left
  echo "$t"
}
enough() { [ "$1" -ge 30 ] || { say "skipped $2: $1 s left of T_ALL"; false; }; }
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
else
  say "no nvidia-smi here"
fi
"$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)" | tee -a "$log"
run=$(mktemp -d)
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  t0=$SECONDS  # the main job runs beside the CUDA tests (both small: correctness, not timing)
  tm=$(limit "${T_MAIN:-150}")
  (cd "$run" && timeout "$tm" "$PY" -m fisherprune train --precision bf16 --save_dir main >"$logs/main_job.log" 2>&1; echo "main job rc=$? $((SECONDS - t0))s" >>"$logs/main_job.log") &
  tc=$(limit "${T_MAIN_COMPILED:-180}")
  (cd "$run" && timeout "$tc" "$PY" -m fisherprune train --precision bf16 --compile --save_dir main_compiled >"$logs/main_job_compiled.log" 2>&1; echo "main job --compile rc=$? $((SECONDS - t0))s" >>"$logs/main_job_compiled.log") &
  timeout "$(limit "${T_TESTS:-130}")" "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py tests/test_recurrent.py >"$logs/cuda_tests.log" 2>&1
  say "pytest -m cuda rc=$? $((SECONDS - t0))s"; tail -n 25 "$logs/cuda_tests.log" | tee -a "$log"; pack
  if [ "${SKIP_SMOKE:-0}" != 1 ] && t=$(limit "${T_SMOKE:-100}") && enough "$t" "the CPU smoke subset"; then
    t0=$SECONDS
    CUDA_VISIBLE_DEVICES= timeout "$t" "$PY" -m pytest -q -x -p no:cacheprovider -n 8 \
      tests/test_signals.py tests/test_masks.py tests/test_apply_masks.py tests/test_cost.py \
      tests/test_device_independence.py tests/test_cuda.py tests/test_prune.py tests/test_optimizer.py \
      >"$logs/smoke_cpu.log" 2>&1
    rc=$?; say "CPU smoke subset on $("$PY" -c 'import torch; print(torch.__version__)') rc=$rc $((SECONDS - t0))s"
    tail -n 4 "$logs/smoke_cpu.log" | tee -a "$log"
  fi
  wait
  for job in main_job main_job_compiled; do
    say "$(tail -n 1 "$logs/$job.log")"; grep -iE "warning|^dense|^pruned|error|step 700|^fisherprune train: digits" "$logs/$job.log" | head -8 | cut -c1-400 | tee -a "$log"
  done
  pack
fi
for form in ${LATENCY_FORMS-cuda_graphs}; do
  [ -n "${LATENCY_MODELS-bert_base resnet50}" ] || break
  t=$(limit "${T_LATENCY:-170}"); enough "$t" "latency_prediction $form" || continue
  t0=$SECONDS  # --threads: the trace and the shrinks run on the CPU at batch 32 (no CPU timing here)
  timeout "$t" "$PY" benchmarks/latency_prediction.py --models ${LATENCY_MODELS-bert_base resnet50} \
    --device "${LATENCY_DEVICE:-cuda:0}" --dtype "${LATENCY_DTYPE:-bfloat16}" \
    --batch "${LATENCY_BATCH:-32}" --checks 0 --rounds 5 \
    --form "$form" --targets ${LATENCY_TARGETS:-75% 50%} \
    --threads "${LATENCY_THREADS:-$(nproc)}" \
    --out "$OUT/latency_prediction_$form.json" >"$logs/latency_prediction_$form.log" 2>&1
  say "== latency_prediction $form rc=$? $((SECONDS - t0))s"; tail -n 8 "$logs/latency_prediction_$form.log" | tee -a "$log"; pack
done
if [ -n "${PROFILE_MODELS-}" ] && t=$(limit "${T_PROFILE:-150}") && enough "$t" profile; then
  t0=$SECONDS
  timeout "$t" "$PY" benchmarks/gpu_profile.py --device "${DEVICE:-cuda}" ${QUICK:-} --models ${PROFILE_MODELS-} --out "$OUT/gpu_profile.json" >"$logs/gpu_profile.log" 2>&1
  say "== profile rc=$? $((SECONDS - t0))s"; tee -a "$log" <"$logs/gpu_profile.log"; pack
fi
for spec in ${GPU_SPECS-bert_base:260:--no-compile,--compiled-steps:bert resnet50:120:--no-compile,--compiled-steps:resnet50 lstm:90:--no-compile:lstm}; do
  IFS=: read -r m t c tag <<<"$spec"; t0=$SECONDS; c=${c//,/ }
  t=$(limit "$t"); enough "$t" "gpu.py $tag" || continue
  # shellcheck disable=SC2086  # $c: the flags, split
  timeout "$t" "$PY" benchmarks/gpu.py --models "$m" $c ${QUICK:-} --device "${DEVICE:-cuda}" --out "$OUT/gpu_$tag.json" >"$logs/gpu_$tag.log" 2>&1
  say "== $tag rc=$? $((SECONDS - t0))s"; tail -n 30 "$logs/gpu_$tag.log" | tee -a "$log"; pack
done
say "gpu_check done in $((SECONDS - start))s"
