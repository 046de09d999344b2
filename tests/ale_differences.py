"""How the opt-in ale backend differs from the in-file wrappers, measured (not collected by pytest).

    python tests/ale_differences.py

1. Max-pool order: the wrappers gray and resize the max of two RGB frames; ale-py's C++ env
   takes the max of two grayscale frames, then resizes. The same emulator frames (random play)
   go through both; it prints the share of the 84x84 pixels that differ and by how much.
2. Replaced actions: the share of a random policy's transitions on the ale backend whose
   action was the FIRE the adapter plays after a lost life (masked out of the policy loss).
"""
import os
import sys

import cv2
import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_atari as P  # noqa: E402


def resize(gray):
    return cv2.resize(gray, (84, 84), interpolation=cv2.INTER_AREA)


def max_pool_order(env_id, agent_steps=2000, seed=0):
    env = gym.make(env_id, frameskip=1)
    env.reset(seed=seed)
    rng, differ, pixels, worst = np.random.default_rng(seed), 0, 0, 0
    for _ in range(agent_steps):
        action, frames = int(rng.integers(env.action_space.n)), []
        for _ in range(4):
            obs, _, terminated, truncated, _ = env.step(action)
            frames.append(obs)
            if terminated or truncated:
                env.reset()
                break
        if len(frames) < 2:
            continue
        a, b = frames[-2], frames[-1]
        wrappers = resize(cv2.cvtColor(np.maximum(a, b), cv2.COLOR_RGB2GRAY))
        ale = resize(np.maximum(cv2.cvtColor(a, cv2.COLOR_RGB2GRAY),
                                cv2.cvtColor(b, cv2.COLOR_RGB2GRAY)))
        delta = np.abs(wrappers.astype(int) - ale.astype(int))
        differ, pixels, worst = differ + (delta > 0).sum(), pixels + delta.size, max(worst,
                                                                                     delta.max())
    env.close()
    return differ / pixels, worst


def replaced_share(env_id, steps=3000, num_envs=8):
    envs = P.make_envs(P.Args(env_id=env_id, num_envs=num_envs, env_backend="ale"), seed=0)
    envs.reset(seed=0)
    rng, replaced = np.random.default_rng(0), 0
    for _ in range(steps):
        *_, infos = envs.step(rng.integers(envs.single_action_space.n, size=num_envs))
        replaced += infos["overridden"].sum()
    envs.close()
    return replaced / (steps * num_envs)


if __name__ == "__main__":
    print("| game | pixels differing (max-pool order) | largest difference (grey levels) "
          "| transitions whose action was replaced by FIRE |")
    print("|---|---|---|---|")
    for game in ("Breakout", "Pong", "SpaceInvaders"):
        share, worst = max_pool_order(f"{game}NoFrameskip-v4")
        replaced = replaced_share(f"{game}NoFrameskip-v4")
        print(f"| {game} | {100 * share:.3f} % | {worst} | {100 * replaced:.2f} % |", flush=True)
