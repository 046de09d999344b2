"""Every stop and signal, in real processes: Ctrl-C, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2
checkpoint and print the command that continues the run (exit 128 + n); a stop mid-rollout gives
the rollout up within a second; a second Ctrl-C exits at once; signals ignored at start stay
ignored; async workers and torchrun ranks stop with the trainer; --stop-at-step; a stop during an
evaluation; main() from a thread or with a closed stderr; a fork that renamed train's variables."""
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

import conftest
import ppo_atari as P
from conftest import (ITER, JOB, Launched, SCRIPT, TINY, assert_finished, free_port,
                      is_repository_file, killed_at, killer, launch, left_in_session, listing,
                      need, run_dirs, run_in_process, scalars, tiny_args)


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


def test_a_two_node_torchrun_job_stopped_on_one_node_with_async_workers(tmp_path):
    """Two torchrun agents as two nodes (one rank each, async envs, node-local folders); only
    node 1 is stopped, by Ctrl-C to its process group (a terminal's; a multi-node preemption's
    notice may reach one node alone). The stop is agreed over ranks at the iteration's end, so
    rank 0 on node 0 stops in the same iteration, well within --dist-timeout: rank 0 writes the
    one checkpoint (its node's folder only) at the step its line names and prints the line that
    continues the run with the same torchrun launcher; no worker traceback or leaked-resource
    warning on either node, no process of either left. Both agents exit 1 (node 1's with
    torch's SignalException, as README says; node 0's as its rank stopped)."""
    port, agents, logs = free_port(), [], []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        logs.append((open(folder / "out.txt", "w+"), open(folder / "err.txt", "w+")))
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
             "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", SCRIPT,
             *TINY, "--total-timesteps", "100000", "--env-backend", "async", "--run-name", "mn",
             "--dist-timeout", "30"], cwd=folder, stdout=logs[-1][0], stderr=logs[-1][1],
            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1")))
    try:
        deadline = time.time() + 200
        while time.time() < deadline and not any(
                "step " in (tmp_path / f"node{n}" / "out.txt").read_text() for n in (0, 1)):
            time.sleep(0.2)
        start = time.time()
        os.killpg(agents[1].pid, signal.SIGINT)
        for agent in agents:
            agent.wait(timeout=120)
        seconds = time.time() - start
    finally:
        for agent in agents:
            agent.kill()
    for agent in agents:
        assert not left_in_session(agent.pid), "processes of a node outlived its agent"
    outs = [(tmp_path / f"node{n}" / "out.txt").read_text() for n in (0, 1)]
    errs = [(tmp_path / f"node{n}" / "err.txt").read_text() for n in (0, 1)]
    assert agents[1].returncode == 1 and "SignalException" in errs[1], errs[1][-2000:]
    assert agents[0].returncode == 1, (agents[0].returncode, errs[0][-2000:])
    for err in errs:
        ours = "\n".join(x for x in err.splitlines() if "torch/distributed" not in x)
        for noise in ("_async_worker", "BrokenPipeError", "EOFError", "leaked"):
            assert noise not in ours, err[-3000:]
    lines = [x for x in outs[0].splitlines() if "continue with: " in x]
    assert len(lines) == 1 and " by a signal to another rank; checkpoint written;" in lines[0], \
        outs[0][-2000:]
    resume = lines[0].split("continue with: ", 1)[1]
    assert resume.startswith("the same torchrun launcher and options, then: "), resume
    step = int(lines[0].split("stopped at step ")[1].split(" of ")[0].replace(",", ""))
    assert P.load_checkpoint(str(tmp_path / "node0" / "runs" / "mn"))["global_step"] == step
    assert step >= 2 * ITER and not (tmp_path / "node1" / "runs" / "mn").exists()
    assert seconds < 30, f"node 0 stopped {seconds:.0f} s after node 1: at --dist-timeout"


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


