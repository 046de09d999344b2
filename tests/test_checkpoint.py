"""Checkpoints: round trip, atomic writes, exact resume (weights, Adam, RNG, the last 100
games, wrapper statistics, a fork's carry), safe loading, videos across resumes."""
import copy
import glob
import importlib.util
import inspect
import os
import pickle
import re
import shutil
import signal
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_atari as P
from conftest import (SCRIPT, TINY, Truncating, bound, need, need_text, obs_shape, run_dirs,
                      run_in_process, run_script, scalars, takes, tiny_args, truncating_envs)


OBS = obs_shape()


def test_round_trip_restores_tensors_counters_and_rng(tmp_path):
    torch.manual_seed(0)
    agent = P.Agent(OBS, 4)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5)
    sum((p ** 2).sum() for p in agent.parameters()).backward()  # any gradient: Adam has state
    opt.step()
    state = {"model": agent.state_dict(), "optimizer": opt.state_dict(), "args": {"seed": 1},
             "global_step": 1234, "iteration": 7, "rng": P.rng_state(torch.device("cpu")),
             "recent_returns": [1.0]}
    expected = torch.rand(3)
    path = str(tmp_path / "checkpoint.pt")
    P.write_atomically(path, state)
    loaded = P.load_checkpoint(str(tmp_path))  # a folder stands for its checkpoint.pt
    assert loaded["global_step"] == 1234 and loaded["iteration"] == 7
    assert loaded["recent_returns"] == [1.0]
    for k, v in agent.state_dict().items():
        assert torch.equal(loaded["model"][k], v), k
    exp_avg = loaded["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, opt.state_dict()["state"][0]["exp_avg"])
    P.set_rng_state(loaded["rng"], torch.device("cpu"))
    assert torch.equal(expected, torch.rand(3)), "the action/minibatch RNG was not restored"
    assert not glob.glob(path + ".*tmp")  # the temporary file was renamed


def test_a_checkpoint_holds_and_restores_the_training_devices_cuda_rng(monkeypatch):
    """A job requeued onto a node with fewer visible GPUs: a checkpoint holds the training
    device's CUDA RNG only (not one state per GPU of the old node), and a resume sets that
    device's. A patched torch.cuda stands in: it cannot show a real GPU's generator."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda s, device="cuda": restored.append((s, device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.ones(4))
    saved = P.rng_state(torch.device("cuda", 0))
    assert torch.equal(saved["cuda"], torch.ones(4))
    P.set_rng_state(saved, torch.device("cuda", 0))
    assert len(restored) == 1 and torch.equal(restored[0][0], torch.ones(4)) and \
        restored[0][1] == torch.device("cuda", 0)
    P.set_rng_state(saved, torch.device("cpu"))  # a resume on the CPU leaves CUDA alone
    assert len(restored) == 1


def test_crash_before_the_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    P.write_atomically(path, {"model": {"w": torch.ones(2)}, "args": {}, "iteration": 1})

    def crash(src, dst):
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        P.write_atomically(path, {"model": {"w": torch.zeros(2)}, "args": {}, "iteration": 2})
    monkeypatch.undo()
    assert os.path.exists(f"{path}.{os.getpid()}.tmp")  # written (named per process), not renamed
    loaded = P.load_checkpoint(path)
    assert loaded["iteration"] == 1 and torch.equal(loaded["model"]["w"], torch.ones(2))


class Steps(gym.Wrapper):
    """A fork's stateful wrapper: steps_state counts the env's steps and the actions' sum."""

    def __init__(self, env):
        super().__init__(env)
        self.steps_state = np.zeros(2, dtype=np.int64)

    def step(self, action):
        self.steps_state = self.steps_state + [1, int(action)]
        return self.env.step(action)


def stateful_envs(args, seed, *a, **kw):
    """The stand-in game that ends every 5 steps (games to count) under a stateful wrapper."""
    thunk = lambda: Steps(gym.wrappers.RecordEpisodeStatistics(Truncating()))  # noqa: E731
    return gym.vector.SyncVectorEnv([thunk] * args.num_envs,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def same(x, y) -> bool:
    """Bit for bit: tensors and arrays equal in dtype, shape and every value, nested alike."""
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(same, x, y))
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)
    return type(x) is type(y) and x == y


