"""Preemption soak (not collected by pytest): random signals at random instants, then the same
command, until the run finishes.

    python tests/dev/soak.py --signals 50 --backend sync
    python tests/dev/soak.py --signals 50 --backend async --script ~/my-experiment/ppo_atari.py

One --run-name run of a tiny configuration (2 envs x 32 steps, a checkpoint every
--checkpoint-interval iterations: 1, or more, where most stops mid-rollout write their own) in
a temporary folder. Each launch of the same command gets one signal, SIGKILL, SIGTERM or SIGINT
(chosen at random), sent to its process group after a random delay (0 to --window seconds from
the launch: start-up, training, checkpoints, the end); then the script waits for it to exit and
launches the same command again. After --signals signals it lets the command run to the end,
then checks: the checkpoint's final step, `finished` in agent.pt, every iteration's losses
exactly once in TensorBoard's view of the events, and that --eval-checkpoint plays a game.
Bounded: --signals launches, --max-seconds in all. Exit code 1 unless every check passes.
"""
import argparse
import collections
import importlib.util
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))
from events import scalars  # noqa: E402  (the tools' events reader)

TINY = ["--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "2",
        "--no-cuda", "--threads", "1"]  # the suite's tiny configuration
ITER = 64  # steps per iteration of TINY
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}


def launch(command, cwd):
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,  # its own group, as under SLURM
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signals", type=int, default=50)
    parser.add_argument("--backend", choices=["sync", "async"], default="sync")
    parser.add_argument("--iterations", type=int, default=400, help="the run's length")
    parser.add_argument("--window", type=float, default=8.0, help="the latest delay, seconds")
    parser.add_argument("--checkpoint-interval", type=int, default=1,
                        help="more than 1: a stop mid-rollout writes a checkpoint of its own")
    parser.add_argument("--seed", type=int, default=0, help="of the delays and signals")
    parser.add_argument("--max-seconds", type=float, default=3600)
    parser.add_argument("--script", default=os.path.join(ROOT, "ppo_atari.py"))
    parser.add_argument("--verbose", action="store_true", help="a line per launch")
    a = parser.parse_args()
    # as a terminal has it: a caught SIGINT resets to the default in each launch, where an
    # ignored one (this script run as a background job, `cmd &`) would stay ignored there
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng, start = random.Random(a.seed), time.time()
    total = a.iterations * ITER
    with tempfile.TemporaryDirectory() as cwd:
        command = [sys.executable, os.path.abspath(a.script), *TINY, "--total-timesteps",
                   str(total), "--checkpoint-interval", str(a.checkpoint_interval),
                   "--run-name", "soak",
                   "--env-backend", a.backend]
        sent, exits = collections.Counter(), collections.Counter()
        for _ in range(a.signals):
            if time.time() - start > a.max_seconds:
                sys.exit(f"stopped after {a.max_seconds:.0f} s with {sum(sent.values())} signals")
            name = rng.choice(list(SIGNALS))
            proc, launched, delay = launch(command, cwd), time.time(), rng.uniform(0.0, a.window)
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, SIGNALS[name])
                except ProcessLookupError:  # it exited in between
                    pass
            out, err = proc.communicate(timeout=300)
            sent[name] += 1
            exits[(name, proc.returncode)] += 1
            if a.verbose:  # what each launch got and did
                steps = [ln for ln in out.splitlines() if ln.startswith(("step ", "continuing",
                                                                         "runs/"))]
                print(f"{name} after {delay:.1f} s: exit {proc.returncode}, "
                      f"{time.time() - launched:.1f} s; {' / '.join(steps[:1] + steps[-1:])}",
                      flush=True)
            if proc.returncode not in (0, 130, 143, -9, -2, -15):
                print(f"unexpected exit {proc.returncode} after {name}:\n{err[-2000:]}")
        finals = 0
        while finals < 5:  # the same command, unsignalled, until it says the run is complete
            finals += 1
            out = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                sys.exit(f"the same command failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            if "is already complete" in out.stdout:
                break
        run = os.path.join(cwd, "runs", "soak")
        sys.path.insert(0, os.path.dirname(os.path.abspath(a.script)))
        spec = importlib.util.spec_from_file_location("ppo_atari", os.path.abspath(a.script))
        P = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(P)
        ckpt, agent = P.load_checkpoint(run), P.load_checkpoint(os.path.join(run, "agent.pt"))
        steps = [s for s, _ in scalars(run)["losses/value_loss"]]
        evaluation = subprocess.run(
            [sys.executable, os.path.abspath(a.script), "--eval-checkpoint",
             os.path.join(run, "agent.pt"), "--eval-episodes", "1", "--no-cuda"],
            cwd=cwd, capture_output=True, text=True, timeout=600)
        checks = {
            f"final step {total:,}": ckpt["global_step"] == total,
            "agent.pt finished, at the final step": agent["finished"] is True and
            agent["global_step"] == total,
            f"each of the {a.iterations} iterations' losses exactly once":
            steps == list(range(ITER, total + 1, ITER)),
            "--eval-checkpoint plays": evaluation.returncode == 0 and
            f"over 1 game (agent at step {total:,})" in evaluation.stdout,
        }
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(sent.items()))
    print(f"backend {a.backend}: {sum(sent.values())} signals ({kinds}), then {finals} "
          f"unsignalled launch(es); {time.time() - start:.0f} s")
    print("exit codes after each signal: " + ", ".join(
        f"{name} -> {code}: {n}" for (name, code), n in sorted(exits.items())))
    for check, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {check}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
