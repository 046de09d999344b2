"""Shared helpers: the script under test, its seams, launches of it (TensorBoard read-back is
tests/tools/events.py's, the reader the tools use).

The suite runs against any copy of the file: `python -m pytest tests --script PATH/ppo_atari.py`
(default: the repository's ppo_atari.py). Tests import it as `ppo_atari` and take sizes and
metric names from it, so a fork fails only the tests that pin a setting it changed.

Each test reaches the file through a few seams (SEAMS below; tests/README.md lists them). A test
first asks for the seams it needs with `need(...)`: where a copy changed a seam's interface, the
test is skipped with one line saying what it needs and what the copy has, and the end of the run
lists what could not be checked. Against the repository's own file a missing seam is a failure.
"""
import dataclasses
import functools
import glob
import importlib.util
import inspect
import os
import signal
import socket
import subprocess
import sys
import tempfile

import gymnasium as gym
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "ppo_atari.py")  # replaced by --script in pytest_configure
IMPORTABLE = ROOT  # the folder `import ppo_atari` finds the copy in (pytest_configure)
sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))
from events import scalars  # noqa: E402, F401  (the tools' reader; tests import it from here)

# A tiny but complete configuration: 2 envs x 32 steps, 2 minibatches, 2 epochs, on the CPU,
# one torch thread (see one_torch_thread)
TINY = ["--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "2",
        "--no-cuda", "--threads", "1"]


def pytest_addoption(parser):
    parser.addoption("--script", default=None,
                     help="the copy of ppo_atari.py to test (default: the repository's)")


