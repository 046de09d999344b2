"""Would overlapping env stepping with inference speed up the rollout? (not collected by pytest)

    python tests/overlap_probe.py [--rounds 3]

Times a 128-step rollout of 8 Breakout envs on ale-py's C++ vector env with ppo_atari.py's
network, in the ways the rollout could be organised:
- serial: what ppo_atari.py does: act on all 8 envs, then step all 8 (2 ALE threads);
- pipelined: two vector envs of 4 (1 ALE thread each); while one half steps in its C++ thread
  (ale-py's send/recv), the network acts on the other half, with 2 or with 1 torch thread;
and, for reference, the env alone (random actions) and the network alone (random frames).
Each figure is the median over rounds, seconds per 128 steps x 8 envs.
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_atari as P  # noqa: E402
from ale_py.vector_env import AtariVectorEnv  # noqa: E402

STEPS = 128


def vector_env(num_envs, threads):
    return AtariVectorEnv("breakout", num_envs, num_threads=threads, autoreset_mode="SameStep",
                          life_loss_info=True, reward_clipping=False)


def act(agent, obs):
    with torch.inference_mode():
        return P.policy_step(agent, torch.from_numpy(obs))[0].numpy()


def serial(agent):
    envs = vector_env(8, 2)
    obs, _ = envs.reset(seed=1)
    t0 = time.time()
    for _ in range(STEPS):
        obs = envs.step(act(agent, obs))[0]
    envs.close()
    return time.time() - t0


def pipelined(agent):
    a, b = vector_env(4, 1), vector_env(4, 1)
    obs_a, _ = a.reset(seed=1)
    obs_b, _ = b.reset(seed=2)
    t0 = time.time()
    a.send(act(agent, obs_a))
    for _ in range(STEPS):
        actions_b = act(agent, obs_b)  # while half a steps
        obs_a = a.recv()[0]
        b.send(actions_b)
        actions_a = act(agent, obs_a)  # while half b steps
        obs_b = b.recv()[0]
        a.send(actions_a)
    a.recv()
    elapsed = time.time() - t0
    a.close(), b.close()
    return elapsed


def env_alone(_):
    envs, rng = vector_env(8, 2), np.random.default_rng(1)
    envs.reset(seed=1)
    t0 = time.time()
    for _ in range(STEPS):
        envs.step(rng.integers(0, 4, 8))
    envs.close()
    return time.time() - t0


def network_alone(agent):
    obs = np.random.default_rng(1).integers(0, 256, (8, 4, 84, 84), dtype=np.uint8)
    t0 = time.time()
    for _ in range(STEPS):
        act(agent, obs)
    return time.time() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    agent = P.Agent(4).to(memory_format=torch.channels_last)
    cases = [("env alone (2 ALE threads)", env_alone, 2),
             ("network alone (2 torch threads)", network_alone, 2),
             ("serial: ppo_atari.py's rollout (2 ALE, 2 torch threads)", serial, 2),
             ("pipelined halves (1+1 ALE, 2 torch threads)", pipelined, 2),
             ("pipelined halves (1+1 ALE, 1 torch thread)", pipelined, 1)]
    times = {name: [] for name, _, _ in cases}
    for _ in range(rounds):  # interleaved, so that a slow spell hits every case
        for name, fn, threads in cases:
            torch.set_num_threads(threads)
            fn(agent)  # warm-up
            times[name].append(fn(agent))
    print(f"| rollout organisation | s per {STEPS} steps x 8 envs | per round |")
    print("|---|---|---|")
    for name, _, _ in cases:
        shown = ", ".join(f"{t:.3f}" for t in times[name])
        print(f"| {name} | {np.median(times[name]):.3f} | {shown} |")


if __name__ == "__main__":
    main()
