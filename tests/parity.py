"""Learning parity (not collected by pytest): do the speed options learn what the plain setup does?

    python tests/parity.py --steps 300000 --seeds 1,2 --configs plain,ale,bf16 --jobs 2

Runs ppo_atari.py on Breakout for each configuration and seed (`--jobs` at a time, threads split
between them), then prints each run's final charts/avg_episodic_return (mean of the last 100
games) and, per configuration, the mean and the spread over seeds. Runs are kept under --out, and
a finished run already there is reused instead of run again.
"""
import argparse
import glob
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import scalars  # noqa: E402

CONFIGS = {
    "plain": ["--env-backend", "sync", "--precision", "fp32"],
    "async": ["--env-backend", "async", "--precision", "fp32"],
    "ale": ["--env-backend", "ale", "--precision", "fp32"],
    "bf16": ["--env-backend", "sync", "--precision", "bf16"],
    "ale+bf16": ["--env-backend", "ale", "--precision", "bf16"],
}


def finished_run(out, config, seed, steps):
    for run in glob.glob(os.path.join(out, "runs", f"*__parity-{config}__{seed}__*")):
        if os.path.exists(os.path.join(run, "agent.pt")):
            logged = scalars(run)["charts/avg_episodic_return"]
            if logged[-1][0] >= steps - 8 * 128:
                return run, logged[-1][1]
    return None, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300_000)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--configs", default="plain,ale,bf16")
    parser.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", default="parity-runs", help="folder for the runs")
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)
    todo = [(c, int(s)) for c in a.configs.split(",") for s in a.seeds.split(",")
            if finished_run(a.out, c, int(s), a.steps)[0] is None]
    threads = str(max(1, (os.cpu_count() or 1) // a.jobs))
    running = []
    while todo or running:
        while todo and len(running) < a.jobs:
            config, seed = todo.pop(0)
            cmd = [sys.executable, os.path.join(ROOT, "ppo_atari.py"), *CONFIGS[config],
                   "--env-id", a.env_id, "--total-timesteps", str(a.steps), "--seed", str(seed),
                   "--exp-name", f"parity-{config}", "--no-cuda"]
            log = open(os.path.join(a.out, f"{config}-{seed}.log"), "w")
            env = dict(os.environ, OMP_NUM_THREADS=threads)
            running.append(subprocess.Popen(cmd, cwd=a.out, stdout=log, stderr=log, env=env))
        time.sleep(5)
        running = [p for p in running if p.poll() is None]

    print(f"# {a.env_id}, {a.steps} steps, final charts/avg_episodic_return (last 100 games)")
    print("| config | flags | per seed | mean ± std |")
    print("|---|---|---|---|")
    for config in a.configs.split(","):
        finals = [finished_run(a.out, config, int(s), a.steps)[1] for s in a.seeds.split(",")]
        shown = ", ".join("failed" if f is None else f"{f:.2f}" for f in finals)
        ok = [f for f in finals if f is not None]
        print(f"| {config} | {' '.join(CONFIGS[config])} | {shown} | "
              f"{np.mean(ok):.2f} ± {np.std(ok):.2f} |")


if __name__ == "__main__":
    main()