def record_iterations(monkeypatch) -> list:
    """What each iteration starts from, one dict per iteration: the torch RNG and the step count
    (rollout), the wrapper state, the carry (make_batch), the weights and Adam (update), the
    last 100 games before it (log_iteration). make_batch also keeps a fork's carry."""
    need("main")
    for name in ("rollout", "make_batch", "update", "log_iteration"):
        need(what=f"the phase {name}, which train calls once an iteration",
             problem=None if callable(getattr(P, name, None)) else "none here")
    need(what="make_batch(agent, storage, next_obs, autocast, args, carry)", problem=None if
         "carry" in inspect.signature(P.make_batch).parameters else "this copy's has no carry")
    record, real = [], {name: getattr(P, name) for name in
                        ("rollout", "make_batch", "update", "log_iteration")}

    def rollout(*a, **kw):
        b = bound(real["rollout"], a, kw)
        record.append({"rng": torch.get_rng_state(), "global_step": b["global_step"],
                       "wrappers": [env["state"] for env in P.env_layer_states(b["envs"])]})
        return real["rollout"](*a, **kw)

    def make_batch(*a, **kw):
        b = bound(real["make_batch"], a, kw)
        carry, rewards = b["carry"], b["storage"]["rewards"].sum()
        record[-1]["carry"] = copy.deepcopy(carry)
        carry |= {"batches": carry.get("batches", 0) + 1,  # a stateful fork's: int, tensor, numpy
                  "rewards": carry.get("rewards", torch.zeros(())) + rewards,
                  "sizes": np.append(carry.get("sizes", np.zeros(0, np.float32)), rewards.item())}
        return real["make_batch"](*a, **kw)

    def update(*a, **kw):
        b = bound(real["update"], a, kw)
        record[-1] |= {"weights": copy.deepcopy(b["agent"].state_dict()),
                       "adam": copy.deepcopy(b["optimizer"].state_dict())}
        return real["update"](*a, **kw)

    def log_iteration(*a, **kw):
        b = bound(real["log_iteration"], a, kw)
        record[-1]["recent"] = list(b["recent"])[:len(b["recent"]) - len(b["games"])]
        return real["log_iteration"](*a, **kw)

    for name, patched in (("rollout", rollout), ("make_batch", make_batch), ("update", update),
                          ("log_iteration", log_iteration)):
        monkeypatch.setattr(P, name, patched)
    monkeypatch.setattr(P, "make_envs", stateful_envs)
    monkeypatch.setattr(P, "check_env_id", lambda env_id: None)
    return record


def test_a_resume_continues_exactly_where_the_checkpoint_left_off(workdir, monkeypatch):
    """README's promise: a resume continues the weights, Adam, the RNG, the counts, the last 100
    games, wrapper state and carry. Run a trains 4 iterations; run b crashes in iteration 3
    (after iteration 2's checkpoint) and is resumed: iteration 3 of the resumed run starts from
    exactly the state iteration 3 of run a started from, bit for bit (only the games in progress
    differ: a resume starts fresh ones). A copy of b's folder, resumed the same way, logs the
    same scalars as b: a resume is itself deterministic. Run d is stopped by a SIGTERM in the
    middle of iteration 3's rollout, with no checkpoint since step 0: it gives the rollout up
    and checkpoints the end of iteration 2, which resumes exactly as b's does. In the stand-in
    game ending every 5 steps (games finish), under a wrapper with *_state, with a carry kept
    by make_batch."""
    record = record_iterations(monkeypatch)
    total, args = 4 * 64, dict(env_id="Truncating", num_envs=2, num_steps=32,
                               num_minibatches=2, update_epochs=2, cuda=False)
    for folder in "abcd":
        (workdir / folder).mkdir()
    monkeypatch.chdir(workdir / "a")
    P.main(P.Args(**args, total_timesteps=total, run_name="r"))
    full, record_a = str(workdir / "a" / "runs" / "r"), list(record)

    monkeypatch.chdir(workdir / "b")  # b crashes at the first env step of iteration 3
    calls, real_step = [], gym.vector.SyncVectorEnv.step

    def crashing_step(self, *a, **kw):
        calls.append(1)
        if len(calls) == 2 * 32 + 1:
            raise RuntimeError("simulated crash")
        return real_step(self, *a, **kw)

    with monkeypatch.context() as crash:
        crash.setattr(gym.vector.SyncVectorEnv, "step", crashing_step)
        with pytest.raises(RuntimeError, match="simulated crash"):
            P.main(P.Args(**args, total_timesteps=total, checkpoint_interval=2, run_name="r"))
    run = str(workdir / "b" / "runs" / "r")
    assert P.load_checkpoint(run)["iteration"] == 2
    shutil.copytree(run, workdir / "c" / "runs" / "r")

    monkeypatch.chdir(workdir / "d")  # d: a SIGTERM at iteration 3's fifth env step
    calls.clear()

    def signalled_step(self, *a, **kw):
        calls.append(1)
        if len(calls) == 2 * 32 + 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, *a, **kw)

    with monkeypatch.context() as stop:
        stop.setattr(gym.vector.SyncVectorEnv, "step", signalled_step)
        with pytest.raises(SystemExit) as stopped:
            P.main(P.Args(**args, total_timesteps=total, checkpoint_interval=4, run_name="r"))
    assert stopped.value.code == 128 + signal.SIGTERM and len(calls) < 2 * 32 + 32, (
        f"the SIGTERM at env step 69 ended the run with {stopped.value.code} after {len(calls)}"
        f" env steps: the rollout in progress was not given up")
    held = P.load_checkpoint(str(workdir / "d" / "runs" / "r"))
    assert (held["iteration"], held["global_step"]) == (2, 128), (held["iteration"],
                                                                  held["global_step"])
    resumed = []
    for folder in "bcd":
        monkeypatch.chdir(workdir / folder)
        del record[:]
        P.main(P.Args(**args, resume=os.path.join("runs", "r")), explicit={"resume"})
        resumed.append(list(record))
    assert run_dirs(workdir / "b") == [run], "resume must continue in the same folder"

    assert len(record_a) == 4 and [len(r) for r in resumed] == [2, 2, 2], (len(record_a),
                                                                            resumed)
    then = record_a[2]  # iteration 3, uninterrupted
    assert then["recent"] and then["carry"] and any(
        then["wrappers"][0].values()), "nothing to restore: the test's run kept no state"
    for how, now in (("after a crash", resumed[0][0]), ("after a stop mid-rollout", resumed[2][0])):
        differ = [what for what in ("global_step", "weights", "adam", "rng", "recent",
                                    "wrappers", "carry") if not same(then[what], now[what])]
        assert not differ, (f"iteration 3 resumed {how} does not start where the uninterrupted "
                            f"run's did: {', '.join(differ)} differ")
    assert same(resumed[0], resumed[1]), "the same resume, twice, did not start alike"

    a, b, c = (scalars(r, raw=True) for r in (full, run, str(workdir / "c" / "runs" / "r")))
    clocks = ("charts/SPS", "charts/rollout_time", "charts/update_time")
    assert P.load_checkpoint(run)["global_step"] == P.load_checkpoint(full)["global_step"] == total
    for tag in ("charts/learning_rate", "charts/clip_coef", "losses/value_loss"):
        steps = [s for s, _ in b[tag]]
        assert steps == [64, 128, 192, 256], f"{tag} logged at {steps}"
    assert a["charts/learning_rate"] == b["charts/learning_rate"]  # the schedule continued
    # iterations 1-2 are the same run; after the resume the envs start fresh games
    assert a["losses/value_loss"][:2] == b["losses/value_loss"][:2]
    differ = [t for t in b.keys() | c.keys() if t not in clocks and b.get(t) != c.get(t)]
    assert not differ, f"the same resume twice logged different {sorted(differ)}"


