"""Learning parity (not collected by pytest): do the speed options learn what the plain setup does?

    python tests/dev/parity.py --steps 300000 --seeds 1,2 --configs plain,bf16 --jobs 2
    python tests/dev/parity.py --plan 10000000 --steps 2000000 --seeds 1 --configs default

Runs ppo_atari.py on Breakout for each configuration and seed (`--jobs` at a time, threads split
between them; with --plan, planned for that many steps and stopped at --steps with
--stop-at-step, so the learning rate anneals over the plan), then prints each run's final
charts/avg_episodic_return (mean of the last 100 games) and, per configuration, the mean and
the spread over seeds. Runs are kept under --out, and
a finished run already there is reused instead of run again.

The last column is each run's highest losses/explained_variance averaged over a window of 75k
steps. Breakout runs can sit on a plateau (a return of 2-4, a value function that predicts
almost everything: windows above 0.9) and leave it at very different times; the column shows
which runs did.

    python tests/dev/parity.py --numerics parity-runs/runs/<run>

compares bf16 autocast with fp32 on one trained agent (no training): log-probabilities, values,
GAE advantages and the gradient of one minibatch, next to the spread that sampling itself gives
(the gradients of two different minibatches).
"""
import argparse
import dataclasses
import glob
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))
from events import scalars  # noqa: E402  (the tools' events reader)

CONFIGS = {
    "default": [],  # --env-backend auto: sync on a CPU
    "plain": ["--env-backend", "sync", "--precision", "fp32"],
    "async": ["--env-backend", "async", "--precision", "fp32"],
    "bf16": ["--env-backend", "sync", "--precision", "bf16"],
}


def finished_run(out, config, seed, steps):
    for run in glob.glob(os.path.join(out, "runs", f"*__parity-{config}__{seed}__*")):
        if os.path.exists(os.path.join(run, "agent.pt")):
            logged = scalars(run).get("charts/avg_episodic_return", [(0, None)])
            if logged[-1][0] >= steps - 8 * 128:
                return run, logged[-1][1]
    return None, None


def plateau(run, window=75_000):
    """The highest mean explained variance over consecutive windows of `window` steps."""
    logged = scalars(run)["losses/explained_variance"]
    steps, ev = np.array([s for s, _ in logged]), np.array([v for _, v in logged])
    return max(ev[(steps > a) & (steps <= a + window)].mean()
               for a in range(0, int(steps.max()) - window + 1, window))


