"""--run-name: the same command continues a preempted run, and torchrun --max-restarts brings a
run back after a worker is SIGKILLed; finished and foreign folders are left alone."""
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import ppo_atari as P
from conftest import (SCRIPT, TINY, Launched, free_port, is_repository_file, launch,
                      left_in_session, need, run_dirs,
                      run_in_process, scalars)

ITER = 64  # steps per iteration of TINY: 2 envs x 32 steps


def listing(folder):
    return {f: os.path.getmtime(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}


def started(command, cwd):
    """A training launch (`python SCRIPT ARGS`), returned once its first iteration is done (its
    first progress line)."""
    python = shutil.which(command[0]) if command[0] in ("python", "python3") else command[0]
    assert os.path.abspath(python) == os.path.abspath(sys.executable), command
    proc = launch(command[2:], cwd, script=command[1])
    proc.line_starting("step ")
    return proc


def test_ctrl_c_and_sigterm_checkpoint_and_the_same_command_finishes_with_clean_curves(tmp_path):
    """Ctrl-C: exit 130, a checkpoint and a resume line; that line, stopped by SIGTERM (a
    preemption): exit 143; the same command as the first finishes the run, each iteration
    logged once; once more, the run is complete and nothing is written."""
    total = 8 * ITER
    command = [sys.executable, SCRIPT, *TINY, "--total-timesteps", str(total),
               "--checkpoint-interval", "1000", "--run-name", "job"]
    run = str(tmp_path / "runs" / "job")
    proc = started(command, tmp_path)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    (resume,) = [x.split("continue with: ", 1)[1] for x in out.splitlines()
                 if "continue with: " in x]
    assert resume.endswith("--no-cuda --threads 1"), resume  # run below as printed
    first = P.load_checkpoint(run)["global_step"]
    assert ITER <= first < total
    assert P.load_checkpoint(os.path.join(run, "agent.pt"))["finished"] is False  # the latest
    proc = started(shlex.split(resume), tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "continue with: " in out, err
    stopped_at = P.load_checkpoint(run)["global_step"]
    assert first < stopped_at < total
    again = run_in_process(command[2:], tmp_path)  # the same command line, in this process
    assert again.returncode == 0, again.stderr
    assert f"continuing runs/job at step {stopped_at:,} of {total:,}" in again.stdout
    assert run_dirs(tmp_path) == [run]
    assert P.load_checkpoint(run)["global_step"] == total
    steps = [s for s, _ in scalars(run, raw=True)["charts/SPS"]]  # every event as written
    assert steps == list(range(ITER, total + 1, ITER)), "repeated or missing iterations"

    before = listing(run)  # the same command once more: complete, nothing is written
    done = run_in_process(command[2:], tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"is already complete: it has run {total:,} steps" in done.stdout
    assert listing(run) == before


def test_a_second_ctrl_c_exits_at_once_without_a_checkpoint(monkeypatch, capsys):
    """The first Ctrl-C is recorded for the loop to read; the second exits at once."""
    exits, stop = [], []
    monkeypatch.setattr(os, "_exit", exits.append)
    release = P.catch_stop_signals(stop)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: stop == [signal.SIGINT]) and exits == []
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: exits == [130]) and "second Ctrl-C: exiting now" in \
            capsys.readouterr().err
    finally:
        release()


def wait_for(condition, seconds=5.0) -> bool:
    """Whether condition() holds within seconds."""
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_folder_of_something_else_is_refused(workdir):
    (workdir / "runs" / "typo").mkdir(parents=True)
    (workdir / "runs" / "typo" / "notes.txt").write_text("keep")
    out = run_in_process([*TINY, "--total-timesteps", "64", "--run-name", "typo"], workdir)
    assert out.returncode == 2 and "holds files but no checkpoint.pt" in out.stderr, out.stderr
    assert os.listdir(workdir / "runs" / "typo") == ["notes.txt"]
    bad = run_in_process([*TINY, "--run-name", "../elsewhere"], workdir)
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
def test_a_worker_killed_on_one_of_two_nodes_is_restarted_on_both(tmp_path):
    """Two torchrun agents as two nodes, each in its own folder: the node whose worker dies
    counts a restart and the other need not (TORCHELASTIC_RESTART_COUNT differs), yet the
    restarted workers must join one group at once and finish the run from its checkpoint."""
    total, port = 8 * 2 * ITER, free_port()
    folders = [tmp_path / "node0", tmp_path / "node1"]
    agents = []
    for folder in folders:
        folder.mkdir()
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
             "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
             "--max-restarts", "1", SCRIPT, *TINY, "--total-timesteps", str(total),
             "--checkpoint-interval", "3", "--run-name", "mn", "--dist-timeout", "60"],
            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")))
    deadline, ranks = time.time() + 200, {}
    while time.time() < deadline and len(ranks) < 2:  # which agent's worker is rank 0
        ranks = {r: (agent, pid) for agent in agents for r, pid in worker_pids(agent.pid).items()}
        time.sleep(0.2)
    first, other = ranks[0][0], ranks[1]
    run = os.path.join(folders[agents.index(first)], "runs", "mn")
    while time.time() < deadline:  # the first periodic checkpoint (iteration 3)
        path = os.path.join(run, "checkpoint.pt")
        if os.path.exists(path) and P.load_checkpoint(path)["iteration"] >= 3:
            break
        time.sleep(0.2)
    os.kill(other[1], signal.SIGKILL)  # the worker of the node that holds rank 1
    outs = [agent.communicate(timeout=300)[0] for agent in agents]
    for agent, out in zip(agents, outs):
        assert agent.returncode == 0, out[-3000:]
    assert all("init_process_group" not in out for out in outs), "a restarted worker failed " \
        "to join the group (and spent a restart)"
    assert "continuing" in outs[agents.index(first)], "the restarted workers did not continue"
    assert P.load_checkpoint(run)["global_step"] == total
    steps = [s for s, _ in scalars(run)["charts/SPS"]]  # TensorBoard's view: events purged
    assert steps == list(range(2 * ITER, total + 1, 2 * ITER)), "repeated or missing iterations"
    # a checkpoint of 2 processes cannot be continued by 1
    one = run_in_process([*TINY, "--total-timesteps", str(2 * total), "--run-name", "mn"],
                         os.path.dirname(os.path.dirname(run)))
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
# Python's default Ctrl-C handler raises a KeyboardInterrupt that is printed and dropped;
# THEN_RAISE=1 makes that call raise a RuntimeError once the file has recorded the signal (in
# the list catch_stop_signals was given), or after 10 s without.
KILLER = """
import importlib.util, os, signal, sys, time
import gymnasium as gym
import tyro
spec = importlib.util.spec_from_file_location("ppo_atari", os.environ["PPO_ATARI_SCRIPT"])
P = importlib.util.module_from_spec(spec)
sys.modules["ppo_atari"] = P
spec.loader.exec_module(P)
where, name, nth = os.environ["KILL_AT"].split(":")
sig, seen, stops = getattr(signal, os.environ.get("SIGNAL", "SIGKILL")), [], []
if hasattr(P, "catch_stop_signals"):  # keep the list a signal is recorded in
    real_catch = P.catch_stop_signals
    def catch(stop, *a, **kw):
        stops.append(stop)
        return real_catch(stop, *a, **kw)
    P.catch_stop_signals = catch

class Finalizer:
    def __del__(self):
        os.kill(os.getpid(), sig)
        sum(range(10 ** 5))  # Python runs the handler here, inside __del__

def hit():
    seen.append(1)
    if len(seen) == int(nth):
        Finalizer() if os.environ.get("SWALLOW") else os.kill(os.getpid(), sig)

if where == "group":  # the whole process group, the moment the async workers start
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
        if os.environ.get("THEN_RAISE") and len(seen) == int(nth):
            deadline = time.time() + 10
            while not (stops and stops[0]) and time.time() < deadline:
                time.sleep(0.01)
            if not (stops and stops[0]):
                raise RuntimeError("the signal was never recorded")
            raise RuntimeError("a bug after the signal was recorded")
        return out
    setattr(P, name, call)
if __name__ == "__main__":  # async env workers import this file as their main module
    P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
"""
TOTAL = 4 * ITER
JOB = [*TINY, "--total-timesteps", str(TOTAL), "--checkpoint-interval", "1", "--run-name", "job"]


