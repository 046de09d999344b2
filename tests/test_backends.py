"""The environment: the in-file wrappers, in this process (sync) or a process per env (async)
with the same numbers; async workers come from a fork server, never wait on a crashed trainer."""
import gc
import importlib.util
import os
import weakref

import numpy as np
import pytest
import torch

import ppo_atari as P
from conftest import SCRIPT, TINY, launch, need, need_text, run_dirs, scalars


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
    (`python tests/dev/benchmark.py --worker-memory` prints them)."""
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


def test_a_crashing_trainer_does_not_wait_for_its_async_workers(tmp_path):
    """The workers ignore SIGTERM (they outlive it for the trainer's checkpoint); a trainer that
    crashes while they serve it must still exit at once instead of waiting out their 60 s."""
    need("main")
    (tmp_path / "crasher.py").write_text(CRASHER)
    proc = launch([*TINY, "--total-timesteps", "64", "--env-backend", "async"], tmp_path,
                  script=tmp_path / "crasher.py", env={"CRASH_IN": "step_wait"})
    _, err = proc.communicate(timeout=50)  # about 70 s when it waits for the workers
    assert proc.returncode == 1 and "bug in a fork" in err, err[-2000:]