def pytest_configure(config):
    """Imports the file under test as the module `ppo_atari`, before any test module does."""
    global SCRIPT
    config.addinivalue_line("markers", "details: the tests that pin a published detail (wrappers, "
                            "network and init, loss of record, GAE, optimizer, schedules), in "
                            "process: `python -m pytest tests -m details --script COPY`")
    config.addinivalue_line("markers", "forks: the example forks of tests/forks/ trained, "
                            "stopped, resumed and evaluated; run only when asked for: "
                            "`python -m pytest tests -m forks`")
    # the signals as a terminal gives them, whoever started pytest: one ignored here (pytest as a
    # script's `&` job: SIGINT; under nohup: SIGHUP) would stay ignored in every process the
    # tests start (a test that wants one ignored says so: launch(..., ignored=...))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        if signal.getsignal(s) == signal.SIG_IGN:
            signal.signal(s, signal.SIG_DFL)
    config.option.loadscopereorder = False  # xdist: the order LONGEST_FIRST gives, not by count
    SCRIPT = os.path.abspath(config.getoption("--script") or os.environ.get("PPO_ATARI_SCRIPT")
                             or SCRIPT)
    if not os.path.isfile(SCRIPT):
        raise pytest.UsageError(f"--script {SCRIPT}: no such file")
    os.environ["PPO_ATARI_SCRIPT"] = SCRIPT  # for subprocesses that import it (torchrun harness)
    global IMPORTABLE  # a folder where `import ppo_atari` finds the copy, whatever its name
    IMPORTABLE = os.path.dirname(SCRIPT)
    if os.path.basename(SCRIPT) != "ppo_atari.py":  # my_fork.py: imported by name as ppo_atari
        IMPORTABLE = tempfile.mkdtemp(prefix="ppo-atari-as-")  # (async env workers, scripts)
        os.symlink(SCRIPT, os.path.join(IMPORTABLE, "ppo_atari.py"))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [IMPORTABLE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    sys.path.insert(0, IMPORTABLE)  # async env workers import it by name
    spec = importlib.util.spec_from_file_location("ppo_atari", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ppo_atari"] = module
    spec.loader.exec_module(module)


# the files that take longest, first: two workers given whole files (--dist loadfile) then end
# together, the short files filling in at the end
LONGEST_FIRST = ["test_stops.py", "test_crashes.py", "test_checkpoint.py", "test_distributed.py",
                 "test_run_folders_and_locks.py", "test_train.py", "test_readme.py"]


def pytest_collection_modifyitems(config, items):
    """The `forks` selection runs only when -m names it; under xdist, the longest files first."""
    if hasattr(config, "workerinput"):  # an xdist worker: its order is the schedule's
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest stay
    if "forks" in (config.getoption("-m") or ""):
        return
    left_out = [item for item in items if "forks" in item.keywords]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if "forks" not in item.keywords]


def is_repository_file() -> bool:
    return os.path.realpath(SCRIPT) == os.path.realpath(os.path.join(ROOT, "ppo_atari.py"))


@functools.cache
def obs_shape():
    """The observation shape of the file under test (its wrappers decide it)."""
    import ppo_atari as P
    env = P.make_env("BreakoutNoFrameskip-v4", seed=0)()
    shape = env.observation_space.shape
    env.close()
    return shape


def takes(function, *args, **kwargs) -> str | None:
    """None if function can be called with these arguments, else what its signature is."""
    try:
        inspect.signature(function).bind(*args, **kwargs)
        return None
    except TypeError:
        return f"this copy has {function.__qualname__}{inspect.signature(function)}"


def _forward():
    import torch
    import ppo_atari as P
    agent = P.Agent(obs_shape(), 4)
    problem = takes(agent.forward, None)
    if problem:
        return problem
    out = agent(torch.zeros(3, *obs_shape(), dtype=torch.uint8))
    shapes = [tuple(t.shape) for t in out] if isinstance(out, tuple) else type(out).__name__
    return None if shapes == [(3, 4), (3,)] else f"this copy's forward returns {shapes}"


def _get_action_and_value():
    import torch
    import ppo_atari as P
    agent = P.Agent(obs_shape(), 4)
    problem = takes(agent.get_action_and_value, None) or takes(agent.get_action_and_value, None,
                                                                 None)
    if problem:
        return problem
    out = agent.get_action_and_value(torch.zeros(3, *obs_shape(), dtype=torch.uint8))
    shapes = [tuple(t.shape) for t in out] if isinstance(out, tuple) else type(out).__name__
    return None if isinstance(shapes, list) and shapes[:4] == [(3,)] * 4 else \
        f"this copy's get_action_and_value returns {shapes}"  # values after the four: a fork's


def stand_in_policy(n: int):
    """A policy with no network for n envs: action 0, zero log-probabilities, entropies and
    values, and zeros for each value a copy's get_action_and_value returns after CleanRL's four
    (an intrinsic value), so the copy's own rollout unpacks it."""
    import torch
    import ppo_atari as P
    extra = len(P.Agent(obs_shape(), 4).get_action_and_value(
        torch.zeros(1, *obs_shape(), dtype=torch.uint8))) - 4
    zeros = torch.zeros(n)
    return lambda obs: (zeros.long(), *[zeros] * (3 + extra))


def _frame_stack():
    import ppo_atari as P
    env, depth = P.make_env("BreakoutNoFrameskip-v4", seed=0)(), None
    while depth is None and hasattr(env, "env"):
        if isinstance(env, gym.wrappers.FrameStackObservation):
            depth = env.stack_size
        env = env.env
    if depth is None:
        return "this copy's make_env has no gym.wrappers.FrameStackObservation"
    if obs_shape()[0] % depth:
        return f"{obs_shape()[0]} channels do not split into {depth} frames"
    return None


def _function(name, *args, **kwargs):
    def check():
        import ppo_atari as P
        function = getattr(P, name, None)
        return f"this copy has no {name}" if function is None else takes(function, *args,
                                                                           **kwargs)
    return check


def _classes(*names):
    def check():
        import ppo_atari as P
        missing = [n for n in names if not isinstance(getattr(P, n, None), type)]
        return f"this copy has no {', '.join(missing)}" if missing else None
    return check


def _heads():
    import torch.nn as nn
    import ppo_atari as P
    agent = P.Agent(obs_shape(), 4)
    missing = [n for n in ("actor", "critic") if not isinstance(getattr(agent, n, None),
                                                                 nn.Module)]
    return f"this copy's Agent has no {', '.join(missing)}" if missing else None


# name: (what a test needs, a check returning None or what this copy has instead)
SEAMS = {
    "env thunk": ("make_env(env_id, seed)() -> one Atari game, observations (C, H, W) uint8",
                  _function("make_env", "BreakoutNoFrameskip-v4", 0)),
    "vector env": ("make_envs(args, seed) -> the vector env over make_env's games",
                   _function("make_envs", None, 0)),
    "frame stack": ("make_env's stack: a gym.wrappers.FrameStackObservation of frames of C/depth "
                    "channels each, concatenated on the channel axis", _frame_stack),
    "wrappers": ("the wrapper classes NoopReset, MaxAndSkip, EpisodicLife, FireReset (each "
                 "Wrapper(env))", _classes("NoopReset", "MaxAndSkip", "EpisodicLife", "FireReset")),
    "Agent.forward": ("Agent(obs_shape, n_actions).forward(obs) -> (logits (B, n), value (B,))",
                      _forward),
    "Agent.get_action_and_value": ("Agent.get_action_and_value(obs, action=None) -> (action, "
                                   "logprob, entropy, value, ...), each (B,)",
                                   _get_action_and_value),
    "Agent heads": ("Agent.actor and Agent.critic (the heads; each trunk is found from them)",
                    _heads),
    "ppo_loss": ("ppo_loss(newlogprob, entropy, newvalue, logprob, advantages, returns, values, "
                 "clip_coef, norm_adv=, clip_vloss=, ent_coef=, vf_coef=) -> (loss, metrics)",
                 _function("ppo_loss", *[None] * 8, norm_adv=True, clip_vloss=True, ent_coef=0.0,
                           vf_coef=0.0)),
    "compute_gae": ("compute_gae(rewards, values, dones, next_value, gamma, gae_lambda) -> "
                    "(advantages, returns)", _function("compute_gae", *[None] * 6)),
    "rollout": ("rollout(policy, envs, next_obs, storage, staging, autocast, global_step, "
                "steps_per_step) and make_storage(obs_shape, num_steps, num_envs, device)",
                lambda: _function("rollout", *[None] * 8)() or
                _function("make_storage", None, 1, 1, None)()),
    "main": ("main(Args(...)) trains in-process, its envs from make_envs(args, seed, ...)",
             lambda: _function("main", None)() or _function("make_envs", None, 0)()),
    "checkpoint": ("load_checkpoint(path) -> the dict on disk (model, optimizer, args, "
                   "global_step, iteration)", _function("load_checkpoint", "path")),
}


@functools.cache
def seam_problem(name: str) -> str | None:
    try:
        return SEAMS[name][1]()
    except Exception as e:  # the probe itself could not run on this copy
        first = str(e).splitlines()[0][:120] if str(e) else ""
        return f"this copy raised {type(e).__name__} ({first})"


def need(*names: str, problem: str | None = None, what: str | None = None):
    """Skips the calling test (fails it, on the repository's file) unless the copy has these
    seams; `what` and `problem` name a test's own seam (a line of the file it edits)."""
    for name in names:
        if seam_problem(name):
            what, problem = SEAMS[name][0], seam_problem(name)
            break
    if problem:
        message = f"needs {what}; {problem}"
        if is_repository_file():
            pytest.fail(f"the repository's file lost a seam the tests use: {message}")
        pytest.skip(message)


def need_text(text: str, what: str):
    """For tests that edit a copy of the file: the line they edit, exactly once."""
    count = open(SCRIPT).read().count(text)
    need(what=what, problem=None if count == 1 else f"this copy has it {count} times")


def expect(*checks):
    """Several details at once: fails naming every one that does not hold, so that one failed
    pin never hides the next. Each check is (holds, "detail: published X; this copy Y")."""
    failed = [message for holds, message in checks if not holds]
    assert not failed, "\n".join(failed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_terminal_summary(terminalreporter):
    """The end of the run: every skipped test, grouped by its reason (what could not be checked
    against this copy, and why), and how many tests a selection left out."""
    reasons = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons.setdefault(reason, []).append(report.nodeid.split("::")[-1])
    if reasons:
        terminalreporter.section("skipped, by reason")
        for reason, tests in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
            terminalreporter.write_line(f"{len(tests)} skipped: {reason}: {', '.join(tests)}")
    forks = [r for r in terminalreporter.stats.get("deselected", []) if "forks" in r.keywords]
    if forks:
        terminalreporter.write_line(f"{len(forks)} deselected: the example forks' runs "
                                    f"(`python -m pytest tests -m forks` runs them)")


class StandIn(gym.Wrapper):
    """The suite's stand-in games play their own frames, rewards and episode ends over the
    copy's own wrapper stack (make_env's Breakout), which they never step. The spaces, and every
    attribute gymnasium's API reaches through wrappers (get_wrapper_attr, a vector env's
    get_attr/set_attr: a fork's NormalizeReward statistics, say), come from that stack, so a
    fork that reads or sets a wrapper's attribute gets the real checks, not a setup error."""

    def __init__(self):
        import ppo_atari as P
        super().__init__(P.make_env("BreakoutNoFrameskip-v4", seed=0)())
        self.action_space = gym.spaces.Discrete(4)
        self.rng = np.random.default_rng(0)

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        return self.first(), {}

    def frame(self, high=255):
        return self.rng.integers(0, high, self.observation_space.shape, dtype=np.uint8)


class Truncating(StandIn):
    """Random frames, reward 1 on action 0, truncated every 5 steps."""

    def first(self):
        self.t = 0
        return self.frame()

    def step(self, action):
        self.t += 1
        return self.frame(), float(action == 0), False, self.t % 5 == 0, {}


def truncating_envs(args, seed, *a, **kw):
    """make_envs(args, seed, ...) with the stand-in game, for main(Args(env_id="Truncating"))."""
    return stand_in_envs(Truncating, args.num_envs)


def stand_in_envs(game, n: int):
    """A vector env of n stand-in games, each with its full-game statistics as make_env's are."""
    thunk = lambda: gym.wrappers.RecordEpisodeStatistics(game())  # noqa: E731
    return gym.vector.SyncVectorEnv([thunk] * n, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def reference_ppo_terms(newlogprob, entropy, newvalue, mb: dict, clip: float, args) -> dict:
    """PPO's loss of record (CleanRL, baselines ppo2), written here apart from the file, term by
    term under the names the file's metrics use: policy_loss (the clipped surrogate),
    value_loss (half the clipped value error), entropy; "loss" with args' coefficients."""
    import torch
    ratio = torch.exp(newlogprob - mb["logprobs"])
    adv = mb["advantages"]
    if args.norm_adv:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    surrogate = torch.min(adv * ratio, adv * ratio.clamp(1 - clip, 1 + clip))
    error = (newvalue - mb["returns"]) ** 2
    if args.clip_vloss:
        moved = mb["values"] + (newvalue - mb["values"]).clamp(-clip, clip)
        error = torch.maximum(error, (moved - mb["returns"]) ** 2)
    terms = {"policy_loss": -surrogate.mean(), "value_loss": 0.5 * error.mean(),
             "entropy": entropy.mean()}  # (means over the rows given: one optimizer step's)
    terms["loss"] = (terms["policy_loss"] + args.vf_coef * terms["value_loss"] -
                     args.ent_coef * terms["entropy"])
    return {k: float(v) for k, v in terms.items()}


def _record_loss_call(call: dict, loss, metrics: dict, optimizer) -> dict:
    """What a test needs of one call of the training loss, taken before the optimizer step."""
    import torch
    mb, agent, args, clip = (call.get(k) for k in ("mb", "agent", "args", "clip_coef"))
    entry = {"loss": float(loss.detach()), "metrics": {k: float(v) for k, v in metrics.items()},
             "lr": optimizer.param_groups[0]["lr"] if optimizer else None, "args": args,
             "clip_coef": None if clip is None else float(clip),
             "actions": mb["actions"].flatten().clone() if isinstance(mb, dict) else None}
    if isinstance(mb, dict):  # what reaches the loss from the estimator, and a fork's own rows
        entry["targets"] = {k: mb[k].detach().flatten().double().clone()
                            for k in ("values", "advantages", "returns") if k in mb}
        entry["own_rows"] = {k: v.detach().clone() for k, v in mb.items() if k not in (
            "obs", "actions", "logprobs", "values", "advantages", "returns") and
            isinstance(v, torch.Tensor) and v.dim() > 0 and len(v) == len(mb["actions"])}
    if isinstance(mb, dict) and agent is not None and not seam_problem(
            "Agent.get_action_and_value"):
        with torch.no_grad():
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(mb["obs"],
                                                                           mb["actions"])[:4]
            entry["ratio_gap"] = (newlogprob - mb["logprobs"]).abs().max().item()
            entry["terms"] = reference_ppo_terms(newlogprob, entropy, newvalue, mb, float(clip),
                                                 args)
            entry["of_record"] = entry["terms"]["loss"]
            entry["forward"] = {"newlogprob": newlogprob, "entropy": entropy,
                                "newvalue": newvalue} | {k: mb[k].detach().clone() for k in (
                                    "logprobs", "advantages", "returns", "values")}
    return entry


def bound(function, args, kwargs) -> dict:
    """The arguments of a call by parameter name."""
    return dict(inspect.signature(function).bind(*args, **kwargs).arguments)


@pytest.fixture(scope="session")
def instrumented(tmp_path_factory):
    """Two iterations of main() on the stand-in env (4 envs x 16 steps, 4 minibatches, 3 epochs,
    --anneal-clip), with the optimizer, gradient clipping, GAE and every call of the training
    loss recorded: the loss function main calls, whatever its signature, on the real minibatches
    of the real update. Also the run's TensorBoard scalars ("logged")."""
    need("main")
    import torch
    import torch.nn as nn
    import ppo_atari as P
    seen = {"adam": [], "clip": [], "loss": [], "gae": [], "batch": [], "rollouts": [],
            "steps": [], "optimizer": None, "agent": None, "carry": {}}

    class Adam(torch.optim.Adam):
        def __init__(self, params, *a, **kw):
            seen["adam"].append(kw)
            super().__init__(params, *a, **kw)
            seen["optimizer"] = self

        def step(self, *a, **kw):  # the loss calls so far: each step learned from those since
            seen["steps"].append(len(seen["loss"]))  # the step before
            return super().step(*a, **kw)

    real_clip, real_loss, real_gae = nn.utils.clip_grad_norm_, P.minibatch_loss, P.compute_gae
    real_batch = P.make_batch

    def clip(params, max_norm, *a, **kw):
        seen["clip"].append(max_norm)
        return real_clip(params, max_norm, *a, **kw)

    def loss(*a, **kw):
        loss, metrics = real_loss(*a, **kw)
        call = bound(real_loss, a, kw)
        seen["loss"].append(_record_loss_call(call, loss, metrics, seen["optimizer"]))
        seen["carry"] = call.get("carry", {})  # the fork's state, as the loss last saw it
        return loss, metrics

    def gae(*a, **kw):
        call = bound(real_gae, a, kw)
        seen["gae"].append({k: v.clone() for k, v in call.items() if hasattr(v, "clone")})
        advantages, returns = real_gae(*a, **kw)
        seen["gae"][-1]["returns"] = returns.clone()
        return advantages, returns

    def make_batch(*a, **kw):  # whatever estimator the copy runs, its batch
        call = bound(real_batch, a, kw)  # and the rollout it estimates from
        storage, agent, next_obs = (call.get(k) for k in ("storage", "agent", "next_obs"))
        rollout = {"problem": "make_batch(agent, storage, next_obs, ...) with storage's "
                   "rewards, values and dones (T, N)"}
        if isinstance(storage, dict) and {"rewards", "values", "dones"} <= set(storage) and \
                not seam_problem("Agent.get_action_and_value"):
            with torch.no_grad(), torch.random.fork_rng(devices=[]):  # the run's RNG as is
                next_value = agent.get_action_and_value(next_obs)[3]
            rollout = {k: storage[k].detach().double().clone()
                       for k in ("rewards", "values", "dones")}
            rollout["next_value"] = next_value.detach().double().flatten().clone()
        seen["rollouts"].append(rollout)
        seen["agent"] = agent
        batch = real_batch(*a, **kw)
        if isinstance(batch, dict) and {"values", "returns"} <= set(batch):
            seen["batch"].append({k: batch[k].detach().flatten().clone()
                                  for k in ("values", "returns")})
        return batch

    cwd = tmp_path_factory.mktemp("instrumented")
    with pytest.MonkeyPatch.context() as mp:  # one run shared by the tests that read it
        mp.chdir(cwd)
        mp.setattr(torch.optim, "Adam", Adam)
        mp.setattr(nn.utils, "clip_grad_norm_", clip)
        mp.setattr(P, "minibatch_loss", loss)
        mp.setattr(P, "compute_gae", gae)
        mp.setattr(P, "make_batch", make_batch)
        mp.setattr(P, "make_envs", truncating_envs)
        mp.setattr(P, "check_env_id", lambda env_id: None)
        seen["run_args"] = P.Args(env_id="Truncating", num_envs=4, num_steps=16,
                                  num_minibatches=4, update_epochs=3, total_timesteps=128,
                                  anneal_clip=True, cuda=False, run_name="instrumented")
        P.main(seen["run_args"])
    seen["logged"] = scalars(str(cwd / "runs" / "instrumented"))
    return seen


def loss_calls(instrumented) -> list:
    """The recorded calls of the training loss; skips when main computes it some other way."""
    need(what="main to compute the training loss by calling minibatch_loss(agent, mb, "
         "clip_coef, args, ...)", problem=None if instrumented["loss"] else
         "this copy's training never called minibatch_loss")
    return instrumented["loss"]


def optimizer_steps(instrumented) -> list:
    """What each optimizer step learned from, whatever the number of loss calls it took (one
    per minibatch as published; two halves, accumulated): its calls, their rows, lr and clip,
    the actions; its loss and metrics (the rows-weighted mean of its calls'; "summed": their sum,
    for a fork whose calls return each their share); and PPO's terms of record over all its rows
    (advantages normalized over the rows of the step, the minibatch: "terms")."""
    import torch
    calls, ends = loss_calls(instrumented), instrumented["steps"]
    args = instrumented["run_args"]
    steps = []
    for first, end in zip([0] + ends, ends):
        group = calls[first:end]
        if not group:
            continue
        rows = [len(c["actions"]) for c in group]
        weight = [r / sum(rows) for r in rows]
        step = {"calls": group, "rows": sum(rows), "lr": group[0]["lr"], "args": group[0]["args"],
                "clip_coef": group[0]["clip_coef"], "actions": torch.cat([c["actions"]
                                                                          for c in group]),
                "loss": sum(w * c["loss"] for w, c in zip(weight, group)),
                "summed": sum(c["loss"] for c in group),
                "metrics": {k: sum(w * c["metrics"][k] for w, c in zip(weight, group))
                            for k in group[0]["metrics"]},
                "ratio_gap": max(c.get("ratio_gap", 0.0) for c in group)}
        if all("forward" in c for c in group):
            joined = {k: torch.cat([c["forward"][k] for c in group]) for k in group[0]["forward"]}
            step["terms"] = reference_ppo_terms(
                joined.pop("newlogprob"), joined.pop("entropy"), joined.pop("newvalue"), joined,
                step["clip_coef"], dataclasses.replace(group[0]["args"], norm_adv=args.norm_adv))
        steps.append(step)
    return steps


def gae_calls(instrumented) -> list:
    """The recorded calls of compute_gae; skips when training estimates advantages otherwise."""
    need(what="training to estimate advantages by calling compute_gae(rewards, values, dones, "
         "next_value, gamma, gae_lambda)", problem=None if instrumented["gae"] else
         "this copy's training never called compute_gae (another advantage estimator?)")
    return instrumented["gae"]


class Launched(subprocess.Popen):
    """A launch of the script (conftest.launch): subprocess.Popen with stdout and stderr in
    files, read back as text by communicate() and line_starting()."""

    def __init__(self, command, out, err, **kwargs):
        self.out, self.err = out, err
        with open(out, "w") as o, open(err, "w") as e:
            super().__init__(command, stdout=o, stderr=e, **kwargs)

    def communicate(self, timeout=None):
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        return tuple(open(path).read() for path in (self.out, self.err))

    def line_starting(self, prefix, timeout=200):
        """Waits for the first stdout line that starts with prefix (None: the process ended
        or the time ran out first)."""
        import time
        deadline = time.time() + timeout
        while time.time() < deadline:
            ended = self.poll() is not None
            for line in open(self.out).read().splitlines(keepends=True):
                if line.startswith(prefix) and line.endswith("\n"):
                    return line
            if ended:
                return None
            time.sleep(0.05)
        return None


def launch(args, cwd, script=None, env=None, new_session=False, sigint_ignored=False,
           ignored=()):
    """`python SCRIPT ARGS` in cwd, a fresh interpreter of its own (what a user's shell starts,
    ~3.5 s of imports before the script's first line runs). new_session: its own process group
    (a scheduler's job); sigint_ignored: started with Ctrl-C ignored (a script's `cmd &`);
    ignored: more signals ignored at start, by name (`trap "" USR1`, nohup's HUP)."""
    import tempfile
    folder = tempfile.mkdtemp(prefix="launch-")
    command = [sys.executable, os.path.abspath(script or SCRIPT), *map(str, args)]
    ignored = ["INT"] * sigint_ignored + list(ignored)
    if ignored:  # as a shell does for `cmd &` (no preexec_fn: unsafe with threads here)
        command = ["/bin/sh", "-c", f'trap "" {" ".join(ignored)}; exec "$@"', "sh", *command]
    proc = Launched(command, os.path.join(folder, "stdout"), os.path.join(folder, "stderr"),
                    cwd=cwd, env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})),
                    start_new_session=new_session)
    LAUNCHED.append((proc, folder))
    return proc


