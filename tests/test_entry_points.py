"""Dependable wherever the file is called: whatever a fork keeps in carry loads again, what it
cannot hold is refused at once, and every entry point (a thread, an evaluation, a torchrun
restart, a resume under another name) ends as the user expects, in real processes."""
import importlib.util
import inspect
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import ppo_atari as P
from conftest import (SCRIPT, TINY, bound, launch, need, need_text, run_dirs, run_in_process,
                      run_script)

# one key per kind a fork may keep; each must come back as it was (numpy as numpy, same dtype)
KINDS = {
    "numpy float64": np.float64(0.1), "numpy float32": np.float32(0.25),
    "numpy int64": np.int64(-7), "numpy bool_": np.bool_(True), "numpy str_": np.str_("s"),
    "float64 array": np.linspace(0, 1, 3), "float32 array": np.ones((2, 2), np.float32),
    "int64 array": np.arange(3), "bool array": np.array([True, False]),
    "int": 3, "float": 0.5, "bool": False, "str": "text", "None": None,
    "tensor": torch.arange(3.0), "list": [1, np.float32(2.5)], "tuple": (np.int64(1), "a"),
    "dict": {"a": np.zeros(2, np.float32), 1: [None, torch.ones(1)]},
}


def same(a, b) -> bool:
    """a and b alike in type (numpy dtypes too) and value, all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and np.shape(a) == np.shape(b) and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def with_carry(monkeypatch, when):
    """make_batch patched: when(carry, calls) runs before each call (calls: the count so far)."""
    need("main")
    real, calls = P.make_batch, []
    need(what="make_batch(agent, storage, next_obs, autocast, args, carry)", problem=None if
         "carry" in inspect.signature(real).parameters else "this copy's has no carry")

    def make_batch(*a, **kw):
        when(bound(real, a, kw)["carry"], len(calls))
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(P, "make_batch", make_batch)
    return calls


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """A run whose make_batch puts every kind in carry at its first iteration, stopped at step
    64, then the same command: what the resumed run's make_batch finds in carry."""
    cwd, found = tmp_path_factory.mktemp("kinds"), {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)

        def keep(carry, calls):  # (beside a fork's own keys: the KL fork starts with one)
            if calls == 0:
                carry.update(KINDS)
            elif not found:
                found.update(carry)
        with_carry(mp, keep)
        args = P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                      total_timesteps=128, run_name="kinds")
        P.main(P.Args(**{**vars(args), "stop_at_step": 64}))
        P.main(args)  # the same command, continued
    return found


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_a_fork_keeps_in_carry_comes_back_as_it_was(kept, kind):
    """carry's values are saved through to_saved (numpy as tensors a weights-only load takes)
    and given back by from_saved: numpy as numpy of its dtype, tensors as tensors (moved to the
    training device: on this CPU, what it cannot show is a CUDA device), the rest as they were."""
    assert kind in kept, f"carry[{kind!r}] did not come back: {sorted(kept)}"
    assert same(KINDS[kind], kept[kind]), f"carry[{kind!r}]: kept {KINDS[kind]!r} " \
        f"({type(KINDS[kind]).__name__}), got back {kept[kind]!r} ({type(kept[kind]).__name__})"


def test_what_carry_cannot_hold_is_refused_at_the_end_of_the_iteration_that_set_it(
        workdir, monkeypatch, capsys):
    """A value no checkpoint can hold, set in iteration 2 with checkpoints every 3: the run
    stops at the end of iteration 2 (not at the checkpoint of iteration 3), in one line that
    names the key and its type, exit 2; the checkpoint written before stays loadable."""
    calls = with_carry(monkeypatch, lambda carry, calls: carry.update(
        {"handle": object()} if calls == 1 else {}))
    with pytest.raises(SystemExit) as exit_:
        P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                      total_timesteps=6 * 64, checkpoint_interval=3, run_name="bad"))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert "carry['handle'] is a object, which a checkpoint cannot hold" in err[0], err
    assert len(calls) == 2, f"refused after {len(calls)} iterations, not at the end of the 2nd"
    assert P.load_checkpoint("runs/bad")["global_step"] == 0


