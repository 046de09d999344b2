"""ppo_atari.py beside CleanRL's ppo_atari.py, the same game and budget, one after the other in
one call (not collected by pytest; CleanRL's file is not part of this project):

    python tests/dev/versus_cleanrl.py ../shared/anchors/cleanrl                  # CPU, 10 iterations
    python tests/dev/versus_cleanrl.py ../shared/anchors/cleanrl --iterations 40 --rounds 2

CLEANRL is the folder holding CleanRL's `ppo_atari.py` and the `cleanrl_utils/` it imports. Both
files run with their default flags (8 envs x 128 steps, 4 epochs x 4 minibatches; each picks
CUDA when there is one) for --iterations x 1,024 steps, each in a fresh process and a folder of
its own; --rounds passes, every other one in the other order. Two figures each:
- whole-process wall time: from the launch to the exit, start-up and first iteration included;
- steps/s over the same window: from the end of iteration --skip to the end of the last, read
  from the wall times of each iteration's `charts/learning_rate` event (both files log it once
  an iteration, after the update), so both are measured by one definition.
and the ratio ours / CleanRL's of each, per round and as the median.
"""
import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 8 * 128  # both files' default batch


def iteration_ends(run_folder: str) -> list[tuple[int, float]]:
    """(global step, wall time) at the end of each iteration, from the events as written."""
    from tensorboard.backend.event_processing import event_file_loader

    ends = {}
    for path in sorted(glob.glob(os.path.join(run_folder, "**", "events.out.tfevents.*"),
                                 recursive=True)):
        for event in event_file_loader.EventFileLoader(path).Load():
            if any(v.tag == "charts/learning_rate" for v in event.summary.value):
                ends[event.step] = event.wall_time
    return sorted(ends.items())


def run(name: str, script: str, a) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, script, "--env-id", a.env_id, "--seed", "1",
               "--total-timesteps", str(a.iterations * STEPS)]
        if name == "ours" and a.threads:
            cmd += ["--threads", str(a.threads)]
        env = dict(os.environ, PYTHONPATH=os.path.dirname(script))  # cleanrl_utils
        start = time.perf_counter()
        out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if out.returncode:
            sys.exit(f"{name} ({script}) exited {out.returncode}: {out.stderr[-1500:]}")
        ends = iteration_ends(os.path.join(tmp, "runs"))
    if len(ends) != a.iterations:
        sys.exit(f"{name}: {len(ends)} iterations logged, expected {a.iterations}")
    (s0, t0), (s1, t1) = ends[a.skip - 1], ends[-1]
    return {"wall": wall, "sps": (s1 - s0) / (t1 - t0), "steps": ends[-1][0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cleanrl", help="the folder of CleanRL's ppo_atari.py and cleanrl_utils/")
    parser.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    parser.add_argument("--iterations", type=int, default=10, help="of 1,024 steps each")
    parser.add_argument("--skip", type=int, default=2, help="iterations before the SPS window")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, help="ours only: --threads N")
    parser.add_argument("--script", default=os.path.join(ROOT, "ppo_atari.py"), help="ours")
    a = parser.parse_args()
    theirs = os.path.join(os.path.abspath(a.cleanrl), "ppo_atari.py")
    if not os.path.exists(os.path.join(os.path.dirname(theirs), "cleanrl_utils")):
        sys.exit(f"{a.cleanrl}: no ppo_atari.py with cleanrl_utils/ beside it there")
    if not 1 <= a.skip < a.iterations:
        sys.exit(f"--skip {a.skip}: give 1 to --iterations - 1 ({a.iterations - 1})")
    files = {"ours": os.path.abspath(a.script), "CleanRL": theirs}
    results = {name: [] for name in files}
    for r in range(a.rounds):
        for name in list(files) if r % 2 == 0 else list(files)[::-1]:
            results[name].append(run(name, files[name], a))
            x = results[name][-1]
            print(f"# round {r + 1}, {name}: {x['wall']:.1f} s, {x['sps']:.0f} steps/s",
                  flush=True)
    try:
        import torch
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
    except ImportError:
        device = "?"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"# {a.env_id}, default flags, {a.iterations} iterations ({a.iterations * STEPS:,} "
          f"steps), steps/s from the end of iteration {a.skip} to the end of the last; {cpu}, "
          f"{os.cpu_count()} cores, {device}; medians over {a.rounds} round(s)")
    print("| file | wall time s (whole process) | steps/s (same window) |\n|---|---|---|")
    med = {n: {k: float(np.median([x[k] for x in rs])) for k in ("wall", "sps")}
           for n, rs in results.items()}
    for name, m in med.items():
        print(f"| {name} | {m['wall']:.1f} | {m['sps']:.0f} |")
    print(f"| ours / CleanRL | {med['ours']['wall'] / med['CleanRL']['wall']:.2f} | "
          f"{med['ours']['sps'] / med['CleanRL']['sps']:.2f} |")


if __name__ == "__main__":
    main()