def killer(cwd, kill_at, args=JOB, **env):
    """The harness in cwd, started in a session of its own (so a group signal stays in it)."""
    (cwd / "killer.py").write_text(KILLER)
    return launch(args, cwd, script=cwd / "killer.py", env=dict(KILL_AT=kill_at, **env),
                  new_session=True)


def assert_finished(run):
    assert P.load_checkpoint(run)["global_step"] == TOTAL
    agent = P.load_checkpoint(os.path.join(run, "agent.pt"))
    assert agent["finished"] is True and agent["global_step"] == TOTAL
    steps = [s for s, _ in scalars(run)["losses/value_loss"]]  # TensorBoard's view
    assert steps == list(range(ITER, TOTAL + 1, ITER)), f"iterations logged at {steps}"


ASYNC = [*JOB, "--env-backend", "async"]
INSTANTS = {  # instant: (KILL_AT, the command, the harness's environment, its exit code)
    "start-up, envs made": ("call:make_envs:1", JOB, {}, -9),
    "writing the first checkpoint": ("rename:checkpoint.pt:1", JOB, {}, -9),
    "the TensorBoard writer's first event file": ("call:SummaryWriter:1", JOB, {}, -9),
    "writing a later checkpoint": ("rename:checkpoint.pt:3", JOB, {}, -9),
    "writing the final agent.pt": ("rename:agent.pt:5", JOB, {}, -9),  # (4 iterations)
    # Python's default handler raises Ctrl-C as a KeyboardInterrupt wherever the main thread
    # is, and one raised in a finalizer (__del__) is printed and dropped: the run trained on
    # as if never signalled. Caught from main's first instant (here: as the run folder is
    # decided, before training), it checkpoints step 0 and stops.
    "Ctrl-C inside a finalizer during start-up": ("call:open_run:1", JOB,
                                                  {"SIGNAL": "SIGINT", "SWALLOW": "1"}, 130),
    # Ctrl-C and SLURM's SIGTERM reach the whole group, async workers still starting too: they
    # must survive it (born with both blocked), and the trainer stops after its first iteration
    "SIGTERM to the group while async workers start": ("group:_check_spaces:1", ASYNC,
                                                       {"SIGNAL": "SIGTERM"}, 143),
    "Ctrl-C to the group while async workers start": ("group:_check_spaces:1", ASYNC,
                                                      {"SIGNAL": "SIGINT"}, 130),
}


