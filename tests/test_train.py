"""End to end: the file alone in an empty folder, TensorBoard read back, determinism, learning."""
import importlib.util
import os
import re
import shutil
import signal
import types

import cv2
import gymnasium as gym
import numpy as np
import pytest

import ppo_atari as P
from conftest import (SCRIPT, TINY, StandIn, bound, launch, need, obs_shape, run_dirs,
                      run_in_process, run_script, scalars, stand_in_envs)

OBS = obs_shape()
# CleanRL's tags (so curves overlay on published ones): a fork may add tags, never lose these
TAGS = ["charts/episodic_return", "charts/episodic_length", "charts/learning_rate", "charts/SPS",
        "losses/value_loss", "losses/policy_loss", "losses/entropy", "losses/old_approx_kl",
        "losses/approx_kl", "losses/clipfrac", "losses/explained_variance",
        "charts/avg_episodic_return", "losses/value_clipfrac", "charts/rollout_time",
        "charts/update_time", "losses/grad_norm"]


def test_file_alone_trains_and_logs_every_tag(tmp_path):
    shutil.copy(SCRIPT, tmp_path / "ppo_atari.py")  # the file alone: no helper module beside it
    out = run_script([*TINY, "--num-steps", "64", "--total-timesteps", "512", "--capture-video"],
                     cwd=tmp_path, script=str(tmp_path / "ppo_atari.py"))
    assert out.returncode == 0, out.stderr
    assert "device: cpu (--no-cuda)\n" in out.stdout  # one line, saying why
    assert "step 512/512" in out.stdout  # the last progress line, plain when not a terminal
    assert "A.L.E" not in out.stderr, "the ALE banner is silenced"
    (run,) = run_dirs(tmp_path)
    shown = os.path.relpath(run, tmp_path)
    first = out.stdout.splitlines()[:2]  # the device, then where it writes, as it starts
    assert first == ["device: cpu (--no-cuda)",
                     f"run folder: {run} (new); watch it with: tensorboard --logdir {shown}"]
    assert out.stdout.splitlines()[-1] == f"run folder: {shown}"
    assert os.path.basename(run).startswith("BreakoutNoFrameskip-v4__ppo_atari__1__")
    logged = scalars(run)  # a fork may log more tags: the published ones must all be there
    assert set(TAGS) <= set(logged), f"published tags missing: {sorted(set(TAGS) - set(logged))}"
    assert [s for s, _ in logged["charts/learning_rate"]] == [128, 256, 384, 512]
    if callable(getattr(P, "schedule", None)):  # the copy's own (its shape: -m details' subject)
        args = P.Args(**P.load_checkpoint(run)["args"])
        np.testing.assert_allclose([v for _, v in logged["charts/learning_rate"]],
                                   [P.schedule(i, 4, args)[0] for i in range(1, 5)], rtol=1e-6)
    assert all(v >= 0 and v == int(v) for _, v in logged["charts/episodic_return"])
    assert all(v > 10 for _, v in logged["charts/episodic_length"])  # full games, not lives
    assert {"agent.pt", "checkpoint.pt"} <= set(os.listdir(run))
    video = cv2.VideoCapture(os.path.join(run, "videos", "game-0.mp4"))  # env 0's first game
    assert video.get(cv2.CAP_PROP_FRAME_COUNT) > 500 and video.get(cv2.CAP_PROP_FRAME_WIDTH) == 160
    saved = P.load_checkpoint(os.path.join(run, "agent.pt"))
    assert saved["args"]["num_steps"] == 64 and saved["global_step"] == 512
    assert saved["finished"] is True


def test_same_seed_gives_the_same_losses(tmp_path):
    """The same command, in a fresh process and in this one (which has trained before): the
    seeding block alone decides the numbers."""
    flags = [*TINY, "--total-timesteps", "128", "--seed", "7"]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    proc = launch(flags, tmp_path / "a")
    here = run_in_process(flags, tmp_path / "b")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and here.returncode == 0, (err[-2000:], here.stderr[-2000:])
    (a,), (b,) = run_dirs(tmp_path / "a"), run_dirs(tmp_path / "b")
    la, lb = scalars(a), scalars(b)
    losses = [t for t in la if t.startswith("losses/")]  # the published ones and a fork's own
    assert {t for t in TAGS if t.startswith("losses/")} <= set(losses)
    for tag in losses:
        assert la[tag] == lb[tag], tag
    assert la["losses/value_loss"][0][1] != la["losses/value_loss"][1][1]  # the data is real


class ShowAndPick(StandIn):
    """A bright bar is shown in one of 4 columns; picking its column scores 1. 10 steps a game:
    chance scores 2.5, a perfect policy 10."""

    def first(self):
        self.t = 0
        return self.show()

    def show(self):
        self.target = int(self.rng.integers(4))
        obs = self.frame(high=60)
        width = obs.shape[-1] // 4
        obs[..., self.target * width:(self.target + 1) * width] += 150
        return obs

    def step(self, action):
        reward, self.t = float(action == self.target), self.t + 1
        return self.show(), reward, self.t >= 10, False, {}


