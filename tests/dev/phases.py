"""Where a training iteration's time goes (not collected by pytest):

    python tests/dev/phases.py                         # sync and async, 8 envs, CPU
    python tests/dev/phases.py --cuda --compile        # on a GPU, the policy and loss compiled
    python tests/dev/phases.py --loop-cost             # the loop's own cost: no-op envs, no network
    python tests/dev/phases.py --loop-cost --script old_ppo_atari.py    # another copy's loop

Phases (default): for each backend, the file's own `rollout` is timed as it runs (the rollout
per vector step, no added syncs), then an instrumented copy of its step times each phase alone,
waiting for the device between phases: the policy's forward, the action copy to the host, the env
step as the trainer waits for it (step, or step_async + step_wait), the observation copy to the
device, the storage writes; then `make_batch` + `update` per iteration. "unexplained" is the
rollout's time per step less the phases' sum: negative where the uninstrumented loop overlaps
phases (async workers step while storage is written; the GPU runs behind the host).

Loop cost (--loop-cost): the same `rollout` over envs that do nothing (constant frames, reward 0,
never done) and a policy that returns constant tensors, per vector step, sync and async, 8 envs:
what the loop itself, the vector env's bookkeeping and the workers' messages cost, without any
emulation or network. A CPU proxy for the per-step overhead of a GPU run.

Prints one markdown table; each figure is the median over iterations after the first.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import gymnasium as gym
import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(script: str):
    """The copy as module ppo_atari, importable by name: the async workers unpickle
    its env_worker by module and name."""
    folder = tempfile.mkdtemp()
    shutil.copy(script, os.path.join(folder, "ppo_atari.py"))
    sys.path.insert(0, folder)
    import ppo_atari
    return ppo_atari


class NoopEnv(gym.Env):
    """Breakout's spaces, nothing behind them: the same frame back, reward 0, never done."""
    observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    action_space = gym.spaces.Discrete(4)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros((4, 84, 84), np.uint8), {}

    def step(self, action):
        return np.zeros((4, 84, 84), np.uint8), 0.0, False, False, {}


def setup(P, a, backend: str, noop: bool):
    args = P.Args(env_id="BreakoutNoFrameskip-v4", num_envs=a.num_envs, num_steps=a.num_steps,
                  env_backend=backend, cuda=a.cuda, compile=a.compile, threads=a.threads)
    device = P.choose_device(args, 0, 1, say=False)
    if noop:
        real, P.make_env = P.make_env, lambda *_a, **_k: NoopEnv
    try:
        envs = P.make_envs(args, a.seed)
    finally:
        if noop:
            P.make_env = real
    agent = P.Agent(envs.single_observation_space.shape, envs.single_action_space.n)
    agent = agent.to(device, memory_format=torch.channels_last)
    policy = agent.get_action_and_value
    if noop:  # constant outputs, no network: what is left is the loop (as many outputs as the
        # copy's policy returns: a fork may add values after CleanRL's four)
        with torch.inference_mode():
            outputs = len(policy(torch.zeros((1, *envs.single_observation_space.shape),
                                             dtype=torch.uint8, device=device)))
        zeros = torch.zeros(a.num_envs, device=device)
        policy = lambda obs: (zeros.long(), *[zeros] * (outputs - 1))  # noqa: E731
    elif a.compile:
        policy = torch.compile(policy)
    storage = P.make_storage(envs.single_observation_space.shape, args.num_steps, a.num_envs,
                             device)
    staging = torch.zeros(storage["obs"].shape[1:], dtype=torch.uint8,
                          pin_memory=device.type == "cuda")
    next_obs = staging.copy_(torch.from_numpy(envs.reset(seed=a.seed)[0])).to(device)
    return args, device, envs, agent, policy, storage, staging, next_obs


