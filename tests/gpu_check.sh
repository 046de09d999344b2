#!/usr/bin/env bash
# The GPU path in one go, on a machine with a GPU (CI has none): 480 s at most (the step limits).
#     bash tests/gpu_check.sh OUT_FOLDER        (PYTHON=python3 where `python` is not on PATH)
# Writes six small text files to OUT_FOLDER and nothing else (run folders go to a temporary
# folder outside it): nvidia-smi.txt; test_cuda.txt (tests/test_cuda.py, 210 s, time for a cold
# torch.compile); benchmark-8.txt and benchmark-64.txt (tests/benchmark.py --cuda at 8 and 64
# envs: sync and async, fp32 and bf16, steady-state steps/s of the whole training loop);
# breakout.txt (a default Breakout run stopped by SIGTERM after 85 s, with its SPS lines); and
# summary.txt (each step's exit code and seconds, and each figure labelled with what it measured).
# Each step has a time limit, so one that hangs costs its limit, not the whole check.
set -u
out=${1:?usage: bash tests/gpu_check.sh OUT_FOLDER}
cd "$(dirname "$0")/.."
command -v nvidia-smi > /dev/null || { echo "error: no nvidia-smi here: this check needs a machine with an NVIDIA GPU" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python}
command -v "$py" > /dev/null || py=python3
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND into OUT/NAME.txt within LIMIT_S seconds
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout --signal TERM --kill-after 10 "$limit" "$@" > "$out/$name.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s (limit $limit s)" | tee -a "$out/summary.txt"
}
: > "$out/summary.txt"
step nvidia-smi 10 nvidia-smi
"$py" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" \
    | tee -a "$out/summary.txt"
step test_cuda 210 "$py" -m pytest tests/test_cuda.py -v -rs -p no:cacheprovider -n 4 \
    --basetemp "$runs/pytest"
bench="tests/benchmark.py --cuda --rounds 1 --iterations 4 --configs sync,async,sync+bf16,async+bf16"
for n in 8 64; do
    step benchmark-$n $((n == 8 ? 65 : 95)) "$py" $bench --num-envs $n
    echo "steps/s of the whole training loop, Breakout, $n envs, 1 round of 4 iterations" \
         "(config | SPS):" >> "$out/summary.txt"
    grep -E "^\| (sync|async)" "$out/benchmark-$n.txt" | cut -d"|" -f2,3 >> "$out/summary.txt"
done
mkdir -p "$runs/breakout"
step breakout 100 bash -c "cd '$runs/breakout' && timeout --signal TERM 85 '$py' \
    '$PWD/ppo_atari.py' --env-id BreakoutNoFrameskip-v4 --run-name gpu-check; true"
echo "last progress line of a default Breakout run (python ppo_atari.py --env-id" \
     "BreakoutNoFrameskip-v4) stopped at 85 s; SPS counts from the end of its first iteration:" \
     >> "$out/summary.txt"
grep -h "SPS" "$out/breakout.txt" | tail -1 >> "$out/summary.txt"
cat "$out/summary.txt"