def numerics(run, seed=1):
    """bf16 autocast against fp32 on one saved agent, on a 128-step rollout of 8 envs."""
    import torch
    sys.path.insert(0, ROOT)
    import ppo_atari as P
    torch.manual_seed(seed)
    state = P.load_checkpoint(os.path.join(run, "agent.pt"))
    known = {f.name for f in dataclasses.fields(P.Args)}
    saved = {k: v for k, v in state["args"].items() if k in known}
    args = P.Args(**saved | {"env_backend": "sync"})
    envs = P.make_envs(args, seed)
    agent = P.Agent(envs.single_observation_space.shape, envs.single_action_space.n)
    P.load_agent(agent, state, run, args.env_id)
    o, _ = envs.reset(seed=seed)
    obs, actions, rewards, dones = [], [], [], []
    for _ in range(args.num_steps + 1):
        obs.append(torch.from_numpy(o))
        with torch.inference_mode():
            actions.append(agent.get_action_and_value(obs[-1])[0])
        o, r, terminated, truncated, _ = envs.step(actions[-1].numpy())
        rewards.append(torch.tensor(r))
        dones.append(torch.tensor(terminated | truncated).float())
    T, flat = args.num_steps, torch.cat(obs)
    act, rew, done = torch.cat(actions), torch.stack(rewards[:T]), torch.stack(dones[:T])

    def forward(bf16):
        with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits, value = agent(flat)
        logp = torch.log_softmax(logits, -1).gather(-1, act[:, None]).squeeze(-1)
        value = value.reshape(T + 1, -1)
        adv, _ = P.compute_gae(rew, value[:T], done, value[T], args.gamma, args.gae_lambda)
        return logp, value, adv.flatten()

    (lp32, v32, adv32), (lp16, v16, adv16) = forward(False), forward(True)
    b = slice(0, T * args.num_envs)
    returns, values = (adv32 + v32[:T].flatten()), v32[:T].flatten()

    def grad(bf16, idx):
        agent.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            mb = dict(obs=flat[b][idx], actions=act[b][idx], logprobs=lp32[b][idx],
                      advantages=adv32[idx], returns=returns[idx], values=values[idx])
            loss, _ = P.minibatch_loss(agent, mb, args.clip_coef, args)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in agent.parameters()])

    mb = T * args.num_envs // args.num_minibatches
    one, two = torch.randperm(T * args.num_envs)[:mb], torch.randperm(T * args.num_envs)[:mb]
    g32, g16, g32_other = grad(False, one), grad(True, one), grad(False, two)
    cos = torch.nn.functional.cosine_similarity
    print(f"# {run}: bf16 autocast against fp32, {T} steps x {args.num_envs} envs")
    print(f"log-probability |bf16 - fp32|: mean {(lp16 - lp32).abs().mean():.4f}, "
          f"max {(lp16 - lp32).abs().max():.4f}")
    print(f"value |bf16 - fp32|: mean {(v16 - v32).abs().mean():.4f} "
          f"(values {v32.min():.2f} to {v32.max():.2f})")
    print(f"GAE advantages: correlation {np.corrcoef(adv16, adv32)[0, 1]:.4f}, "
          f"mean |bf16 - fp32| {(adv16 - adv32).abs().mean():.4f}, std {adv32.std():.4f}")
    print(f"minibatch gradient: cosine bf16 vs fp32 {cos(g16, g32, 0):.4f}; "
          f"fp32 on another minibatch vs fp32 {cos(g32_other, g32, 0):.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300_000)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--configs", default="plain,bf16")
    parser.add_argument("--plan", type=int, help="plan the runs for this many steps and stop "
                        "them at --steps (--stop-at-step); default: plan = --steps")
    parser.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", default="parity-runs", help="folder for the runs")
    parser.add_argument("--numerics", metavar="RUN", help="compare bf16 with fp32 on RUN's agent")
    parser.add_argument("--reference", default="", metavar="V1,V2,...",
                        help="final returns of reference seeds (e.g. sync runs made earlier); "
                             "each config gets Welch's t against them")
    a = parser.parse_args()
    if a.numerics:
        return numerics(a.numerics)
    os.makedirs(a.out, exist_ok=True)
    todo = [(c, int(s)) for c in a.configs.split(",") for s in a.seeds.split(",")
            if finished_run(a.out, c, int(s), a.steps)[0] is None]
    threads = str(max(1, len(os.sched_getaffinity(0)) // a.jobs))
    plan = ["--total-timesteps", str(a.plan), "--stop-at-step", str(a.steps)] if a.plan else \
        ["--total-timesteps", str(a.steps)]
    running = []
    while todo or running:
        while todo and len(running) < a.jobs:
            config, seed = todo.pop(0)
            cmd = [sys.executable, os.path.join(ROOT, "ppo_atari.py"), *CONFIGS[config],
                   "--env-id", a.env_id, *plan, "--seed", str(seed), "--threads", threads,
                   "--exp-name", f"parity-{config}", "--no-cuda"]
            log = open(os.path.join(a.out, f"{config}-{seed}.log"), "w")
            running.append(subprocess.Popen(cmd, cwd=a.out, stdout=log, stderr=log))
        time.sleep(5)
        running = [p for p in running if p.poll() is None]

    print(f"# {a.env_id}, {a.steps} steps, final charts/avg_episodic_return (last 100 games)")
    reference = [float(v) for v in a.reference.split(",") if v]
    print("| config | flags | per seed | mean ± std | Welch t vs reference "
          "| max explained variance, 75k window |")
    print("|---|---|---|---|---|---|")
    for config in a.configs.split(","):
        runs = [finished_run(a.out, config, int(s), a.steps) for s in a.seeds.split(",")]
        shown = ", ".join("failed" if f is None else f"{f:.2f}" for _, f in runs)
        ok = [f for _, f in runs if f is not None]
        ev = ", ".join(f"{plateau(run):.2f}" for run, _ in runs if run is not None)
        t = f"{welch_t(ok, reference):.2f}" if len(reference) > 1 and len(ok) > 1 else "-"
        print(f"| {config} | {' '.join(CONFIGS[config]) or '(none)'} | {shown} | "
              f"{np.mean(ok):.2f} ± {np.std(ok):.2f} | {t} | {ev} |")
    if reference:
        print(f"reference: {reference}, {np.mean(reference):.2f} ± {np.std(reference):.2f}")


def welch_t(a, b):
    """Welch's t of mean(a) - mean(b), with the sample (n - 1) variances."""
    a, b = np.asarray(a), np.asarray(b)
    return (a.mean() - b.mean()) / np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))


if __name__ == "__main__":
    main()