def test_a_sigterm_to_one_rank_alone_stops_every_rank_in_the_same_iteration(tmp_path):
    """A multi-node preemption's SIGTERMs land in different iterations, or one node gets its own
    notice: here only rank 1's trainer is signalled (torchrun with two processes; two nodes, one
    stopped alone: the test above). The stop is agreed over ranks at each iteration's end, so
    rank 0 stops in the same iteration: one checkpoint (rank 0's folder only), at the step its
    line names, and the line that continues the run, well within --dist-timeout (a rank left
    training would wait that long in the next all-reduce, then fail)."""
    need("main")
    common = [SCRIPT, *TINY, "--total-timesteps", "100000", "--run-name", "one",
              "--dist-timeout", "30"]
    commands = [["--standalone", "--nproc_per_node", "2"]]
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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_async_workers_survive_a_stop_signal_to_the_process_group(tmp_path, signum):
    """SLURM sends SIGTERM to every process, an ssh drop SIGHUP to the process group: the
    workers (and the resource tracker and the server they fork from) must keep serving the
    trainer until it has finished its iteration and written the checkpoint; exit 128 + n, no
    traceback, no process left."""
    proc = launch([*TINY, "--total-timesteps", "100000", "--env-backend", "async"], tmp_path,
                  new_session=True)
    proc.line_starting("step ")
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum and f"by {signum.name}; checkpoint written" in out, \
        err[-2000:]
    assert "Traceback" not in err and not left_in_session(proc.pid), err[-2000:]
    (run,) = run_dirs(tmp_path)
    assert P.load_checkpoint(run)["global_step"] >= 64


SIGNAL_IN_STEP = """
import importlib.util, os, signal, sys
import gymnasium as gym, tyro
spec = importlib.util.spec_from_file_location("ppo_atari", os.environ["PPO_ATARI_SCRIPT"])
P = importlib.util.module_from_spec(spec)
sys.modules["ppo_atari"] = P
spec.loader.exec_module(P)
class Pipe:  # env 1's pipe: its 140th answer (iteration 2's 7th step) comes with a SIGTERM
    def __init__(self, pipe):
        self.pipe, self.answers = pipe, 0
    def __getattr__(self, name):
        return getattr(self.pipe, name)
    def recv(self):
        self.answers += 1
        if self.answers == 140:  # (after env 0's answer: the step's answers half read)
            os.kill(os.getpid(), signal.SIGTERM)
        return self.pipe.recv()
real_init = gym.vector.AsyncVectorEnv.__init__
def init(self, *a, **kw):
    real_init(self, *a, **kw)
    self.parent_pipes[1] = Pipe(self.parent_pipes[1])
gym.vector.AsyncVectorEnv.__init__ = init
if __name__ == "__main__":  # env workers import this file as their main module
    P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
"""


def test_a_stop_inside_an_async_step_waits_for_the_step_then_gives_the_rollout_up(tmp_path):
    """A SIGTERM while the trainer reads the workers' answers to a step: given up there, the
    answers would be left half read and closing the envs would wait forever; the rollout is
    given up once the step is read: exit 143, iteration 1's checkpoint, no process left."""
    need("main")
    (tmp_path / "signaller.py").write_text(SIGNAL_IN_STEP)
    proc = launch([*TINY, "--num-steps", "128", "--total-timesteps", "100000", "--env-backend",
                   "async", "--run-name", "r"], tmp_path, script=tmp_path / "signaller.py",
                  new_session=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "by SIGTERM; checkpoint written" in out, err[-2000:]
    assert P.load_checkpoint(str(tmp_path / "runs" / "r"))["global_step"] == 256
    assert not left_in_session(proc.pid), "processes of the run outlived it"


def test_a_ctrl_c_while_async_workers_start_does_not_hang_the_exit(tmp_path):
    """A script of one's own that makes the async envs itself (Python's own Ctrl-C: a
    KeyboardInterrupt) and gets a Ctrl-C while the workers start: the signal waits, blocked,
    until the vector env exists, then interrupts. The exit must not hang: the hook that kills
    the workers is in place before they start (multiprocessing's own would SIGTERM them, which
    they ignore, and wait for them forever)."""
    need("vector env")
    (tmp_path / "starter.py").write_text(
        "import os, signal, gymnasium as gym, ppo_atari as P\n"
        "real = gym.vector.AsyncVectorEnv._check_spaces\n"
        "def check_spaces(self):  # a Ctrl-C to the group while the workers start\n"
        "    os.killpg(os.getpgid(0), signal.SIGINT)\n"
        "    return real(self)\n"
        "gym.vector.AsyncVectorEnv._check_spaces = check_spaces\n"
        "if __name__ == '__main__':  # env workers import this file as their main module\n"
        "    P.make_envs(P.Args(num_envs=2, env_backend='async'), seed=0)\n")
    proc = launch([], tmp_path, script=tmp_path / "starter.py", new_session=True,
                  env={"PYTHONPATH": conftest.IMPORTABLE})
    _, err = proc.communicate(timeout=60)  # forever when the workers outlive the exit hook
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, (proc.returncode, err[-2000:])


def signal_masks(pid):
    """(ignored, caught) signal numbers of a process, from /proc."""
    status = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines()
                  if ":\t" in line)
    mask = lambda hexmask: {s for s in range(1, 32) if int(hexmask, 16) >> (s - 1) & 1}  # noqa
    return mask(status["SigIgn"]), mask(status["SigCgt"])


