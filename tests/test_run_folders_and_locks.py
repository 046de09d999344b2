"""Run folders: one run, one folder, one writer. A run in use refused to a second launch,
freed by any exit of its holder; the dated or named folder (a folder of its own for runs started
in the same second, and for two torchrun jobs), --runs-dir, node-local runs/ folders that
disagree; what a resume refuses: another run name, another version or another file, an older
snapshot over a newer checkpoint, a folder of something else."""
import errno
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import torch

import ppo_atari as P
from conftest import (ITER, SCRIPT, TINY, free_port, launch, need, run_dirs, run_in_process,
                      run_script, scalars)


def test_a_second_launch_of_a_run_in_use_is_refused_and_a_kill_9_frees_it(tmp_path):
    """A job submitted twice: the second launch of --run-name same (here in the test's process)
    while the first (a process of its own) trains is refused in one line naming the holder
    (pid, host, SLURM job), exit 2, and touches nothing of the live run, which goes on. After a kill -9 of the holder, the same command continues the
    run at once, and the killed writer's temporary files are gone."""
    need("main")
    job = [*TINY, "--total-timesteps", "1000000", "--checkpoint-interval", "1",
           "--run-name", "same"]
    first = launch(job, tmp_path, env={"SLURM_JOB_ID": "777"})
    try:
        assert first.line_starting("step ") is not None, first.communicate(timeout=5)
        run = tmp_path / "runs" / "same"
        before = {f: (run / f).stat().st_mtime_ns for f in os.listdir(run)}
        second = run_in_process([*TINY, "--total-timesteps", "64", "--run-name", "same"],
                                tmp_path)  # (a budget that would end at once if it ran)
        out, err = second.stdout, second.stderr
        assert second.returncode == 2 and len(err.strip().splitlines()) == 1, (out, err)
        assert (f"runs/same is in use: pid {first.pid} on {socket.gethostname()} (SLURM job "
                f"777) holds its lock") in err and "--run-name" in err, err
        assert "Traceback" not in err and first.poll() is None
        after = os.listdir(run)  # no events file of its own, no temporary file of its pid
        assert {f for f in after if f.startswith("events")} == {
            f for f in before if f.startswith("events")}, (before, after)
        assert not [f for f in after if f".{os.getpid()}." in f], after
        assert first.line_starting("step ") is not None  # still training
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        first.kill()
    step = P.load_checkpoint(str(tmp_path / "runs" / "same"))["global_step"]
    (tmp_path / "runs" / "same" / "checkpoint.pt.99999.tmp").write_bytes(b"half")  # a dead one's
    again = run_in_process([*job[:-4], "--total-timesteps", str(step + ITER), "--run-name",
                            "same"], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"continuing runs/same at step {step:,}" in again.stdout, again.stdout
    assert not [f for f in os.listdir(tmp_path / "runs" / "same") if f.endswith(".tmp")]


def test_a_filesystem_that_cannot_lock_is_said_and_the_run_goes_on(workdir, monkeypatch):
    """An NFS mount without lockd answers flock with ENOLCK: one line says what is not protected
    and the run trains. (A patched fcntl.flock stands in: no such mount here.)"""
    need("main")

    def no_lock(*a):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(P.fcntl, "flock", no_lock)
    out = run_in_process([*TINY, "--total-timesteps", "64", "--run-name", "nfs"], workdir)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cannot lock files (No locks available): nothing stops a second launch of nfs from " \
           "writing it too" in out.stdout, out.stdout


NODE = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
        "--master_addr", "127.0.0.1"]


