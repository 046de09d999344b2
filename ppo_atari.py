"""PPO on Atari in one file: the clipped-surrogate PPO of Schulman et al. (2017) with the Atari
details of record (openai/baselines ppo2, CleanRL), resumable, and runnable under torchrun.

    python ppo_atari.py --env-id BreakoutNoFrameskip-v4 --run-name NAME  # again: it continues
    tensorboard --logdir runs                                            # watch
    python ppo_atari.py --eval-checkpoint runs/NAME/agent.pt             # score a saved agent
    torchrun --nproc_per_node 2 ppo_atari.py                             # several processes/GPUs

Above THE FENCE, in CleanRL's order, the PPO a fork edits: Args, the Atari wrappers, the
network, GAE and the loss, the phases of an iteration, the loop. Below it, the machinery a fork
leaves alone. Tested with Python 3.11-3.13, torch 2.13 and 2.11, gymnasium 1.4, ale-py 0.12.
"""
import atexit
import collections
import contextlib
import copy
import dataclasses
import datetime
import errno
import fcntl
import functools
import gc
import glob
import hashlib
import importlib.util
import math
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import random
import re
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Literal

# before torch loads OpenMP: idle threads sleep, so runs sharing cores do not starve each other
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import ale_py  # noqa: E402  (importing registers the Atari ids; the ROMs ship in the wheel)
import cv2  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import tyro  # noqa: E402
from gymnasium.wrappers.utils import RunningMeanStd  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

gym.register_envs(ale_py)
ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # no banner at every start; errors show


@dataclasses.dataclass
class Args:
    """PPO on Atari (one file, CleanRL style). Each run writes TensorBoard logs, checkpoint.pt and
    agent.pt to runs/<run>/; the same command with --run-name continues a stopped run."""

    # CleanRL's fields, in CleanRL's order (anneal_clip beside its kin)
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run folder's name)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """True: cudnn picks deterministic kernels (and cudnn.benchmark stays off)"""
    cuda: bool = True
    """True: train on CUDA when it is available"""
    track: bool = False
    """True: also log to Weights and Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "ppo-atari"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the wandb entity (team); None: your default entity"""
    capture_video: bool = False
    """True: write mp4 videos of full games of env 0 to the run folder's videos/"""
    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the Atari environment (NoFrameskip-v4 or ALE/...-v5)"""
    total_timesteps: int = 10_000_000
    """total agent steps of the run, summed over envs (and processes under torchrun)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments (per process under torchrun)"""
    num_steps: int = 128
    """the number of steps run in each environment per rollout"""
    anneal_lr: bool = True
    """True: anneal the learning rate linearly to 0 over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda of generalized advantage estimation"""
    num_minibatches: int = 4
    """the number of minibatches each epoch splits the batch into"""
    update_epochs: int = 4
    """the number of passes over the batch per update"""
    norm_adv: bool = True
    """True: normalize advantages within each minibatch"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    anneal_clip: bool = False
    """True: anneal the clip coefficient linearly to 0 over the run, as the PPO paper does"""
    clip_vloss: bool = True
    """True: clip the value loss as in baselines ppo2"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum global norm of the gradient"""
    target_kl: float | None = None
    """stop an update's epochs early when approx_kl exceeds this; None: never"""

    # the file's own: run management, speed, torchrun
    run_name: str | None = None
    """the run folder RUNS_DIR/RUN_NAME, which the same command continues; None: a new dated name"""
    runs_dir: str = "runs"
    """where run folders are made (a job script pins it whatever directory it starts in)"""
    resume: str | None = None
    """a run folder or checkpoint to continue; it may change only --allow-other-file,
    --capture-video, --checkpoint-interval, --checkpoint-minutes, --compile, --cuda,
    --dist-timeout, --env-backend, --run-name, --runs-dir, --stop-at-step, --threads,
    --total-timesteps, --track, --wandb-entity, --wandb-project-name"""
    allow_other_file: bool = False
    """True: continue a run that another file, or this one with another core, trained"""
    stop_at_step: int | None = None
    """stop with a checkpoint once this many steps are done, the schedule still to the total"""
    checkpoint_interval: int = 50
    """write checkpoint.pt every this many iterations (and at the end)"""
    checkpoint_minutes: float | None = None
    """also write it once this many minutes have passed since the last (slow iterations)"""
    eval_checkpoint: str | None = None
    """score this saved agent (agent.pt or checkpoint.pt) instead of training"""
    eval_episodes: int = 10
    """the number of full games --eval-checkpoint plays"""
    env_backend: Literal["auto", "sync", "async"] = "auto"
    """sync: the envs in this process; async: a process each; auto: async on CUDA with 4+ cores"""
    threads: int | None = None
    """torch's CPU threads per process; None: the usable cores / torchrun's local processes"""
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 autocast for the network's trunk (CUDA; CPUs with AVX512-BF16 or AMX)"""
    compile: bool = False
    """True: torch.compile the rollout's policy and the minibatch loss"""
    dist_timeout: int = 600
    """torchrun: seconds a rendezvous or collective may wait for the other processes, then fail"""


# Atari wrappers, innermost first (semantics of openai/baselines atari_wrappers.py and SB3)


class NoopReset(gym.Wrapper):
    """After a real reset, take 1..noop_max no-ops (count from the env's seeded RNG) so that
    games start from varied states."""

    def __init__(self, env, noop_max: int = 30):
        super().__init__(env)
        self.noop_max = noop_max

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        for _ in range(self.unwrapped.np_random.integers(1, self.noop_max + 1)):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


class MaxAndSkip(gym.Wrapper):
    """Repeat the action `skip` frames, sum the rewards, and observe the pixel-wise max of the
    last two frames (Atari sprites flicker between frames). Stops early when the game ends."""

    def __init__(self, env, skip: int = 4):
        super().__init__(env)
        self.skip = skip

    def step(self, action):
        total, frames = 0.0, collections.deque(maxlen=2)
        for _ in range(self.skip):
            obs, reward, terminated, truncated, info = self.env.step(action)
            frames.append(obs)
            total += float(reward)
            if terminated or truncated:
                break
        return np.maximum(frames[0], frames[-1]), total, terminated, truncated, info


class EpisodicLife(gym.Wrapper):
    """A lost life ends the learning episode (terminated) but not the game: the game is reset
    only after a real game over, otherwise one no-op step stands in for the reset."""

    def __init__(self, env):
        super().__init__(env)
        self.lives, self.game_over = 0, True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.unwrapped.ale.lives()
        terminated = terminated or 0 < lives < self.lives
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        if self.game_over:
            obs, info = self.env.reset(**kwargs)
        else:
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:  # the no-op itself ended the game
                obs, info = self.env.reset(**kwargs)
        self.lives, self.game_over = self.unwrapped.ale.lives(), False
        return obs, info


class FireReset(gym.Wrapper):
    """Press FIRE (then action 2) after every reset, the pseudo-reset after a lost life included:
    games such as Breakout wait for FIRE and an untrained agent rarely presses it."""

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        return obs, info


class ClipReward(gym.RewardWrapper):
    """Learn from the sign of the reward; the statistics wrapper inside keeps the raw score."""

    def reward(self, reward):
        return float(np.sign(reward))


class GrayResize(gym.ObservationWrapper):
    """RGB (210, 160, 3) -> grayscale (size, size) uint8, resized with area interpolation."""

    def __init__(self, env, size: int = 84):
        super().__init__(env)
        self.size = size
        self.observation_space = gym.spaces.Box(0, 255, (size, size), np.uint8)

    def observation(self, obs):
        gray = cv2.cvtColor(obs, cv2.COLOR_RGB2GRAY)
        return cv2.resize(gray, (self.size, self.size), interpolation=cv2.INTER_AREA)


def make_env(env_id: str, seed: int, video_folder: str | None = None, every_game=False):
    """A thunk for the vector env: one Atari game with the wrappers of record. Observations
    (4, 84, 84) uint8, the newest frame last; info["episode"] at a real game over."""

    def thunk():
        gym.register_envs(ale_py)  # an env worker registers the ids itself
        env = gym.make(env_id, frameskip=1)  # frame skipping is done by MaxAndSkip
        if video_folder is not None:
            env = VideoRecorder(env, video_folder, every_game)
        env = gym.wrappers.RecordEpisodeStatistics(env)  # full game, raw score
        env = NoopReset(env, noop_max=30)
        env = MaxAndSkip(env, skip=4)
        env = EpisodicLife(env)
        if "FIRE" in env.unwrapped.get_action_meanings():
            env = FireReset(env)
        env = ClipReward(env)
        env = GrayResize(env)
        env = gym.wrappers.FrameStackObservation(env, 4)  # padded with the reset frame
        env.action_space.seed(seed)
        return env

    return thunk


def make_envs(args: Args, seed: int, video_folder: str | None = None, every_game=False):
    """The vector env over the wrappers above. Same-step autoreset: a finished env is reset inside
    step() and its new first obs returned, so no reset transition enters a batch."""
    use_async = choose_backend(args) == "async"  # auto: by the device and the cores
    # with_state_access (below the fence): checkpoints reach each env's wrapper state
    thunks = [with_state_access(make_env(args.env_id, seed + i, video_folder if i == 0 else None,
                                         every_game), i) for i in range(args.num_envs)]
    same_step = gym.vector.AutoresetMode.SAME_STEP
    if use_async:  # a process per env, started by start_workers (below the fence)
        envs = start_workers(lambda: gym.vector.AsyncVectorEnv(
            thunks, autoreset_mode=same_step, context="forkserver", copy=False))
    else:
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=same_step, copy=False)
    shape = envs.single_observation_space.shape
    if len(shape) != 3:  # storage and the network take (C, H, W) frames, channels first
        envs.close()
        fail(f"the env's observations are {shape}, not (C, H, W): a stack of colour frames "
             f"(4, H, W, 3) must be reshaped to (12, H, W) in make_env")
    return envs