def test_async_workers_ignore_signals_with_no_timer_and_die_with_the_trainer(tmp_path):
    """A worker ignores SIGINT and SIGTERM outright (no alarm that would kill it during a long
    iteration and checkpoint), and exits when its trainer is killed."""
    need("vector env")
    (tmp_path / "trainer.py").write_text(
        "import time, ppo_atari as P\n"
        "if __name__ == '__main__':  # env workers import this file as their main module\n"
        "    envs = P.make_envs(P.Args(num_envs=2, env_backend='async'), seed=0)\n"
        "    envs.reset(seed=0)\n"
        "    print('workers:', *(p.pid for p in envs.processes), flush=True)\n"
        "    time.sleep(600)\n")
    trainer = launch([], tmp_path, script=tmp_path / "trainer.py",
                     env={"PYTHONPATH": conftest.IMPORTABLE})
    line = trainer.line_starting("workers: ")
    assert line is not None, (trainer.kill(), trainer.communicate()[1][-2000:])
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 2
    for pid in pids:
        ignored, caught = signal_masks(pid)
        assert {signal.SIGINT, signal.SIGTERM} <= ignored, "a worker must ignore both"
        assert signal.SIGALRM not in caught and signal.SIGTERM not in caught
    assert signal.SIGINT not in signal_masks(trainer.pid)[0], "the trainer must not ignore it"
    trainer.kill()  # SIGKILL: no atexit, no cleanup; the workers' pipes close
    trainer.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") and
                                         "Z" not in open(f"/proc/{p}/stat").read().split()[2]
                                         for p in pids):
        time.sleep(0.2)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}")
             and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    assert not alive, "workers outlived their trainer"
    time.sleep(2)  # the resource tracker's turn, once every holder of its pipe is gone
    err = trainer.communicate()[1]  # the workers and the tracker write to the trainer's stderr
    assert "Traceback" not in err and "leaked" not in err, err[-3000:]


STUCK = """
import importlib.util, os, sys, time
import gymnasium as gym
import tyro
spec = importlib.util.spec_from_file_location("ppo_atari", os.environ["PPO_ATARI_SCRIPT"])
P = importlib.util.module_from_spec(spec)
sys.modules["ppo_atari"] = P
spec.loader.exec_module(P)

class Stuck(gym.Wrapper):  # once STUCK_FLAG exists, a step takes two minutes
    def step(self, action):
        if os.path.exists(os.environ["STUCK_FLAG"]):
            time.sleep(120)
        return self.env.step(action)

real_make_env = P.make_env
P.make_env = lambda *a, **kw: (lambda thunk: lambda: Stuck(thunk()))(real_make_env(*a, **kw))
if __name__ == "__main__":  # async env workers import this file as their main module
    P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
"""


def test_a_second_ctrl_c_kills_async_workers_stuck_in_a_step(tmp_path):
    """The second Ctrl-C ends the run at once, workers included: a worker in the middle of a
    step that takes two minutes (a hung emulator, a slow fork's env) is killed with the trainer
    instead of finishing its step first (it would find the trainer gone only then)."""
    need("main")
    (tmp_path / "stuck.py").write_text(STUCK)
    flag = tmp_path / "stuck-now"
    proc = launch([*TINY, "--total-timesteps", "100000", "--env-backend", "async",
                   "--run-name", "stuck"], tmp_path, script=tmp_path / "stuck.py",
                  env={"STUCK_FLAG": str(flag)}, new_session=True)
    try:
        assert proc.line_starting("step ") is not None, proc.communicate()[1][-2000:]
        flag.write_text("")  # the workers' next step hangs, and the trainer waits for it
        time.sleep(1.0)
        for _ in range(2):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
        proc.wait(timeout=30)
        left = left_in_session(proc.pid, within=10)
        assert proc.returncode == 130, (proc.returncode, open(proc.err).read()[-2000:])
        assert not left, f"{len(left)} process(es) of the run still alive 10 s after it exited " \
            f"(its workers, still in their step)"
    finally:
        for pid in left_in_session(proc.pid, within=0):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("when", ["training", "workers starting"])