def test_node_local_runs_folders_that_disagree_stop_every_rank(tmp_path):
    """Two torchrun agents as two nodes, each in a working directory of its own (node-local
    runs/): the job first ran with node A as rank 0 and stopped at step 64 in A's folder; the
    requeue has node B as rank 0, which sees no checkpoint. Every rank stops in one line saying
    runs/ must be on a filesystem every node sees; nothing is written in B's folder, A's
    checkpoint is untouched."""
    need("main")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    out = run_in_process([*TINY, "--total-timesteps", "64", "--run-name", "multi"], a)
    assert out.returncode == 0, out.stderr[-2000:]
    checkpoint = (a / "runs" / "multi" / "checkpoint.pt").read_bytes()
    port, agents = free_port(), []
    for node_rank, folder in ((0, b), (1, a)):
        agents.append(subprocess.Popen(
            [*NODE, "--node_rank", str(node_rank), "--master_port", str(port), SCRIPT, *TINY,
             "--total-timesteps", "256", "--run-name", "multi", "--dist-timeout", "60"],
            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")))
    results = [agent.communicate(timeout=200) for agent in agents]
    for agent, (out, err) in zip(agents, results):
        assert agent.returncode != 0, (out, err[-2000:])
        line = [x for x in err.splitlines() if "must be on a filesystem every node sees" in x]
        assert line and "rank 1 on" in line[0] and "at step 64 and rank 0 on" in line[0] and \
            "none" in line[0], err[-3000:]
    assert not (b / "runs" / "multi").exists() or not os.listdir(b / "runs" / "multi")
    assert (a / "runs" / "multi" / "checkpoint.pt").read_bytes() == checkpoint


HELD_CLOCK = """
import os, sys, time
sys.path.insert(0, os.environ["SCRIPT_DIR"])
import tyro
import ppo_atari as P
clock = iter(range(10 ** 6))  # 1 ms a call, from the same instant in every job
P.time = type("Clock", (), {"time": staticmethod(lambda: 1_800_000_000 + next(clock) / 1000),
                            "perf_counter": staticmethod(time.perf_counter),
                            "sleep": staticmethod(time.sleep)})
if __name__ == "__main__":
    P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
"""


def test_two_torchrun_jobs_in_one_second_get_a_folder_each(tmp_path):
    """A sweep as an array of torchrun jobs without --run-name, started in the same second (a
    clock that starts every job at the same instant stands in): the second job gets NAME__2 and its own settings, as
    plain python does, instead of taking the first job's run for its own."""
    need("main")
    (tmp_path / "held.py").write_text(HELD_CLOCK)
    for rate in ("0.0001", "0.0003"):
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             "1", "held.py", *TINY, "--total-timesteps", "64", "--learning-rate", rate],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                     SCRIPT_DIR=os.path.dirname(SCRIPT)))
        assert out.returncode == 0, out.stderr[-3000:]
    runs = run_dirs(tmp_path)
    assert len(runs) == 2 and runs[1] == runs[0] + "__2", runs
    assert [P.load_checkpoint(r)["args"]["learning_rate"] for r in runs] == [1e-4, 3e-4]
    assert [P.load_checkpoint(r)["global_step"] for r in runs] == [64, 64]


def edit_args(path, add=None, remove=()):
    state = torch.load(path, weights_only=True)
    for name in remove:
        state["args"].pop(name)
    state["args"].update(add or {})
    torch.save(state, path)


def test_a_checkpoint_of_another_version_of_the_file(workdir):
    """A fork's checkpoint (a field this file lacks: its setting would be lost) is refused,
    naming the field; a renamed field names both spellings; one from an older file without a
    field this file added continues with its default, said, and the next checkpoint holds it."""
    need("main")
    run = workdir / "runs" / "f" / "checkpoint.pt"
    base = [*TINY, "--total-timesteps", "192", "--run-name", "f"]
    out = run_in_process([*base, "--stop-at-step", "64"], workdir)
    assert out.returncode == 0, out.stderr[-2000:]
    pristine = run.read_bytes()
    edit_args(run, add={"aux_coef": 0.5})
    out = run_in_process([*base, "--stop-at-step", "128"], workdir)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and "whose Args has --aux-coef, which this " \
        "file lacks" in err[0] and "continue it with the file that wrote it" in err[0], err
    run.write_bytes(pristine)
    edit_args(run, add={"entropy_coef": 0.01}, remove=["ent_coef"])
    out = run_in_process([*base, "--stop-at-step", "128"], workdir)
    assert out.returncode == 2 and "--entropy-coef, which this file lacks (it has --ent-coef " \
        "instead)" in out.stderr, out.stderr
    run.write_bytes(pristine)
    edit_args(run, remove=["target_kl"])
    out = run_in_process([*base, "--stop-at-step", "128"], workdir)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("was written by a file without --target-kl (continued with its "
                            "default, None)") == 1, out.stdout
    saved = P.load_checkpoint(str(run))
    assert saved["global_step"] == 128 and saved["args"]["target_kl"] is None


def test_an_older_snapshot_never_replaces_a_newer_checkpoint(workdir):
    """--resume runs/r/older.pt (a copy at step 64) while runs/r/checkpoint.pt holds step 128:
    refused in one line naming both steps and how to do it on purpose; nothing touched. Moved
    aside as the line says, the snapshot continues."""
    need("main")
    base = [*TINY, "--total-timesteps", "256", "--run-name", "r"]
    assert run_in_process([*base, "--stop-at-step", "64"], workdir).returncode == 0
    run = workdir / "runs" / "r"
    shutil.copy(run / "checkpoint.pt", run / "older.pt")
    assert run_in_process([*base, "--stop-at-step", "128"], workdir).returncode == 0
    before = {f: (run / f).read_bytes() for f in os.listdir(run) if f.endswith(".pt")}
    out = run_in_process([*TINY, "--resume", "runs/r/older.pt", "--stop-at-step", "192"],
                         workdir)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr
    assert "runs/r/older.pt holds step 64 but runs/r/checkpoint.pt is further along (step 128)" \
        in err[0] and "mv runs/r/checkpoint.pt runs/r/checkpoint-128.pt" in err[0], err[0]
    assert before == {f: (run / f).read_bytes() for f in before}
    os.rename(run / "checkpoint.pt", run / "checkpoint-128.pt")
    out = run_in_process([*TINY, "--resume", "runs/r/older.pt", "--stop-at-step", "128"],
                         workdir)
    assert out.returncode == 0 and "continuing runs/r at step 64" in out.stdout, out.stdout


