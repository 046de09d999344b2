"""PPO on Atari in one file: the clipped-surrogate PPO of Schulman et al. (2017) with the Atari
details of record (openai/baselines ppo2, CleanRL), fast on CPU and GPU, resumable, and runnable
under torchrun.

    pip install -r requirements.txt
    python ppo_atari.py --env-id BreakoutNoFrameskip-v4          # train, CUDA if available
    tensorboard --logdir runs                                    # watch
    python ppo_atari.py --resume runs/<run>                      # continue a stopped run
    python ppo_atari.py --run-name NAME                          # the same command continues
    python ppo_atari.py --eval-checkpoint runs/<run>/agent.pt    # score a saved agent
    torchrun --nproc_per_node 2 ppo_atari.py                     # several processes/GPUs

Tested with Python 3.11 (3.12 and 3.13: unit tests), torch 2.13, gymnasium 1.4, ale-py 0.12,
tyro 1.0, opencv 5.0.
"""
import atexit
import collections
import dataclasses
import datetime
import difflib
import multiprocessing
import os
import random
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from typing import Literal

import ale_py  # importing registers the Atari ids with gymnasium; the ROMs ship in the wheel
import cv2
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro
from torch.utils.tensorboard import SummaryWriter

gym.register_envs(ale_py)
ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # no banner at every start; errors show