def test_a_second_ctrl_c_with_async_workers_exits_quietly_and_leaves_none(tmp_path, when):
    """Two Ctrl-Cs to the process group (a terminal's), async workers, during an update: the
    first is answered at once (the stop waits for the update: about how long; a second Ctrl-C
    quits), the second exits 130 with the line that says so, no worker traceback, no
    leaked-resource warning, every process of the run gone. While the workers start (their
    signals blocked), the second still exits before any iteration."""
    # updates of seconds (100 epochs): the second Ctrl-C comes while the first's stop waits for
    # the update's end, not after the run has ended (its last teardown, where Python has given
    # the signals back to the system's default, would end it by SIGINT: -2)
    proc = launch([*TINY, "--update-epochs", "100", "--num-minibatches", "1", "--total-timesteps",
                   "100000", "--env-backend", "async", "--run-name", "twice"], tmp_path,
                  new_session=True)
    assert proc.line_starting("step " if when == "training" else "device: ") is not None, \
        proc.communicate()[1][-2000:]
    time.sleep(0.5 if when == "training" else 0)  # iteration 2's rollout (64 steps) is done
    deadline = time.time() + 30  # starting: once the fork server, the 2 workers and the tracker
    while when != "training" and len(left_in_session(proc.pid, 0)) < 5 and \
            time.time() < deadline:  # exist, while the workers start and the mask is on
        time.sleep(0.02)
    for _ in range(2):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.3)
    out, _ = proc.communicate(timeout=30)
    assert not left_in_session(proc.pid), "processes of the run outlived it"
    err = open(proc.err).read()  # the workers' and the tracker's stderr too, now all are gone
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    first, *rest = err.strip().splitlines()  # the first Ctrl-C's answer, then the second's
    assert rest == ["", "second Ctrl-C: exiting now without a checkpoint"], err[-3000:]
    timed = r"within about \d+ s, an iteration's time" if when == "training" else \
        r"the first, not timed yet"
    assert re.fullmatch(r"Ctrl-C: stopping: the rollout in progress is given up and the last "
                        r"whole iteration checkpointed, or the update in progress ends \(" +
                        timed + r"\) and its iteration is checkpointed; a second Ctrl-C quits "
                        r"at once without a checkpoint( \(the last holds step 0\))?", first), first
    if when == "workers starting":
        assert "step " not in out, "an iteration ran between the two Ctrl-Cs"


def test_main_in_a_thread_trains_to_its_end_and_leaves_signals_to_the_caller(tmp_path):
    """A sweep's trial thread (Optuna, Ray Tune) calls main(): Python lets only the main thread
    set signal handlers, so the run says that Ctrl-C is the caller's and trains to its end."""
    need("main")
    (tmp_path / "sweep.py").write_text(
        "import sys, threading\nsys.path.insert(0, sys.argv[1])\nimport ppo_atari as P\n"
        "args = P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, "
        "cuda=False, threads=1, total_timesteps=128, run_name='trial')\n"
        "done = []\nthread = threading.Thread(target=lambda: done.append(P.main(args)))\n"
        "thread.start()\nthread.join()\nassert done and done[0] is not None\n")
    out = subprocess.run([sys.executable, "sweep.py", os.path.dirname(SCRIPT)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "note: main() runs outside the main thread: Ctrl-C and SIGTERM are left to the " \
           "caller" in out.stdout, out.stdout
    assert P.load_checkpoint(str(tmp_path / "runs" / "trial"))["global_step"] == 128


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_evaluation_prints_the_games_played_and_exits_quietly(agent_file, sig):
    """Ctrl-C (130) or SIGTERM (143) while --eval-checkpoint plays: it stops at once, prints
    the score over the games it played, says it was stopped, and shows no traceback."""
    need("main")
    cwd, path = agent_file
    proc = launch(["--eval-checkpoint", path, "--eval-episodes", "1000", "--no-cuda",
                   "--threads", "1"], cwd)
    assert proc.line_starting("game 1: ", timeout=200), proc.communicate()[1][-2000:]
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig and "Traceback" not in err, (proc.returncode, err)
    played = out.count("\ngame ")
    assert f"over {played} game" in out and \
        f"stopped by {signal.Signals(sig).name} after {played} of 1000 games" in out, out


def test_a_signal_the_instant_its_handler_is_set_is_recorded(monkeypatch):
    """The handler records a stop signal in the list the loop reads, from the instant it is
    installed (here the signal is sent by signal.signal itself)."""
    need("main")
    real = signal.signal

    def install_then_signal(signum, handler):
        old = real(signum, handler)
        if signum == signal.SIGTERM and handler not in (signal.SIG_DFL, signal.SIG_IGN):
            os.kill(os.getpid(), signal.SIGTERM)
        return old
    saved = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    monkeypatch.setattr(signal, "signal", install_then_signal)
    stop = []
    release = P.catch_stop_signals(stop)
    try:
        assert stop == [signal.SIGTERM], "the signal sent as its handler was set was lost"
    finally:
        release()
        monkeypatch.undo()
        for s, h in zip((signal.SIGINT, signal.SIGTERM), saved):
            signal.signal(s, h)


CLOSED_STDERR = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import ppo_atari as P
read, write = os.pipe()
os.close(read)
os.dup2(write, 2)  # stderr: a pipe whose reader is gone (a sweep's closed log)
real = P.log_iteration
def log_iteration(*a, **kw):  # a SIGTERM as iteration 1 is logged
    real(*a, **kw)
    os.kill(os.getpid(), signal.SIGTERM)
P.log_iteration = log_iteration
try:
    P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                  threads=1, total_timesteps=100000, run_name="sweep"))