def test_resume_refuses_a_change_of_network_or_game_but_takes_safe_overrides(workdir):
    out = run_in_process([*TINY, "--total-timesteps", "64"], cwd=workdir)
    assert out.returncode == 0, out.stderr
    (run,) = run_dirs(workdir)
    before = sorted(os.listdir(run))
    refusals = [(["--env-id", "PongNoFrameskip-v4"], "--env-id cannot change"),
                (["--num-envs", "4"], "--num-envs cannot change")]
    for args, message in refusals:
        out = run_in_process(["--resume", run, *args], workdir)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    assert sorted(os.listdir(run)) == before
    # a finished run is complete: nothing written, with the way to extend it
    out = run_in_process(["--resume", run], cwd=workdir)
    assert out.returncode == 0 and "is already complete: it has run 64 steps" in out.stdout
    assert sorted(os.listdir(run)) == before
    out = run_in_process(["--resume", run, "--total-timesteps", "128", "--num-envs", "2"],
                         cwd=workdir)
    assert out.returncode == 0, out.stderr
    assert "at step 64 of 128 (1 iteration left); --total-timesteps changed from 64" in out.stdout
    assert P.load_checkpoint(run)["global_step"] == 128
    assert [s for s, _ in scalars(run, raw=True)["charts/SPS"]] == [64, 128]
    # the copy's own schedule (whatever its shape), re-planned over 128 steps as README says:
    # iteration 1 of a 1-iteration plan, then iteration 2 of a 2-iteration plan
    need(what="schedule(iteration, num_iterations, args) -> (learning rate, clip)",
         problem=takes(P.schedule, 1, 1, P.Args()) if hasattr(P, "schedule") else "none here")
    args = P.Args(**{**P.load_checkpoint(run)["args"], "total_timesteps": 128})
    planned = [P.schedule(1, 1, args)[0], P.schedule(2, 2, args)[0]]
    if args.anneal_lr:
        assert f"schedules re-planned; learning rate {planned[1]:.3g} now" in out.stdout, (
            f"the resume's line names the learning rate of its re-planned schedule "
            f"({planned[1]:.3g}): {out.stdout}")
    lr = scalars(run, raw=True)["charts/learning_rate"]
    np.testing.assert_allclose([v for _, v in lr], planned, rtol=1e-6, err_msg=(
        "the learning rates logged: iteration 1 by the first plan (64 steps), iteration 2 by "
        "the plan over the new total (128 steps), each the copy's own schedule"))


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(workdir, monkeypatch, capsys):
    real, real_update, updates = P.minibatch_loss, P.update, []

    def poisoned(*a, **kw):  # iterations 1-2 are sound, the third update's losses turn NaN
        loss, metrics = real(*a, **kw)
        return (loss * float("nan"), metrics) if len(updates) > 2 else (loss, metrics)

    def update(*a, **kw):
        updates.append(1)
        return real_update(*a, **kw)

    monkeypatch.setattr(P, "update", update)

    closed, real_writer = [], P.SummaryWriter

    class Writer(real_writer):
        def close(self):
            closed.append(1)
            super().close()

    monkeypatch.setattr(P, "minibatch_loss", poisoned)
    monkeypatch.setattr(P, "SummaryWriter", Writer)
    with pytest.raises(SystemExit) as e:
        P.main(tiny_args(total_timesteps=6 * 64, checkpoint_interval=1))
    assert e.value.code == 1
    assert closed == [1], "the TensorBoard writer was not closed"
    assert "non-finite loss or parameters at iteration 3" in capsys.readouterr().err
    (run,) = run_dirs(workdir)
    ckpt = P.load_checkpoint(run)
    assert ckpt["iteration"] == 2
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