LAUNCHED = []  # (process, the folder of its stdout and stderr files)


def pytest_unconfigure(config):
    """A launch a failed test left running is killed, and the launches' output files are
    removed."""
    import shutil
    for proc, folder in LAUNCHED:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def left_in_session(sid, within=30.0) -> list[int]:
    """The processes of session `sid` (a launch with new_session: the trainer, its workers, the
    resource tracker) still alive, not zombies, after waiting up to `within` seconds."""
    import time
    deadline = time.time() + within
    while True:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                alive.append(int(pid))
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


def run_script(args, cwd, script=None, timeout=300, env=None):
    """The script run to its end in a process of its own (launch); a CompletedProcess."""
    proc = launch(args, cwd, script, env)
    out, err = proc.communicate(timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_in_process(args, cwd, module=None) -> subprocess.CompletedProcess:
    """The script's command line run in this process, as its `__main__` line runs it: exit
    code, stdout and stderr. For checks where a process of its own is not the point; each launch
    saved is seconds of torch's import. module: another copy, imported (default: the script's)."""
    import contextlib
    import io
    import tyro
    import ppo_atari
    P = module or ppo_atari
    out, err, code, before = io.StringIO(), io.StringIO(), 0, os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            P.main(tyro.cli(P.Args, args=list(args)), P.explicit_fields(list(args)))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run_dirs(cwd):
    return sorted(glob.glob(os.path.join(cwd, "runs", "*")))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The suite's two workers share two cores: a training in this process uses one torch thread
    unless its Args name --threads (launches pass TINY's --threads 1), as each of torchrun's two
    local processes would; test_backends.py checks the file's own choice (choose_device.real)."""
    import ppo_atari as P
    real = getattr(P, "choose_device", None)

    def one_thread(args, *a, **kw):
        return real(dataclasses.replace(args, threads=args.threads or 1), *a, **kw)
    one_thread.real = real
    with pytest.MonkeyPatch.context() as mp:
        if real is not None:
            mp.setattr(P, "choose_device", one_thread)
        yield


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---- runs killed or stopped at an instant (test_stops.py, test_crashes.py) ----

ITER = 64  # steps per iteration of TINY: 2 envs x 32 steps


def tiny_args(**kw):
    import ppo_atari as P
    return P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=2, cuda=False, **kw)


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """A test that calls main() in this process leaves SIGINT and SIGTERM as it found them."""
    saved = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    yield
    for s, h in zip((signal.SIGINT, signal.SIGTERM), saved):
        signal.signal(s, h)


def listing(folder):
    return {f: os.path.getmtime(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}


# Runs the file under test (PPO_ATARI_SCRIPT) and kills itself at one exact instant, named by
# KILL_AT = "rename:FILE:N": the N-th write of FILE, its temporary file half written and not yet
# renamed; "call:NAME:N": the moment the N-th call of the file's NAME has returned. SIGNAL names
# the signal (default SIGKILL); SWALLOW=1 sends it from inside a finalizer (__del__), where
# Python's default Ctrl-C handler raises a KeyboardInterrupt that is printed and dropped;
# THEN_RAISE=1 makes that call raise a RuntimeError once the file has recorded the signal (in
# the list catch_stop_signals was given), or after 10 s without.
KILLER = """
import importlib.util, os, signal, sys, time
import gymnasium as gym
import tyro
spec = importlib.util.spec_from_file_location("ppo_atari", os.environ["PPO_ATARI_SCRIPT"])
P = importlib.util.module_from_spec(spec)
sys.modules["ppo_atari"] = P
spec.loader.exec_module(P)
where, name, nth = os.environ["KILL_AT"].split(":")
sig, seen, stops = getattr(signal, os.environ.get("SIGNAL", "SIGKILL")), [], []
if hasattr(P, "catch_stop_signals"):  # keep the list a signal is recorded in
    real_catch = P.catch_stop_signals
    def catch(stop, *a, **kw):
        stops.append(stop)
        return real_catch(stop, *a, **kw)
    P.catch_stop_signals = catch

class Finalizer:
    def __del__(self):
        os.kill(os.getpid(), sig)
        sum(range(10 ** 5))  # Python runs the handler here, inside __del__

def hit():
    seen.append(1)
    if len(seen) == int(nth):
        Finalizer() if os.environ.get("SWALLOW") else os.kill(os.getpid(), sig)

if where == "group":  # the whole process group, the moment the async workers start
    real_check = gym.vector.AsyncVectorEnv._check_spaces
    def check_spaces(self):
        os.killpg(os.getpgid(0), sig)
        return real_check(self)
    gym.vector.AsyncVectorEnv._check_spaces = check_spaces
elif where == "rename":
    real_replace = os.replace
    def replace(src, dst, *a, **kw):
        if os.path.basename(dst) == name and len(seen) + 1 == int(nth):
            os.truncate(src, os.path.getsize(src) // 2)
            hit()
        elif os.path.basename(dst) == name:
            seen.append(1)
        return real_replace(src, dst, *a, **kw)
    os.replace = replace
else:
    real = getattr(P, name)
    def call(*a, **kw):
        out = real(*a, **kw)
        hit()
        if os.environ.get("THEN_RAISE") and len(seen) == int(nth):
            deadline = time.time() + 10
            while not (stops and stops[0]) and time.time() < deadline:
                time.sleep(0.01)
            if not (stops and stops[0]):
                raise RuntimeError("the signal was never recorded")
            raise RuntimeError("a bug after the signal was recorded")
        return out
    setattr(P, name, call)
if __name__ == "__main__":  # async env workers import this file as their main module
    P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
"""


TOTAL = 4 * ITER


JOB = [*TINY, "--total-timesteps", str(TOTAL), "--checkpoint-interval", "1", "--run-name", "job"]


def killer(cwd, kill_at, args=JOB, **env):
    """The harness in cwd, started in a session of its own (so a group signal stays in it)."""
    (cwd / "killer.py").write_text(KILLER)
    return launch(args, cwd, script=cwd / "killer.py", env=dict(KILL_AT=kill_at, **env),
                  new_session=True)


def killed_at(cwd, kill_at, args=JOB, **env):
    proc = killer(cwd, kill_at, args, **env)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(kill_at, proc.returncode, out, err)


def assert_finished(run):
    import ppo_atari as P
    assert P.load_checkpoint(run)["global_step"] == TOTAL
    agent = P.load_checkpoint(os.path.join(run, "agent.pt"))
    assert agent["finished"] is True and agent["global_step"] == TOTAL
    steps = [s for s, _ in scalars(run)["losses/value_loss"]]  # TensorBoard's view
    assert steps == list(range(ITER, TOTAL + 1, ITER)), f"iterations logged at {steps}"


@pytest.fixture(scope="session")
def agent_file(tmp_path_factory):
    """A finished tiny run's folder and its agent.pt, shared by the tests that only read it."""
    cwd = tmp_path_factory.mktemp("scored")
    out = run_script([*TINY, "--total-timesteps", "64", "--run-name", "r"], cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    return cwd, os.path.join("runs", "r", "agent.pt")