except SystemExit as e:
    print("exit", e.code, flush=True)
"""


def test_main_from_a_script_whose_stderr_is_closed_still_stops_on_sigterm(tmp_path):
    """A sweep script calls main() with its stderr a closed pipe (not wrapped: not run as a
    script): the answer to the stop cannot be written, and the stop holds all the same: the
    iteration is checkpointed and main exits 143."""
    need("main")
    (tmp_path / "sweep.py").write_text(CLOSED_STDERR)
    out = subprocess.run([sys.executable, "sweep.py", os.path.dirname(SCRIPT)], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         timeout=200)
    assert "exit 143" in out.stdout and "stopped at step 64 of 100,000 by SIGTERM" in out.stdout, \
        out.stdout[-2000:]
    assert P.load_checkpoint(str(tmp_path / "runs" / "sweep"))["global_step"] == 64


def test_stop_at_step_keeps_the_full_plans_schedule_and_continues_to_it(workdir, capsys):
    """--stop-at-step: a run planned for 4 iterations and stopped after 2 has trained with the
    learning rates of the full plan's first 2; the same command without it finishes the plan."""
    (workdir / "full").mkdir()
    (workdir / "cut").mkdir()
    os.chdir(workdir / "full")
    P.main(tiny_args(total_timesteps=4 * 64, run_name="r"))
    full = scalars(str(workdir / "full" / "runs" / "r"))
    os.chdir(workdir / "cut")
    P.main(tiny_args(total_timesteps=4 * 64, run_name="r", stop_at_step=100))  # mid-iteration 2
    run = str(workdir / "cut" / "runs" / "r")
    ckpt = P.load_checkpoint(run)
    assert ckpt["global_step"] == 128 and ckpt["args"]["total_timesteps"] == 4 * 64
    assert P.load_checkpoint(os.path.join(run, "agent.pt"))["finished"] is False
    assert "stopped at step 128 of 256 by --stop-at-step; checkpoint written; continue with: " \
        in capsys.readouterr().out
    cut = scalars(run)
    assert cut["charts/learning_rate"] == full["charts/learning_rate"][:2]
    assert cut["losses/value_loss"] == full["losses/value_loss"][:2]  # the same training
    # the same command again: already past the stop, nothing written
    P.main(tiny_args(total_timesteps=4 * 64, run_name="r", stop_at_step=100))
    assert "already past --stop-at-step 100; nothing written" in capsys.readouterr().out
    P.main(tiny_args(total_timesteps=4 * 64, run_name="r", stop_at_step=128))  # exactly there
    assert "has run 128 steps, already at --stop-at-step 128; nothing written" in \
        capsys.readouterr().out
    assert P.load_checkpoint(run)["global_step"] == 128
    # without it: on to the full plan, along the same schedule
    P.main(tiny_args(total_timesteps=4 * 64, run_name="r"))
    assert P.load_checkpoint(run)["global_step"] == 256
    assert scalars(run)["charts/learning_rate"] == full["charts/learning_rate"]