class Evil:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


class System:
    def __reduce__(self):
        return (os.system, ("true",))


def test_malicious_pickle_never_runs(workdir):
    """torch.save'd and plain pickles, given to --resume and to --eval-checkpoint: refused in
    one line naming the global, with no advice to load them unsafely."""
    cases = [(writer, flag) for writer in ("torch", "pickle")
             for flag in ("--resume", "--eval-checkpoint")]
    for writer, flag in cases:
        folder = workdir / f"{writer}{flag}"
        folder.mkdir()
        payload = {"model": Evil(str(folder / "pwned")), "args": {}}
        if writer == "torch":
            torch.save(payload, folder / "evil.pt")
        else:
            with open(folder / "evil.pt", "wb") as f:
                pickle.dump(payload, f)
    for writer, flag in cases:
        out = run_in_process([flag, "evil.pt", "--no-cuda"], workdir / f"{writer}{flag}")
        assert out.returncode == 2, (writer, flag, out.stderr)
        assert "cannot load evil.pt as a safe checkpoint" in out.stderr
        assert not (workdir / f"{writer}{flag}" / "pwned").exists()
        # the refused global named; torch's advice to load it with weights_only=False never
        if writer == "torch":  # (a plain pickle's STACK_GLOBAL: torch names no global)
            assert "it holds a pickled io.open" in out.stderr, out.stderr
        assert "weights_only" not in out.stderr and "False" not in out.stderr, out.stderr
    torch.save({"model": System(), "args": {}}, workdir / "system.pt")  # torch 2.13's wording:
    out = run_in_process(["--resume", "system.pt", "--no-cuda"], workdir)  # "unsupported GLOBAL"
    assert out.returncode == 2 and "it holds a pickled posix.system" in out.stderr, out.stderr


def test_main_from_python_honours_a_changed_total_on_resume(workdir):
    """main(Args(resume=R, total_timesteps=N)) without an explicit set: fields that differ from
    their defaults count as given, as they would on the command line."""
    P.main(tiny_args(total_timesteps=64))
    (run,) = run_dirs(workdir)
    P.main(tiny_args(resume=run, total_timesteps=192))
    assert P.load_checkpoint(run)["global_step"] == 192


def test_agent_pt_is_the_latest_weights_written_atomically_before_each_checkpoint(
        workdir, monkeypatch):
    """agent.pt (what --eval-checkpoint scores) is written with every checkpoint, just before
    checkpoint.pt, through write_atomically (temporary file, fsync, rename): after a kill at any
    instant it holds the weights of the last checkpoint or newer, whole."""
    written, real = [], P.write_atomically
    monkeypatch.setattr(P, "write_atomically", lambda path, state, *a: (written.append(
        (os.path.basename(path), state["global_step"], state["model"])), real(path, state, *a)))
    P.main(tiny_args(total_timesteps=3 * 64, checkpoint_interval=2, run_name="r"))
    assert [(name, step) for name, step, _ in written] == [
        (name, step) for step in (0, 128, 192) for name in ("agent.pt", "checkpoint.pt")], written
    for (_, _, weights), (_, _, then) in zip(written[::2], written[1::2]):
        assert all(torch.equal(weights[k], then[k]) for k in weights)
    assert P.load_checkpoint("runs/r/agent.pt")["finished"] is True


