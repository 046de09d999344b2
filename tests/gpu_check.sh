#!/usr/bin/env bash
# The GPU path in one go, on a machine with a GPU (CI has none): 480 s at most (the step limits).
#     bash tests/gpu_check.sh OUT_FOLDER        (PYTHON=python3 where `python` is not on PATH)
# Writes seven small text files to OUT_FOLDER and nothing else (run folders go to a temporary
# folder outside it): nvidia-smi.txt; test_cuda.txt (tests/test_cuda.py, 210 s, time for a cold
# torch.compile); benchmark-8.txt and benchmark-64.txt (tests/benchmark.py --cuda --no-bounds at
# 8 and 64 envs: sync and async, fp32 and bf16, steady-state steps/s of whole training runs,
# each row printed as it finishes, so a step stopped at its limit keeps the rows it measured);
# workers.txt (each async env worker's memory); and summary.txt (each step's exit code and
# seconds, and each figure labelled with what it measured). Each step has a time limit, so one
# that hangs costs its limit, not the whole check. On the first H200 lent, one benchmark row
# with its two bound runs took over 45 s, as each process takes long to start (tests/gpu/).
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
bench="tests/benchmark.py --cuda --no-bounds --rounds 1 --iterations 4"
bench="$bench --configs sync,sync+bf16,async,async+bf16"
for n in 8 64; do
    step benchmark-$n $((n == 8 ? 100 : 130)) "$py" $bench --num-envs $n
    echo "steps/s of whole training runs (ppo_atari.py, Breakout, $n envs, 4 iterations of" \
         "$((n * 128)) steps, the first not counted), by config:" >> "$out/summary.txt"
    grep -h "^# round" "$out/benchmark-$n.txt" >> "$out/summary.txt"
done
step workers 30 "$py" tests/benchmark.py --worker-memory --num-envs 4
echo "memory of each async env worker (a process that imports torch):" >> "$out/summary.txt"
grep -h "^worker" "$out/workers.txt" | head -1 >> "$out/summary.txt"
cat "$out/summary.txt"
