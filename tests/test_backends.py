"""The environment: the in-file wrappers, in this process (sync) or a process per env (async)
with the same numbers; async workers serve the trainer through signals and die with it."""
import gc
import importlib.util
import os
import re
import signal
import time
import weakref

import numpy as np
import pytest
import torch

import ppo_atari as P
import conftest
from conftest import SCRIPT, TINY, launch, left_in_session, need, need_text, run_dirs, scalars


def test_sync_and_async_step_identically():
    need("vector env")
    args = P.Args(num_envs=2, env_backend="sync")
    sync = P.make_envs(args, seed=5)
    asyn = P.make_envs(P.Args(num_envs=2, env_backend="async"), seed=5)
    assert type(asyn).__name__ == "AsyncVectorEnv"
    a, _ = sync.reset(seed=5)
    b, _ = asyn.reset(seed=5)
    assert np.array_equal(a, b)
    rng, terminations = np.random.default_rng(0), 0
    for _ in range(200):
        actions = rng.integers(0, 4, size=2)
        a, ra, ta, ua, ia = sync.step(actions)
        b, rb, tb, ub, ib = asyn.step(actions)
        assert np.array_equal(a, b) and np.array_equal(ra, rb)
        assert np.array_equal(ta, tb) and np.array_equal(ua, ub)
        assert P.finished_games(ia) == P.finished_games(ib)
        terminations += ta.sum()
    sync.close()
    asyn.close()
    assert terminations > 0, "no life was lost: the comparison saw no episode boundary"
    closed = weakref.ref(asyn)
    del asyn
    gc.collect()
    assert closed() is None, "closed async envs are still referenced (an atexit hook per call?):" \
        " a sweep of runs in one process would keep every run's envs"


def test_async_workers_are_forked_from_a_server_that_loaded_torch_not_from_the_trainer():
    """Each async env worker is forked from one server process that had imported torch (a
    worker starts without importing it and shares those pages), never from the trainer, whose
    CUDA state a fork would copy. What it cannot show: the time and memory this saves
    (`python tests/benchmark.py --worker-memory` prints them)."""
    need("vector env")
    envs = P.make_envs(P.Args(num_envs=2, env_backend="async"), seed=5)
    try:
        need(what="async workers as processes (envs.processes)",
             problem=None if hasattr(envs, "processes") else "this copy's async envs have none")
        parents = {int(next(line for line in open(f"/proc/{p.pid}/status")
                            if line.startswith("PPid:")).split()[1]) for p in envs.processes}
        assert len(parents) == 1 and os.getpid() not in parents, \
            f"the workers' parents {parents}: not one server (this process is {os.getpid()})"
        (server,) = parents
        loaded = "libtorch" in open(f"/proc/{server}/maps").read()
        assert loaded, f"the server the workers were forked from ({server}) had not loaded torch"
    finally:
        envs.close()


def test_sync_and_async_train_to_the_same_losses(workdir, monkeypatch):
    logged = {}
    for backend in ("sync", "async"):
        (workdir / backend).mkdir()
        monkeypatch.chdir(workdir / backend)
        P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=2, cuda=False,
                      total_timesteps=3 * 64, env_backend=backend, seed=3))
        (run,) = run_dirs(workdir / backend)
        logged[backend] = scalars(run)
    losses = [t for t in logged["sync"] if t.startswith("losses/")]
    assert losses and losses == [t for t in logged["async"] if t.startswith("losses/")]
    for tag in losses:
        assert len(logged["sync"][tag]) == 3
        assert logged["sync"][tag] == logged["async"][tag], tag


def test_auto_picks_async_only_on_cuda_with_4_cores_per_process(monkeypatch):
    args = P.Args()
    assert args.env_backend == "auto"
    monkeypatch.setattr(P, "usable_cores", lambda: 16)
    assert P.choose_backend(args, use_cuda=True, local_processes=1) == "async"
    assert P.choose_backend(args, use_cuda=False, local_processes=1) == "sync"
    assert P.choose_backend(args, use_cuda=True, local_processes=8) == "sync"  # 2 cores each
    monkeypatch.setattr(P, "usable_cores", lambda: 2)
    assert P.choose_backend(args, use_cuda=True, local_processes=1) == "sync"
    assert P.choose_backend(P.Args(env_backend="async"), False, 1) == "async"  # asked for: kept