def test_a_forks_carry_survives_a_resume(workdir, monkeypatch):
    """A fork's own state (a penalty coefficient, a running statistic) lives in main's carry
    dict, which the training loss and make_batch receive: checkpoints save it and a resume
    restores it."""
    need("main")
    real = P.minibatch_loss
    need(what="minibatch_loss(agent, mb, clip_coef, args, carry)", problem=None if "carry" in
         inspect.signature(real).parameters else takes(real, None, None, None, None, None))

    def counting(*a, **kw):  # what a stateful fork does: update its state as it trains
        carry = bound(real, a, kw)["carry"]
        carry["calls"] = carry.get("calls", 0) + 1
        carry["running"] = torch.tensor(float(carry["calls"]))  # tensors are kept too
        return real(*a, **kw)

    real_batch = P.make_batch

    def estimating(*a, **kw):  # an estimator's running statistic, in the same carry
        carry = bound(real_batch, a, kw)["carry"]
        carry["batches"] = carry.get("batches", 0) + 1
        return real_batch(*a, **kw)

    monkeypatch.setattr(P, "minibatch_loss", counting)
    need(what="make_batch(agent, storage, next_obs, autocast, args, carry)", problem=None if
         "carry" in inspect.signature(real_batch).parameters else "this copy's has no carry")
    monkeypatch.setattr(P, "make_batch", estimating)
    P.main(tiny_args(total_timesteps=2 * 64, run_name="stateful"))
    run = str(workdir / "runs" / "stateful")
    per_iteration = P.load_checkpoint(run)["carry"]["calls"] / 2  # 2 epochs x 2 minibatches
    assert per_iteration >= 4  # (or more loss calls, each minibatch split)
    P.main(tiny_args(total_timesteps=3 * 64, run_name="stateful"))  # continued
    carry = P.load_checkpoint(run)["carry"]
    assert carry["calls"] == 3 * per_iteration, "the resume did not restore the fork's state"
    assert carry["batches"] == 3, "make_batch's carry is not the one checkpoints keep"
    assert torch.equal(carry["running"], torch.tensor(3 * per_iteration))


def test_a_resume_keeps_the_last_100_games(workdir, monkeypatch):
    """charts/avg_episodic_return, the figure papers report, is the mean of the last 100
    finished games of the whole run: after a resume, the games finished before the checkpoint
    still count. Checked against the run's own per-game events (charts/episodic_return), in a
    stand-in game that ends every 5 steps (about 13 games an iteration, 115 before the stop)."""
    need("main")
    monkeypatch.setattr(P, "make_envs", truncating_envs)
    monkeypatch.setattr(P, "check_env_id", lambda env_id: None)
    args = dict(env_id="Truncating", total_timesteps=12 * 64, run_name="games")
    P.main(tiny_args(**args, stop_at_step=9 * 64))
    P.main(tiny_args(**args))
    logged = scalars(str(workdir / "runs" / "games"), raw=True)
    games, averages = logged["charts/episodic_return"], logged["charts/avg_episodic_return"]
    assert sum(step <= 9 * 64 for step, _ in games) > 100, "too few games before the stop"
    after = [(step, avg) for step, avg in averages if step > 9 * 64]
    assert [step for step, _ in after] == [64 * i for i in range(10, 13)], after
    for step, avg in after:
        last = [score for s, score in games if s <= step][-100:]
        assert abs(avg - np.mean(last)) < 1e-4, (
            f"avg_episodic_return at step {step} after the resume: {avg:.4f}; the mean of the "
            f"run's last 100 games is {np.mean(last):.4f} (the resume forgot the games finished "
            f"before the checkpoint?)")


def test_a_resume_restores_the_weights_the_optimizer_and_the_rng(workdir, monkeypatch):
    """A resumed run goes on with the checkpoint's weights, Adam's moments and step counts and
    the torch RNG (action samples, minibatch order), not fresh ones."""
    need("main")
    P.main(tiny_args(total_timesteps=2 * 64, run_name="r"))
    saved = P.load_checkpoint(str(workdir / "runs" / "r"))
    seen, real_rollout, real_update = {}, P.rollout, P.update

    def rollout(*a, **kw):
        seen.setdefault("rng", torch.get_rng_state())  # before the first action is sampled
        return real_rollout(*a, **kw)

    def update(*a, **kw):
        if "optimizer" not in seen:  # a copy: the update changes the moments in place
            seen["optimizer"] = copy.deepcopy(bound(real_update, a, kw)["optimizer"].state_dict())
            seen["weights"] = copy.deepcopy(bound(real_update, a, kw)["agent"].state_dict())
        return real_update(*a, **kw)

    monkeypatch.setattr(P, "rollout", rollout)
    monkeypatch.setattr(P, "update", update)
    P.main(tiny_args(total_timesteps=3 * 64, run_name="r"))
    assert torch.equal(seen["rng"], saved["rng"]["torch"]), "the RNG was not restored"
    assert saved["model"].keys() == seen["weights"].keys() and all(
        torch.equal(saved["model"][k], seen["weights"][k]) for k in saved["model"]), \
        "the resumed run did not start from the checkpoint's weights"
    state, restored = saved["optimizer"]["state"], seen["optimizer"]["state"]
    assert state and set(state) == set(restored), "Adam's state was not restored"
    for k in state:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(state[k][name]),
                               torch.as_tensor(restored[k][name])), f"Adam's {name} restarted"