@pytest.fixture(scope="module")
def instants(tmp_path_factory):
    """Every instant's harness run at once, then the same command line in each folder, in this
    process and with sync envs (what is checked is the folder the killed process left; a resume
    may change --env-backend)."""
    need("main")
    folders = {name: tmp_path_factory.mktemp("instant") for name in INSTANTS}
    procs = {name: killer(folders[name], kill_at, args, **env)
             for name, (kill_at, args, env, _) in INSTANTS.items()}
    killed = {name: (p.wait(timeout=150), *p.communicate()) for name, p in procs.items()}
    left = {name: sorted(os.listdir(f / "runs" / "job")) if (f / "runs" / "job").is_dir() else []
            for name, f in folders.items()}
    later = folders["writing a later checkpoint"]  # README's evaluation command, after kill -9
    scored = run_in_process(["--eval-checkpoint", "runs/job/agent.pt", "--eval-episodes", "1",
                             "--no-cuda", "--threads", "1"], later)
    steps = [torch.load(later / "runs" / "job" / f)["global_step"] if (
        later / "runs" / "job" / f).is_file() else None for f in ("checkpoint.pt", "agent.pt")]
    again = {name: run_in_process([*JOB, "--env-backend", "sync"], folders[name])
             for name in INSTANTS}
    again = {name: (out.returncode, out.stdout, out.stderr) for name, out in again.items()}
    return {name: (folders[name], killed[name], again[name], left[name]) for name in INSTANTS} | {
        "scored after kill -9": (scored, *steps)}


def test_after_a_kill_9_readmes_evaluation_scores_the_latest_weights(instants):
    """SIGKILL while the 3rd checkpoint (step 128) is written: checkpoint.pt still holds step
    64, and agent.pt, written just before it, step 128. `--eval-checkpoint runs/NAME/agent.pt`
    scores those weights: the latest, never older than the checkpoint a resume continues."""
    scored, checkpoint_step, agent_step = instants["scored after kill -9"]
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert (checkpoint_step, agent_step) == (64, 128), (checkpoint_step, agent_step)
    assert "over 1 game (agent at step 128)" in scored.stdout, scored.stdout