def test_core_count_is_the_processs_allocation_not_the_machines():
    """A SLURM or cgroup allocation (here: sched_setaffinity) gives the process fewer cores
    than os.cpu_count() reports; auto and the thread split must see the allocation. Linux's
    affinity is per thread: a thread of this process given one core stands in for the process."""
    import threading
    seen = []

    def on_one_core():
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        seen.append(P.usable_cores())
    thread = threading.Thread(target=on_one_core)
    thread.start()
    thread.join()
    assert seen == [1], f"usable_cores() on one allocated core of {os.cpu_count()}: {seen}"


def test_torch_threads_are_the_allocation_split_over_torchruns_local_processes(monkeypatch):
    """Without --threads, each process takes its share of the allocation's cores (two ranks on
    8 cores: 4 threads each, so that they do not oversubscribe); --threads overrides it."""
    choose = getattr(P.choose_device, "real", P.choose_device)  # not the suite's one thread
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # (--no-cuda sets it: restored after)
    monkeypatch.setattr(P, "usable_cores", lambda: 8)
    before = torch.get_num_threads()
    try:
        seen = []
        for threads, local_processes in ((None, 2), (None, 1), (3, 2)):
            choose(P.Args(cuda=False, threads=threads), 0, local_processes, say=False)
            seen.append(torch.get_num_threads())
    finally:
        torch.set_num_threads(before)
    assert seen == [4, 8, 3], f"threads for (default, 2 ranks), (default, 1), (--threads 3): {seen}"


def test_an_edited_wrapper_changes_what_a_default_run_does(tmp_path, monkeypatch):
    source = open(SCRIPT).read()
    original = "        return float(np.sign(reward))\n"
    need_text(original, "ClipReward's line `return float(np.sign(reward))`, which it edits")
    layer, chain = P.make_env("BreakoutNoFrameskip-v4", 0)(), []
    while layer is not None:
        chain, layer = chain + [type(layer).__name__], getattr(layer, "env", None)
    need(what="ClipReward among make_env's wrappers (the wrapper this test edits)",
         problem=None if "ClipReward" in chain else f"this copy's make_env wraps {chain}")
    edited = source.replace(original, "        raise RuntimeError('edited ClipReward ran')\n")
    (tmp_path / "edited.py").write_text(edited)
    spec = importlib.util.spec_from_file_location("edited", tmp_path / "edited.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="edited ClipReward ran"):  # a default run, in process
        module.main(module.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=2,
                                total_timesteps=64, cuda=False, threads=1))


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


CRASHER = """
import importlib.util, os, sys
import gymnasium as gym, tyro
spec = importlib.util.spec_from_file_location("ppo_atari", os.environ["PPO_ATARI_SCRIPT"])
P = importlib.util.module_from_spec(spec)
sys.modules["ppo_atari"] = P
spec.loader.exec_module(P)
def crash(self, *a, **kw):  # any bug of the trainer's while the workers wait on it
    raise RuntimeError("bug in a fork")
setattr(gym.vector.AsyncVectorEnv, os.environ["CRASH_IN"], crash)
if __name__ == "__main__":  # env workers import this file as their main module
    P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
"""


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


def test_a_crashing_trainer_does_not_wait_for_its_async_workers(tmp_path):
    """The workers ignore SIGTERM (they outlive it for the trainer's checkpoint); a trainer that
    crashes while they serve it must still exit at once instead of waiting out their 60 s."""
    need("main")
    (tmp_path / "crasher.py").write_text(CRASHER)
    proc = launch([*TINY, "--total-timesteps", "64", "--env-backend", "async"], tmp_path,
                  script=tmp_path / "crasher.py", env={"CRASH_IN": "step_wait"})
    _, err = proc.communicate(timeout=50)  # about 70 s when it waits for the workers
    assert proc.returncode == 1 and "bug in a fork" in err, err[-2000:]


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

