"""Shared helpers: the script under test, subprocess runs of it, and TensorBoard read-back.

The suite runs against any copy of the file: `python -m pytest tests --script PATH/ppo_atari.py`
(default: the repository's ppo_atari.py). Tests import it as `ppo_atari` and take sizes and
metric names from it, so a fork fails only the tests that pin a setting it changed.
"""
import functools
import glob
import importlib.util
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "ppo_atari.py")  # replaced by --script in pytest_configure

# A tiny but complete configuration: 2 envs x 32 steps, 2 minibatches, 2 epochs, on the CPU.
TINY = ["--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "2",
        "--no-cuda"]


def pytest_addoption(parser):
    parser.addoption("--script", default=None,
                     help="the copy of ppo_atari.py to test (default: the repository's)")


def pytest_configure(config):
    """Imports the file under test as the module `ppo_atari`, before any test module does."""
    global SCRIPT
    SCRIPT = os.path.abspath(config.getoption("--script") or os.environ.get("PPO_ATARI_SCRIPT")
                             or SCRIPT)
    if not os.path.isfile(SCRIPT):
        raise pytest.UsageError(f"--script {SCRIPT}: no such file")
    os.environ["PPO_ATARI_SCRIPT"] = SCRIPT  # for subprocesses that import it (torchrun harness)
    sys.path.insert(0, os.path.dirname(SCRIPT))  # spawned env workers import it by name
    spec = importlib.util.spec_from_file_location("ppo_atari", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ppo_atari"] = module
    spec.loader.exec_module(module)


@functools.cache
def obs_shape():
    """The observation shape of the file under test (its wrappers decide it)."""
    import ppo_atari as P
    env = P.make_env("BreakoutNoFrameskip-v4", seed=0)()
    shape = env.observation_space.shape
    env.close()
    return shape


class Truncating(gym.Env):
    """Atari-shaped stand-in game (the file's observation shape, 4 actions): random frames,
    reward 1 on action 0, truncated every 5 steps."""

    def __init__(self):
        self.observation_space = gym.spaces.Box(0, 255, obs_shape(), np.uint8)
        self.action_space = gym.spaces.Discrete(4)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.integers(0, 255, self.observation_space.shape, dtype=np.uint8), {}

    def step(self, action):
        self.t += 1
        obs = self.np_random.integers(0, 255, self.observation_space.shape, dtype=np.uint8)
        return obs, float(action == 0), False, self.t % 5 == 0, {}


def random_minibatch(agent, n: int) -> dict:
    """A minibatch dict as update() makes it, from random frames and the agent's own policy."""
    import torch
    obs = torch.randint(0, 256, (n, *obs_shape()), dtype=torch.uint8)
    with torch.no_grad():
        actions, logprobs, _, values = agent.get_action_and_value(obs)
    return dict(obs=obs, actions=actions, logprobs=logprobs, advantages=torch.randn(n),
                returns=torch.randn(n), values=values)


def loss_metric_names():
    """The names of the metrics the file's minibatch_loss returns (each logged as losses/NAME)."""
    import ppo_atari as P
    agent = P.Agent(obs_shape(), 4)
    return sorted(P.minibatch_loss(agent, random_minibatch(agent, 8), 0.1, P.Args())[1])


def run_script(args, cwd, script=None, timeout=300, env=None):
    """Runs the script in a subprocess; returns the CompletedProcess (text mode)."""
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run([sys.executable, script or SCRIPT, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=full_env)


def run_dirs(cwd):
    return sorted(glob.glob(os.path.join(cwd, "runs", "*")))


def scalars(run_dir, raw=False):
    """{tag: [(step, value), ...]} from the run folder's event files. raw=True reads every event
    as written (so a step logged twice shows twice); otherwise TensorBoard's own view."""
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader
    from tensorboard.util import tensor_util

    if not raw:
        acc = event_accumulator.EventAccumulator(run_dir, size_guidance={"scalars": 0})
        acc.Reload()
        return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
        for event in event_file_loader.EventFileLoader(path).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "scalars":
                    value = float(tensor_util.make_ndarray(v.tensor).item())
                    out.setdefault(v.tag, []).append((event.step, value))
    return out


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path