@pytest.mark.parametrize("instant", list(INSTANTS))
def test_a_kill_at_this_instant_leaves_a_run_the_same_command_finishes(instants, instant):
    folder, (code, out, err), (again_code, again_out, again_err), left = instants[instant]
    assert code == INSTANTS[instant][3], (code, err[-2000:])
    run = folder / "runs" / "job"
    if instant == "writing the first checkpoint":
        assert left[0] == "agent.pt" and re.fullmatch(r"checkpoint\.pt\.\d+\.tmp", left[1]) \
            and len(left) == 2, left  # the temporary file is named per process
        assert not [f for f in os.listdir(run) if f.endswith(".tmp")], "the dead writer's .tmp"
    if code > 0:  # caught and acted on: a checkpoint after the first iteration, no traceback
        assert "continue with: " in out and "Traceback" not in err, (out, err[-2000:])
    assert again_code == 0, again_err[-2000:]
    if instant == "writing the final agent.pt":  # written before the final checkpoint
        assert "continuing runs/job at step 192 of 256" in again_out, again_out
    assert_finished(str(run))


def killed_at(cwd, kill_at, args=JOB, **env):
    proc = killer(cwd, kill_at, args, **env)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(kill_at, proc.returncode, out, err)


def test_a_crash_after_a_signal_mid_run_keeps_its_traceback(tmp_path):
    """A signal during an update asks for a stop at the end of the iteration; an error before
    then is a bug of its own, shown with its traceback, not taken for a signalled start-up."""
    need("main")  # the harness wraps update whatever its arguments
    need(what="a function update that train calls once per iteration",
         problem=None if callable(getattr(P, "update", None)) else "this copy has none")
    need(what="catch_stop_signals(the list a signal is recorded in, ...) -> release",
         problem=None if callable(getattr(P, "catch_stop_signals", None)) else "none here")
    out = killed_at(tmp_path, "call:update:2", SIGNAL="SIGTERM", THEN_RAISE="1")
    assert "RuntimeError: the signal was never recorded" not in out.stderr, out.stderr[-2000:]
    assert out.returncode == 1, (f"exit {out.returncode}: a bug raised after the signal was "
                                 f"recorded must exit 1 with its traceback", out.stderr[-2000:])
    assert "Traceback" in out.stderr and "RuntimeError: a bug after the signal was recorded" in \
        out.stderr, out.stderr[-2000:]


def test_a_kill_during_evaluation_leaves_the_run_and_the_same_command_plays(instants):
    folder = instants["start-up, envs made"][0]  # a run the same command finished
    run = str(folder / "runs" / "job")
    before = listing(run)
    evaluation = ["--eval-checkpoint", os.path.join(run, "agent.pt"), "--eval-episodes", "1",
                  "--no-cuda"]
    out = killed_at(folder, "call:SummaryWriter:1", args=evaluation)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    again, training = run_in_process(evaluation, folder), run_in_process(JOB, folder)
    assert again.returncode == 0 and "over 1 game (agent at step 256)" in again.stdout
    assert "nothing written" in training.stdout
    assert {f: t for f, t in listing(run).items() if f != "eval"} == before
    assert_finished(run)


def stderr_line(proc, text: str, seconds: float = 10.0) -> tuple[str | None, float]:
    """The first stderr line of a launch holding text, and when it was read (time.time())."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        for line in open(proc.err).read().splitlines():
            if text in line:
                return line, time.time()
        time.sleep(0.01)
    return None, time.time()


def test_a_stop_gives_up_the_rollout_in_progress_and_the_first_ctrl_c_is_answered_at_once(
        tmp_path):
    """Iterations of 512 steps (rollouts of a second and more): a Ctrl-C as iteration 2's
    rollout starts is answered on stderr at once (the rollout given up; a second Ctrl-C quits
    without a checkpoint; the last holds step 0), and the run exits 130 with iteration 1's
    checkpoint, not iteration 2's."""
    need("main")
    proc = launch([*TINY, "--num-steps", "256", "--update-epochs", "1", "--total-timesteps",
                   "100000", "--run-name", "long"], tmp_path)
    assert proc.line_starting("step 512/"), proc.communicate()[1][-2000:]
    sent = time.time()
    proc.send_signal(signal.SIGINT)
    line, answered = stderr_line(proc, "Ctrl-C: stopping")
    out, err = proc.communicate(timeout=60)
    ended = time.time()
    assert proc.returncode == 130 and line is not None, err[-2000:]
    assert answered - sent < 2, f"the first Ctrl-C was answered after {answered - sent:.1f} s"
    assert "the rollout in progress is given up" in line and "a second Ctrl-C quits at once " \
        "without a checkpoint (the last holds step 0)" in line, line
    held = P.load_checkpoint(str(tmp_path / "runs" / "long"))
    assert held["global_step"] == 512 and "stopped at step 512 of 100,000 by SIGINT" in out, (
        f"the checkpoint holds step {held['global_step']} {ended - sent:.1f} s after the "
        f"Ctrl-C: the stop waited for the rollout in progress")