@dataclass
class Args:
    """PPO on Atari (one file, CleanRL style). Each run writes TensorBoard logs, checkpoint.pt and
    agent.pt to runs/<run>/ (see --run-name). Train: python ppo_atari.py --env-id
    BreakoutNoFrameskip-v4. Continue a stopped run: python ppo_atari.py --resume runs/<run>. Score
    a saved agent: python ppo_atari.py --eval-checkpoint runs/<run>/agent.pt."""

    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run folder's name)"""
    run_name: str | None = None
    """the run folder is runs/RUN_NAME; when it holds a checkpoint, the same command continues
    it (after a preemption or a torchrun restart); None: {env_id}__{exp_name}__{seed}__{time}"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """True: cudnn picks deterministic kernels (torch.backends.cudnn.deterministic)"""
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
    env_backend: Literal["auto", "sync", "async", "ale"] = "auto"
    """auto: async when training on CUDA with at least 4 cores per process, else sync; sync/async:
    the in-file wrappers, in this process or a process per env (same numbers); ale: ale-py's C++
    env, opt-in, not the wrappers (gray-then-max frames, its own start, a masked FIRE per life)"""
    total_timesteps: int = 10_000_000
    """total agent steps of the run, summed over envs (and processes under torchrun)"""
    stop_at_step: int | None = None
    """stop with a checkpoint after the iteration that reaches this many steps, keeping the
    schedule planned for --total-timesteps; the same command without it continues the run"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments (per process under torchrun)"""
    num_steps: int = 128
    """the number of steps run in each environment per rollout"""
    anneal_lr: bool = True
    """True: anneal the learning rate linearly to 0 over the run"""
    anneal_clip: bool = False
    """True: anneal the clip coefficient linearly to 0 over the run, as the PPO paper does"""
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

    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 autocast for the network (CUDA; CPUs with AVX512-BF16 or AMX)"""
    compile: bool = False
    """True: torch.compile the rollout policy step and the minibatch loss"""
    checkpoint_interval: int = 50
    """write checkpoint.pt every this many iterations (and at the end)"""
    resume: str | None = None
    """a run folder or checkpoint file to continue from; it may change only --total-timesteps,
    --checkpoint-interval, --cuda, --compile, --env-backend and the logging options"""
    eval_checkpoint: str | None = None
    """score this saved agent (agent.pt or checkpoint.pt) instead of training"""
    eval_episodes: int = 10
    """the number of full games --eval-checkpoint plays"""
    dist_timeout: int = 600
    """torchrun: seconds a rendezvous or collective may wait for the other processes, then fail"""


# Arguments that may differ from a checkpoint's when resuming: they change neither the network, the
# game nor the optimisation already done.
RESUME_OVERRIDABLE = {"total_timesteps", "checkpoint_interval", "track", "wandb_project_name",
                      "wandb_entity", "capture_video", "cuda", "compile", "env_backend", "resume",
                      "run_name", "dist_timeout", "stop_at_step"}


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
                 "checkpoint_interval", "eval_episodes", "dist_timeout", "stop_at_step"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            value = getattr(args, name)
            fail(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    for name in ("learning_rate", "clip_coef"):
        if not getattr(args, name) > 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    batch = args.num_envs * args.num_steps
    if batch % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} does not divide the batch of --num-envs "
             f"{args.num_envs} x --num-steps {args.num_steps} = {batch}; pick a divisor of {batch}")
    if args.total_timesteps < batch * world_size:
        fail(f"--total-timesteps {args.total_timesteps} is less than one batch "
             f"({batch * world_size} steps); raise it or shrink --num-envs/--num-steps")
    check_env_id(args.env_id)
    if args.capture_video and args.env_backend == "ale" and args.eval_checkpoint is None:
        fail("--capture-video needs the in-file wrappers (ale-py's vector env renders no "
             "frames): drop --env-backend ale")


def check_env_id(env_id: str):
    """Only ALE image environments fit the wrappers and the CNN, and only the ids whose settings
    the trainer keeps: NoFrameskip-v4 (no sticky actions) and ALE/...-v5 (sticky actions 0.25).
    Plain -v4 ids skip a random 2-4 frames and -v0 ids have sticky actions: both are refused."""
    def wanted(name):
        return name.endswith("NoFrameskip-v4") or (name.startswith("ALE/") and name.endswith("-v5"))

    if env_id not in gym.registry:
        close = difflib.get_close_matches(env_id, [n for n in gym.registry if wanted(n)], 3, 0.6)
        hint = f"did you mean {' or '.join(close)}?" if close else "e.g. BreakoutNoFrameskip-v4"
        fail(f"unknown --env-id {env_id!r}; {hint}")
    spec = gym.spec(env_id)
    image = spec.kwargs.get("obs_type", "rgb") == "rgb"
    if not str(spec.entry_point).startswith("ale_py") or not image:
        fail(f"--env-id {env_id!r} is not an Atari image environment; this trainer needs an ALE id "
             f"such as BreakoutNoFrameskip-v4 or ALE/Pong-v5")
    if not wanted(env_id):
        game = env_id.split("-")[0].removesuffix("NoFrameskip")
        what = "sticky actions" if spec.kwargs.get("repeat_action_probability") else "no"
        what += "" if spec.kwargs.get("frameskip") == 1 else " and a random frame skip"
        fail(f"--env-id {env_id} has {what.removeprefix('no and ')}; use {game}NoFrameskip-v4 "
             f"(the published setting) or ALE/{game}-v5 (sticky actions)")


# ---------------------------------------------------------------------------------------------
# Atari wrappers, innermost first (semantics of openai/baselines atari_wrappers.py and SB3)


class VideoRecorder(gym.Wrapper):
    """Writes games to mp4 with OpenCV: games 0, 1, 8, 27, ... (cubes) then every 1000th, or with
    every_game (evaluation) every full game and no cut-off one. Innermost, so it sees every
    emulator frame and only real game overs."""

    def __init__(self, env, folder: str, every_game: bool = False):
        super().__init__(env)
        self.folder, self.every_game, self.games, self.writer = folder, every_game, 0, None

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._finish(complete=True)
        k, self.games = self.games, self.games + 1
        if self.every_game or round(k ** (1 / 3)) ** 3 == k or k % 1000 == 0:
            os.makedirs(self.folder, exist_ok=True)
            self.path = os.path.join(self.folder, f"game-{k}.mp4")
            height, width = obs.shape[:2]
            fourcc = cv2.VideoWriter_fourcc(*"mp4v")
            self.writer = cv2.VideoWriter(self.path, fourcc, 60, (width, height))
        self._write(obs)
        return obs, info

    def step(self, action):
        result = self.env.step(action)
        self._write(result[0])
        return result

    def _write(self, frame):
        if self.writer is not None:
            self.writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))

    def _finish(self, complete: bool):
        if self.writer is not None:
            self.writer.release()
            self.writer = None
            if not complete and self.every_game:  # evaluation keeps full games only; training
                os.remove(self.path)  # keeps the last, cut-off game (a short run may have no other)

    def close(self):
        self._finish(complete=False)
        super().close()


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
    """RGB (210, 160, 3) -> grayscale (84, 84) uint8, resized with area interpolation."""

    def __init__(self, env, size: int = 84):
        super().__init__(env)
        self.size = size
        self.observation_space = gym.spaces.Box(0, 255, (size, size), np.uint8)

    def observation(self, obs):
        gray = cv2.cvtColor(obs, cv2.COLOR_RGB2GRAY)
        return cv2.resize(gray, (self.size, self.size), interpolation=cv2.INTER_AREA)


def make_env(env_id: str, seed: int, video_folder: str | None = None, every_game=False):
    """A thunk for the vector env: one Atari game with the wrappers of record.
    Observations (4, 84, 84) uint8, the newest frame last; info["episode"] at a real game over."""

    def thunk():
        if multiprocessing.parent_process() is not None:  # an async worker
            # Ctrl-C (a terminal) and SIGTERM (SLURM) reach every process; the trainer finishes
            # its iteration and checkpoints, so a worker keeps serving it: SIGINT is ignored and
            # SIGTERM ends the worker only 60 s later (SIGALRM), if the trainer has not closed it
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, lambda *_: signal.alarm(60))
            cv2.setNumThreads(1)  # one core per worker: never oversubscribe the machine
        gym.register_envs(ale_py)  # a spawned worker registers the ids itself
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


class AleGames(gym.vector.VectorWrapper):
    """Makes ale-py's C++ AtariVectorEnv behave as the in-file wrappers do:
    - the step after a lost life plays FIRE whatever the agent chose (as FireReset does inside
      the pseudo-reset), and that step's observation, like a game's first, repeats its newest
      frame four times (FrameStackObservation pads after a reset; ale-py pads with zeros);
    - info["overridden"] marks the envs whose action was replaced by that FIRE: the trainer
      keeps those samples out of the policy and entropy terms (`ppo_loss(mask=...)`);
    - rewards are clipped here (ale-py's clipping would hide the raw score), and full games
      are reported in info["final_info"]["episode"]: raw score, length in emulator frames.
    A game is over on truncation, or on a termination without a life lost (the same-step reset
    has already restored the lives)."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        action_set, fire = self.env.ale.get_action_set(), ale_py.Action.FIRE
        self.fire_action = action_set.index(fire) if fire in action_set else -1
        self.lives, self.frames = info["lives"].copy(), info["episode_frame_number"].copy()
        self.returns, self.fire = np.zeros(self.num_envs), np.zeros(self.num_envs, bool)
        obs[:, :3] = obs[:, 3:]
        return obs, info

    def step(self, actions):
        overridden = self.fire.copy()
        actions = np.where(overridden, self.fire_action, np.asarray(actions, np.int64))
        obs, reward, terminated, truncated, info = self.env.step(actions)
        info["overridden"] = overridden  # these envs played FIRE, not the agent's action
        self.returns += reward
        over = truncated | (terminated & (info["lives"] >= self.lives))
        if over.any():
            info["final_info"] = {"episode": {"r": self.returns.copy(), "l": self.frames + 4},
                                  "_episode": over}
            self.returns[over] = 0
        fresh = over | self.fire
        obs[fresh, :3] = obs[fresh, 3:]
        self.fire = terminated & ~over & (self.fire_action >= 0)
        self.lives, self.frames = info["lives"].copy(), info["episode_frame_number"].copy()
        return obs, np.sign(reward).astype(np.float32), terminated, truncated, info


def make_envs(args: Args, seed: int, video_folder: str | None = None, every_game=False):
    """The vector env. Same-step autoreset: a finished env is reset inside step(), the returned
    obs is the new episode's first, and no transition of the reset enters the batch."""
    if args.env_backend == "ale":
        # The same preprocessing in C++ threads; AleGames adds what differs (README).
        kwargs = gym.spec(args.env_id).kwargs
        threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return AleGames(ale_py.vector_env.AtariVectorEnv(
            kwargs["game"], args.num_envs, num_threads=threads, autoreset_mode="SameStep",
            repeat_action_probability=kwargs.get("repeat_action_probability", 0.0),
            max_num_frames_per_episode=kwargs.get("max_num_frames_per_episode", 108_000),
            frameskip=4, noop_max=30, use_fire_reset=True, episodic_life=False,
            life_loss_info=True, reward_clipping=False))
    thunks = [make_env(args.env_id, seed + i, video_folder if i == 0 else None, every_game)
              for i in range(args.num_envs)]
    same_step = gym.vector.AutoresetMode.SAME_STEP
    if args.env_backend == "async":  # spawn: a forked CUDA context or NCCL group is not safe
        envs = gym.vector.AsyncVectorEnv(thunks, autoreset_mode=same_step, context="spawn")
        # workers outlive SIGTERM (see make_env), so a trainer that crashes kills them itself
        atexit.register(lambda: [p.kill() for p in envs.processes if p.is_alive()])
        return envs
    return gym.vector.SyncVectorEnv(thunks, autoreset_mode=same_step)


def choose_backend(args: Args, use_cuda: bool, local_processes: int) -> str:
    """--env-backend auto: the in-file wrappers either way. A process per env (async) pays off
    only when the network does not need the cores: on CUDA with 4 or more cores per process.
    On a CPU the envs and the network take turns on the same cores and sync is faster."""
    if args.env_backend != "auto":
        return args.env_backend
    cores = (os.cpu_count() or 1) // local_processes
    return "async" if use_cuda and cores >= 4 else "sync"


def finished_games(infos: dict) -> list[tuple[float, int]]:
    """(raw score, length in emulator frames) of every full game that ended in this vector step."""
    final = infos.get("final_info", {})
    if "episode" not in final:
        return []
    ended, episode = final["_episode"], final["episode"]
    return [(float(r), int(n)) for r, n in zip(episode["r"][ended], episode["l"][ended])]


# ---------------------------------------------------------------------------------------------
# Network


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """NatureCNN trunk (Mnih et al. 2015) shared by the policy and value heads."""

    def __init__(self, n_actions: int):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def forward(self, obs):
        """obs (B, 4, 84, 84) uint8 -> logits (B, n_actions) float32, value (B,) float32."""
        # scaled in place (one fewer 29 MB buffer per minibatch of 256, bit-identical to
        # `/ 255.0`); copy=True so that a float input is never scaled under its owner's feet
        x = obs.to(torch.float32, memory_format=torch.channels_last, copy=True).div_(255.0)
        hidden = self.network(x)
        return self.actor(hidden).float(), self.critic(hidden).float().squeeze(-1)


def policy_step(agent: Agent, obs):
    """Sample actions for a rollout step: action (B,) int64, logprob (B,), value (B,)."""
    logits, value = agent(obs)
    logp_all = torch.log_softmax(logits, dim=-1)
    action = torch.multinomial(logp_all.exp(), 1).squeeze(-1)
    return action, logp_all.gather(-1, action[:, None]).squeeze(-1), value


# ---------------------------------------------------------------------------------------------
# Pure helpers: advantages, loss, checkpoint I/O


def compute_gae(rewards, values, dones, next_value, gamma: float, gae_lambda: float):
    """Generalized advantage estimation (Schulman et al. 2016), cut at every done.
    rewards, values, dones: (T, N); dones[t] = 1 when the episode ended with step t's action;
    next_value (N,): the value of the observation after the last step. Returns (advantages,
    returns), returns = advantages + values (the value targets)."""
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        nextvalues = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        nextnonterminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def kept_mean(x, mask=None):
    """Mean over the samples whose mask is 1; all of them without a mask."""
    return x.mean() if mask is None else (x * mask).sum() / mask.sum().clamp(min=1)


def ppo_loss(newlogprob, entropy, newvalue, logprob, advantages, returns, values, clip_coef,
             norm_adv=True, clip_vloss=True, ent_coef=0.01, vf_coef=0.5, mask=None):
    """The PPO objective on one minibatch (all tensors (B,); clip_coef a float or 0-d tensor).
    mask (B,) float, optional: 0 for a sample whose action the env replaced (the ale backend's
    FIRE after a lost life); such a sample is left out of the policy and entropy terms and of
    the advantage statistics, but still trains the value. Returns the loss to minimise and,
    detached, [pg_loss, v_loss, entropy, old_approx_kl, approx_kl, clipfrac, value_clipfrac]."""
    logratio = newlogprob - logprob
    ratio = logratio.exp()
    if norm_adv and mask is None:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    elif norm_adv:  # the kept samples' mean and (unbiased) std
        mean = kept_mean(advantages, mask)
        var = ((advantages - mean) ** 2 * mask).sum() / (mask.sum() - 1).clamp(min=1)
        advantages = (advantages - mean) / (var.sqrt() + 1e-8)
    pg_loss = kept_mean(torch.max(-advantages * ratio,
                                  -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)),
                        mask)
    if clip_vloss:  # baselines ppo2: the value may move at most clip_coef from its rollout value
        v_clipped = values + torch.clamp(newvalue - values, -clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((newvalue - returns) ** 2, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * ((newvalue - returns) ** 2).mean()
    entropy_loss = kept_mean(entropy, mask)
    loss = pg_loss - ent_coef * entropy_loss + vf_coef * v_loss
    with torch.no_grad():  # http://joschu.net/blog/kl-approx.html
        old_approx_kl = kept_mean(-logratio, mask)
        approx_kl = kept_mean((ratio - 1) - logratio, mask)
        clipfrac = kept_mean(((ratio - 1.0).abs() > clip_coef).float(), mask)
        value_clipfrac = ((newvalue - values).abs() > clip_coef).float().mean()
    metrics = torch.stack([pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac,
                           value_clipfrac]).detach()
    return loss, metrics


def minibatch_loss(agent, obs, actions, logprob, advantages, returns, values, clip_coef, args,
                   mask=None):
    """Forward pass on a minibatch, then ppo_loss. obs (B, 4, 84, 84) uint8, actions (B,) int64."""
    logits, newvalue = agent(obs)
    logp_all = torch.log_softmax(logits, dim=-1)
    newlogprob = logp_all.gather(-1, actions[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return ppo_loss(newlogprob, entropy, newvalue, logprob, advantages, returns, values,
                    clip_coef, args.norm_adv, args.clip_vloss, args.ent_coef, args.vf_coef, mask)


def save_checkpoint(path: str, state: dict):
    """Atomic: write a temporary file, flush it to disk, then rename over the old checkpoint, so
    a crash at any point leaves either the old or the new file, both complete."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint_file(path: str) -> str:
    """A run folder stands for its checkpoint.pt."""
    return os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path


def load_checkpoint(path: str) -> dict:
    """weights_only=True: tensors and plain types only, so a crafted pickle cannot run code."""
    path = checkpoint_file(path)
    if not os.path.isfile(path):
        fail(f"no checkpoint at {path}; pass a run folder or a .pt file written by this script")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, unsafe pickle, not a torch file at all
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail(f"cannot load {path} as a safe checkpoint ({first[:160]})")
    if not isinstance(state, dict) or not {"model", "args"} <= set(state):
        fail(f"{path} is not a checkpoint of this script (no model and args in it)")
    return state


def shown_path(path: str) -> str:
    """A path as printed: relative to the working directory when inside it, else absolute."""
    rel = os.path.relpath(path)
    return os.path.abspath(path) if rel.startswith("..") else rel


def run_folder_started(name: str) -> bool:
    """--run-name: True when runs/NAME holds a checkpoint to continue (every run writes one
    before anything else); a folder with other files in it belongs to something else."""
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        fail(f"--run-name {name!r} must be a plain folder name (no '/', not starting with '.')")
    folder = os.path.join("runs", name)
    if os.path.isfile(os.path.join(folder, "checkpoint.pt")):
        return True
    if os.path.isdir(folder) and os.listdir(folder):
        fail(f"{folder} holds files but no checkpoint.pt, so it is not a run of this script to "
             f"continue; pick another --run-name or remove the folder")
    return False


def resume_plan(args: Args, saved: Args, ckpt: dict, world_size: int, num_iterations: int,
                rank: int) -> bool:
    """Checks a checkpoint against this launch, says (rank 0) what resuming does, and returns
    True when the run has already reached --total-timesteps (then nothing is written)."""
    done, step, local_batch = ckpt["iteration"], ckpt["global_step"], args.num_envs * args.num_steps
    if done and step != done * local_batch * world_size:  # each iteration: every rank's batch
        written_by = step // (done * local_batch)
        fail(f"{args.resume} was written by {written_by} process(es) and this launch has "
             f"{world_size}; continue it with {written_by} processes (torchrun --nproc_per_node)")
    where = shown_path(os.path.dirname(os.path.abspath(checkpoint_file(args.resume))))
    past_stop = done < num_iterations and bool(args.stop_at_step and step >= args.stop_at_step)
    if rank == 0 and past_stop:
        print(f"{where} has run {step:,} steps, already past --stop-at-step "
              f"{args.stop_at_step:,}; nothing written. Drop --stop-at-step (or raise it) to "
              f"continue to {args.total_timesteps:,}", flush=True)
    elif rank == 0 and done >= num_iterations:
        print(f"{where} is already complete: it has run {step:,} steps and --total-timesteps is "
              f"{args.total_timesteps:,}; nothing written. To train longer, pass a larger "
              f"--total-timesteps", flush=True)
    elif rank == 0:
        old_iterations = saved.total_timesteps // (local_batch * world_size)
        lr_old = (1.0 - done / old_iterations) * args.learning_rate
        lr_new = (1.0 - done / num_iterations) * args.learning_rate
        line = (f"continuing {where} at step {step:,} of {args.total_timesteps:,} "
                f"({num_iterations - done} iterations left)")
        if args.anneal_lr and saved.total_timesteps != args.total_timesteps:
            line += (f"; --total-timesteps changed from {saved.total_timesteps:,}: the learning-"
                     f"rate{' and clip' if args.anneal_clip else ''} schedule is re-planned over "
                     f"the new total ({lr_old:.3g} -> {lr_new:.3g} now, 0 at the end)")
        elif args.anneal_lr:
            line += f"; the learning rate goes on along its schedule ({lr_new:.3g} now)"
        print(line, flush=True)
    return done >= num_iterations or past_stop


def rng_state() -> dict:
    np_state = np.random.get_state(legacy=False)
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy_key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "numpy_pos": np_state["state"]["pos"],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict):
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    torch.set_rng_state(state["torch"])
    np.random.set_state({"bit_generator": "MT19937", "has_gauss": 0, "gauss": 0.0, "state": {
        "key": state["numpy_key"].numpy().astype(np.uint32), "pos": state["numpy_pos"]}})
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_agent(agent: Agent, state: dict, path: str):
    """Loads weights, with a clear error when the checkpoint's game has another action set."""
    n_saved, n_env = state["model"]["actor.weight"].shape[0], agent.actor.out_features
    if n_saved != n_env:
        fail(f"{path} was trained on {state['args']['env_id']} with {n_saved} actions; this game "
             f"has {n_env}")
    agent.load_state_dict(state["model"])


# ---------------------------------------------------------------------------------------------
# Evaluation of a saved agent


def evaluate(args: Args, device: torch.device, explicit: set[str]):
    """Plays full games (all lives, raw score) with a saved agent and reports their scores."""
    path = args.eval_checkpoint
    state = load_checkpoint(path)
    saved = state["args"]
    if "env_id" in explicit and args.env_id != saved["env_id"]:
        fail(f"{path} was trained on {saved['env_id']}, not {args.env_id}; drop --env-id")
    run_dir = os.path.dirname(os.path.abspath(checkpoint_file(path)))
    eval_args = dataclasses.replace(args, env_id=saved["env_id"], num_envs=1, env_backend="sync")
    video = os.path.join(run_dir, "eval-videos") if args.capture_video else None
    envs = make_envs(eval_args, args.seed, video, every_game=True)
    agent = Agent(envs.single_action_space.n).to(device, memory_format=torch.channels_last)
    load_agent(agent, state, path)
    # each evaluation is a TensorBoard run of its own, so repeated ones never overlap
    step = state.get("global_step", 0)
    writer = SummaryWriter(os.path.join(run_dir, "eval", f"step{step}-seed{args.seed}-"
                                                         f"{int(time.time())}"))
    obs, _ = envs.reset(seed=args.seed)  # seeded: the same command plays the same games
    scores = []
    while len(scores) < args.eval_episodes:
        with torch.inference_mode():  # actions sampled from the policy, as in training
            action, _, _ = policy_step(agent, torch.as_tensor(obs, device=device))
        obs, _, _, _, infos = envs.step(action.cpu().numpy())
        for score, length in finished_games(infos)[:args.eval_episodes - len(scores)]:
            scores.append(score)
            writer.add_scalar("eval/episodic_return", score, len(scores))
            print(f"game {len(scores)}: score {score:.0f}, {length} frames", flush=True)
    writer.add_scalar("eval/mean_episodic_return", np.mean(scores), step)
    envs.close()
    writer.close()
    games = "game" if len(scores) == 1 else "games"
    print(f"{saved['env_id']}: {np.mean(scores):.2f} ± {np.std(scores):.2f} over {len(scores)} "
          f"{games} (agent at step {step:,})")


# ---------------------------------------------------------------------------------------------


def join_process_group(backend: str, rank: int, world_size: int, timeout_s: int):
    """init_process_group through torchrun's store, under a prefix of its own for each restart:
    workers restarted by `torchrun --max-restarts` would otherwise read the dead round's peer
    addresses from the same store and wait on them. Every wait is bounded by timeout_s."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # not torchrun: env:// init
        return dist.init_process_group(backend, timeout=timeout)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"ppo_atari/restart{restart}", store),
                            rank=rank, world_size=world_size, timeout=timeout)


def main(args: Args, explicit: set[str] = frozenset()):
    # distributed: inert without torchrun, which sets the environment variables read here
    distributed = "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank, world_size, local_rank = 0, 1, 0
    if distributed:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])

    # arguments: a resumed run takes its checkpoint's, with the safe overrides given now
    ckpt = None
    if (args.resume is None and args.eval_checkpoint is None and args.run_name is not None
            and run_folder_started(args.run_name)):
        args = dataclasses.replace(args, resume=os.path.join("runs", args.run_name))
    if args.resume is not None:
        ckpt = load_checkpoint(args.resume)
        known = {f.name for f in dataclasses.fields(Args)}
        saved = Args(**{k: v for k, v in ckpt["args"].items() if k in known})
        for name in sorted(explicit - RESUME_OVERRIDABLE):
            if getattr(args, name) != getattr(saved, name):
                fail(f"--{name.replace('_', '-')} cannot change when resuming (the checkpoint has "
                     f"{getattr(saved, name)!r}); drop it or start a new run")
        overrides = (explicit & RESUME_OVERRIDABLE) | {"resume", "stop_at_step"}  # never saved
        args = dataclasses.replace(saved, **{n: getattr(args, n) for n in overrides})
    check_args(args, world_size)
    if args.track:
        try:
            import wandb
        except ImportError:
            fail("--track needs wandb, which is not installed: pip install wandb")
    local_batch = args.num_envs * args.num_steps
    batch_size = local_batch * world_size  # steps per iteration, all processes
    minibatch_size = local_batch // args.num_minibatches  # per process
    num_iterations = args.total_timesteps // batch_size
    if ckpt is not None and args.eval_checkpoint is None:
        if resume_plan(args, saved, ckpt, world_size, num_iterations, rank):
            return None  # already complete

    # device: the one place it is chosen
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    why = "" if use_cuda else " (--no-cuda)" if not args.cuda else " (CUDA is not available)"
    device_line = f"device: {device}{why}"  # printed after the run folder, on rank 0
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16")
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = choose_backend(args, use_cuda, local_processes)  # args keep "auto" for a resume

    # seeding: one block; each rank gets its own env seeds and action samples
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    if args.eval_checkpoint is not None:  # under torchrun, rank 0 alone plays
        if rank == 0:
            print(device_line, flush=True)
        return evaluate(args, device, explicit) if rank == 0 else None
    if distributed:
        join_process_group("nccl" if use_cuda else "gloo", rank, world_size, args.dist_timeout)
        if use_cuda:
            torch.cuda.set_device(device)
        else:  # share the cores between the local processes instead of oversubscribing them
            torch.set_num_threads(max(1, os.cpu_count() // local_processes))

    if ckpt is not None:
        run_dir = os.path.dirname(os.path.abspath(checkpoint_file(args.resume)))
    else:
        run_dir = os.path.join("runs", args.run_name or f"{args.env_id.replace('/', '-')}__"
                               f"{args.exp_name}__{args.seed}__{int(time.time())}")

    # envs, agent, optimizer
    video = os.path.join(run_dir, "videos") if args.capture_video and rank == 0 else None
    start_iteration, global_step, recent = 1, 0, collections.deque(maxlen=100)
    if ckpt is not None:
        start_iteration, global_step = ckpt["iteration"] + 1, ckpt["global_step"]
        recent.extend(ckpt["recent_returns"])
    env_seed = args.seed + rank * args.num_envs + 7919 * (start_iteration - 1)  # fresh games
    envs = make_envs(dataclasses.replace(args, env_backend=backend), env_seed, video)
    agent = Agent(envs.single_action_space.n).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    if ckpt is not None:
        load_agent(agent, ckpt, args.resume)
        optimizer.load_state_dict(ckpt["optimizer"])
        set_rng_state(ckpt["rng"])
        if rank > 0:
            torch.manual_seed(args.seed + rank + 7919 * start_iteration)
    if distributed:  # identical initial weights everywhere
        for p in agent.parameters():
            dist.broadcast(p.data, src=0)
    # compile: the one site; checkpoints save `agent` itself, never a compiled wrapper
    act, loss_fn = policy_step, minibatch_loss
    if args.compile:
        act, loss_fn = torch.compile(policy_step), torch.compile(minibatch_loss)

    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")

    def checkpoint(iteration):
        if rank == 0:
            if writer is not None:
                writer.flush()  # the logs reach at least as far as the checkpoint
            save_checkpoint(checkpoint_path, {
                "model": agent.state_dict(), "optimizer": optimizer.state_dict(),
                "args": dataclasses.asdict(args), "global_step": global_step,
                "iteration": iteration, "rng": rng_state(), "recent_returns": list(recent)})

    writer = None
    shown = shown_path(run_dir)
    if rank == 0:
        print(f"run folder: {shown}; watch it with: tensorboard --logdir {shown}", flush=True)
        print(device_line, flush=True)
        os.makedirs(run_dir, exist_ok=True)
        if ckpt is None:  # iteration 0, before any event: a run folder always has a checkpoint
            checkpoint(0)
        if args.track:
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args),
                       name=os.path.basename(run_dir), sync_tensorboard=True, save_code=True)
        # purge_step hides events a crashed run logged after its last checkpoint
        writer = SummaryWriter(run_dir, purge_step=global_step + 1 if ckpt else None)
        if ckpt is None:
            writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
                f"|{k}|{v}|" for k, v in vars(args).items()))

    # storage on the training device, (T, N, ...) = (num_steps, num_envs, ...)
    obs = torch.zeros((args.num_steps, args.num_envs, 4, 84, 84), dtype=torch.uint8, device=device)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long, device=device)
    logprobs = torch.zeros((args.num_steps, args.num_envs), device=device)  # float32
    rewards = torch.zeros((args.num_steps, args.num_envs), device=device)  # clipped, float32
    dones = torch.zeros((args.num_steps, args.num_envs), device=device)  # 1.0: ended at step t
    values = torch.zeros((args.num_steps, args.num_envs), device=device)  # float32
    # 1.0: the env played the agent's action (0.0 only for the ale backend's FIRE after a life)
    acted = torch.ones((args.num_steps, args.num_envs), device=device)
    # host staging for observations: pinned so the copy to the GPU can overlap (CUDA only)
    staging = torch.zeros((args.num_envs, 4, 84, 84), dtype=torch.uint8, pin_memory=use_cuda)

    # signals: the first Ctrl-C/SIGTERM stops at the end of the iteration; a second Ctrl-C now
    stop = []

    def on_signal(signum, frame):
        if stop and signum == signal.SIGINT:
            print("\nsecond Ctrl-C: exiting now without a checkpoint", file=sys.stderr)
            os._exit(130)
        stop.append(signum)

    old_handlers = [signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)]

    next_obs_np, _ = envs.reset(seed=env_seed)
    next_obs = staging.copy_(torch.from_numpy(next_obs_np)).to(device, non_blocking=True)
    start_time, start_step, last_print = time.time(), global_step, 0.0
    is_tty = sys.stdout.isatty()

    iteration, stopped = start_iteration - 1, False
    for iteration in range(start_iteration, num_iterations + 1):
        # anneal: learning rate (and optionally clip range) fall linearly to 0 over the run
        frac = 1.0 - (iteration - 1.0) / num_iterations
        lr_now = frac * args.learning_rate if args.anneal_lr else args.learning_rate
        optimizer.param_groups[0]["lr"] = lr_now
        clip_value = frac * args.clip_coef if args.anneal_clip else args.clip_coef
        clip_now = torch.tensor(clip_value, device=device)  # a tensor: compile won't recompile

        # rollout
        t0, games = time.time(), []
        for step in range(args.num_steps):
            global_step += args.num_envs * world_size
            obs[step] = next_obs
            with torch.inference_mode(), autocast:
                action, logprob, value = act(agent, next_obs)
            actions[step], logprobs[step], values[step] = action, logprob, value
            # sync point: the env needs the actions on the host
            next_obs_np, reward, terminated, truncated, infos = envs.step(action.cpu().numpy())
            rewards[step] = torch.as_tensor(reward, dtype=torch.float32).to(device)
            dones[step] = torch.as_tensor(terminated | truncated, dtype=torch.float32).to(device)
            if "overridden" in infos:
                acted[step] = torch.as_tensor(~infos["overridden"], dtype=torch.float32).to(device)
            next_obs = staging.copy_(torch.from_numpy(next_obs_np)).to(device, non_blocking=True)
            games += [(global_step, r, n) for r, n in finished_games(infos)]
        rollout_time = time.time() - t0

        # advantages
        t0 = time.time()
        with torch.inference_mode(), autocast:
            _, next_value = agent(next_obs)
        advantages, returns = compute_gae(rewards, values, dones, next_value.float(),
                                          args.gamma, args.gae_lambda)
        b_obs = obs.reshape((-1, 4, 84, 84))
        b_actions, b_logprobs = actions.reshape(-1), logprobs.reshape(-1)
        b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)
        b_values = values.reshape(-1)
        b_acted = acted.reshape(-1) if backend == "ale" else None  # no mask: CleanRL's math

        # update: metrics stay on the device until the single read after the loop
        metrics, n_minibatches = torch.zeros(7, device=device), 0
        for epoch in range(args.update_epochs):
            perm = torch.randperm(local_batch, device=device)
            for start in range(0, local_batch, minibatch_size):
                mb = perm[start:start + minibatch_size]
                with autocast:
                    loss, mb_metrics = loss_fn(agent, b_obs[mb], b_actions[mb], b_logprobs[mb],
                                               b_advantages[mb], b_returns[mb], b_values[mb],
                                               clip_now, args,
                                               None if b_acted is None else b_acted[mb])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if distributed:  # average gradients over ranks, as one flat all-reduce
                    grads = [p.grad for p in agent.parameters()]
                    flat = torch.cat([g.reshape(-1) for g in grads]) / world_size
                    dist.all_reduce(flat)
                    for g, new in zip(grads, torch.split(flat, [g.numel() for g in grads])):
                        g.copy_(new.view_as(g))
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
                metrics += mb_metrics
                n_minibatches += 1
            if args.target_kl is not None:  # sync point, once per epoch and only with target_kl
                kl = mb_metrics[4].clone()
                if distributed:  # decided on the mean over ranks so that all stop together
                    dist.all_reduce(kl)
                    kl /= world_size
                if kl.item() > args.target_kl:
                    break

        # logging: one host sync for all of the iteration's metrics
        y_pred, y_true = b_values, b_returns
        explained_var = 1 - torch.var(y_true - y_pred) / torch.var(y_true)
        finite = torch.stack([torch.isfinite(p).all() for p in agent.parameters()]).all()
        summary = torch.cat([metrics / n_minibatches, explained_var[None], finite[None].float(),
                             torch.tensor([float(len(stop))], device=device)])
        if distributed:
            dist.all_reduce(summary)
            summary /= world_size
            gathered = [None] * world_size
            dist.all_gather_object(gathered, games)
            games = sorted(g for part in gathered for g in part)
        summary = summary.tolist()
        update_time = time.time() - t0  # advantages + update; measured after the sync
        stopped = summary[9] > 0
        at_stop = args.stop_at_step is not None and global_step >= args.stop_at_step
        if summary[8] < 1.0 or not np.isfinite(summary[:7]).all():
            kept = (f"the last good checkpoint is {checkpoint_path}" if os.path.exists(
                checkpoint_path) else "no checkpoint had been written")
            envs.close()
            fail(f"non-finite loss or parameters at iteration {iteration} (global step "
                 f"{global_step}); stopped; {kept}", code=1)
        recent.extend(r for _, r, _ in games)
        sps = int((global_step - start_step) / (time.time() - start_time))
        if writer is not None:
            for step_done, score, length in games:
                writer.add_scalar("charts/episodic_return", score, step_done)
                writer.add_scalar("charts/episodic_length", length, step_done)
            if recent:  # mean of the last 100 finished games, the figure papers report
                writer.add_scalar("charts/avg_episodic_return", np.mean(recent), global_step)
            writer.add_scalar("charts/learning_rate", lr_now, global_step)
            writer.add_scalar("charts/clip_coef", clip_value, global_step)
            writer.add_scalar("charts/SPS", sps, global_step)
            writer.add_scalar("charts/rollout_time", rollout_time, global_step)  # seconds/iter
            writer.add_scalar("charts/update_time", update_time, global_step)  # seconds/iter
            # each loss scalar: the mean over all minibatches of this iteration's update
            for i, tag in enumerate(["policy_loss", "value_loss", "entropy", "old_approx_kl",
                                     "approx_kl", "clipfrac", "value_clipfrac"]):
                writer.add_scalar(f"losses/{tag}", summary[i], global_step)
            writer.add_scalar("losses/explained_variance", summary[7], global_step)  # batch

            # console: in place on a terminal, a plain line every 30 s otherwise
            now = time.time()
            if is_tty or now - last_print > 30 or iteration == num_iterations:
                eta = (args.total_timesteps - global_step) / max(sps, 1)
                avg = f"{np.mean(recent):.1f}" if recent else "n/a"
                line = (f"step {global_step:,}/{args.total_timesteps:,} | SPS {sps} | avg return "
                        f"{avg} | ETA {int(eta // 3600)}h{int(eta % 3600 // 60):02d}m")
                print(f"\r{line}   " if is_tty else line, end="" if is_tty else "\n", flush=True)
                last_print = now

        if iteration % args.checkpoint_interval == 0 or stopped or at_stop:
            checkpoint(iteration)
        if stopped or at_stop:
            break

    # close: final checkpoint and the trained agent with its arguments
    at_stop = args.stop_at_step is not None and global_step >= args.stop_at_step
    if (iteration >= start_iteration and iteration % args.checkpoint_interval and not stopped
            and not at_stop):
        checkpoint(iteration)
    if rank == 0:  # the latest weights; finished: the run reached --total-timesteps
        torch.save({"model": agent.state_dict(), "args": dataclasses.asdict(args),
                    "global_step": global_step, "finished": iteration == num_iterations},
                   os.path.join(run_dir, "agent.pt"))
        print(f"\nrun folder: {shown}" if is_tty else f"run folder: {shown}")
        if at_stop and iteration < num_iterations:
            print(f"stopped at step {global_step:,} (--stop-at-step); continue to "
                  f"{args.total_timesteps:,} with: " + shlex.join(
                      [sys.executable, sys.argv[0], "--resume", shown]), flush=True)
    envs.close()
    if writer is not None:
        writer.close()
    if distributed:
        dist.destroy_process_group()
    for s, handler in zip((signal.SIGINT, signal.SIGTERM), old_handlers):
        signal.signal(s, handler)
    if stopped:
        if rank == 0:
            print("stopped by signal; checkpoint written; resume with: " + shlex.join(
                [sys.executable, sys.argv[0], "--resume", shown]), flush=True)
        raise SystemExit(128 + (stop[0] if stop else signal.SIGTERM))
    return agent


if __name__ == "__main__":
    main(tyro.cli(Args), explicit_fields(sys.argv[1:]))
