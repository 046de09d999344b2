"""A fork's wrapper state under README's *_state convention: found per wrapper layer (class and
attribute) in every env that has it, numpy kept as numpy across a resume, anything a checkpoint
cannot hold refused in one line before the first iteration, every checkpoint the run writes
loadable by load_checkpoint (a weights-only load), and a fork's vector wrapper checkpointed."""
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

import ppo_atari as P
from conftest import SCRIPT, TINY, need, need_text, run_in_process, run_script


LINE = "        env = ClipReward(env)\n"


TALLY = """
class Tally(gym.Wrapper):
    \"\"\"A fork's stateful wrapper, as gymnasium keeps its numbers: numpy in *_state.\"\"\"

    def __init__(self, env, by: int = 1):
        super().__init__(env)
        self.by, self.steps_state = by, np.zeros(1, np.int64)

    def step(self, action):
        assert type(self.steps_state) is np.ndarray and self.steps_state.dtype == np.int64, \\
            f"steps_state came back as {type(self.steps_state)}"
        self.steps_state += self.by
        return self.env.step(action)


"""


def copy_with(workdir, line: str, extra: str = TALLY, name: str = "fork"):
    need_text(LINE, "make_env's line `env = ClipReward(env)`, which the test wraps")
    need("main")
    source = open(SCRIPT).read().replace(LINE, line).replace("def make_env(",
                                                              extra + "def make_env(")
    path = workdir / f"{name}.py"
    path.write_text(source)
    return path


def load(path):
    sys.path.insert(0, str(path.parent))  # async env workers import it by name
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def test_numpy_state_in_two_layers_of_one_class_resumes_as_numpy(workdir, monkeypatch):
    """Two Tally layers (steps by 1 and by 10) keep their own numpy counts: saved per layer as
    Tally.steps_state and Tally#2.steps_state, restored as int64 arrays, continued exactly (32
    steps an env to the stop, 64 at the end); the checkpoint, with a tensor in carry beside, loads
    with load_checkpoint."""
    M = load(copy_with(workdir, "        env = ClipReward(Tally(Tally(env), by=10))\n"))
    real = M.restore

    def restore(ckpt, agent, optimizer, envs, carry, *a, **kw):
        real(ckpt, agent, optimizer, envs, carry, *a, **kw)
        carry.setdefault("coef", torch.tensor(0.5))

    monkeypatch.setattr(M, "restore", restore)
    args = dict(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                total_timesteps=128, run_name="tally", env_backend="sync")
    M.main(M.Args(**args, stop_at_step=64))
    saved = M.load_checkpoint("runs/tally/checkpoint.pt")
    state = saved["env_statistics"]
    assert {"Tally.steps_state", "Tally#2.steps_state"} <= state.keys(), state.keys()
    assert [M.from_saved(v).tolist() for v in state["Tally.steps_state"]] == [[320]] * 2
    assert [M.from_saved(v).tolist() for v in state["Tally#2.steps_state"]] == [[32]] * 2
    assert float(saved["carry"]["coef"]) == 0.5
    M.main(M.Args(**args))
    state = M.load_checkpoint("runs/tally/checkpoint.pt")["env_statistics"]
    assert [M.from_saved(v).tolist() for v in state["Tally#2.steps_state"]] == [[64]] * 2, \
        "the resume did not continue each env's own count"
    assert [M.from_saved(v).tolist() for v in state["Tally.steps_state"]] == [[640]] * 2


def test_a_wrapper_in_some_envs_only_is_saved_for_those_async(workdir):
    """Tally in env 0 only (beside VideoRecorder, which env 0 alone has), async workers: saved
    for env 0, None for env 1, and env 0's count continued at the resume."""
    M = load(copy_with(workdir, "        env = ClipReward(Tally(env) if video_folder else env)\n",
                       name="some"))
    args = dict(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                total_timesteps=128, run_name="some", env_backend="async", capture_video=True)
    M.main(M.Args(**args, stop_at_step=64))
    state = M.load_checkpoint("runs/some/checkpoint.pt")["env_statistics"]["Tally.steps_state"]
    assert state[1] is None and M.from_saved(state[0]).tolist() == [32], state
    M.main(M.Args(**args))
    state = M.load_checkpoint("runs/some/checkpoint.pt")["env_statistics"]["Tally.steps_state"]
    assert state[1] is None and M.from_saved(state[0]).tolist() == [64], state


@pytest.mark.parametrize("backend", ["sync", "async"])
def test_state_a_checkpoint_cannot_hold_is_refused_in_one_line_before_training(workdir,
                                                                                backend):
    """An object in *_state: the run stops at its first checkpoint, before any iteration, with
    one line naming the wrapper layer and the attribute, exit 2, no traceback."""
    extra = TALLY.replace("np.zeros(1, np.int64)", "object()")
    path = copy_with(workdir, "        env = ClipReward(Tally(env))\n", extra=extra)
    out = run_script(["--num-envs", "2", "--num-steps", "32", "--no-cuda", "--threads", "1",
                      "--env-backend", backend, "--run-name", "bad"], workdir, script=path)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, (out.returncode, out.stderr[-2000:])
    assert "Tally.steps_state is a object, which a checkpoint cannot hold" in err[0], err
    assert "step " not in out.stdout, "an iteration ran before the refusal"
    assert not os.path.exists(workdir / "runs" / "bad" / "checkpoint.pt")


def test_numpy_state_round_trips_through_a_weights_only_load(tmp_path):
    """to_saved/from_saved: arrays and numpy scalars come back with their type and dtype."""
    need("main")
    value = {"a": np.arange(3, dtype=np.float32), "b": [np.int16(7), np.bool_(True)], "c": 2.5}
    torch.save({"v": P.to_saved(value)}, tmp_path / "x.pt")
    back = P.from_saved(torch.load(tmp_path / "x.pt", weights_only=True)["v"])
    assert back["a"].dtype == np.float32 and back["a"].tolist() == [0.0, 1.0, 2.0]
    assert type(back["b"][0]) is np.int16 and back["b"][0] == 7 and type(back["b"][1]) is np.bool_
    assert back["c"] == 2.5


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