def test_a_cpu_run_never_initializes_cuda(workdir, monkeypatch):
    """--no-cuda on a machine with a GPU: training, a resume and an evaluation leave CUDA alone
    (each CPU seed or gloo rank would otherwise hold ~0.5 GB of GPU 0, and a GPU in
    exclusive-process mode would refuse the second). The stand-in GPU is shown to the file
    under test only: torch's own code sees the real machine (on a CUDA build, torch's optimizer
    asks is_available at each step); test_cuda.py checks a real --no-cuda run on a real GPU."""
    need("main", "checkpoint")

    def untouchable(name):
        def call(*a, **kw):
            raise AssertionError(f"a --no-cuda run called torch.cuda.{name}")
        return call

    real = torch.cuda.is_available
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True if sys._getframe(1).f_globals.get(
        "__name__") == P.__name__ else real())
    for name in ("_lazy_init", "init", "get_rng_state", "set_rng_state", "set_device"):
        monkeypatch.setattr(torch.cuda, name, untouchable(name))
    P.main(tiny_args(total_timesteps=192, stop_at_step=64, run_name="cpu"))
    P.main(tiny_args(total_timesteps=192, run_name="cpu"))
    assert P.load_checkpoint("runs/cpu")["global_step"] == 192
    P.main(P.Args(eval_checkpoint="runs/cpu/agent.pt", eval_episodes=1, cuda=False))


def test_a_compiled_bf16_cpu_run_saves_plain_weights_and_never_initializes_cuda(workdir,
                                                                               monkeypatch):
    """--compile --precision bf16 trains and saves plain fp32 weights (no torch.compile prefixes).
    --compile --no-cuda on a machine with a GPU: torch.compile's tracing saves the CUDA RNG
    state, and inductor reads the GPU's properties, wherever torch sees a GPU, which initializes
    CUDA. The file hides the GPUs (CUDA_VISIBLE_DEVICES) before torch counts them, so the run
    keeps off the GPU, twice in one process too. Stand-in: torch sees a GPU unless the variable
    hides it, its answer kept from the first question as a real device count is; initializing
    CUDA fails as torch's does where the variable hides the GPUs, and records who asked where
    it does not. What it cannot show: a real driver (test_cuda.py's --compile case
    runs on a GPU); a process whose torch counted the GPUs before main() (test_devices.py: the
    run says it cannot hide them)."""
    need("main")
    asked, counted = [], []

    def lazy_init():
        if os.environ.get("CUDA_VISIBLE_DEVICES") == "":  # as torch's: no GPU it may start
            raise RuntimeError("No CUDA GPUs are available")
        caller = inspect.stack()[2]
        asked.append(f"{caller.filename}:{caller.lineno}")
        raise AssertionError("CUDA initialized")

    def is_available():  # the first answer is kept, as torch keeps its device count
        counted.append(counted[0] if counted else os.environ.get("CUDA_VISIBLE_DEVICES") != "")
        return counted[-1]

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lazy_init)
    monkeypatch.setattr(torch.cuda.random, "_lazy_init", lazy_init)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    P.main(tiny_args(total_timesteps=128, compile=True, precision="bf16", run_name="compiled"))
    assert not asked and counted[0] is False, f"a --compile --no-cuda run initialized CUDA: {asked}"
    P.main(tiny_args(total_timesteps=64, run_name="again"))  # a second call, in one process
    assert not asked, f"the second call: {asked}"
    saved = P.load_checkpoint("runs/compiled/agent.pt")["model"]
    assert list(saved) == list(P.Agent(OBS, 4).state_dict()), "torch.compile prefixes saved"
    assert all(t.dtype == torch.float32 for t in saved.values()), "bf16 autocast: fp32 weights"
    losses = scalars("runs/compiled")["losses/value_loss"]
    assert len(losses) == 2 and all(np.isfinite(v) for _, v in losses)


def test_a_resumed_run_keeps_the_videos_its_earlier_launches_wrote(workdir, capsys):
    """--capture-video numbers env 0's games; a resume must number on after the videos already
    in the folder, not start again at game-0.mp4 and overwrite the first launch's. A resume
    with videos turned off loses no state, and says nothing of the video count."""
    need("main")
    P.main(tiny_args(total_timesteps=320, stop_at_step=128, run_name="vid", capture_video=True))
    folder = workdir / "runs" / "vid" / "videos"
    first = {f: (folder / f).read_bytes() for f in os.listdir(folder)}
    assert first, "the first launch wrote no video"
    P.main(tiny_args(total_timesteps=320, stop_at_step=256, run_name="vid", capture_video=True))
    capsys.readouterr()
    P.main(tiny_args(total_timesteps=320, run_name="vid", capture_video=False),
           {"total_timesteps", "run_name", "capture_video"})  # as --no-capture-video gives it
    assert "note: " not in capsys.readouterr().out, "videos off: a note of state not restored"
    for name, data in first.items():
        assert (folder / name).read_bytes() == data, f"the resume overwrote {name}"
    added = set(os.listdir(folder)) - set(first)
    assert added, "the resumed launch wrote no video of its own"
    last = max(int(f[5:-4]) for f in first)
    assert all(int(f[5:-4]) > last for f in added), f"{sorted(added)} after {sorted(first)}"


