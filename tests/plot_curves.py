"""Learning-curve figure from the parity runs' TensorBoard files (not collected by pytest).

    pip install matplotlib        # this script only; the trainer does not need it
    python tests/plot_curves.py --configs default,ale --out tests/figures/breakout-300k.png

For each configuration it reads charts/avg_episodic_return (mean of the last 100 games) of every
seed under parity-runs/runs/, puts the seeds on a common grid of steps, and draws their mean with
a band from the lowest to the highest seed. A dashed line marks the random agent's Breakout score
(1.7, Mnih et al. 2015, Nature, Extended Data Table 2).
"""
import argparse
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import scalars  # noqa: E402

RANDOM_BREAKOUT = 1.7
LABELS = {"default": "default (in-file wrappers, sync)", "ale": "--env-backend ale (masked)",
          "plain": "--env-backend sync"}


def curves(out, config, grid):
    seeds = []
    for run in sorted(glob.glob(os.path.join(out, "runs", f"*__parity-{config}__*"))):
        logged = scalars(run).get("charts/avg_episodic_return", [])
        if logged and logged[-1][0] >= grid[-1]:
            steps, values = np.array(logged).T
            seeds.append(np.interp(grid, steps, values))
    return np.array(seeds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="parity-runs", help="tests/parity.py's --out folder")
    parser.add_argument("--configs", default="default,ale")
    parser.add_argument("--steps", type=int, default=300_000)
    parser.add_argument("--out", default="tests/figures/breakout-300k.png")
    a = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(5_000, a.steps - 1024, 120)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for config in a.configs.split(","):
        seeds = curves(a.runs, config, grid)
        if not len(seeds):
            sys.exit(f"no finished {config} runs of {a.steps} steps under {a.runs}/runs")
        label = f"{LABELS.get(config, config)}, {len(seeds)} seeds"
        line, = ax.plot(grid, seeds.mean(0), label=label)
        ax.fill_between(grid, seeds.min(0), seeds.max(0), color=line.get_color(), alpha=0.2)
    ax.axhline(RANDOM_BREAKOUT, color="gray", linestyle="--", label="random agent (1.7)")
    ax.set_xlabel("agent steps")
    ax.set_ylabel("average return of the last 100 games")
    ax.set_title("BreakoutNoFrameskip-v4, 300k steps: mean, band = min to max over seeds",
                 fontsize=10)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
