"""--run-name: the same command continues a preempted run, and torchrun --max-restarts brings a
run back after a worker is SIGKILLed; finished and foreign folders are left alone."""
import os
import signal
import subprocess
import sys
import time

import pytest

import ppo_atari as P
from conftest import SCRIPT, TINY, run_dirs, run_script, scalars

ITER = 64  # steps per iteration of TINY: 2 envs x 32 steps


def listing(folder):
    return {f: os.path.getmtime(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}


def test_same_command_after_sigterm_finishes_the_run_with_clean_curves(tmp_path):
    total = 12 * ITER
    command = [sys.executable, SCRIPT, *TINY, "--total-timesteps", str(total),
               "--checkpoint-interval", "1000", "--run-name", "job"]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step "):
            break
    proc.send_signal(signal.SIGTERM)  # a preemption
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    run = str(tmp_path / "runs" / "job")
    stopped_at = P.load_checkpoint(run)["global_step"]
    assert ITER <= stopped_at < total
    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"continuing runs/job at step {stopped_at:,} of {total:,}" in again.stdout
    assert run_dirs(tmp_path) == [run]
    assert P.load_checkpoint(run)["global_step"] == total
    steps = [s for s, _ in scalars(run, raw=True)["charts/SPS"]]  # every event as written
    assert steps == list(range(ITER, total + 1, ITER)), "repeated or missing iterations"

    # the same command once more: the run is complete, nothing is written
    before = listing(run)
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"is already complete: it has run {total:,} steps" in done.stdout
    assert listing(run) == before


def test_a_folder_of_something_else_is_refused(workdir):
    (workdir / "runs" / "typo").mkdir(parents=True)
    (workdir / "runs" / "typo" / "notes.txt").write_text("keep")
    out = run_script([*TINY, "--total-timesteps", "64", "--run-name", "typo"], cwd=workdir)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "holds files but no checkpoint.pt" in out.stderr
    assert os.listdir(workdir / "runs" / "typo") == ["notes.txt"]
    bad = run_script([*TINY, "--run-name", "../elsewhere"], cwd=workdir)
    assert bad.returncode == 2 and "must be a plain folder name" in bad.stderr


def test_an_empty_folder_is_used_and_a_new_run_checkpoints_before_logging(workdir, monkeypatch):
    (workdir / "runs" / "fresh").mkdir(parents=True)
    at_first_event, real = [], P.SummaryWriter

    def writer(run_dir, **kw):  # the checkpoint a restart would find before any event exists
        at_first_event.append(P.load_checkpoint(run_dir)["iteration"])
        return real(run_dir, **kw)

    monkeypatch.setattr(P, "SummaryWriter", writer)
    P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                  total_timesteps=64, run_name="fresh"))
    assert at_first_event == [0]
    assert P.load_checkpoint(str(workdir / "runs" / "fresh"))["global_step"] == 64


def worker_pids(parent):
    """{RANK: pid} of the workers torchrun (pid `parent`) started."""
    pids = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            env = dict(e.decode().split("=", 1) for e in environ if b"=" in e)
            if "RANK" in env:
                pids[int(env["RANK"])] = int(pid)
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_torchrun_restarts_a_killed_worker_from_the_last_checkpoint(tmp_path):
    total = 30 * 2 * ITER  # 2 processes: 128 steps an iteration
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--max-restarts", "1", SCRIPT, *TINY, "--total-timesteps", str(total),
         "--checkpoint-interval", "3", "--run-name", "elastic", "--dist-timeout", "60"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    run = str(tmp_path / "runs" / "elastic")
    deadline = time.time() + 200
    while time.time() < deadline:  # the first periodic checkpoint (iteration 3)
        path = os.path.join(run, "checkpoint.pt")
        if os.path.exists(path) and P.load_checkpoint(path)["iteration"] >= 3:
            break
        time.sleep(0.2)
    reached = P.load_checkpoint(run)["global_step"]
    assert reached >= 3 * 2 * ITER
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "continuing" in out, "the restarted workers did not continue the run"
    assert P.load_checkpoint(run)["global_step"] == total
    # TensorBoard's view (events after the checkpoint purged): each iteration exactly once
    steps = [s for s, _ in scalars(run)["charts/SPS"]]
    assert steps == list(range(2 * ITER, total + 1, 2 * ITER))
    # a checkpoint of 2 processes cannot be continued by 1
    one = run_script([*TINY, "--total-timesteps", str(2 * total), "--run-name", "elastic"],
                     cwd=tmp_path)
    assert one.returncode == 2 and "written by 2 process(es) and this launch has 1" in one.stderr


TRAINER_IN_A_CHILD = """
import multiprocessing, os, signal, sys
sys.path.insert(0, os.path.dirname(os.environ["PPO_ATARI_SCRIPT"]))

def train():
    import ppo_atari as P
    P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                  total_timesteps=128))
    sys.exit(3 if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else 0)

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    child = multiprocessing.get_context("spawn").Process(target=train)
    child.start()
    child.join()
    print("exit", child.exitcode, flush=True)
"""


def test_a_trainer_inside_a_multiprocessing_child_is_not_taken_for_an_env_worker(tmp_path):
    """A sweep (multiprocessing.Pool, submitit) runs the trainer in a child process: it must
    keep Ctrl-C (not ignore it as an async env worker does), also after training."""
    (tmp_path / "sweep.py").write_text(TRAINER_IN_A_CHILD)
    out = subprocess.run([sys.executable, "sweep.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert "exit 0" in out.stdout, (out.stdout, out.stderr[-2000:])
