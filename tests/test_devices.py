"""What the CPU can check of the CUDA paths: the rollout's host-device traffic, the heads'
precision under bf16, cudnn's settings, wandb's arguments for a continued run, and --no-cuda
hiding the GPUs before torch counts them."""
import importlib.machinery
import importlib.util
import os
import sys
import types

import gymnasium as gym
import torch
from torch.overrides import TorchFunctionMode

import ppo_atari as P
from conftest import Truncating, need, obs_shape, run_dirs, stand_in_policy


OBS = obs_shape()


class RecordMoves(TorchFunctionMode):
    """Every tensor a .to, .cuda or copy_ call moves or fills."""

    def __init__(self):
        super().__init__()
        self.moved = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("to", "cuda", "copy_"):
            self.moved += [a for a in args if isinstance(a, torch.Tensor)]
        return func(*args, **(kwargs or {}))


def test_rewards_and_dones_stay_on_the_host_during_the_rollout():
    """On CUDA every per-step copy of rewards or dones to the device is a blocking sync: they
    are stored on the host, and no (N,) float row (a step's rewards or dones) is moved."""
    need("rollout", "Agent.get_action_and_value")  # the stand-in policy returns what it does
    storage = P.make_storage(OBS, 6, 2, torch.device("meta"))  # meta: a device without memory
    assert storage["rewards"].device.type == "cpu" and storage["dones"].device.type == "cpu"
    assert storage["obs"].device.type == "meta" and storage["values"].device.type == "meta"

    storage = P.make_storage(OBS, 6, 2, torch.device("cpu"))
    envs = gym.vector.SyncVectorEnv([Truncating, Truncating],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    staging = torch.zeros((2, *OBS), dtype=torch.uint8)
    next_obs = staging.copy_(torch.from_numpy(envs.reset(seed=0)[0]))

    policy = stand_in_policy(2)  # no tensor moves of its own; action 0 scores 1
    with RecordMoves() as record:
        P.rollout(policy, envs, next_obs, storage, staging, torch.autocast("cpu", enabled=False),
                  0, 2)
    rows = [tuple(t.shape) for t in record.moved if t.is_floating_point() and t.dim() == 1]
    assert not rows, f"the rollout moved per-step float rows {rows} (rewards or dones?)"
    assert torch.equal(storage["rewards"], torch.ones(6, 2))
    assert torch.equal(storage["dones"][:, 0], torch.tensor([0.0, 0, 0, 0, 1, 0]))


def test_heads_compute_in_float32_under_bf16_autocast():
    """bf16 rounds values of 8-16 to steps of 0.0625 (the value clip is 0.1): the trunk may run
    in bf16, the policy and value heads must not."""
    need("Agent.forward", "Agent heads")
    agent = P.Agent(OBS, 4)
    dtypes = {}
    agent.actor.register_forward_hook(lambda m, i, o: dtypes.__setitem__("actor", o.dtype))
    agent.critic.register_forward_hook(lambda m, i, o: dtypes.__setitem__("critic", o.dtype))
    obs = torch.randint(0, 256, (4, *OBS), dtype=torch.uint8)
    with torch.autocast("cpu", torch.bfloat16):
        logits, value = agent(obs)
    assert dtypes == {"actor": torch.float32, "critic": torch.float32}
    assert logits.dtype == value.dtype == torch.float32


def tiny(**kw):
    return P.Args(**{"num_envs": 2, "num_steps": 32, "num_minibatches": 2, "update_epochs": 1,
                     "cuda": False, "total_timesteps": 64, **kw})


def test_cudnn_benchmark_is_on_unless_deterministic(workdir, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    P.main(tiny(torch_deterministic=False, run_name="fast"))
    assert torch.backends.cudnn.benchmark is True
    P.main(tiny(run_name="exact"))
    assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic


def test_a_continued_run_continues_the_same_wandb_run(workdir, monkeypatch):
    """wandb is optional (not in requirements): a stand-in module records what init is given.
    Each requeue or resume of a run must log to one wandb run, whose id is the folder's."""
    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    P.main(tiny(track=True, run_name="tracked"))
    P.main(tiny(track=True, run_name="tracked", total_timesteps=128))  # continued
    assert len(calls) == 2 and run_dirs(workdir) == [str(workdir / "runs" / "tracked")]
    for kw in calls:
        assert kw["id"] == "tracked" and kw["resume"] == "allow" and kw["name"] == "tracked"


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
