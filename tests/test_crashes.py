"""What a crash costs: a kill -9 at any instant leaves a run the same command finishes,
--checkpoint-minutes bounds what it loses, torchrun --max-restarts brings a SIGKILLed worker's run
back; a full disk, a read-only folder and closed output say what they cost. The filesystem tests
run on a small tmpfs mounted in a private mount namespace (`unshare -m`, which needs root or user
namespaces; they skip with the reason where it is refused)."""
import functools
import glob
import os
import pty
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ppo_atari as P
from conftest import (ITER, JOB, SCRIPT, TINY, assert_finished, free_port, killed_at, killer,
                      launch, listing, need, run_in_process, scalars)


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


@functools.cache
def private_tmpfs_refused() -> str | None:
    """Why this machine cannot mount a private tmpfs (None: it can)."""
    try:
        done = subprocess.run(["unshare", "-m", "sh", "-c", 'd=$(mktemp -d) && mount -t tmpfs '
                               '-o size=1m none "$d" && umount "$d" && rmdir "$d"'],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare: {e}"
    return None if done.returncode == 0 else f"unshare -m: {done.stderr.strip()[:120]}"


def in_small_filesystem(script: str, cwd, megabytes: int) -> subprocess.CompletedProcess:
    """script (sh) run with $D a tmpfs of that size, seen by it alone, and $RUN `python
    SCRIPT` with the tiny configuration; the files it leaves in cwd stay."""
    if private_tmpfs_refused():
        pytest.skip(private_tmpfs_refused())
    env = dict(os.environ, RUN=f"{sys.executable} {SCRIPT} {' '.join(TINY)}",
               PYTHONWARNINGS="ignore")
    body = f'set -u; D=$(mktemp -d); mount -t tmpfs -o size={megabytes}m none "$D"; {script}'
    return subprocess.run(["unshare", "-m", "sh", "-c", body], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_a_full_disk_ends_the_run_in_one_line_keeps_its_checkpoint_and_leaves_no_temporary(
        tmp_path):
    """A run checkpointing every iteration; once its first is done the disk is filled to 1 MiB
    (the events fit, a checkpoint does not): exit 1, one line naming the file, the cause and
    the step the checkpoint holds, which loads; no .tmp left. The same command then finds no
    room for two checkpoints and says so in one line, touching nothing; a new run there is
    refused alike, and leaves no folder. A run that checkpoints rarely, its disk filled to the
    last byte: the events' write fails, in one line too."""
    need("main")
    done = in_small_filesystem('''
        E=$(mktemp -d); mount -t tmpfs -o size=64m none "$E"
        $RUN --total-timesteps 100000 --checkpoint-interval 1 --runs-dir "$D" --run-name r \
            > out1 2> err1 &
        first=$!
        $RUN --total-timesteps 100000 --checkpoint-interval 1000 --runs-dir "$E" --run-name r \
            > out4 2> err4 &
        while ! grep -q "^step " out1 && kill -0 $first 2>/dev/null; do sleep 0.05; done
        free=$(df --output=avail -k "$D" | tail -1)
        dd if=/dev/zero of="$D/filler" bs=1k count=$((free - 1024)) 2>/dev/null
        while ! grep -q "^step " out4 && kill -0 $! 2>/dev/null; do sleep 0.05; done
        cat /dev/zero > "$E/filler" 2>/dev/null
        wait $first; echo $? > rc1
        ls -a "$D/r" > listing; cp "$D/r/checkpoint.pt" held.pt
        $RUN --total-timesteps 100000 --checkpoint-interval 1 --runs-dir "$D" --run-name r \
            > out2 2> err2; echo $? > rc2; ls -a "$D/r" > listing2
        $RUN --total-timesteps 64 --runs-dir "$D" --run-name new > out3 2> err3; echo $? > rc3
        ls -a "$D" > listing3
        wait $!; echo $? > rc4; ls -a "$E/r" > listing4
        ''', tmp_path, 64)
    assert done.returncode == 0, done.stderr
    read = lambda name: (tmp_path / name).read_text()  # noqa: E731
    assert read("rc1").strip() == "1", read("err1")
    line, held = one_error_line(read("err1")), P.load_checkpoint(str(tmp_path / "held.pt"))
    assert "cannot write" in line and ".pt" in line and "the disk is full" in line, line
    assert f"holds step {held['global_step']:,}" in line and held["global_step"] >= 64, line
    assert not [f for f in read("listing").split() if "tmp" in f], read("listing")
    assert read("rc2").strip() == "1" and read("listing2") == read("listing"), read("err2")
    line = one_error_line(read("err2"))
    assert "has room for" in line and "two checkpoints" in line and "free some space" in line
    assert read("rc3").strip() == "1" and "new" not in read("listing3").split(), read("err3")
    assert "or pass --runs-dir on another disk" in one_error_line(read("err3"))
    assert read("rc4").strip() == "1" and "tmp" not in read("listing4"), read("err4")
    line = one_error_line(read("err4"))
    assert line.startswith("error: cannot write the events in ") and "the disk is full" in \
        line and "holds step " in line, line


def test_a_read_only_run_folder_is_evaluated_with_its_events_under_runs_here(tmp_path):
    """A run trained on a filesystem then made read-only: its agent plays, and the evaluation's
    events go to runs/NAME/eval of the working directory, which it says."""
    need("main")
    done = in_small_filesystem('''
        $RUN --total-timesteps 64 --runs-dir "$D" --run-name r > out1 2> err1 || exit 3
        mount -o remount,ro "$D"
        $RUN --eval-checkpoint "$D/r/agent.pt" --eval-episodes 1 > out2 2> err2; echo $? > rc2
        ''', tmp_path, 64)
    assert done.returncode == 0, done.stderr + (tmp_path / "err1").read_text()
    out, err = ((tmp_path / f).read_text() for f in ("out2", "err2"))
    assert (tmp_path / "rc2").read_text().strip() == "0", err
    assert "is read-only: the evaluation writes to runs/r instead" in out, out
    (events,) = glob.glob(str(tmp_path / "runs" / "r" / "eval" / "*"))
    acc = EventAccumulator(events)
    acc.Reload()
    assert len(acc.Scalars("eval/episodic_return")) == 1


def test_closed_output_never_stops_a_run(tmp_path):
    """stdout and stderr are pipes closed after the first line (`| head -1`, a dropped `| tee`):
    the run goes on to its end, exit 0, every iteration logged; its events name the run
    folder. A terminal that hangs up (a pty whose master closes: EIO) likewise."""
    need("main")
    command = [sys.executable, SCRIPT, *TINY, "--total-timesteps", str(3 * 64)]
    piped = subprocess.Popen([*command, "--run-name", "piped"], cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    master, slave = pty.openpty()
    hung_up = subprocess.Popen([*command, "--run-name", "hung-up"], cwd=tmp_path, stdout=slave,
                               stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    assert piped.stdout.readline() and os.read(master, 100)
    for closed in (piped.stdout, piped.stderr):
        closed.close()
    os.close(master)
    assert piped.wait(timeout=200) == 0 and hung_up.wait(timeout=200) == 0
    for name in ("piped", "hung-up"):
        run = tmp_path / "runs" / name
        assert P.load_checkpoint(str(run))["global_step"] == 3 * 64, name
        acc = EventAccumulator(str(run), size_guidance={"tensors": 0})
        acc.Reload()
        assert [e.step for e in acc.Scalars("charts/SPS")] == [64, 128, 192], name
        (launch,) = acc.Tensors("launch/text_summary")
        assert str(run) in launch.tensor_proto.string_val[0].decode(), name