def test_runs_dir_pins_the_run_whatever_the_working_directory(tmp_path):
    """A job script's line run from two working directories (sbatch's default is the submit
    directory): with --runs-dir DIR both reach one run, printed with its absolute path, new then
    continued; its continue line's --resume works from anywhere."""
    need("main")
    pinned = tmp_path / "shared" / "runs"
    line = [*TINY, "--total-timesteps", "192", "--run-name", "pin", "--runs-dir", str(pinned)]
    outs = []
    for cwd, stop in (("one", "64"), ("two", "128")):
        (tmp_path / cwd).mkdir()
        outs.append(run_in_process([*line, "--stop-at-step", stop], tmp_path / cwd))
        assert outs[-1].returncode == 0, outs[-1].stderr[-2000:]
    assert f"run folder: {pinned / 'pin'} (new)" in outs[0].stdout, outs[0].stdout
    assert f"run folder: {pinned / 'pin'} (continued)" in outs[1].stdout, outs[1].stdout
    assert not (tmp_path / "one" / "runs").exists() and not (tmp_path / "two" / "runs").exists()
    assert P.load_checkpoint(str(pinned / "pin"))["global_step"] == 128
    out = run_in_process([*TINY, "--resume", str(pinned / "pin")], tmp_path)
    assert out.returncode == 0 and P.load_checkpoint(str(pinned / "pin"))["global_step"] == 192


def test_small_bad_input_writes_nothing_and_durations_survive_a_clock_step(workdir, monkeypatch):
    """--track without wandb is refused before a folder is made; an over-long --run-name or
    --exp-name is refused in one line (not ENAMETOOLONG's traceback); a wall clock that steps an
    hour back and forth mid-run (NTP, a suspended VM) changes no logged duration: they are read
    from a monotonic clock."""
    need("main")
    real_spec = P.importlib.util.find_spec
    monkeypatch.setattr(P.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real_spec(name, *a))
    out = run_in_process([*TINY, "--total-timesteps", "64", "--track"], workdir)
    assert out.returncode == 2 and "--track needs wandb" in out.stderr, out.stderr
    assert not (workdir / "runs").exists(), os.listdir(workdir / "runs")
    monkeypatch.undo()
    for flag in ("--run-name", "--exp-name"):
        out = run_in_process([*TINY, "--total-timesteps", "64", flag, "x" * 300], workdir)
        err = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(err) == 1 and "at most 240 bytes" in err[0], (flag, err)
    assert not (workdir / "runs").exists() or not os.listdir(workdir / "runs")
    readings = iter(range(10 ** 6))  # every other reading an hour back: any wall-clock
    monkeypatch.setattr(P.time, "time", lambda: 1_800_000_000 - 3600 * (next(readings) % 2))
    out = run_in_process([*TINY, "--total-timesteps", "192", "--run-name", "clock"], workdir)
    assert out.returncode == 0, out.stderr[-2000:]
    logged = scalars(str(workdir / "runs" / "clock"))
    for tag in ("charts/rollout_time", "charts/update_time", "charts/SPS"):
        assert all(0 < v < 3600 for _, v in logged[tag]), (tag, logged[tag])


