"""--run-name: the same command continues a preempted run, and torchrun --max-restarts brings a
run back after a worker is SIGKILLed; finished and foreign folders are left alone."""
import os
import signal
import subprocess
import sys
import time

import pytest

import ppo_atari as P
from conftest import SCRIPT, TINY, need, run_dirs, run_script, scalars

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


# Runs the file under test (PPO_ATARI_SCRIPT) and kills itself at one exact instant, named by
# KILL_AT = "rename:FILE:N": the N-th write of FILE, its temporary file half written and not yet
# renamed; "call:NAME:N": the moment the N-th call of the file's NAME has returned. SIGNAL names
# the signal (default SIGKILL); SWALLOW=1 sends it from inside a finalizer (__del__), where
# Python's default Ctrl-C handler raises a KeyboardInterrupt that is printed and dropped.
KILLER = """
import importlib.util, os, signal, sys
import gymnasium as gym
import tyro
spec = importlib.util.spec_from_file_location("ppo_atari", os.environ["PPO_ATARI_SCRIPT"])
P = importlib.util.module_from_spec(spec)
sys.modules["ppo_atari"] = P
spec.loader.exec_module(P)
where, name, nth = os.environ["KILL_AT"].split(":")
sig, seen = getattr(signal, os.environ.get("SIGNAL", "SIGKILL")), []

class Finalizer:
    def __del__(self):
        os.kill(os.getpid(), sig)
        sum(range(10 ** 5))  # Python runs the handler here, inside __del__

def hit():
    seen.append(1)
    if len(seen) == int(nth):
        Finalizer() if os.environ.get("SWALLOW") else os.kill(os.getpid(), sig)

if where == "group":  # the whole process group, the moment the async workers are spawned
    real_check = gym.vector.AsyncVectorEnv._check_spaces
    def check_spaces(self):
        os.killpg(os.getpgid(0), sig)
        return real_check(self)
    gym.vector.AsyncVectorEnv._check_spaces = check_spaces
elif where == "rename":
    real_replace = os.replace
    def replace(src, dst, *a, **kw):
        if os.path.basename(dst) == name and len(seen) + 1 == int(nth):
            os.truncate(src, os.path.getsize(src) // 2)
            hit()
        elif os.path.basename(dst) == name:
            seen.append(1)
        return real_replace(src, dst, *a, **kw)
    os.replace = replace
else:
    real = getattr(P, name)
    def call(*a, **kw):
        out = real(*a, **kw)
        hit()
        return out
    setattr(P, name, call)
P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
"""
TOTAL = 4 * ITER
JOB = [*TINY, "--total-timesteps", str(TOTAL), "--checkpoint-interval", "1", "--run-name", "job"]


def killed_at(cwd, kill_at, args=JOB, **env):
    (cwd / "killer.py").write_text(KILLER)
    return subprocess.run([sys.executable, str(cwd / "killer.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, start_new_session=True,
                          env=dict(os.environ, PYTHONWARNINGS="ignore", KILL_AT=kill_at, **env))


def assert_finished(run):
    assert P.load_checkpoint(run)["global_step"] == TOTAL
    agent = P.load_checkpoint(os.path.join(run, "agent.pt"))
    assert agent["finished"] is True and agent["global_step"] == TOTAL
    steps = [s for s, _ in scalars(run)["losses/value_loss"]]  # TensorBoard's view
    assert steps == list(range(ITER, TOTAL + 1, ITER)), f"iterations logged at {steps}"


@pytest.mark.parametrize("instant, kill_at, left", [
    ("start-up, envs made", "call:make_envs:1", None),
    ("writing the first checkpoint", "rename:checkpoint.pt:1", ["checkpoint.pt.tmp"]),
    ("the TensorBoard writer's first event file", "call:SummaryWriter:1", None),
    ("writing a later checkpoint", "rename:checkpoint.pt:3", None),
    ("writing the final agent.pt", "rename:agent.pt:1", None),
])
def test_a_kill_at_this_instant_leaves_a_run_the_same_command_finishes(tmp_path, instant,
                                                                        kill_at, left):
    need("main")
    out = killed_at(tmp_path, kill_at)
    assert out.returncode == -signal.SIGKILL, (instant, out.stderr[-2000:])
    run = tmp_path / "runs" / "job"
    if left is not None:
        assert sorted(os.listdir(run)) == left, instant
    again = run_script(JOB, cwd=tmp_path)
    assert again.returncode == 0, (instant, again.stderr[-2000:])
    if kill_at.startswith("rename:agent.pt"):
        assert "agent.pt was missing or partial, written from the checkpoint" in again.stdout
    assert_finished(str(run))
    assert not os.path.exists(run / "checkpoint.pt.tmp") or kill_at.startswith("rename:agent")


def test_a_kill_during_evaluation_leaves_the_run_and_the_same_command_plays(tmp_path):
    need("main")
    assert run_script(JOB, cwd=tmp_path).returncode == 0
    run = str(tmp_path / "runs" / "job")
    before = listing(run)
    evaluation = ["--eval-checkpoint", os.path.join(run, "agent.pt"), "--eval-episodes", "1",
                  "--no-cuda"]
    out = killed_at(tmp_path, "call:SummaryWriter:1", args=evaluation)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    again = run_script(evaluation, cwd=tmp_path)
    assert again.returncode == 0 and "over 1 game (agent at step 256)" in again.stdout
    assert {f: t for f, t in listing(run).items() if f != "eval"} == before
    assert "nothing written" in run_script(JOB, cwd=tmp_path).stdout
    assert_finished(run)


def test_a_ctrl_c_during_start_up_is_never_dropped(tmp_path):
    """Python's default handler raises Ctrl-C as a KeyboardInterrupt wherever the main thread
    is, and one raised inside a finalizer (a __del__ run by the garbage collector) is printed
    and dropped: the run then trained on as if never signalled. The trainer catches the signal
    from its first instant instead: it stops after its first iteration with a checkpoint."""
    need("main")
    out = killed_at(tmp_path, "call:make_envs:1", SIGNAL="SIGINT", SWALLOW="1")
    assert out.returncode == 130, out.stderr[-2000:]
    assert "resume with: " in out.stdout
    run = str(tmp_path / "runs" / "job")
    assert P.load_checkpoint(run)["global_step"] == ITER
    assert run_script(JOB, cwd=tmp_path).returncode == 0
    assert_finished(run)


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_group_while_async_workers_start_stops_plainly(tmp_path, name):
    """Ctrl-C or SLURM's SIGTERM reach every process of the group, the async env workers too,
    and kill those still starting (they ignore both only once their env thunk runs). The
    trainer, which caught the signal, stops with its exit code and one line, no traceback; the
    same command continues."""
    need("main")
    job = [*JOB, "--env-backend", "async"]
    out = killed_at(tmp_path, "group:_check_spaces:1", args=job, SIGNAL=name)
    assert out.returncode == 128 + getattr(signal, name), out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"stopped by {name} during start-up" in out.stderr
    again = run_script(job, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_finished(str(tmp_path / "runs" / "job"))