def test_a_checkpoint_with_a_pickled_numpy_scalar_is_refused_in_plain_words(workdir):
    """A file torch.save wrote with a numpy scalar in it (a fork's own save, say): refused in
    one line that names what it holds, without torch's ANSI codes or its advice."""
    need("checkpoint")
    torch.save({"model": {}, "args": {}, "carry": {"x": np.float64(1.0)}}, "numpy.pt")
    out = run_script(["--resume", "numpy.pt", "--no-cuda"], workdir)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr[-2000:]
    assert "cannot load numpy.pt as a safe checkpoint: it holds a pickled numpy" in err[0], err
    assert "\x1b" not in out.stderr and "Traceback" not in out.stderr


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


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("scored")
    out = run_script([*TINY, "--total-timesteps", "64", "--run-name", "r"], cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    return cwd, os.path.join("runs", "r", "agent.pt")


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


RESTARTING = """
import os, sys
sys.path.insert(0, os.environ["SCRIPT_DIR"])
import tyro
import ppo_atari as P
real = P.save_checkpoint
def save_checkpoint(*a, **kw):  # the first start dies (a node failure) after its 2nd iteration
    real(*a, **kw)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and a[6] == 2:
        os._exit(1)
P.save_checkpoint = save_checkpoint
if __name__ == "__main__":
    P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
"""


def test_a_torchrun_restart_without_a_run_name_continues_its_run(tmp_path):
    """torchrun --max-restarts 1 and no --run-name: the first start names the run in torchrun's
    store; its worker dies after the 2nd iteration's checkpoint; the restarted worker continues
    that folder from step 128 instead of starting a second run at step 0."""
    need("main")
    (tmp_path / "restarting.py").write_text(RESTARTING)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         "--max-restarts", "1", "restarting.py", *TINY, "--total-timesteps", "256",
         "--checkpoint-interval", "1"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                              SCRIPT_DIR=os.path.dirname(SCRIPT)))
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = run_dirs(tmp_path)
    assert f"continuing runs/{os.path.basename(run)} at step 128 of 256" in out.stdout, out.stdout
    assert P.load_checkpoint(run)["global_step"] == 256


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


def test_a_forks_vector_wrapper_trains_stops_and_resumes_with_its_statistics(workdir):
    """A fork that wraps the vector env in one of gymnasium's vector wrappers (reward
    normalization, in make_envs): the machinery reaches the envs through gymnasium's public API
    (envs.unwrapped.call), so the run trains, checkpoints the wrapper's running statistics
    (checkpointed under "vector") and a resume continues them without a note."""
    line = "    return envs\n"
    need_text(line, "make_envs' last line `return envs`, which the test wraps")
    source = open(SCRIPT).read().replace(
        line, "    return gym.wrappers.vector.NormalizeReward(envs, gamma=args.gamma)\n")
    (workdir / "normalized.py").write_text(source)
    spec = importlib.util.spec_from_file_location("normalized", workdir / "normalized.py")
    M = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(M)
    command = [*TINY, "--run-name", "normalized", "--total-timesteps", "128"]
    out = run_in_process([*command, "--stop-at-step", "64"], workdir, M)
    assert out.returncode == 0, out.stderr[-2000:]
    saved = M.load_checkpoint("runs/normalized")["env_statistics"]["vector"]
    count = M.from_saved(saved["NormalizeReward.return_rms"])["count"]
    assert count > 64, f"the running statistics of 64 steps were not checkpointed: {saved}"
    out = run_in_process(command, workdir, M)
    assert out.returncode == 0 and "note: " not in out.stdout, (out.stdout, out.stderr[-2000:])
    final = M.load_checkpoint("runs/normalized")["env_statistics"]["vector"]
    assert M.from_saved(final["NormalizeReward.return_rms"])["count"] > count + 60


def test_no_cuda_hides_the_gpus_before_torch_counts_them(monkeypatch, capsys):
    """--no-cuda sets CUDA_VISIBLE_DEVICES to "" before torch counts the GPUs, for this process
    and the workers it starts; where torch counted them before main() (a notebook asked), the
    run says in one line that it cannot hide them. Stand-in: torch's count, kept from its first
    question as the real one is. What it cannot show: a real GPU (test_cuda.py's --no-cuda run
    does, where there is one)."""
    need("main")
    counted = []

    def is_available():
        counted.append(counted[0] if counted else os.environ.get("CUDA_VISIBLE_DEVICES") != "")
        return counted[-1]
    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    choose = getattr(P.choose_device, "real", P.choose_device)
    before = torch.get_num_threads()
    try:
        assert choose(P.Args(cuda=False, threads=1), 0, 1, say=False).type == "cpu"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and counted == [False]
        assert "note: " not in capsys.readouterr().out
        counted[:] = [True]  # torch counted a GPU before main()
        assert choose(P.Args(cuda=False, threads=1), 0, 1, say=False).type == "cpu"
        assert "so --no-cuda cannot hide them" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


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