def test_the_trainer_learns_an_image_task_well_above_chance(workdir, monkeypatch):
    need("main")

    def make_envs(args, seed, *a, **kw):
        return stand_in_envs(ShowAndPick, args.num_envs)

    monkeypatch.setattr(P, "make_envs", make_envs)
    monkeypatch.setattr(P, "check_env_id", lambda env_id: None)
    real_log, learned = P.log_iteration, []

    def log_iteration(*a, **kw):  # learned: stopped there as a user would (SIGTERM)
        real_log(*a, **kw)
        recent = bound(real_log, a, kw)["recent"]
        if len(recent) >= 40 and np.mean(recent) > 8.5 and not learned:
            learned.append(len(recent))
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(P, "log_iteration", log_iteration)
    # at most 36 iterations at the default epochs: a recurrent fork (minibatches of whole envs)
    # learns in them too, which 22 iterations of 2 epochs were too few for (6.35)
    args = P.Args(env_id="ShowAndPick", num_envs=4, num_steps=32, total_timesteps=128 * 36,
                  learning_rate=1e-3, cuda=False)
    try:
        P.main(args)
    except SystemExit as stop:  # the SIGTERM once learned
        assert learned and stop.code == 143, stop.code
    (run,) = run_dirs(workdir)
    avg = scalars(run)["charts/avg_episodic_return"]
    assert avg[0][1] < 4.0, "the first games should be near chance (2.5)"
    assert avg[-1][1] > 8.0, f"did not learn: average return {avg[-1][1]:.2f} (chance 2.5)"


def test_a_copy_with_another_frame_size_trains(tmp_path, monkeypatch):
    """The frame size is a one-place edit (GrayResize's size): storage, staging, batch and the
    network's flattened size all follow the observation space. 64x64 frames, or 72x72 when the
    file under test already has 64."""
    source = open(SCRIPT).read()
    sizes = re.findall(r"class GrayResize.*?size: int = (\d+)", source, re.S)
    need(what="class GrayResize with its `size: int = N` default (the frame-size edit point)",
         problem=None if len(sizes) == 1 else f"this copy has {len(sizes)} such defaults")
    size = 64 if sizes[0] != "64" else 72
    edited = re.sub(r"(class GrayResize.*?size: int = )\d+", rf"\g<1>{size}", source, flags=re.S)
    (tmp_path / "resized.py").write_text(edited)
    spec = importlib.util.spec_from_file_location("resized", tmp_path / "resized.py")
    resized = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resized)
    env = resized.make_env("BreakoutNoFrameskip-v4", 0)()
    assert env.observation_space.shape[-2:] == (size, size)
    monkeypatch.chdir(tmp_path)
    resized.main(resized.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1,
                              total_timesteps=64, cuda=False, run_name="resized"))
    assert len(scalars(str(tmp_path / "runs" / "resized"))["losses/value_loss"]) == 1


def test_sps_counts_from_the_end_of_the_first_iteration(workdir, monkeypatch):
    """A slow first iteration (warm-up after a start or resume) must not drag SPS down. The
    file's clock is a stand-in (each reading 1 ms later; the first rollout 10 s long), so the
    figures do not depend on how busy the machine is."""
    need("main")
    real, clock = P.rollout, [0.0]

    def tick():
        clock[0] += 0.001
        return clock[0]

    def slow_first(*a, **kw):
        clock[0] += 10.0 if clock[0] < 10.0 else 0.0
        return real(*a, **kw)

    monkeypatch.setattr(P, "time", types.SimpleNamespace(time=tick, perf_counter=tick))
    monkeypatch.setattr(P, "rollout", slow_first)
    P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                  total_timesteps=4 * 64))
    (run,) = run_dirs(workdir)
    sps = [v for _, v in scalars(run)["charts/SPS"]]
    assert sps[0] < 64 / 10.0  # the first iteration reports its own rate, its 10 s included
    # counted from the process start, 256 steps over more than 10 s would be < 26
    assert sps[-1] > 1000, f"SPS {sps}: counted from the start, not from the first iteration"


class ColourStack(gym.Env):
    """A stack of 4 colour frames as gymnasium stacks them, (4, 84, 84, 3): not channels first."""

    def __init__(self):
        self.observation_space = gym.spaces.Box(0, 255, (4, 84, 84, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(4)

    def reset(self, seed=None, options=None):
        return np.zeros((4, 84, 84, 3), np.uint8), {}

    def step(self, action):
        return np.zeros((4, 84, 84, 3), np.uint8), 0.0, False, False, {}


def test_observations_that_are_not_channels_first_are_refused_in_one_line(workdir, monkeypatch,
                                                                           capsys):
    need("main", "env thunk")
    monkeypatch.setattr(P, "make_env", lambda *a, **kw: ColourStack)
    with pytest.raises(SystemExit) as e:
        P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=2, cuda=False, run_name="rgb",
                      total_timesteps=64))
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: the env's observations are (4, 84, 84, 3), not (C, H, W)")
    assert "reshaped to (12, H, W)" in line
    # nothing is written for a run that cannot start (its lock file, runs/.rgb.lock, may stay)
    assert os.listdir(workdir / "runs") == [".rgb.lock"], os.listdir(workdir / "runs")
