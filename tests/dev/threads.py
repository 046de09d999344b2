"""Thread-count probe (not collected by pytest): how fast is one training alone, and two at once
on the same cores, for each choice of torch threads?

    python tests/dev/threads.py [--iterations 5] [--script ppo_atari.py]

Each candidate runs the default configuration (8 envs x 128 steps) on the CPU for a few
iterations, first alone, then as two trainings started together. A figure is the median over
iterations after the first of 1024 / (rollout_time + update_time), read from TensorBoard.
Candidates: --threads 1; --threads = the usable cores with OpenMP's own wait policy (idle
threads spin a while before they sleep; OMP_WAIT_POLICY set empty, which the file leaves as
it is); the same with OMP_WAIT_POLICY=PASSIVE (idle threads sleep at once: the file's default).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from events import scalars  # noqa: E402  (the tools' events reader)
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "ppo_atari.py")


def start(script, threads, env, cwd, iterations):
    return subprocess.Popen([sys.executable, script, "--no-cuda", "--threads", str(threads),
                             "--total-timesteps", str(1024 * iterations), "--run-name", "t"],
                            cwd=cwd, env=dict(os.environ, **env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def sps(cwd):
    logged = scalars(os.path.join(cwd, "runs", "t"))
    times = [r + u for (_, r), (_, u) in zip(logged["charts/rollout_time"],
                                            logged["charts/update_time"])]
    return statistics.median(1024 / t for t in times[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--script", default=SCRIPT)
    a = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    candidates = [("1 thread", 1, {}),
                  (f"{cores} threads (the usable cores), OpenMP's own wait", cores,
                   {"OMP_WAIT_POLICY": ""}),
                  (f"{cores} threads, OMP_WAIT_POLICY=PASSIVE (the default)", cores,
                   {"OMP_WAIT_POLICY": "PASSIVE"})]
    print("| threads | one training alone, SPS | two at once, SPS each | two at once, sum |")
    print("|---|---|---|---|")
    for name, threads, env in candidates:
        with tempfile.TemporaryDirectory() as tmp:
            dirs = [os.path.join(tmp, d) for d in ("alone", "a", "b")]
            for d in dirs:
                os.mkdir(d)
            p = start(a.script, threads, env, dirs[0], a.iterations)
            assert p.wait() == 0, p.stderr.read()
            procs = [start(a.script, threads, env, d, a.iterations) for d in dirs[1:]]
            assert all(p.wait() == 0 for p in procs)
            alone, pair = sps(dirs[0]), [sps(d) for d in dirs[1:]]
        print(f"| {name} | {alone:.0f} | {pair[0]:.0f}, {pair[1]:.0f} | {sum(pair):.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