def instrumented_rollout(P, policy, envs, next_obs, storage, staging, autocast, wait):
    """The file's rollout step by step, each phase timed alone (wait: for the device). With
    --script, the copy's policy and envs in the repository's rollout: a fork's own rollout
    changes (extra values stored) are not timed."""
    names = ["forward", "action to host", "env step", "obs to device", "storage writes"]
    spent = dict.fromkeys(names, 0.0)
    is_async = hasattr(envs, "step_async")
    for step in range(storage["obs"].shape[0]):
        t = [time.perf_counter()]
        storage["obs"][step] = next_obs
        with torch.inference_mode(), autocast:
            action, logprob, _, value, *_ = policy(next_obs)  # a fork's extra values: unstored
        wait()
        t.append(time.perf_counter())
        actions_np = action.cpu().numpy()
        t.append(time.perf_counter())
        if is_async:
            envs.step_async(actions_np)
            next_obs_np, reward, terminated, truncated, infos = envs.step_wait()
        else:
            next_obs_np, reward, terminated, truncated, infos = envs.step(actions_np)
        t.append(time.perf_counter())
        next_obs = staging.copy_(torch.from_numpy(next_obs_np))
        next_obs = next_obs.to(storage["obs"].device, non_blocking=True)
        wait()
        t.append(time.perf_counter())
        storage["actions"][step], storage["logprobs"][step] = action, logprob
        storage["values"][step] = value
        storage["rewards"][step] = torch.from_numpy(reward)
        storage["dones"][step] = torch.from_numpy(terminated | truncated)
        P.finished_games(infos)
        wait()
        t.append(time.perf_counter())
        for name, t0, t1 in zip(names, t, t[1:]):
            spent[name] += t1 - t0
    return next_obs, spent


def phases(P, a, backend: str) -> list[tuple[str, float]]:
    args, device, envs, agent, policy, storage, staging, next_obs = setup(P, a, backend, False)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=a.precision == "bf16")
    loss_fn = torch.compile(P.minibatch_loss) if a.compile else P.minibatch_loss
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    clip = torch.tensor(args.clip_coef, device=device)
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    T, rows = args.num_steps, []
    for _ in range(a.iterations):
        wait()
        t0 = time.perf_counter()
        next_obs, _, _ = P.rollout(policy, envs, next_obs, storage, staging, autocast, 0,
                                   a.num_envs)
        wait()
        t1 = time.perf_counter()
        next_obs, spent = instrumented_rollout(P, policy, envs, next_obs, storage, staging,
                                               autocast, wait)
        t2 = time.perf_counter()
        batch = P.make_batch(agent, storage, next_obs, autocast, args, {})
        totals, _ = P.update(agent, optimizer, loss_fn, batch, clip, autocast, args, 1, {})
        torch.stack(list(totals.values())).sum().item()  # the update is done
        t3 = time.perf_counter()
        per_step = {k: 1e3 * v / T for k, v in spent.items()}
        rows.append({"rollout per step (as trained)": 1e3 * (t1 - t0) / T, **per_step,
                     "unexplained": 1e3 * (t1 - t0) / T - sum(per_step.values()),
                     "instrumented per step": 1e3 * (t2 - t1) / T,
                     "update per iteration": 1e3 * (t3 - t2),
                     "steps/s (rollout as trained + update)": T * a.num_envs / (t1 - t0 + t3 - t2)})
    envs.close()
    return [(k, float(np.median([r[k] for r in rows[1:] or rows]))) for k in rows[0]]


def loop_cost(P, a, backend: str) -> list[tuple[str, float]]:
    args, device, envs, agent, policy, storage, staging, next_obs = setup(P, a, backend, True)
    autocast = torch.autocast(device.type, enabled=False)
    per_step = []
    for _ in range(a.iterations):
        t0 = time.perf_counter()
        next_obs, _, _ = P.rollout(policy, envs, next_obs, storage, staging, autocast, 0,
                                   a.num_envs)
        per_step.append(1e6 * (time.perf_counter() - t0) / args.num_steps)
    envs.close()
    return [("loop per vector step, us (no-op envs, no network)",
             float(np.median(per_step[1:] or per_step)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", default=os.path.join(ROOT, "ppo_atari.py"))
    parser.add_argument("--backends", default="sync,async")
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--num-steps", type=int, default=128, help="vector steps an iteration")
    parser.add_argument("--iterations", type=int, default=4, help="the first is not counted")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads")
    parser.add_argument("--loop-cost", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    a = parser.parse_args()
    if a.loop_cost and "--iterations" not in sys.argv:
        a.iterations = 20
    P = load(os.path.abspath(a.script))
    measure = loop_cost if a.loop_cost else phases
    results = {b: measure(P, a, b) for b in a.backends.split(",")}
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                     if v not in (None, False) and k not in ("script", "loop_cost"))
    device = torch.cuda.get_device_name() if a.cuda else "CPU"
    print(f"# {os.path.basename(a.script)} on {device}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {torch.get_num_threads()} torch threads; {flags}; ms unless "
          f"said; median over iterations after the first")
    names = list(results)
    print("| phase | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for i, (name, _) in enumerate(results[names[0]]):
        print(f"| {name} | " + " | ".join(f"{results[b][i][1]:.3f}" if results[b][i][1] < 100
                                          else f"{results[b][i][1]:.0f}" for b in names) + " |")


if __name__ == "__main__":
    main()
