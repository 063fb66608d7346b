#!/usr/bin/env bash
# The GPU benchmarks of `make bench-gpu`, shaped for a lent GPU machine's short calls (at most
# 10 minutes each, 15 in all): each step runs under its own time limit, and a failure or a
# timeout ends that step alone (its log, at the end of bench.log, says why), so one broken
# benchmark no longer loses the ones after it. CSVs and bench.log go to OUT; the status is 1 if
# any step failed or timed out.
#
# usage: gpu_benchmarks.sh OUT [STEP ...]   steps, in the default order (least measured first):
#   optimizer         fused SGD/LARS against torch's, float32 and bfloat16        (about 1 min)
#   training-eager    ResNet-50 steps, batch 256, bf16, channels_last, eager       (about 1 min)
#   batchnorm         local BatchNorm against cuDNN and ghost BN, bfloat16         (about 2 min)
#   training-compile  the same steps under torch.compile (two cold compiles)      (2-4 min)
#   batchnorm-fp32    the BatchNorm benchmark in float32                           (about 2 min)
#   allreduce         four ranks sharing the GPU as 2x2 over Gloo's CUDA engine    (1-2 min)
set -u
out=${1:?usage: gpu_benchmarks.sh OUT [STEP ...]}
shift
all_steps=(optimizer training-eager batchnorm training-compile batchnorm-fp32 allreduce)
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=("${all_steps[@]}")
for name in "${steps[@]}"; do  # before any runs: a misspelt step costs no device time
  [[ " ${all_steps[*]} " == *" $name "* ]] \
    || { echo "gpu_benchmarks.sh: no step $name (steps: ${all_steps[*]})" >&2; exit 2; }
done
mkdir -p "$out"
: > "$out/bench.log"  # this run's alone, on a warm machine's second call too
python=${PYTHON:-python3}

# step NAME SECONDS COMMAND...: COMMAND under `timeout` (its whole process group killed 10 s
# after SIGTERM), its output appended to bench.log and shown.
failed=()
step() {
  local name=$1 seconds=$2 start=$SECONDS
  shift 2
  echo "== $name (at most $seconds s): $*" | tee -a "$out/bench.log"
  timeout -k 10 "$seconds" "$@" 2>&1 | tee -a "$out/bench.log"
  local status=${PIPESTATUS[0]}
  echo "== $name: exit $status after $((SECONDS - start)) s$( [ "$status" = 124 ] \
    || [ "$status" = 137 ] && echo ', timed out')" | tee -a "$out/bench.log"
  [ "$status" = 0 ] || failed+=("$name")
}

for name in "${steps[@]}"; do
  case $name in
    optimizer)
      for dtype in float32 bfloat16; do
        step "optimizer-$dtype" 90 "$python" benchmarks/bench_optimizer.py --device cuda \
          --dtype "$dtype" --csv "$out/optimizer_$dtype.csv"
      done ;;
    training-eager)
      step "$name" 150 "$python" benchmarks/bench_training.py --device cuda --modes eager \
        --csv "$out/training_eager.csv" ;;
    training-compile)
      step "$name" 330 "$python" benchmarks/bench_training.py --device cuda --modes compile \
        --csv "$out/training_compile.csv" ;;
    batchnorm)
      step "$name" 200 "$python" benchmarks/bench_batchnorm.py --device cuda --dtype bfloat16 \
        --min-run-time 1 --csv "$out/batchnorm_bfloat16.csv" ;;
    batchnorm-fp32)
      step "$name" 200 "$python" benchmarks/bench_batchnorm.py --device cuda --dtype float32 \
        --min-run-time 1 --csv "$out/batchnorm_float32.csv" ;;
    allreduce)
      step "$name" 200 "$python" benchmarks/bench_allreduce.py --device cuda --shapes 2x2 \
        --rounds 3 --csv "$out/allreduce_cuda.csv" ;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_benchmarks.sh: failed or timed out: ${failed[*]} (bench.log)"
  exit 1
fi