def finished_games(infos: dict) -> list[tuple[float, int]]:
    """(raw score, length in emulator frames) of every full game that ended in this vector step."""
    final = infos.get("final_info", {})
    if "episode" not in final:
        return []
    ended, episode = final["_episode"], final["episode"]
    return [(float(r), int(n)) for r, n in zip(episode["r"][ended], episode["l"][ended])]


# Network


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """NatureCNN trunk (Mnih et al. 2015) shared by the policy and value heads. The file uses only
    forward(obs) -> (logits, value) and get_action_and_value: another feed-forward network is
    another Agent. A recurrent one also changes rollout, make_batch, update and act."""

    def __init__(self, obs_shape: tuple, n_actions: int):
        super().__init__()
        convs = [layer_init(nn.Conv2d(obs_shape[0], 32, 8, stride=4)), nn.ReLU(),
                 layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
                 layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(), nn.Flatten()]
        with torch.no_grad():  # the flattened size from a dummy frame: 64 * 7 * 7 at 84x84
            n_flat = nn.Sequential(*convs)(torch.zeros(1, *obs_shape)).shape[1]
        self.network = nn.Sequential(*convs, layer_init(nn.Linear(n_flat, 512)), nn.ReLU())
        self.actor = layer_init(nn.Linear(512, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def forward(self, obs):
        """obs (B, C, H, W) uint8 -> logits (B, n_actions) float32, value (B,) float32."""
        # scaled in place (one buffer fewer); copy=True: a float input is never scaled in place
        x = obs.to(torch.float32, memory_format=torch.channels_last, copy=True).div_(255.0)
        hidden = self.network(x)
        # the heads in float32 under bf16 autocast: bf16 would round values of 8-16 to 0.0625
        with torch.autocast(x.device.type, enabled=False):
            hidden = hidden.float()
            return self.actor(hidden), self.critic(hidden).squeeze(-1)

    def get_action_and_value(self, obs, action=None):
        """CleanRL's interface: (action, log-probability, entropy, value), each (B,), sampling
        the action when none is given. The one place the policy's distribution is written."""
        logits, value = self(obs)
        logp_all = torch.log_softmax(logits, dim=-1)
        if action is None:
            action = torch.multinomial(logp_all.exp(), 1).squeeze(-1)
        logprob = logp_all.gather(-1, action[:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return action, logprob, entropy, value


# Advantages and the loss


def compute_gae(rewards, values, dones, next_value, gamma: float, gae_lambda: float):
    """Generalized advantage estimation (Schulman et al. 2016), cut at every done. rewards,
    values, dones (T, N), dones[t] = 1 when the episode ended with step t's action; next_value
    (N,) the value after the last step. Returns advantages and returns (the value targets)."""
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        nextvalues = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        nextnonterminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def ppo_loss(newlogprob, entropy, newvalue, logprob, advantages, returns, values, clip_coef,
             norm_adv=True, clip_vloss=True, ent_coef=0.01, vf_coef=0.5):
    """The PPO objective on one minibatch (tensors (B,)): the loss and its metrics, detached 0-d
    tensors logged as losses/<name>. Every term keeps its gradient (approx_kl too: a KL penalty
    is `+ kl_coef * approx_kl` in the loss line)."""
    logratio = newlogprob - logprob
    ratio = logratio.exp()
    approx_kl = ((ratio - 1) - logratio).mean()  # http://joschu.net/blog/kl-approx.html
    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio,
                        -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    if clip_vloss:  # baselines ppo2: the value may move at most clip_coef from its rollout value
        v_clipped = values + torch.clamp(newvalue - values, -clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((newvalue - returns) ** 2, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * ((newvalue - returns) ** 2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + vf_coef * v_loss
    with torch.no_grad():
        metrics = {"policy_loss": pg_loss, "value_loss": v_loss, "entropy": entropy_loss,
                   "old_approx_kl": (-logratio).mean(), "approx_kl": approx_kl,
                   "clipfrac": ((ratio - 1.0).abs() > clip_coef).float().mean(),
                   "value_clipfrac": ((newvalue - values).abs() > clip_coef).float().mean()}
    return loss, {name: value.detach() for name, value in metrics.items()}


def minibatch_loss(agent, mb: dict, clip_coef, args: Args, carry: dict):
    """Forward pass on one minibatch (a dict of (B, ...) tensors: obs, actions, logprobs,
    advantages, returns, values), then ppo_loss. A new loss term and its metric go here; carry
    is main's dict of the fork's own state (a penalty coefficient: carry["kl_coef"])."""
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(mb["obs"], mb["actions"])
    return ppo_loss(newlogprob, entropy, newvalue, mb["logprobs"], mb["advantages"],
                    mb["returns"], mb["values"], clip_coef, args.norm_adv, args.clip_vloss,
                    args.ent_coef, args.vf_coef)


# The phases of an iteration: rollout, make_batch (advantages), update, summarize, log_iteration


def make_storage(obs_shape: tuple, num_steps: int, num_envs: int, device) -> dict:
    """Rollout storage (T, N, ...) = (num_steps, num_envs, ...), allocated once. The network's
    inputs and outputs on the training device; rewards and dones on the host, where the envs
    return them and GAE runs (its many tiny kernels would cost more than a copy)."""
    T, N = num_steps, num_envs
    return {"obs": torch.zeros((T, N, *obs_shape), dtype=torch.uint8, device=device),
            "actions": torch.zeros((T, N), dtype=torch.long, device=device),
            "logprobs": torch.zeros((T, N), device=device),  # float32
            "values": torch.zeros((T, N), device=device),  # float32
            "rewards": torch.zeros((T, N)),  # host, clipped, float32
            # host; 1.0: the episode ended with step t's action, so obs[t + 1] starts a new one
            # (CleanRL's dones is one step later: a recurrent policy resets on dones[t - 1])
            "dones": torch.zeros((T, N))}


def rollout(policy, envs, next_obs, storage: dict, staging, autocast, global_step: int,
            steps_per_step: int, stop=()):
    """num_steps vector steps with the current policy, into storage. Returns the observation
    after the last step, the finished games [(global_step, score, length)] and global_step;
    once `stop` holds a stop signal, (None, [], the global_step it started at): given up."""
    games, start = [], global_step
    overlap = isinstance(envs, gym.vector.AsyncVectorEnv)  # (a vector wrapper: its own step)
    for step in range(storage["obs"].shape[0]):
        if stop:  # checked between env steps, never inside one: train checkpoints what it had
            return None, [], start
        global_step += steps_per_step  # envs x processes
        storage["obs"][step] = next_obs
        with torch.inference_mode(), autocast:
            action, logprob, _, value = policy(next_obs)
        # sync point, the only one per step: the envs need the actions on the host
        actions_np = action.cpu().numpy()
        if overlap:  # async: the workers step while storage is written
            envs.step_async(actions_np)
        storage["actions"][step], storage["logprobs"][step] = action, logprob
        storage["values"][step] = value
        next_obs_np, reward, terminated, truncated, infos = envs.step_wait() if overlap \
            else envs.step(actions_np)
        storage["rewards"][step] = torch.from_numpy(reward)
        storage["dones"][step] = torch.from_numpy(terminated | truncated)
        # pinned on CUDA; refilling it is safe: the next action.cpu() waits for this copy
        next_obs = staging.copy_(torch.from_numpy(next_obs_np))
        next_obs = next_obs.to(storage["obs"].device, non_blocking=True)
        games += [(global_step, r, n) for r, n in finished_games(infos)]
    return next_obs, games, global_step


def make_batch(agent, storage: dict, next_obs, autocast, args: Args, carry: dict) -> dict:
    """Advantages by GAE (on the host, one copy each way), then the rollout flattened to
    (T * N, ...): obs, actions, logprobs, values, advantages, returns. Another estimator goes
    here (carry: a running statistic it keeps)."""
    with torch.inference_mode(), autocast:
        _, next_value = agent(next_obs)
    advantages, returns = compute_gae(storage["rewards"], storage["values"].cpu(), storage["dones"],
                                      next_value.cpu(), args.gamma, args.gae_lambda)
    batch = {k: storage[k].flatten(0, 1) for k in ("obs", "actions", "logprobs", "values")}
    device = storage["obs"].device
    return batch | {"advantages": advantages.flatten().to(device),
                    "returns": returns.flatten().to(device)}


def schedule(iteration: int, num_iterations: int, args: Args) -> tuple[float, float]:
    """The learning rate and clip coefficient of iteration 1..num_iterations: annealed, both
    fall linearly to 0 over the run. Another schedule (a warm-up) goes here; a resume's message
    reads it too."""
    frac = 1.0 - (iteration - 1.0) / num_iterations
    return (frac * args.learning_rate if args.anneal_lr else args.learning_rate,
            frac * args.clip_coef if args.anneal_clip else args.clip_coef)


def check_sizes(args: Args):
    """What the update needs of the sizes, checked at start-up (a fork's update that splits the
    batch otherwise checks its own here); `fail` says it in one line."""
    batch = args.num_envs * args.num_steps
    if batch % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} does not divide the batch of --num-envs "
             f"{args.num_envs} x --num-steps {args.num_steps} = {batch}; pick a divisor of {batch}")


def update(agent, optimizer, loss_fn, batch: dict, clip_coef, autocast, args: Args,
           world_size: int, carry: dict):
    """update_epochs passes over the batch in shuffled minibatches; returns the metrics summed
    over minibatches (0-d device tensors: no host sync; grad_norm before clipping), their count."""
    local_batch = batch["obs"].shape[0]
    minibatch_size = local_batch // args.num_minibatches
    totals, n_minibatches = {}, 0
    for epoch in range(args.update_epochs):
        perm = torch.randperm(local_batch, device=batch["obs"].device)
        for start in range(0, local_batch, minibatch_size):
            mb = {k: v[perm[start:start + minibatch_size]] for k, v in batch.items()}
            with autocast:
                loss, metrics = loss_fn(agent, mb, clip_coef, args, carry)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if world_size > 1:  # torchrun: every rank steps with the mean gradient (DDP's)
                all_reduce_gradients(agent, world_size)
            grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
            metrics = metrics | {"grad_norm": grad_norm}
            totals = {name: totals.get(name, 0) + value for name, value in metrics.items()}
            n_minibatches += 1
        if args.target_kl is not None:  # sync point, once per epoch and only with target_kl
            kl = metrics["approx_kl"].clone()
            if world_size > 1:  # decided on the mean over ranks so that all stop together
                dist.all_reduce(kl)
                kl /= world_size
            if kl.item() > args.target_kl:
                break
    return totals, n_minibatches


def act(agent, obs, memory: dict):
    """The action evaluate() plays for obs (B, C, H, W), sampled as in training. memory: its dict,
    "starts" (B,) (1.0: obs begins an episode) and what a recurrent policy keeps between steps."""
    return agent.get_action_and_value(obs)[0]


def summarize(agent, totals: dict, n_minibatches: int, batch: dict, games: list,
              world_size: int, stop=()):
    """The iteration's scalars in one host sync, averaged over ranks: losses/<name> (mean over
    minibatches), explained variance, `finite` (1.0: all parameters finite), `stop` (> 0: a rank
    holds a stop signal, so that all stop together); every rank's games."""
    stats = {f"losses/{name}": total / n_minibatches for name, total in totals.items()}
    y_pred, y_true = batch["values"], batch["returns"]
    stats["losses/explained_variance"] = 1 - torch.var(y_true - y_pred) / torch.var(y_true)
    stats["finite"] = torch.stack([torch.isfinite(p).all() for p in agent.parameters()]).all()
    stats["stop"] = torch.tensor(float(bool(stop)), device=y_true.device)
    flat = torch.stack([v.float() for v in stats.values()])
    if world_size > 1:  # torchrun: the mean over ranks, and every rank's games for the logs
        dist.all_reduce(flat)
        flat /= world_size
        gathered = [None] * world_size
        dist.all_gather_object(gathered, games)
        games = sorted(g for part in gathered for g in part)
    return dict(zip(stats, flat.tolist())), games


def log_iteration(writer, stats: dict, games: list, recent, global_step: int, total: int,
                  show: bool):
    """Logs each finished game, the last 100's mean and the stats; show: prints a progress line."""
    for step_done, score, length in games:
        writer.add_scalar("charts/episodic_return", score, step_done)
        writer.add_scalar("charts/episodic_length", length, step_done)
    if recent:  # mean of the last 100 finished games, the figure papers report
        writer.add_scalar("charts/avg_episodic_return", np.mean(recent), global_step)
    for tag, value in stats.items():
        if tag.startswith(("charts/", "losses/")):
            writer.add_scalar(tag, value, global_step)
    if show:
        sps, tty = stats["charts/SPS"], sys.stdout.isatty()
        eta = (total - global_step) / max(sps, 1)
        avg = f"{np.mean(recent):.1f}" if recent else "n/a"
        line = (f"step {global_step:,}/{total:,} | SPS {sps} | avg return {avg} | "
                f"ETA {int(eta // 3600)}h{int(eta % 3600 // 60):02d}m")
        print(f"\r{line}   " if tty else line, end="" if tty else "\n", flush=True)


# The training loop


def train(args: Args, ckpt: dict | None, device: torch.device, run, rank: int = 0,
          world_size: int = 1):
    """Rollout, advantages, update and logging, with a checkpoint every --checkpoint-interval,
    until --total-timesteps (or --stop-at-step, or a stop signal main's handler put in
    run.stops). ckpt: the checkpoint to continue, or None; run: the run's record (below the
    fence: its folder, stops, last checkpoint). Returns the agent."""
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16")
    # seeding: one block; each rank gets its own env seeds and action samples
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.backends.cudnn.benchmark = not args.torch_deterministic  # every shape is static

    iteration, global_step = (ckpt["iteration"], ckpt["global_step"]) if ckpt else (0, 0)
    # rank 0 alone records videos, logs and checkpoints (under torchrun)
    video = os.path.join(run.folder, "videos") if args.capture_video and rank == 0 else None
    env_seed = args.seed + rank * args.num_envs + 7919 * iteration  # a resume: fresh games
    envs = make_envs(args, env_seed, video)
    agent = Agent(envs.single_observation_space.shape, envs.single_action_space.n)
    agent = agent.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    # a fork's state across iterations (first values here): checkpoints save it, resumes restore it
    carry = {}
    recent = collections.deque(maxlen=100)  # the returns of the last 100 finished games
    restore(ckpt, agent, optimizer, envs, carry, recent, device, rank, args.seed)
    # compile: the one site; checkpoints save `agent` itself, never a compiled wrapper
    policy, loss_fn = agent.get_action_and_value, minibatch_loss
    if args.compile:
        policy, loss_fn = torch.compile(policy), torch.compile(loss_fn)
    env_state = wrapper_statistics(envs, world_size, carry)
    writer = begin_run(run, args, ckpt, agent, optimizer, env_state, carry) if rank == 0 else None

    storage = make_storage(envs.single_observation_space.shape, args.num_steps, args.num_envs,
                           device)
    staging = torch.zeros(storage["obs"].shape[1:], dtype=torch.uint8,
                          pin_memory=device.type == "cuda")
    next_obs = staging.copy_(torch.from_numpy(envs.reset(seed=env_seed)[0])).to(device)
    batch_steps = args.num_envs * args.num_steps * world_size  # per iteration, all ranks
    num_iterations, clock, last_print = args.total_timesteps // batch_steps, None, -math.inf
    for iteration in range(iteration + 1, num_iterations + 1):
        lr_now, clip_value = map(float, schedule(iteration, num_iterations, args))  # not numpy
        optimizer.param_groups[0]["lr"] = lr_now
        clip_now = torch.tensor(clip_value, device=device)  # a tensor: compile won't recompile

        t0 = time.perf_counter()  # monotonic: a clock step is no duration
        # a stop mid-rollout checkpoints the iteration before: its RNG and carry, kept here
        rng, carry_before = rng_state(device), copy.deepcopy(carry)
        next_obs, games, global_step = rollout(policy, envs, next_obs, storage, staging, autocast,
                                               global_step, args.num_envs * world_size,
                                               run.stops if world_size == 1 else ())
        if next_obs is None:  # given up by a stop signal (one process, so rank 0)
            set_rng_state(rng, device)
            writer.flush()  # the logs reach as far as the checkpoint
            save_checkpoint(run, agent, optimizer, env_state, args, global_step, iteration - 1,
                            recent, carry_before)
            stopped, at_stop = True, False
            break
        t1 = time.perf_counter()
        batch = make_batch(agent, storage, next_obs, autocast, args, carry)
        totals, n_minibatches = update(agent, optimizer, loss_fn, batch, clip_now, autocast, args,
                                       world_size, carry)
        stats, games = summarize(agent, totals, n_minibatches, batch, games, world_size, run.stops)
        if stats["finite"] < 1.0 or not np.isfinite([stats[f"losses/{k}"] for k in totals]).all():
            close(envs, writer)
            fail(f"non-finite loss or parameters at iteration {iteration} (global step "
                 f"{global_step}); stopped; the last good checkpoint is in {run.folder}", code=1)
        recent.extend(r for _, r, _ in games)
        stopped = stats["stop"] > 0  # a stop signal on any rank: all stop at this iteration
        at_stop = args.stop_at_step is not None and global_step >= args.stop_at_step
        last = iteration == num_iterations or stopped or at_stop
        now = time.perf_counter()
        run.iteration_s = now - t0  # (a stop signal's answer says it)
        # SPS from the end of this process's first iteration: a start's warm-up is no slowdown
        if clock is None:
            clock, sps = (global_step, now), int(batch_steps / (now - t0))
        elif now > clock[1]:
            sps = int((global_step - clock[0]) / (now - clock[1]))
        checkpoint = checkpoint_due(iteration, args, run, world_size, device) or last
        # what a checkpoint cannot hold is refused now, not at the checkpoint; all ranks' state
        env_state = wrapper_statistics(envs, world_size, carry, gather=checkpoint)
        if writer is not None:
            stats |= {"charts/learning_rate": lr_now, "charts/clip_coef": clip_value,
                      "charts/SPS": sps, "charts/rollout_time": t1 - t0,
                      "charts/update_time": now - t1}  # seconds per iteration (after the sync)
            show = sys.stdout.isatty() or now - last_print > 30 or iteration == num_iterations
            log_iteration(writer, stats, games, recent, global_step, args.total_timesteps, show)
            last_print = now if show else last_print
            if checkpoint:
                writer.flush()  # the logs reach at least as far as the checkpoint
                save_checkpoint(run, agent, optimizer, env_state, args, global_step,
                                iteration, recent, carry, iteration == num_iterations)
        if last:
            break

    close(envs, writer)
    end_run(run, args, global_step, stopped, at_stop and iteration < num_iterations, rank,
            world_size)
    return agent


# ================================= THE FENCE =================================================
# Below: the machinery a fork leaves alone (argument checks, torchrun, checkpoints, run folders,
# resume, signals, evaluation, videos, main). Nothing here changes what PPO computes.

# What a resume may change (not the network, game or optimisation so far); LAUNCH_ONLY: unsaved
LAUNCH_ONLY = {"resume", "stop_at_step", "cuda", "threads", "runs_dir", "allow_other_file"}
RESUME_OVERRIDABLE = LAUNCH_ONLY | {"total_timesteps", "checkpoint_interval",
                                    "checkpoint_minutes", "track", "wandb_project_name",
                                    "wandb_entity", "capture_video", "compile", "env_backend",
                                    "run_name", "dist_timeout"}


def fail(message: str, code: int = 2):
    """Bad input: one line on stderr, no traceback, a non-zero exit."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def explicit_fields(argv: list[str]) -> set[str]:
    """The Args fields named on the command line (`--no-cuda` names cuda)."""
    names = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    fields = {f.name for f in dataclasses.fields(Args)}
    return {n[3:] if n.startswith("no_") and n[3:] in fields else n for n in names} & fields


def check_args(args: Args, world_size: int = 1):
    """Fails with a message naming the field unless the sizes fit together; no env is made."""
    for name in ("num_envs", "num_steps", "num_minibatches", "update_epochs", "total_timesteps",
                 "checkpoint_interval", "checkpoint_minutes", "eval_episodes", "dist_timeout",
                 "stop_at_step", "threads", "learning_rate", "clip_coef"):
        if (value := getattr(args, name)) is not None and not value > 0:
            kind = "positive" if isinstance(value, float) else "a positive integer"
            fail(f"--{name.replace('_', '-')} must be {kind}, got {value}")
    check_sizes(args)
    if args.total_timesteps < (batch := args.num_envs * args.num_steps * world_size):
        fail(f"--total-timesteps {args.total_timesteps} is less than one batch "
             f"({batch} steps); raise it or shrink --num-envs/--num-steps")
    check_env_id(args.env_id)
    if args.track and importlib.util.find_spec("wandb") is None:  # before a folder is made
        fail("--track needs wandb, which is not installed: pip install wandb")


def check_env_id(env_id: str):
    """ALE image ids of record only: NoFrameskip-v4 (the published setting), ALE/...-v5."""
    try:
        spec = gym.spec(env_id)
    except gym.error.Error as e:  # gymnasium's message names the unknown part, with a guess
        fail(f"unknown --env-id {env_id!r}: {str(e).strip()} (ids of record look like "
             f"BreakoutNoFrameskip-v4 or ALE/Breakout-v5)")
    if "ale_py" not in str(spec.entry_point):  # (ale-py registers image ids only)
        fail(f"--env-id {env_id} is not an Atari game: this file trains on the ALE's Atari ids, "
             f"such as BreakoutNoFrameskip-v4 or ALE/Breakout-v5")
    if not (env_id.endswith("NoFrameskip-v4") or env_id.startswith("ALE/")):
        name = env_id.split("-")[0].removesuffix("NoFrameskip")
        fail(f"--env-id {env_id} is not an Atari image id of record (the other v4 ids and v0 "
             f"skip frames at random or repeat actions); use {name}NoFrameskip-v4 (the "
             f"published setting) or ALE/{name}-v5 (sticky actions)")


class VideoRecorder(gym.Wrapper):
    """Innermost, games to mp4: 0, 1, 8, 27, ... (cubes) and every 1000th; every_game: all."""

    def __init__(self, env, folder: str, every_game: bool = False):
        super().__init__(env)
        self.folder, self.every_game, self.writer = folder, every_game, None
        self.games_state = 0  # the games started, which name the videos: checkpoints keep it

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        if self.writer is not None:  # the game before is over: its video is complete
            self.writer = self.writer.release()  # (None)
        k, self.games_state = self.games_state, self.games_state + 1
        if self.every_game or round(k ** (1 / 3)) ** 3 == k or k % 1000 == 0:
            os.makedirs(self.folder, exist_ok=True)
            self.path = os.path.join(self.folder, f"game-{k}.mp4")
            self.writer = cv2.VideoWriter(self.path, cv2.VideoWriter_fourcc(*"mp4v"), 60,
                                          (obs.shape[1], obs.shape[0]))
        return self._write(obs), info

    def step(self, action):
        obs, *rest = self.env.step(action)
        return self._write(obs), *rest

    def _write(self, frame):
        if self.writer is not None:
            self.writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        return frame

    def close(self):  # a game cut off: evaluation keeps full games only; training keeps the
        if self.writer is not None:  # last (a short run may have no other)
            self.writer = self.writer.release()
            if self.every_game:
                os.remove(self.path)
        super().close()


# Stops with a checkpoint: Ctrl-C, SIGTERM, a hang-up (an ssh drop), and the warnings schedulers
# send before a kill (SLURM --signal, Lightning's requeue: USR1; submitit: USR2; SGE)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# A failed write's errno, in plain words
STORAGE_ERRORS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                  errno.EROFS: "the filesystem is read-only", errno.EIO: "the storage failed",
                  errno.ESTALE: "the network mount was lost", errno.EACCES: "permission denied",
                  errno.EFBIG: "the file size limit was reached"}


def start_workers(make_async):
    """make_async() from a server that imported torch (not the trainer: CUDA). The resource
    tracker (its stderr /dev/null: its leak warnings after a kill -9) and the server start with
    the stop signals blocked, so that the workers the server forks are born with them blocked
    until their set-up ignores them (a group's Ctrl-C as they start)."""
    atexit.unregister(kill_workers)  # one per process; first: a failed start must not hang
    atexit.register(kill_workers)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    stderr, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        multiprocessing.resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))  # it unblocked INT and TERM
        os.dup2(stderr, 2)
        multiprocessing.set_forkserver_preload(["torch", "torch.utils.tensorboard", "gymnasium",
                                                "ale_py", "cv2"])  # read when the server starts
        multiprocessing.forkserver.ensure_running()
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(devnull)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return make_async()


def with_state_access(thunk, index: int):
    """An env thunk as the vector env runs it. The env gets layers_get and layers_set, which
    checkpoints call through an async vector env's public call(). In a worker (a process other
    than the trainer, which makes one env too, for its spaces), first: deaf to the stop signals
    (it serves the trainer to its checkpoint), one cv2 thread, and SIGPIPE's default action
    (once the trainer is gone, its next answer ends it without a traceback)."""
    trainer = os.getpid()

    def set_up():
        if os.getpid() != trainer:
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_IGN)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            cv2.setNumThreads(1)
        env = thunk()
        env.layers_get = lambda: layer_state(env)
        env.layers_set = lambda states: set_layer_state(env, states[index])
        return env
    return set_up


def kill_workers():
    """At exit: multiprocessing would SIGTERM the workers, which ignore it, and wait forever."""
    for worker in multiprocessing.active_children():
        if worker.daemon:
            worker.kill()


def usable_cores() -> int:
    """The cores this process may run on (its SLURM or cgroup allocation), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def choose_backend(args: Args, use_cuda: bool | None = None,
                   local_processes: int | None = None) -> str:
    """auto: async only on CUDA with 4+ cores per process (on a CPU, sync is faster)."""
    if args.env_backend != "auto":
        return args.env_backend
    use_cuda = args.cuda and torch.cuda.is_available() if use_cuda is None else use_cuda
    local_processes = local_processes or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return "async" if use_cuda and usable_cores() // local_processes >= 4 else "sync"


def choose_device(args: Args, local_rank: int, local_processes: int, say: bool) -> torch.device:
    """The one place the device and torch's CPU threads are chosen; say: print which, and why.
    --no-cuda hides the GPUs from this process and its workers before torch counts them
    (torch.compile's tracing would start CUDA wherever torch sees a GPU); a main() called after
    torch counted them can only say so."""
    if not args.cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if torch.cuda.is_available():  # counted before this line: too late to hide them
            print("note: torch counted the GPUs before main(), so --no-cuda cannot hide them: the "
                  "run trains on the CPU, but torch.compile may still start CUDA", flush=True)
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    torch.set_num_threads(args.threads or max(1, usable_cores() // local_processes))
    if use_cuda:
        torch.cuda.set_device(device)
    if say:
        why = "" if use_cuda else " (--no-cuda)" if not args.cuda else " (CUDA is not available)"
        print(f"device: {device}{why}", flush=True)
    return device


def join_process_group(backend: str, rank: int, world_size: int, timeout_s: int):
    """init_process_group via torchrun's store, per start; rank 0 beats until all check in."""
    timeout, all_in = datetime.timedelta(seconds=timeout_s), threading.Event()
    if (store := torchrun_store(timeout_s)) is None:  # not torchrun: env:// init
        return dist.init_process_group(backend, timeout=timeout)
    if rank == 0:
        generation = store.add("ppo_atari/generation", 1)
        store.set("ppo_atari/open", str(generation))
        beats = torchrun_store(timeout_s)  # its own connection

        def beat():
            while not all_in.wait(0.1):
                beats.add(f"ppo_atari/beat{generation}", 1)
        threading.Thread(target=beat, daemon=True).start()
    else:
        for _ in range(max(1, timeout_s * 2)):  # rank 0's beat advances within 0.5 s
            generation = int(store.get("ppo_atari/open"))
            before = store.add(f"ppo_atari/beat{generation}", 0)
            time.sleep(0.5)
            if store.add(f"ppo_atari/beat{generation}", 0) > before:
                break
        else:
            raise RuntimeError(f"rank 0 did not start within --dist-timeout {timeout_s} s")
        store.set(f"ppo_atari/in{generation}/{rank}", "")
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                store=dist.PrefixStore(f"ppo_atari/generation{generation}", store))
        if rank == 0:  # beating until every rank checked in: torch's wait fails at the timeout
            store.wait([f"ppo_atari/in{generation}/{r}" for r in range(1, world_size)], timeout)
    finally:
        all_in.set()


def torchrun_store(timeout_s: int):
    """A connection to torchrun's store, which lives as long as the job (restarts included)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def checkpoint_due(iteration: int, args: Args, run, world_size: int, device) -> bool:
    """Every --checkpoint-interval iterations, and once --checkpoint-minutes have passed since the
    last checkpoint (rank 0's clock decides for all ranks)."""
    if iteration % args.checkpoint_interval == 0:
        return True
    if args.checkpoint_minutes is None:
        return False
    waited = time.perf_counter() - run.saved_at
    due = torch.tensor(float(waited >= 60 * args.checkpoint_minutes), device=device)
    if world_size > 1:
        dist.broadcast(due, src=0)
    return due.item() > 0


def all_reduce_gradients(agent: nn.Module, world_size: int):
    """The mean gradient over ranks, one flat all-reduce; parameters without one are skipped."""
    grads = [p.grad for p in agent.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads]) / world_size
    dist.all_reduce(flat)
    for g, new in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def check_one_folder(args: Args, ckpt: dict | None, rank: int, world_size: int):
    """All ranks stop if one sees a checkpoint rank 0 does not, or a newer one (node-local runs)."""
    where = args.resume or os.path.join(args.runs_dir, args.run_name)
    path = where if os.path.isfile(where) else os.path.join(where, "checkpoint.pt")
    step = ckpt["global_step"] if ckpt and rank == 0 else None
    if rank != 0 and os.path.isfile(path):
        step = torch.load(path, map_location="cpu", weights_only=True)["global_step"]
    seen = [None] * world_size
    dist.all_gather_object(seen, (socket.gethostname(), step))
    first_host, first = seen[0]
    for r, (host, s) in enumerate(seen):
        if s is not None and (first is None or s > first):
            fail(f"rank {r} on {host} sees {path} at step {s:,} and rank 0 on {first_host} "
                 + ("none" if first is None else f"step {first:,}") + ": runs/ must be on a "
                 "filesystem every node sees (a shared --runs-dir)")


# The run: its record, its folder, the rules of a resume


@dataclasses.dataclass
class Run:
    """The run as the machinery keeps it: made once by open_run, passed to train and to what
    checkpoints, stops and reports. The loop reads `stops`; nothing of it is module state."""
    folder: str  # the run folder (every rank: the one rank 0 decided)
    stops: list  # the stop signals received, in order (on_stop appends them)
    source: dict  # the file training it: its name and its core's hash (checkpoints record it)
    lock: object = None  # rank 0: the open runs/.NAME.lock, held until main returns
    saved_step: int | None = None  # the step checkpoint.pt holds (None: none yet)
    saved_at: float = dataclasses.field(default_factory=time.perf_counter)  # when written
    iteration_s: float | None = None  # the last iteration's duration (a stop's answer says it)


def this_source() -> dict:
    """This file's name and a hash of its core (the text above the fence): a run continues only
    with the PPO that trained it."""
    with open(os.path.abspath(__file__), "rb") as f:
        core = re.split(rb"^# =+ THE FENCE", f.read(), maxsplit=1, flags=re.M)[0]
    return {"file": os.path.basename(__file__), "core": hashlib.sha256(core).hexdigest()[:12]}


def open_run(args: Args, explicit: set[str], stops: list, rank: int, world_size: int):
    """The run this launch trains: (args, checkpoint or None, Run), or (None, None, None) when
    there is nothing to train. Rank 0 alone decides (decide_run: node-local disks); its answer,
    or its exit code, is sent to every rank."""
    decided, lock, source = None, None, this_source()
    try:
        if rank == 0:
            args, ckpt, lock = decide_run(args, explicit, world_size, source)
            decided = (args, ckpt)
    except BaseException as e:  # the other ranks exit too, with its code; rank 0 said why
        decided = e.code if isinstance(e, SystemExit) else 1
        raise
    finally:
        if world_size > 1:
            box = [decided]
            dist.broadcast_object_list(box, src=0)
            decided = box[0]
    if not isinstance(decided, tuple):
        raise SystemExit(decided)
    args, ckpt = decided
    if args is None:  # nothing to train
        if lock is not None:
            lock.close()
        return None, None, None
    if world_size > 1:
        check_one_folder(args, ckpt, rank, world_size)
    folder = ckpt["run_dir"] if ckpt else os.path.join(args.runs_dir, args.run_name)
    return args, ckpt, Run(folder, stops, source, lock, ckpt["global_step"] if ckpt else None)


def decide_run(args: Args, explicit: set[str], world_size: int, source: dict):
    """Rank 0, the one place a launch's run folder is decided: --resume's, RUNS_DIR/RUN_NAME (new,
    or continued where it holds checkpoint.pt), or a new dated one (NAME__2 if taken; a torchrun
    restart: its job's first). The arguments are checked once, as the run will use them, before
    a folder is made; the folder is locked before anything is written to it, and its checkpoint
    checked again under the lock. Returns (args, checkpoint or None, lock); args None: nothing
    to train (said)."""
    name, store = args.run_name, None
    dated = args.resume is None and name is None
    if dated:  # a dated name; a torchrun restart continues its job's first start's folder
        store = torchrun_store(args.dist_timeout)
        name = f"{args.env_id.replace('/', '-')}__{args.exp_name}__{args.seed}__{int(time.time())}"
        if store is not None and store.check(["ppo_atari/run_name"]):
            name, dated = store.get("ppo_atari/run_name").decode(), False
    if args.resume is None and (not name or name.startswith(".") or "/" in name
                                or len(name.encode()) > 240):
        fail(f"--run-name {name!r:.60} must be a plain folder name of at most 240 bytes "
             f"(no '/', not starting with '.'; a dated name holds --exp-name)")
    folder = os.path.join(args.runs_dir, name) if args.resume is None else args.resume
    named = args.resume is None and not dated  # (a dated name is never a run to continue)
    if named and os.path.isfile(os.path.join(folder, "checkpoint.pt")):
        args = dataclasses.replace(args, resume=folder)
    elif named and os.path.isdir(folder) and any(  # (a killed writer's temporary: not a file)
            f != "agent.pt" and not re.fullmatch(r".+\.pt\..*tmp", f) for f in os.listdir(folder)):
        fail(f"{folder} holds files but no checkpoint.pt, so it is not a run of this script "
             f"to continue; pick another --run-name or remove the folder")
    ckpt = None
    if args.resume is not None:
        args, ckpt, saved = resumed_args(args, explicit, name, source)
        folder = ckpt["run_dir"]
    args = dataclasses.replace(args, run_name=name) if ckpt is None else args
    check_args(args, world_size)
    if dated:  # a folder of its own, made now (name__2 if taken)
        args = dataclasses.replace(args, run_name=own_folder(args.runs_dir, name))
        folder = os.path.join(args.runs_dir, args.run_name)
        if store is not None:  # what a restart of this job continues
            store.set("ppo_atari/run_name", args.run_name)
    lock = lock_run(folder)
    if ckpt is not None:
        check_newest(args.resume, ckpt)  # (under the lock: no launch writes it meanwhile)
        if resume_plan(args, saved, ckpt, world_size):
            return None, None, lock
    return args, ckpt, lock


def resumed_args(args: Args, explicit: set[str], name: str | None, source: dict):
    """(this launch's args merged into the checkpoint's, the checkpoint, its own args) for
    --resume, or a one-line refusal: an agent file, another run's --run-name, another file, a
    field this file lacks, a change a resume cannot make."""
    ckpt = load_checkpoint(args.resume)
    if "optimizer" not in ckpt:
        fail(f"{args.resume} is a saved agent, not a checkpoint to continue; pass its run folder")
    if "run_name" in explicit and name != (folder := os.path.basename(ckpt["run_dir"])):
        fail(f"--run-name {name} is not the run --resume {args.resume} continues ({folder}): "
             f"a resumed run keeps its folder; drop --run-name")
    theirs = ckpt.get("source", source)  # (a checkpoint of a file that did not record it: any)
    if theirs != source and not args.allow_other_file:
        fail(f"{args.resume} (step {ckpt['global_step']:,}) was trained by {theirs['file']} "
             f"(core {theirs['core']}), not by this {source['file']} (core {source['core']}): "
             f"continue it with the file that trained it, or pass --allow-other-file to go on "
             f"with this one on purpose (the run's events record it)")
    shared = same_fields(args.resume, ckpt)
    saved = Args(**{k: v for k, v in ckpt["args"].items() if k in shared})
    for field in sorted(explicit - RESUME_OVERRIDABLE):
        if getattr(args, field) != getattr(saved, field):
            fail(f"--{field.replace('_', '-')} cannot change when resuming (the checkpoint has "
                 f"{getattr(saved, field)!r}); drop it or start a new run")
    overrides = (explicit & RESUME_OVERRIDABLE) | LAUNCH_ONLY
    return dataclasses.replace(saved, **{n: getattr(args, n) for n in overrides}), ckpt, saved


def same_fields(path: str, ckpt: dict) -> set[str]:
    """The Args fields a checkpoint and this file share (refused: fields this one lacks)."""
    ours = {f.name for f in dataclasses.fields(Args)} - LAUNCH_ONLY
    theirs = set(ckpt["args"]) - LAUNCH_ONLY

    def flags(names):
        return ", ".join(f"--{n.replace('_', '-')}" for n in sorted(names))
    if theirs - ours:
        fail(f"{path} was written by another version of this file, whose Args has "
             f"{flags(theirs - ours)}, which this file lacks" + (
                 f" (it has {flags(ours - theirs)} instead)" if ours - theirs else "") +
             "; their settings would be lost: continue it with the file that wrote it")
    if ours - theirs:
        print(f"note: {path} was written by a file without " + ", ".join(
            f"--{n.replace('_', '-')} (continued with its default, {getattr(Args(), n)!r})"
            for n in sorted(ours - theirs)), flush=True)
    return ours & theirs


def check_newest(path: str, ckpt: dict):
    """Refuses to continue an older snapshot over its folder's checkpoint.pt further along."""
    newest = os.path.join(ckpt["run_dir"], "checkpoint.pt")
    if os.path.isfile(newest):
        step = load_checkpoint(newest)["global_step"]
        if step > ckpt["global_step"]:
            fail(f"{path} holds step {ckpt['global_step']:,} but {shown_path(newest)} is further "
                 f"along (step {step:,}), and continuing would replace it; to go back on "
                 f"purpose, move that file aside first (mv {shown_path(newest)} "
                 f"{shown_path(newest)[:-3]}-{step}.pt)")


def resume_plan(args: Args, saved: Args, ckpt: dict, world_size: int) -> bool:
    """Checks a checkpoint against this launch and says what resuming does; True: nothing to do."""
    done, step, batch = ckpt["iteration"], ckpt["global_step"], args.num_envs * args.num_steps
    if done and step != done * batch * world_size:  # each iteration: every rank's batch
        n = step // (done * batch)
        fail(f"{args.resume} was written by {n} process(es) and this launch has {world_size}; "
             f"continue it with {n} processes (torchrun --nproc_per_node)")
    where, iterations = shown_path(ckpt["run_dir"]), args.total_timesteps // (batch * world_size)
    if done >= iterations:
        print(f"{where} is already complete: it has run {step:,} steps of --total-timesteps "
              f"{args.total_timesteps:,}; nothing written (a larger one trains on)", flush=True)
        return True
    if args.stop_at_step and step >= args.stop_at_step:
        print(f"{where} has run {step:,} steps, already "
              f"{'at' if step == args.stop_at_step else 'past'} --stop-at-step "
              f"{args.stop_at_step:,}; nothing written (drop or raise it to continue to "
              f"{args.total_timesteps:,})", flush=True)
        return True
    line = (f"continuing {where} at step {step:,} of {args.total_timesteps:,} "
            f"({iterations - done} iteration{'s' if iterations - done > 1 else ''} left)")
    if saved.total_timesteps != args.total_timesteps:
        line += f"; --total-timesteps changed from {saved.total_timesteps:,}: schedules re-planned"
    if args.anneal_lr:  # the next iteration's, by the schedule the loop uses
        line += f"; learning rate {schedule(done + 1, iterations, args)[0]:.3g} now"
    print(line, flush=True)
    return False


def lock_run(folder: str):
    """One writer a run folder: runs/.NAME.lock, freed at any exit (kill -9 too), or a refusal.
    Returns the open lock file (None where the filesystem cannot lock, said)."""
    parent, name = os.path.split(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    lock = open(os.path.join(parent, f".{name}.lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        fail(f"{shown_path(folder)} is in use: {holder} holds its lock; wait for it to end (the "
             f"same command then continues the run), stop it, or pick another --run-name")
    except OSError as e:  # an NFS mount without locking: ENOLCK
        lock.close()
        print(f"note: {shown_path(parent)} cannot lock files ({e.strerror}): nothing stops a "
              f"second launch of {name} from writing it too", flush=True)
        return None
    job = f" (SLURM job {os.environ['SLURM_JOB_ID']})" if "SLURM_JOB_ID" in os.environ else ""
    with contextlib.suppress(OSError):  # the holder, for a refused launch to name (unbuffered:
        os.ftruncate(lock.fileno(), 0)  # on a full disk, the start's room check says so)
        os.write(lock.fileno(), f"pid {os.getpid()} on {socket.gethostname()}{job}".encode())
    for stale in glob.glob(os.path.join(folder, "*.pt.*tmp")):  # a killed writer's
        os.remove(stale)
    return lock


def own_folder(parent: str, name: str) -> str:
    """Makes parent/name, or name__2, name__3, ... if taken (a start in the same second)."""
    for folder in [name] + [f"{name}__{n}" for n in range(2, 10_000)]:
        with contextlib.suppress(FileExistsError):
            os.makedirs(os.path.join(parent, folder))
            return folder


def shown_path(path: str) -> str:
    """A path as printed: relative to the working directory when inside it, else absolute."""
    rel = os.path.relpath(path)
    return os.path.abspath(path) if rel.startswith("..") else rel


# Checkpoint files


def map_tensors(obj, fn, is_leaf=torch.is_tensor):
    """obj (nested dicts, lists and tuples) with fn applied to every tensor (is_leaf) in it."""
    if is_leaf(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn, is_leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, is_leaf) for v in obj)
    return obj


def rng_state(device: torch.device) -> dict:
    """torch's CPU RNG and, on CUDA only, the training device's (a CPU run never starts CUDA)."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device):
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def write_atomically(path: str, state: dict, held: int | None = None):
    """Via a temporary file of this process's, fsynced and renamed: a crash leaves one whole
    file, and two writers never mix bytes; CPU tensors. held: the step checkpoint.pt holds."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as f:
            torch.save(map_tensors(state, lambda t: t.detach().cpu()), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except Exception as e:  # no space, quota, read-only, a lost mount: no temporary is left
        if storage_error(e) is None:
            raise
        with contextlib.suppress(OSError):
            os.remove(temporary)
        cannot_write(path, storage_error(e), held)


def storage_error(e: BaseException | None) -> OSError | None:
    """The OSError of a storage failure behind e (torch.save raises its own error from it)."""
    while e is not None and not (isinstance(e, OSError) and e.errno in STORAGE_ERRORS):
        e = e.__cause__ or e.__context__
    return e


def cannot_write(what: str, error: OSError, held: int | None):
    """A write that failed: what, why in plain words, the step the checkpoint holds; exit 1."""
    fail(f"cannot write {what}: {STORAGE_ERRORS[error.errno]} ({error.strerror}); " + (
        "no checkpoint was written" if held is None else f"the run's checkpoint.pt holds step "
        f"{held:,}, and the same command continues from it once the disk takes writes"), code=1)


def check_room(run_dir: str, agent: nn.Module, new: bool):
    """Refuses a start whose filesystem has no room for two checkpoints (agent.pt: the weights;
    checkpoint.pt: the weights and Adam's two moments; a temporary of each beside them)."""
    need = 2 * 4 * sum(p.numel() * p.element_size() for p in agent.parameters())
    kept = [os.path.join(run_dir, f) for f in ("agent.pt", "checkpoint.pt")]
    disk = os.statvfs(run_dir)
    room = disk.f_bavail * disk.f_frsize + sum(map(os.path.getsize, filter(os.path.isfile, kept)))
    if room < need:
        if new:
            with contextlib.suppress(OSError):
                os.rmdir(run_dir)
        fail(f"{shown_path(run_dir)} has room for {room / 2**20:.0f} MiB of checkpoints and a run "
             f"needs {need / 2**20:.0f} MiB (two checkpoints): free some space there" + (
                 ", or pass --runs-dir on another disk" if new else ""), code=1)


def load_checkpoint(path: str) -> dict:
    """A checkpoint file or a run folder's, with "run_dir" added; weights only: no pickled code."""
    path = os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        fail(f"no checkpoint at {path}; pass a run folder or a .pt file written by this script")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, unsafe pickle, not a torch file at all
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip() or type(e).__name__  # ANSI codes
        unsafe = re.search(r"GLOBAL ([\w.]+)", text, re.IGNORECASE)  # torch 2.11 and 2.13 spell it
        reason = f"it holds a pickled {unsafe[1]}, which a weights-only load does not run" \
            if unsafe else text.splitlines()[0][:200]
        if "weights_only" in reason:  # never pass on torch's advice to load it unsafely
            reason = "it holds pickled objects a weights-only load refuses (none was run)"
        fail(f"cannot load {path} as a safe checkpoint: {reason}")
    if not isinstance(state, dict) or not {"model", "args"} <= set(state):
        fail(f"{path} is not a checkpoint of this script (no model and args in it)")
    return state | {"run_dir": os.path.dirname(os.path.abspath(path))}


def load_agent(agent: nn.Module, state: dict, path: str, env_id: str):
    """Loads weights, or fails in one line naming the first tensor whose shape differs."""
    own, saved = agent.state_dict(), state["model"]
    for name in [*own, *(k for k in saved if k not in own)]:
        mine, theirs = (tuple(d[name].shape) if name in d else None for d in (own, saved))
        if mine != theirs:
            fail(f"{path} does not fit this network: {name} is {theirs or 'missing'} in the "
                 f"checkpoint ({state['args'].get('env_id')}) and {mine or 'missing'} here "
                 f"({env_id}): another game's action set, network or frame size")
    agent.load_state_dict(saved)


def save_checkpoint(run: Run, agent, optimizer, env_state: dict, args: Args,
                    global_step: int, iteration: int, recent, carry: dict, finished=False):
    """agent.pt (the weights alone), then checkpoint.pt (see restore), each written atomically,
    unless checkpoint.pt holds this step already."""
    if global_step == run.saved_step and not finished:
        return
    state = {"model": agent.state_dict(), "args": dataclasses.asdict(args),
             "global_step": global_step, "finished": finished, "source": run.source}
    write_atomically(os.path.join(run.folder, "agent.pt"), state, run.saved_step)
    write_atomically(os.path.join(run.folder, "checkpoint.pt"), state | {
        "optimizer": optimizer.state_dict(), "iteration": iteration,
        "rng": rng_state(next(agent.parameters()).device), "recent_returns": list(recent),
        "env_statistics": env_state, "carry": to_saved(carry)}, run.saved_step)
    run.saved_step, run.saved_at = global_step, time.perf_counter()


def restore(ckpt: dict | None, agent, optimizer, envs, carry: dict, recent, device, rank: int,
            seed: int):
    """A resume: weights, Adam, RNG, wrapper state, carry, recent returns; rank 0's weights."""
    if ckpt is not None:
        restore_wrapper_statistics(envs, ckpt.get("env_statistics", {}), rank)
        load_agent(agent, ckpt, ckpt["run_dir"], ckpt["args"]["env_id"])
        optimizer.load_state_dict(ckpt["optimizer"])
        set_rng_state(ckpt["rng"], device)
        if rank > 0:  # rank 0's RNG state is in the checkpoint; the others draw afresh
            torch.manual_seed(seed + rank + 7919 * (ckpt["iteration"] + 1))
        carry.update(map_tensors(from_saved(ckpt.get("carry", {})), lambda t: t.to(device)))
        recent.extend(ckpt["recent_returns"])
    if dist.is_initialized():  # identical weights and buffers everywhere
        for t in agent.state_dict().values():
            dist.broadcast(t, src=0)


def begin_run(run: Run, args: Args, ckpt: dict | None, agent, optimizer, env_state: dict,
              carry: dict):
    """Rank 0: says where the run goes, writes a new run's checkpoint first, opens the writer."""
    shown = shown_path(run.folder)
    print(f"run folder: {os.path.abspath(run.folder)} ({'new' if ckpt is None else 'continued'}); "
          f"watch it with: tensorboard --logdir {shown}", flush=True)
    os.makedirs(run.folder, exist_ok=True)
    check_room(run.folder, agent, ckpt is None)
    if ckpt is None:
        save_checkpoint(run, agent, optimizer, env_state, args, 0, 0, [], carry)
    if args.track:  # a continued run continues the same wandb run: its id is the folder's name
        import wandb
        name = os.path.basename(run.folder)
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args),
                   name=name, id=name, resume="allow", sync_tensorboard=True, save_code=True)
    # purge_step hides events a crashed run logged after its last checkpoint
    writer = SummaryWriter(run.folder, purge_step=ckpt["global_step"] + 1 if ckpt else None)
    if ckpt is None:
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in vars(args).items()))
    launch = f"run folder {os.path.abspath(run.folder)} on {socket.gethostname()}: " \
        f"{shlex.join(sys.argv)}"
    if ckpt is not None and ckpt.get("source", run.source) != run.source:
        launch += (f"; with --allow-other-file, continues what {ckpt['source']['file']} (core "
                   f"{ckpt['source']['core']}) trained with {run.source['file']} (core "
                   f"{run.source['core']})")
    writer.add_text("launch", launch, ckpt["global_step"] if ckpt else 0)  # (no stdout)
    return writer


# Wrapper state: each env's *_state attributes and running statistics, through the vector env


def wrapper_layers(env):
    """(name, layer) for each layer of one env, outermost first (of a vector env: its vector
    wrappers); a class's second is Class#2."""
    seen, layer = collections.Counter(), env
    while isinstance(layer, (gym.Env, gym.vector.VectorWrapper)):
        seen[kind := type(layer).__name__] += 1
        yield (kind if seen[kind] == 1 else f"{kind}#{seen[kind]}"), layer
        layer = getattr(layer, "env", None)


def to_saved(value):
    """value with numpy as tensors (np.str_ as str), which a weights-only load accepts."""
    return map_tensors(value, lambda a: {"__numpy__": str(a) if isinstance(a, np.str_) else
                                         torch.from_numpy(np.array(a)),
                                         "scalar": isinstance(a, np.generic)},
                       lambda v: isinstance(v, (np.ndarray, np.generic)) and checkpointable(v))


def from_saved(value):
    """to_saved's inverse: numpy comes back as numpy, of the same dtype."""
    return map_tensors(value, lambda d: np.str_(d["__numpy__"]) if isinstance(
        d["__numpy__"], str) else d["__numpy__"].numpy()[()] if d["scalar"] else
        d["__numpy__"].numpy(), lambda v: isinstance(v, dict) and "__numpy__" in v)


def checkpointable(obj) -> bool:
    """What to_saved makes loadable: tensors, numbers, str, None, numpy (not objects), nested."""
    if isinstance(obj, (list, tuple)):
        return all(checkpointable(v) for v in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, (str, int)) and checkpointable(v) for k, v in obj.items())
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.dtype.kind in "biufc" or isinstance(obj, np.str_)
    return isinstance(obj, (torch.Tensor, int, float, bool, str, type(None)))


def layer_state(env) -> dict:
    """One env's layers' "Layer.attr" (*_state attributes, running statistics, the games
    counted): "state", what a checkpoint holds, and "refused", what it cannot (their types)."""
    out = {"state": {}, "refused": {}}
    for name, layer in wrapper_layers(env):
        for attr, value in vars(layer).items():
            key, rms = f"{name}.{attr}", isinstance(value, RunningMeanStd)
            if attr.endswith("_state") or rms or key == "RecordEpisodeStatistics.episode_count":
                saved = to_saved(vars(value) if rms else value)
                out["state" if checkpointable(saved) else "refused"][key] = \
                    saved if checkpointable(saved) else type(value).__name__
    return out


def set_layer_state(env, state: dict):
    """Sets one env's layers' state back from layer_state's "state"."""
    for name, layer in wrapper_layers(env):
        for attr, value in list(vars(layer).items()):
            if (saved := state.get(f"{name}.{attr}")) is not None:
                if isinstance(value, RunningMeanStd):
                    vars(value).update(from_saved(saved))
                else:
                    setattr(layer, attr, from_saved(saved))


def env_layer_states(envs) -> list[dict]:
    """layer_state of every env of the vector env, in order (sync: its envs; async: through its
    public call(), from the workers); under a fork's vector wrappers, it is envs.unwrapped."""
    vector = envs.unwrapped
    if isinstance(vector, gym.vector.SyncVectorEnv):
        return [layer_state(env) for env in vector.envs]
    return list(vector.call("layers_get"))


def wrapper_statistics(envs, world_size: int = 1, carry=None, gather=True) -> dict | None:
    """{"Layer.attr": [each env's value or None], "vector": the vector wrappers' state}, all
    ranks' envs (under torchrun every rank calls it; gather=False: None).
    What a checkpoint cannot hold (carry, *_state) stops the run."""
    states, vector = env_layer_states(envs), layer_state(envs)
    refused = [(f"env {i}'s wrapper state {key}", kind) for i, env in enumerate(states)
               for key, kind in env["refused"].items()]
    refused += [(f"the vector wrapper state {key}", kind)
                for key, kind in vector["refused"].items()]
    refused += [(f"carry[{k!r}]", type(v).__name__) for k, v in (carry or {}).items()
                if not checkpointable(v)]
    for what, kind in refused[:1]:
        envs.close()
        fail(f"{what} is a {kind}, which a checkpoint cannot hold: keep it as numbers, str, None,"
             f" numpy numbers or arrays, tensors, or lists, tuples and dicts of them")
    if world_size > 1 and not gather:
        return None
    return all_ranks_statistics(states, world_size) | {"vector": vector["state"]}


def all_ranks_statistics(states: list, world_size: int) -> dict:
    """wrapper_statistics' answer from this rank's envs' states (every rank calls it)."""
    if world_size > 1:  # every rank's envs, rank 0's first
        gathered = [None] * world_size
        dist.all_gather_object(gathered, states)
        states = [env for part in gathered for env in part]
    keys = dict.fromkeys(key for env in states for key in env["state"])
    return {key: [env["state"].get(key) for env in states] for key in keys}


def restore_wrapper_statistics(envs, saved: dict, rank: int = 0):
    """Sets this rank's envs' wrapper state back; names in one line what it cannot restore."""
    now, num_envs = {key for env in env_layer_states(envs) for key in env["state"]}, \
        envs.unwrapped.num_envs
    kept, first = saved.keys() - {"numbers", "vector"}, rank * num_envs
    states = [{key: saved[key][first + i] for key in now & kept if first + i < len(saved[key])}
              for i in range(num_envs)]
    count, games = "VideoRecorder.games_state", "RecordEpisodeStatistics.episode_count"
    if count in now - kept and games in kept:  # videos from this launch on: env 0's next game
        states[0][count], kept = saved[games][0] + 1, kept | {count}
    if isinstance(envs.unwrapped, gym.vector.SyncVectorEnv):
        for env, state in zip(envs.unwrapped.envs, states):
            set_layer_state(env, state)
    else:  # each worker takes its own env's
        envs.unwrapped.call("layers_set", states)
    vector, vector_now = saved.get("vector", {}), layer_state(envs)["state"]
    set_layer_state(envs, vector)
    lost = sorted((now ^ kept) - {count}) + sorted(vector.keys() ^ vector_now.keys())
    if lost:
        print(f"note: env wrapper state {lost} is not restored (starts afresh): the checkpoint or "
              f"these envs lack it; resumes keep a wrapper's *_state attributes", flush=True)


# Stops: a handler records the signal; the loop reads run.stops (rollout, train)


def catch_stop_signals(stops: list, run=None):
    """Points each stop signal not ignored at start (`cmd &`, nohup: those stay ignored) at
    on_stop, which records it in stops and answers it (from run, once main has one: how long,
    what the checkpoint holds). Returns release(), which puts the handlers back. Outside the
    main thread Python lets no handler be set: the signals stay the caller's."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s, handler in old.items():
        if handler != signal.SIG_IGN:
            signal.signal(s, functools.partial(on_stop, stops, run))

    def release():
        for s, handler in old.items():
            signal.signal(s, handler)
    return release


def on_stop(stops: list, run, signum: int, frame):
    """A stop signal: recorded first, then answered once on stderr (a write that may fail); a
    second Ctrl-C ends the process at once, its async workers first, without a checkpoint."""
    if stops and signum == signal.SIGINT:
        with contextlib.suppress(Exception):
            print("\nsecond Ctrl-C: exiting now without a checkpoint", file=sys.stderr, flush=True)
        kill_workers()  # before they find the trainer gone
        os._exit(130)
    stops.append(signum)
    if len(stops) == 1 and not (dist.is_initialized() and dist.get_rank() > 0):
        with contextlib.suppress(Exception):  # a closed pipe, a write this handler interrupted
            print(stop_answer(run, signum), file=sys.stderr, flush=True)


def stop_answer(run, signum: int) -> str:
    """What a first stop signal does, and about how long it takes."""
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    about = f"within about {run.iteration_s:.0f} s, an iteration's time" if run and \
        run.iteration_s is not None else "the first, not timed yet"
    if run is None:  # not training yet, or evaluating
        what = "nothing to checkpoint: it stops at its next step"
    elif dist.is_initialized():
        what = f"the iteration in progress ends on every rank ({about}) and is checkpointed"
    else:
        what = (f"the rollout in progress is given up and the last whole iteration checkpointed, "
                f"or the update in progress ends ({about}) and its iteration is checkpointed")
    second = "; a second Ctrl-C quits at once without a checkpoint" + (
        f" (the last holds step {run.saved_step:,})" if run and run.saved_step is not None else "")
    return f"\n{name}: stopping: {what}" + (second if signum == signal.SIGINT else "")


# The end of a run, failures, evaluation and main


def end_run(run: Run, args: Args, global_step: int, stopped: bool, stopped_early: bool,
            rank: int, world_size: int):
    """Rank 0 says where the run is and, stopped early, the launch that continues it; stopped by
    a signal (on this rank or another), it exits 128 + n as its default action would (130, 143:
    a preempted job)."""
    signum = run.stops[0] if run.stops else None  # (None: another rank's signal)
    shown = shown_path(run.folder)
    python = next((name for name in ("python", "python3") if shutil.which(name) and
                   os.path.abspath(shutil.which(name)) == os.path.abspath(sys.executable)),
                  sys.executable)  # the same command: `python` when that is this interpreter
    again = ["--no-cuda"] * (not args.cuda) + ["--threads", str(args.threads)] * bool(args.threads)
    if args.stop_at_step and not stopped_early:  # a stop by signal goes on to the planned stop
        again += ["--stop-at-step", str(args.stop_at_step)]
    resume = shlex.join([python] * (world_size == 1) + [sys.argv[0], "--resume", shown, *again])
    if world_size > 1:
        resume = f"the same torchrun launcher and options, then: {resume}"
    by = "--stop-at-step" if not stopped else "a signal to another rank" if signum is None \
        else signal.Signals(signum).name
    if rank == 0:
        print(f"\nrun folder: {shown}" if sys.stdout.isatty() else f"run folder: {shown}")
        if stopped or stopped_early:
            print(f"stopped at step {global_step:,} of {args.total_timesteps:,} by {by}; "
                  f"checkpoint written; continue with: {resume}", flush=True)
    if stopped:
        raise SystemExit(128 + (signum or signal.SIGTERM))


def close(envs, writer):
    for opened in (envs, writer):
        if opened is not None:
            opened.close()
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # a group a reference cycle frees at interpreter exit aborts gloo (exit -6)


def evaluate(args: Args, device: torch.device, explicit: set[str], stops: list):
    """Plays full games (all lives, raw score) with a saved agent, until done or signalled."""
    torch.manual_seed(args.seed)  # the actions sampled
    path, state = args.eval_checkpoint, load_checkpoint(args.eval_checkpoint)
    trained, run_dir, step = state["args"]["env_id"], state["run_dir"], state.get("global_step", 0)
    # another id of the same game (ROM, actions): ALE/Game-v5 adds sticky actions (Machado 2018)
    env_id = args.env_id if "env_id" in explicit else trained
    if gym.spec(env_id).kwargs["game"] != gym.spec(trained).kwargs["game"]:
        fail(f"{path} was trained on {trained}, not {env_id}; drop --env-id, or give an id of "
             f"the same game")
    other = "" if env_id == trained else env_id.replace("/", "-") + "-"
    name = f"{other}step{step}-seed{args.seed}-{time.time():.3f}"  # a TensorBoard run of its own
    into = run_dir
    if not os.access(run_dir, os.W_OK):  # a read-only folder: runs/ of the working directory
        into = os.path.join("runs", os.path.basename(run_dir))
        print(f"note: {shown_path(run_dir)} is read-only: the evaluation writes to "
              f"{shown_path(into)} instead", flush=True)
    events = os.path.join(into, "eval", name)
    video = os.path.join(into, "eval-videos", name) if args.capture_video else None
    eval_args = dataclasses.replace(args, env_id=env_id, num_envs=1, env_backend="sync")
    envs = make_envs(eval_args, args.seed, video, every_game=True)
    agent = Agent(envs.single_observation_space.shape, envs.single_action_space.n)
    agent = agent.to(device, memory_format=torch.channels_last)
    load_agent(agent, state, path, env_id)
    print(f"evaluation events: {shown_path(events)}" + (f"; videos: {shown_path(video)}"
                                                         if video else ""), flush=True)
    writer = SummaryWriter(events)
    obs, _ = envs.reset(seed=args.seed)  # seeded: the same command plays the same games
    scores, memory = [], {"starts": torch.ones(1, device=device)}
    while len(scores) < args.eval_episodes and not stops:
        with torch.inference_mode():  # actions sampled from the policy, as in training
            action = act(agent, torch.as_tensor(obs, device=device), memory)
        obs, _, terminated, truncated, infos = envs.step(action.cpu().numpy())
        memory["starts"] = torch.as_tensor(terminated | truncated, device=device).float()
        for score, length in finished_games(infos)[:args.eval_episodes - len(scores)]:
            scores.append(score)
            writer.add_scalar("eval/episodic_return", score, len(scores))
            print(f"game {len(scores)}: score {score:.0f}, {length} frames", flush=True)
    if scores:
        writer.add_scalar("eval/mean_episodic_return", np.mean(scores), step)
        print(f"{env_id}: {np.mean(scores):.2f} ± {np.std(scores):.2f} over {len(scores)} "
              f"game{'s' if len(scores) > 1 else ''} (agent at step {step:,})", flush=True)
    close(envs, writer)
    if stops:  # 130, 143
        print(f"stopped by {signal.Signals(stops[0]).name} after {len(scores)} of "
              f"{args.eval_episodes} games", flush=True)
        raise SystemExit(128 + stops[0])


def quiet_storage_errors(hook_args):
    """threading.excepthook: TensorBoard's writer thread dies of a failed write silently (main
    says it in one line when the next write raises it)."""
    if storage_error(hook_args.exc_value) is None:
        sys.__excepthook__(hook_args.exc_type, hook_args.exc_value, hook_args.exc_traceback)


class Unbroken:
    """sys.stdout or sys.stderr for a run: once a write fails (a closed pipe, EIO after a hang-up)
    its descriptor points at /dev/null, and the run goes on without output."""

    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            self.silence()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            self.silence()

    def silence(self):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())  # what the stream still holds goes there too
        os.close(devnull)


def main(args: Args, explicit: set[str] | None = None):
    """Trains (returns the agent; None: nothing to train) or evaluates; explicit: CLI fields."""
    if explicit is None:
        explicit = {f.name for f in dataclasses.fields(Args)
                    if getattr(args, f.name) != getattr(Args(), f.name)}
    if threading.current_thread() is not threading.main_thread():
        print("note: main() runs outside the main thread: Ctrl-C and SIGTERM are left to the "
              "caller", flush=True)
    stops, run = [], None
    release = catch_stop_signals(stops)
    hook, threading.excepthook = threading.excepthook, quiet_storage_errors
    try:
        # distributed: inert without torchrun (or a launcher) setting the variables read here
        rank, world_size, local_rank, local_processes = (int(os.environ.get(k, d)) for k, d in (
            ("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)))
        device = choose_device(args, local_rank, local_processes, say=rank == 0)
        if args.eval_checkpoint is not None:  # under torchrun, rank 0 alone plays
            check_args(args)
            return evaluate(args, device, explicit, stops) if rank == 0 else None
        if world_size > 1:
            join_process_group("nccl" if device.type == "cuda" else "gloo", rank, world_size,
                               args.dist_timeout)
        args, ckpt, run = open_run(args, explicit, stops, rank, world_size)
        if run is None:  # nothing to train: complete, or past --stop-at-step
            return close(None, None)
        catch_stop_signals(stops, run)  # the answer to a stop now reads the run
        return train(args, ckpt, device, run, rank, world_size)
    except OSError as e:  # an events write (checkpoints: write_atomically)
        if storage_error(e) is None:
            raise
        cannot_write(f"the events in {shown_path(run.folder if run else args.runs_dir)}",
                     storage_error(e), run.saved_step if run else None)
    finally:
        release()
        threading.excepthook = hook
        if run is not None and run.lock is not None:  # (a next main() in this process may lock)
            run.lock.close()


if __name__ == "__main__":
    sys.stdout, sys.stderr = Unbroken(sys.stdout), Unbroken(sys.stderr)  # output never stops it
    main(tyro.cli(Args), explicit_fields(sys.argv[1:]))