def test_checkpoint_minutes_bounds_what_a_kill_9_loses(tmp_path):
    """--checkpoint-interval 1000 with --checkpoint-minutes 0.001 (0.06 s): by the first progress
    line's end of iteration a checkpoint is written, which a kill -9 keeps."""
    need("main")
    proc = launch([*TINY, "--total-timesteps", "100000", "--checkpoint-interval", "1000",
                   "--checkpoint-minutes", "0.001", "--run-name", "timed"], tmp_path)
    assert proc.line_starting("step "), proc.communicate()[1][-2000:]
    deadline = time.time() + 30
    while P.load_checkpoint(str(tmp_path / "runs" / "timed"))["global_step"] < 128 and \
            time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.communicate()
    assert P.load_checkpoint(str(tmp_path / "runs" / "timed"))["global_step"] >= 128


def test_signals_ignored_at_start_stay_ignored_and_the_warning_signals_stop(tmp_path):
    """A script's background job (`python ppo_atari.py &`, no job control) starts with SIGINT
    ignored, and `trap "" USR1` ignores USR1: the trainer leaves both so, before and after
    start-up alike, instead of acting on them once its handlers are in. SIGUSR2 (submitit's
    --signal=USR2@90; USR1 is Lightning's and SGE's) stops it like SIGTERM: the checkpoint, the
    stop line, exit 140."""
    proc = launch([*TINY, "--total-timesteps", "100000", "--checkpoint-interval", "1",
                   "--run-name", "bg"], tmp_path, sigint_ignored=True, ignored=["USR1"])
    run = tmp_path / "runs" / "bg"

    def iteration():  # the last checkpoint's, once there is one (a new run writes it first)
        try:
            return P.load_checkpoint(str(run))["iteration"]
        except SystemExit:  # not there yet, or being renamed into place
            return -1

    def wait_for(target):
        deadline = time.time() + 200
        while iteration() < target and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        return iteration()

    assert wait_for(1) >= 1, proc.communicate()[1][-2000:]
    status = open(f"/proc/{proc.pid}/status").read()
    ignored = int(status.split("SigIgn:\t")[1].split()[0], 16)
    for s in (signal.SIGINT, signal.SIGUSR1):
        assert ignored >> (s - 1) & 1, f"{s.name} is no longer ignored while training"
        proc.send_signal(s)
    reached = iteration()
    assert wait_for(reached + 2) >= reached + 2, "an ignored signal stopped the run"
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 140 and "continue with: " in out, err[-2000:]
    step = P.load_checkpoint(str(run))["global_step"]
    assert f"stopped at step {step:,} of 100,000 by SIGUSR2; checkpoint written" in out, out


