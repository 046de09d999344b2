"""Learning-curve figure from runs' TensorBoard files (not collected by pytest).

    pip install matplotlib        # this script only; the trainer does not need it
    python tests/plot_curves.py --runs /work/learn/runs --out tests/figures/pong-breakout-2m.png

One panel per game: charts/avg_episodic_return (the mean of the last 100 finished games) of each
run folder named {game}-*, and the published points at the same budgets, each marked with its
source: CleanRL's ppo_atari.py docs figures (values read off the plotted curves) and SB3
rl-zoo's PPO monitor files (DLR-RM/rl-trained-agents, the mean of the last 100 training games,
one seed). Both are runs planned for 10M steps, as ours are. Prints the table of our values at
0.5M, 1M, 1.5M and 2M steps.
"""
import argparse
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import scalars  # noqa: E402

BUDGETS = [500_000, 1_000_000, 1_500_000, 2_000_000]
PUBLISHED = {  # game: {source: {steps: value}} (shared/REFERENCES.md)
    "Pong": {"CleanRL ppo_atari.py docs figure": {500_000: -19.5, 1_000_000: -8.9,
                                                  2_000_000: 12.7},
             "SB3 rl-zoo PPO, 1 seed": {500_000: -18.8, 1_000_000: -12.1, 2_000_000: 14.8}},
    "Breakout": {"CleanRL ppo_atari.py docs figure": {500_000: 10.3, 1_000_000: 19.3,
                                                      2_000_000: 48.7},
                 "SB3 rl-zoo PPO, 1 seed": {500_000: 14.7, 1_000_000: 25.7, 2_000_000: 58.3}},
}
RANDOM = {"Pong": -20.7, "Breakout": 1.7}  # Mnih et al. 2015


def curve(run):
    logged = scalars(run).get("charts/avg_episodic_return", [])
    return np.array(logged).T if logged else (np.array([]), np.array([]))


def at(steps, values, budget):
    """The logged value at the last iteration at or before `budget` steps."""
    before = steps <= budget
    return values[before][-1] if before.any() and steps.max() >= budget - 2048 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs", help="the folder holding the run folders")
    parser.add_argument("--out", default="tests/figures/pong-breakout-2m.png")
    a = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    print("| game | run | " + " | ".join(f"{b / 1e6:g}M" for b in BUDGETS) + " |")
    print("|---|---|" + "---|" * len(BUDGETS))
    for ax, game in zip(axes, PUBLISHED):
        for run in sorted(glob.glob(os.path.join(a.runs, f"{game.lower()}-*"))):
            steps, values = curve(run)
            if not len(steps):
                continue
            ax.plot(steps, values, label=f"ppo_atari.py, {os.path.basename(run)}")
            cells = [at(steps, values, b) for b in BUDGETS]
            print(f"| {game} | {os.path.basename(run)} | " + " | ".join(
                "-" if c is None else f"{c:.1f}" for c in cells) + " |")
        for (source, points), marker in zip(PUBLISHED[game].items(), ("o", "s")):
            ax.scatter(list(points), list(points.values()), marker=marker, s=40, zorder=3,
                       color="black" if marker == "o" else "gray", label=source)
        ax.axhline(RANDOM[game], color="gray", linestyle=":", label=f"random ({RANDOM[game]})")
        ax.set_title(f"{game}NoFrameskip-v4, planned for 10M steps, stopped at 2M", fontsize=10)
        ax.set_xlabel("agent steps")
        ax.set_ylabel("average return of the last 100 games")
        ax.set_xlim(0, 2_100_000)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