def test_videos_are_named_after_the_game_they_show_across_resumes(workdir):
    """Env 0's game count is in the checkpoint: a resume names its first video after env 0's
    next game, whether the videos before it are still in the folder or not, and whether the
    launch before recorded videos at all (then from env 0's finished games)."""
    need("main")
    P.main(tiny_args(total_timesteps=256, stop_at_step=64, run_name="v", capture_video=True))
    folder = workdir / "runs" / "v" / "videos"
    saved = P.load_checkpoint("runs/v")["env_statistics"]
    count = [P.from_saved(v) for v in saved["VideoRecorder.games_state"]]
    assert count[1:] == [None] and count[0] >= 1, count  # env 0 alone records
    shutil.rmtree(folder)  # the user cleared the first launch's videos
    P.main(tiny_args(total_timesteps=256, stop_at_step=128, run_name="v", capture_video=True))
    first = min(int(f[5:-4]) for f in os.listdir(folder))
    assert first >= count[0], f"the resume's videos start at game {first}, env 0 had started " \
        f"{count[0]} games before it"
    P.main(tiny_args(total_timesteps=256, stop_at_step=64, run_name="w"))  # no videos, then some
    saved = P.load_checkpoint("runs/w")["env_statistics"]
    finished = saved["RecordEpisodeStatistics.episode_count"]
    P.main(tiny_args(total_timesteps=256, stop_at_step=128, run_name="w", capture_video=True))
    numbers = sorted(int(f[5:-4]) for f in os.listdir(workdir / "runs" / "w" / "videos"))
    assert numbers and numbers[0] > P.from_saved(finished[0]), \
        f"videos {numbers} after env 0 finished {finished[0]} games (game-0 is the first run's)"


class Foreign(torch.Tensor):
    """Stands for a tensor on another device: .cpu() is what brings it to the host."""

    def cpu(self, *a, **kw):
        return self.as_subclass(torch.Tensor)


def test_checkpoint_and_agent_files_hold_host_tensors_only(workdir, monkeypatch):
    """A CUDA run's files load with a plain torch.load on a laptop: every tensor in them (the
    weights, Adam's state, a fork's carry) was brought to the host before saving."""
    need("checkpoint")
    agent = P.Agent(OBS, 4)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5)
    sum((p ** 2).sum() for p in agent.parameters()).backward()
    opt.step()
    foreign = lambda state: P.map_tensors(state, lambda t: t.as_subclass(Foreign))  # noqa: E731
    real_agent_state, real_opt_state = agent.state_dict, opt.state_dict
    monkeypatch.setattr(agent, "state_dict", lambda: foreign(real_agent_state()))
    monkeypatch.setattr(opt, "state_dict", lambda: foreign(real_opt_state()))
    written, saving = {}, torch.save  # what reaches torch.save, by file ("checkpoint.pt.PID.tmp")
    monkeypatch.setattr(torch, "save", lambda state, f: (written.update(
        {re.sub(r"\.\d+\.tmp$", "", os.path.basename(f.name)): state}), saving(state, f)))
    os.makedirs("run")
    envs = gym.vector.SyncVectorEnv([Truncating])
    run = P.Run("run", [], P.this_source())
    P.save_checkpoint(run, agent, opt, P.wrapper_statistics(envs), tiny_args(), 64, 1, [],
                      {"buffer": torch.ones(2).as_subclass(Foreign)})
    assert set(written) == {"checkpoint.pt", "agent.pt"}
    for name, state in written.items():
        kinds = []
        P.map_tensors(state, lambda t: kinds.append(type(t).__name__))
        assert kinds and set(kinds) == {"Tensor"}, f"{name} holds tensors left on the device"


def by_attribute(saved: dict, attr: str) -> list:
    """The checkpoint's per-env values of the one wrapper layer that has `attr` ("Layer.attr")."""
    (key,) = [k for k in saved if k.endswith(f".{attr}")]
    return [P.from_saved(v) for v in saved[key]]


def test_env_wrapper_statistics_survive_a_resume(workdir, monkeypatch):
    """A fork that swaps ClipReward for gymnasium's NormalizeReward (one line:
    tests/forks/normalize.diff) learns from rewards scaled by running statistics kept in the
    wrapper: checkpoints keep them per env, and a resume continues them instead of restarting."""
    line = "        env = ClipReward(env)\n"
    need_text(line, "make_env's line `env = ClipReward(env)`, which the test swaps for "
              "gymnasium's NormalizeReward")
    (workdir / "normalized.py").write_text(open(SCRIPT).read().replace(
        line, "        env = gym.wrappers.NormalizeReward(env, gamma=0.99)\n"))
    spec = importlib.util.spec_from_file_location("normalized", workdir / "normalized.py")
    M = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(M)
    need(what="restore_wrapper_statistics(envs, saved), which a resume calls",
         problem=None if hasattr(M, "restore_wrapper_statistics") else "this copy has none")
    args = dict(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                total_timesteps=192, run_name="norm")
    M.main(M.Args(**args, stop_at_step=64))
    saved = by_attribute(M.load_checkpoint("runs/norm")["env_statistics"], "return_rms")
    assert len(saved) == 2 and all(s["count"] > 30 for s in saved), saved
    restored, real = [], M.restore_wrapper_statistics

    def spy(envs, state, *rank):
        real(envs, state, *rank)
        restored.extend((float(s.mean), float(s.var), s.count) for s in envs.get_attr("return_rms"))

    monkeypatch.setattr(M, "restore_wrapper_statistics", spy)
    M.main(M.Args(**args))
    assert restored == [(float(s["mean"]), float(s["var"]), s["count"]) for s in saved], \
        "the resumed envs did not continue the checkpoint's running reward statistics"
    final = by_attribute(M.load_checkpoint("runs/norm")["env_statistics"], "return_rms")
    assert all(f["count"] > s["count"] for f, s in zip(final, saved)), "the statistics restarted"


