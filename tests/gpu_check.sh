#!/usr/bin/env bash
# The GPU path in one go, on a machine with a GPU (CI has none): 475 s at most (the step limits).
#     bash tests/gpu_check.sh OUT_FOLDER
# Writes to OUT_FOLDER: nvidia-smi.txt, test_cuda.txt (the CUDA tests), benchmark-8.txt and
# benchmark-64.txt (tests/benchmark.py --cuda at 8 and 64 envs: sync and async, fp32 and bf16),
# breakout-3min.txt (a default Breakout run stopped by SIGTERM after 3 minutes, with its SPS
# lines), and summary.txt (each step's exit code and seconds). Each step has a time limit, so
# one that hangs costs its limit, not the whole check.
set -u
out=${1:?usage: bash tests/gpu_check.sh OUT_FOLDER}
cd "$(dirname "$0")/.."
command -v nvidia-smi > /dev/null || { echo "error: no nvidia-smi here: this check needs a machine with an NVIDIA GPU" >&2; exit 2; }
mkdir -p "$out"
py=${PYTHON:-python}
step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND into OUT/NAME.txt within LIMIT_S seconds
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout --signal TERM --kill-after 15 "$limit" "$@" > "$out/$name.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s (limit $limit s)" | tee -a "$out/summary.txt"
}
: > "$out/summary.txt"
step nvidia-smi 15 nvidia-smi
step test_cuda 110 "$py" -m pytest tests/test_cuda.py -v -rs -p no:cacheprovider
bench="tests/benchmark.py --cuda --rounds 1 --iterations 4 --configs sync,async,sync+bf16,async+bf16"
step benchmark-8 70 "$py" $bench --num-envs 8
step benchmark-64 95 "$py" $bench --num-envs 64
mkdir -p "$out/breakout"
step breakout-3min 185 bash -c "cd '$out/breakout' && timeout --signal TERM 175 '$py' \
    '$PWD/ppo_atari.py' --env-id BreakoutNoFrameskip-v4 --run-name gpu-3min; true"
grep -h "SPS" "$out/breakout-3min.txt" | tail -1 | tee -a "$out/summary.txt"