def test_a_run_continues_only_with_the_file_that_trained_it(tmp_path):
    """The checkpoint records the file that wrote it (its name, a hash of its core): the same
    command with another file (the baseline over a fork's run), or with this file's core edited,
    is refused in one line naming both and the step held, and writes nothing; an edit below the
    fence changes nothing; --allow-other-file continues on purpose, and the run's events record
    it. (Each copy imported in this process: the file's name and text are what count.)"""
    need("main")
    source = open(SCRIPT).read()
    fence = "# ================================= THE FENCE"
    if source.count(fence) != 1:
        need(what="one line `# ===... THE FENCE ===...`", problem="this copy has none")
    core, machinery = source.split(fence)
    edited = core.replace('"""coefficient of the entropy bonus"""',
                          '"""the entropy bonus\'s coefficient"""') + fence + machinery
    copies = {"fork.py": source, "baseline/ppo_atari.py": edited, "core/fork.py": edited,
              "below/fork.py": source + "\n# an edit below the fence\n"}
    modules = {}
    for name, text in copies.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
        spec = importlib.util.spec_from_file_location(name[:-3].replace("/", "_"), tmp_path / name)
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    command = [*TINY, "--total-timesteps", "192", "--run-name", "local-fork-s1"]
    out = run_in_process([*command, "--stop-at-step", "64"], tmp_path, modules["fork.py"])
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "runs" / "local-fork-s1"
    before = sorted(os.listdir(run)), (run / "checkpoint.pt").read_bytes()
    for name, other in (("baseline/ppo_atari.py", "ppo_atari.py"), ("core/fork.py", "fork.py")):
        out = run_in_process([*command, "--stop-at-step", "128"], tmp_path, modules[name])
        err = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(err) == 1, out.stderr[-2000:]
        assert "(step 64) was trained by fork.py (core " in err[0] and f"not by this {other} " \
            "(core " in err[0] and "--allow-other-file" in err[0], err[0]
        assert (sorted(os.listdir(run)), (run / "checkpoint.pt").read_bytes()) == before
    out = run_in_process([*command, "--stop-at-step", "128"], tmp_path, modules["below/fork.py"])
    assert out.returncode == 0 and "continuing runs/local-fork-s1 at step 64" in out.stdout, \
        out.stderr[-2000:]
    out = run_in_process([*command, "--allow-other-file"], tmp_path,
                         modules["baseline/ppo_atari.py"])
    assert out.returncode == 0 and P.load_checkpoint(str(run))["global_step"] == 192, \
        out.stderr[-2000:]
    from tensorboard.backend.event_processing import event_accumulator
    acc = event_accumulator.EventAccumulator(str(run), size_guidance={"tensors": 0})
    acc.Reload()
    launches = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("launch/text_summary")]
    assert any("with --allow-other-file, continues what fork.py (core" in t for t in launches), \
        launches


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


def test_resume_under_another_run_name_is_refused_and_damages_nothing(agent_file):
    """--resume runs/r --run-name other would continue runs/r with another name recorded:
    one line, exit 2, the run's files unchanged."""
    cwd, _ = agent_file
    before = {f: open(os.path.join(cwd, "runs", "r", f), "rb").read()
              for f in ("checkpoint.pt", "agent.pt")}
    out = run_script(["--resume", "runs/r", "--run-name", "other", "--no-cuda"], cwd)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr[-2000:]
    assert "--run-name other is not the run --resume runs/r continues (r)" in err[0], err
    assert before == {f: open(os.path.join(cwd, "runs", "r", f), "rb").read() for f in before}
    assert not os.path.exists(os.path.join(cwd, "runs", "other"))


def test_new_runs_started_in_the_same_second_get_folders_of_their_own(workdir, monkeypatch):
    """A sweep starts runs of one seed at once without --run-name (another learning rate
    each): their dated names fall in the same second. The second gets a folder of its own
    (NAME__2) instead of being taken for a continuation of the first, whose files it leaves
    alone; its checkpoint records its own settings. Two evaluations of one agent in the same
    second log apart. A clock whose seconds never turn stands in for the same second."""
    need("main")
    clock = iter(range(10 ** 6))  # 1 ms a call: the same second for 1000 calls
    monkeypatch.setattr(P, "time", type("Clock", (), {
        "time": staticmethod(lambda: 1_800_000_000 + next(clock) / 1000),
        "perf_counter": staticmethod(time.perf_counter), "sleep": staticmethod(time.sleep)}))
    small = dict(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                 total_timesteps=64)
    P.main(P.Args(**small, learning_rate=1e-4))
    (first,) = run_dirs(workdir)
    before = {f: open(os.path.join(first, f), "rb").read() for f in os.listdir(first)
              if f.endswith(".pt")}
    P.main(P.Args(**small, learning_rate=3e-4))
    runs = run_dirs(workdir)
    assert runs == [first, first + "__2"], runs
    assert before == {f: open(os.path.join(first, f), "rb").read() for f in before}
    assert [P.load_checkpoint(r)["args"]["learning_rate"] for r in runs] == [1e-4, 3e-4]
    for _ in range(2):  # two evaluations of one agent in the same second: two TensorBoard runs
        P.main(P.Args(eval_checkpoint=os.path.join(first, "agent.pt"), eval_episodes=1,
                      cuda=False), explicit={"eval_checkpoint", "eval_episodes", "cuda"})
    evaluations = sorted(os.listdir(os.path.join(first, "eval")))
    assert len(evaluations) == 2, evaluations  # (named to the millisecond)