COUNTING = """
class Counting(gym.Wrapper):
    \"\"\"A fork's own stateful wrapper: steps_state follows the convention, plain does not.\"\"\"

    def __init__(self, env):
        super().__init__(env)
        self.steps_state, self.plain = {"steps": 0}, 0.0

    def step(self, action):
        self.steps_state, self.plain = {"steps": self.steps_state["steps"] + 1}, self.plain + 1
        return self.env.step(action)


"""


def test_a_forks_own_wrapper_keeps_its_state_by_the_convention(workdir, capsys):
    """README's convention: a wrapper keeps what a resume continues in an attribute named
    *_state, which checkpoints save per env and a resume sets back (without a note); state kept
    otherwise (a plain float) is not saved, and starts afresh."""
    line = "        env = ClipReward(env)\n"
    need_text(line, "make_env's line `env = ClipReward(env)`, which the test wraps")
    source = open(SCRIPT).read().replace(line, "        env = ClipReward(Counting(env))\n")
    source = source.replace("def make_env(", COUNTING + "def make_env(")
    (workdir / "counting.py").write_text(source)
    spec = importlib.util.spec_from_file_location("counting", workdir / "counting.py")
    M = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(M)
    args = dict(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                total_timesteps=128, run_name="counting")
    M.main(M.Args(**args, stop_at_step=64))
    saved = M.load_checkpoint("runs/counting")["env_statistics"]
    assert saved.get("Counting.steps_state") == [{"steps": 32}] * 2, saved
    assert not any(key.endswith(".plain") for key in saved), saved
    capsys.readouterr()
    M.main(M.Args(**args))
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: ")]
    assert not notes, notes
    final = M.load_checkpoint("runs/counting")["env_statistics"]["Counting.steps_state"]
    assert final == [{"steps": 64}] * 2, f"the resume did not continue the wrapper's state: {final}"


def test_carry_refuses_what_a_checkpoint_cannot_hold_in_one_line(workdir, monkeypatch, capsys):
    """carry keeps tensors (back on the training device), numbers, str, None, numpy and
    containers of them; anything else (an object) is refused at the first checkpoint, in one
    line naming the key, before any training."""
    need("main")
    real = P.restore

    def restore(ckpt, agent, optimizer, envs, carry, *a, **kw):
        real(ckpt, agent, optimizer, envs, carry, *a, **kw)
        carry["stats"] = object()

    monkeypatch.setattr(P, "restore", restore)
    with pytest.raises(SystemExit) as exit_:
        P.main(tiny_args(total_timesteps=64, run_name="bad"))
    err = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert "carry['stats'] is a object, which a checkpoint cannot hold" in err[0]
    assert not os.path.exists("runs/bad/checkpoint.pt")


def test_a_resume_reports_the_learning_rate_the_forks_schedule_gives(workdir, capsys):
    """The learning rate a resume says it goes on with is the one its next iteration logs, also
    for a fork with its own schedule (here a warm-up: half the rate for the first 3 iterations,
    a numpy float), since both read the core's schedule(); its checkpoints load."""
    need("main")
    line = "    frac = 1.0 - (iteration - 1.0) / num_iterations\n"
    need_text(line, "schedule()'s line `frac = 1.0 - (iteration - 1.0) / num_iterations`")
    source = open(SCRIPT).read().replace(  # numpy's floats, as np.cos gives, are saved as floats
        line, line + "    frac *= np.float64(0.5) if iteration <= 3 else 1\n")
    (workdir / "warm.py").write_text(source)
    spec = importlib.util.spec_from_file_location("warm", workdir / "warm.py")
    M = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(M)
    args = dict(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                total_timesteps=6 * 64, run_name="warm")
    M.main(M.Args(**args, stop_at_step=128))
    capsys.readouterr()
    M.main(M.Args(**args, stop_at_step=192))
    said = capsys.readouterr().out.split("; learning rate ", 1)[1].split(" now")[0]
    logged = dict(scalars("runs/warm")["charts/learning_rate"])[192]
    assert said == f"{logged:.3g}", f"the resume said {said}; its next iteration used {logged}"


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


def alike(a, b) -> bool:
    """a and b alike in type (numpy dtypes too) and value, all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(alike(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(alike(a[k], b[k]) for k in a)
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
    assert alike(KINDS[kind], kept[kind]), f"carry[{kind!r}]: kept {KINDS[kind]!r} " \
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