def test_a_stopped_torchrun_with_async_workers_checkpoints_and_leaves_no_process(tmp_path):
    """torchrun --standalone, two ranks with async envs, SIGTERM to the agent (a scheduler's
    stop) once iteration 1 is logged: every rank ends the iteration in progress (the stop agreed
    in the iteration's one all-reduce), rank 0 writes its checkpoint and prints the
    line that continues the run (the same torchrun launcher); no worker traceback, no
    leaked-resource warning, every process of the job gone. The agent itself exits 1 with its
    SignalException traceback: torch's elastic agent raises it after passing the signal on
    (torch 2.13), which the file cannot change; README says so. Ctrl-C under torchrun: the
    two-node test below."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         SCRIPT, *TINY, "--total-timesteps", "100000", "--env-backend", "async", "--run-name",
         "tr"], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        for line in proc.stdout:
            if line.startswith("step "):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert not left_in_session(proc.pid), "processes of the job (ranks, workers) outlived it"
    ours = "\n".join(x for x in err.splitlines() if "torch/distributed" not in x)
    assert proc.returncode == 1 and "SignalException" in err, (proc.returncode, err[-2000:])
    for noise in ("_async_worker", "BrokenPipeError", "EOFError", "leaked"):
        assert noise not in ours, err[-3000:]
    (resume,) = [x.split("continue with: ", 1)[1] for x in out.splitlines()
                 if "continue with: " in x]
    assert resume.startswith("the same torchrun launcher and options, then: "), resume
    (line,) = [x for x in out.splitlines() if "continue with: " in x]
    step = int(line.split("stopped at step ")[1].split(" of ")[0].replace(",", ""))
    held = P.load_checkpoint(str(tmp_path / "runs" / "tr"))
    assert held["global_step"] == step >= 2 * 2 * ITER and len(held["env_statistics"][
        "RecordEpisodeStatistics.episode_count"]) == 4, (held["global_step"], line)


def test_a_two_node_torchrun_job_stopped_with_async_workers(tmp_path):
    """Two torchrun agents as two nodes (one rank each, async envs, node-local folders), one
    stopped by SIGTERM to its agent (a scheduler's), the other by Ctrl-C to its process group (a
    terminal's): rank 0 writes the checkpoint and prints the line that continues the run with
    the same torchrun launcher; no worker traceback or leaked-resource warning
    on either node, no process of either left. Each agent exits 1 (torch's SignalException, as
    README says)."""
    port, agents, logs = free_port(), [], []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        logs.append((open(folder / "out.txt", "w+"), open(folder / "err.txt", "w+")))
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
             "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", SCRIPT,
             *TINY, "--total-timesteps", "100000", "--env-backend", "async", "--run-name", "mn",
             "--dist-timeout", "60"], cwd=folder, stdout=logs[-1][0], stderr=logs[-1][1],
            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1")))
    try:
        deadline = time.time() + 200
        while time.time() < deadline and not any(
                "step " in (tmp_path / f"node{n}" / "out.txt").read_text() for n in (0, 1)):
            time.sleep(0.2)
        agents[0].send_signal(signal.SIGTERM)
        os.killpg(agents[1].pid, signal.SIGINT)
        for agent in agents:
            agent.wait(timeout=120)
    finally:
        for agent in agents:
            agent.kill()
    for agent in agents:
        assert not left_in_session(agent.pid), "processes of a node outlived its agent"
    outs = [(tmp_path / f"node{n}" / "out.txt").read_text() for n in (0, 1)]
    errs = [(tmp_path / f"node{n}" / "err.txt").read_text() for n in (0, 1)]
    for agent, err in zip(agents, errs):
        assert agent.returncode == 1 and "SignalException" in err, (agent.returncode, err[-2000:])
        ours = "\n".join(x for x in err.splitlines() if "torch/distributed" not in x)
        for noise in ("_async_worker", "BrokenPipeError", "EOFError", "leaked"):
            assert noise not in ours, err[-3000:]
    (resume,) = [x.split("continue with: ", 1)[1] for out in outs for x in out.splitlines()
                 if "continue with: " in x]
    assert resume.startswith("the same torchrun launcher and options, then: "), resume
    (run,) = [tmp_path / f"node{n}" / "runs" / "mn" for n in (0, 1) if "continue with" in outs[n]]
    assert P.load_checkpoint(str(run))["global_step"] >= 2 * ITER


def rank_process(agent: int, rank: int, within=60.0) -> int:
    """The pid of the trainer of this rank (RANK in its environment) that torchrun's agent
    started (in a session of its own)."""
    deadline = time.time() + within
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == agent and f"RANK={rank}".encode() in environ:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} started by {agent}")


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_sigterm_to_one_rank_alone_stops_every_rank_in_the_same_iteration(tmp_path, nodes):
    """A multi-node preemption's SIGTERMs land in different iterations, or one node gets its own
    notice: here only rank 1's trainer is signalled (torchrun with two processes; two agents as
    two nodes, node-local folders). The stop is agreed over ranks at each iteration's end, so
    rank 0 stops in the same iteration: one checkpoint (rank 0's folder only), at the step its
    line names, and the line that continues the run, well within --dist-timeout (a rank left
    training would wait that long in the next all-reduce, then fail)."""
    need("main")
    common = [SCRIPT, *TINY, "--total-timesteps", "100000", "--run-name", "one",
              "--dist-timeout", "30"]
    if nodes == 1:
        commands = [["--standalone", "--nproc_per_node", "2"]]
    else:
        port = free_port()
        commands = [["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                     "--rdzv_endpoint", f"127.0.0.1:{port}"]] * 2
    agents, folders = [], []
    for node, options in enumerate(commands):
        folders.append(tmp_path / f"node{node}")
        folders[-1].mkdir()
        agents.append(Launched(
            [sys.executable, "-m", "torch.distributed.run", *options, *common],
            folders[-1] / "out.txt", folders[-1] / "err.txt", cwd=folders[-1],
            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1")))
    try:
        assert agents[0].line_starting("step ", timeout=200), agents[0].communicate()[1][-2000:]
        start = time.time()
        os.kill(rank_process(agents[-1].pid, 1), signal.SIGTERM)
        outs = [agent.communicate(timeout=120)[0] for agent in agents]
        seconds = time.time() - start
    finally:
        for agent in agents:
            agent.kill()
    lines = [x for x in outs[0].splitlines() if "continue with: " in x]
    assert len(lines) == 1 and " by a signal to another rank; checkpoint written;" in lines[0], \
        outs[0][-2000:]
    step = int(lines[0].split("stopped at step ")[1].split(" of ")[0].replace(",", ""))
    assert P.load_checkpoint(str(folders[0] / "runs" / "one"))["global_step"] == step
    assert not any((f / "runs" / "one" / "checkpoint.pt").exists() for f in folders[1:])
    assert seconds < 30, f"rank 0 stopped {seconds:.0f} s after rank 1: at --dist-timeout"


def test_a_fork_that_renamed_trains_variables_and_decorated_its_phases_stops_right(tmp_path):
    """tests/forks/renamed.diff renames train's variables (agent, optimizer, global_step,
    iteration, ...) and decorates rollout, make_batch and update (torch.profiler's
    record_function; torch.no_grad on rollout), as a tidy or profiled fork does. A SIGTERM in
    iteration 3's rollout (at its 6th env step) gives it up and checkpoints iteration 2; one as
    update 2 begins lets it end and checkpoints iteration 2; the same command then finishes the
    run, every iteration logged once."""
    if not is_repository_file():
        pytest.skip("renamed.diff is a diff of the repository's ppo_atari.py, not of a copy")
    fork = tmp_path / "fork"
    fork.mkdir()
    shutil.copy(SCRIPT, fork / "ppo_atari.py")
    diff = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forks", "renamed.diff")
    subprocess.run(["git", "apply", "-p0", diff], cwd=fork, check=True, timeout=60)
    script = str(fork / "ppo_atari.py")
    folders = {"rollout": tmp_path / "rollout", "update": tmp_path / "update"}
    job = [*JOB[:-4], "--checkpoint-interval", "1000", "--run-name", "job"]  # the stop writes it
    procs = {}
    for when, kill_at in (("rollout", "call:finished_games:70"), ("update", "call:make_batch:2")):
        folders[when].mkdir()  # both at once: (2 x 32 steps a rollout: step 70 is iteration 3's)
        procs[when] = killer(folders[when], kill_at, job, SIGNAL="SIGTERM",
                             PPO_ATARI_SCRIPT=script)
    for when, proc in procs.items():
        out, err = proc.communicate(timeout=200)
        held = P.load_checkpoint(str(folders[when] / "runs" / "job"))
        assert proc.returncode == 143 and "by SIGTERM; checkpoint written" in out, (when, err)
        assert (held["global_step"], held["iteration"]) == (2 * ITER, 2), (
            when, held["global_step"], held["iteration"])
    spec = importlib.util.spec_from_file_location("renamed", script)
    F = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(F)
    for when, folder in folders.items():
        again = run_in_process(job, folder, F)
        assert again.returncode == 0 and f"continuing runs/job at step {2 * ITER}" in \
            again.stdout, (when, again.stderr[-2000:])
        assert_finished(str(folder / "runs" / "job"))
