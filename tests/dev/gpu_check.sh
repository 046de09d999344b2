#!/usr/bin/env bash
# The GPU path in one go, on a machine with a GPU (CI has none): 520 s at most (the step limits).
#     bash tests/dev/gpu_check.sh OUT_FOLDER [CLEANRL_FOLDER]   (PYTHON=python3 where `python` is not
#                                                             on PATH)
# CLEANRL_FOLDER: CleanRL's ppo_atari.py with its cleanrl_utils/ (default ../shared/anchors/cleanrl).
# Writes seven small text files to OUT_FOLDER and nothing else (run folders go to a temporary
# folder outside it): nvidia-smi.txt; test_cuda.txt (tests/test_cuda.py, time for a cold
# torch.compile); phases.txt and phases-compile.txt (tests/dev/phases.py --cuda at 8 envs, sync and
# async, eager and --compile: where each vector step's time goes); versus-cleanrl.txt (ours and
# CleanRL's file, default flags, the same budget, one after the other: whole-process wall time and
# steps/s over the same iterations); breakout.txt (a default `python ppo_atari.py --env-id
# BreakoutNoFrameskip-v4` run stopped by SIGTERM: its progress lines, checkpoint and continue
# line); and summary.txt (each step's exit code and seconds, and each figure labelled). Each step
# has a time limit, so one that hangs costs its limit, not the whole check.
# DRY_RUN=1 runs the same steps on a machine without a GPU (no --cuda, no nvidia-smi): the
# script's plumbing checked on the CPU before a GPU call is spent on it (4 iterations a file).
set -u
out=${1:?usage: bash tests/dev/gpu_check.sh OUT_FOLDER [CLEANRL_FOLDER]}
cd "$(dirname "$0")/../.."
cleanrl=${2:-../shared/anchors/cleanrl}
dry=${DRY_RUN:-}
cuda=--cuda iterations=30  # versus CleanRL: 30 x 1,024 steps each (CleanRL's ~600 steps/s: ~50 s)
if [ -n "$dry" ]; then cuda= iterations=4; else
    command -v nvidia-smi > /dev/null || { echo "error: no nvidia-smi here: this check needs a machine with an NVIDIA GPU (DRY_RUN=1 runs it without one)" >&2; exit 2; }
fi
[ -f "$cleanrl/ppo_atari.py" ] || { echo "error: no CleanRL ppo_atari.py in $cleanrl; give its folder as the second argument" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
cleanrl=$(cd "$cleanrl" && pwd)
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
label() {  # label TEXT FILE PATTERN: TEXT, then FILE's lines matching PATTERN, into summary.txt
    { echo "$1"; grep -h -E "$3" "$out/$2" 2>/dev/null || echo "(none: see $2)"; } >> "$out/summary.txt"
}
: > "$out/summary.txt"
[ -n "$dry" ] && echo "DRY RUN on the CPU: no figure here is a GPU's" | tee -a "$out/summary.txt"
[ -z "$dry" ] && step nvidia-smi 10 nvidia-smi
"$py" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" \
    | tee -a "$out/summary.txt"
step test_cuda 170 "$py" -m pytest tests/test_cuda.py -v -rs -p no:cacheprovider -n 4 \
    --basetemp "$runs/pytest"
label "tests/test_cuda.py:" test_cuda.txt "passed|failed|skipped"
phases="tests/dev/phases.py $cuda --num-envs 8 --iterations 3 --backends sync,async"
step phases 60 "$py" $phases
step phases-compile 110 "$py" $phases --compile
label "where a vector step's time goes, ms (tests/dev/phases.py $cuda, 8 envs, eager):" phases.txt "^[|#]"
label "the same with --compile:" phases-compile.txt "^[|#]"
step versus-cleanrl 110 "$py" tests/dev/versus_cleanrl.py "$cleanrl" --iterations $iterations
label "ours beside CleanRL's ppo_atari.py, default flags, $iterations iterations each, one call:" \
    versus-cleanrl.txt "^[|#]"
step breakout 70 bash -c "cd '$runs' && exec timeout --signal TERM 60 '$py' '$PWD/ppo_atari.py' \
    --env-id BreakoutNoFrameskip-v4 --run-name gpu-check"
label "a default Breakout run, SIGTERM at 60 s (SPS counted from the end of its first iteration):" \
    breakout.txt "^step|device|stopped|resume"
cat "$out/summary.txt"
