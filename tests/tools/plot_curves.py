"""Learning curves: CSV files from runs' TensorBoard events, and figures from either (not
collected by pytest).

    python tests/tools/plot_curves.py --runs ../learn/runs --export tests/results/figures   # one CSV per run
    pip install matplotlib        # the figures only; the trainer does not need it
    python tests/tools/plot_curves.py --csv tests/results/figures/breakout-10M-seed*.csv \\
        --out tests/results/figures/breakout-10m.png --until 10000000
    python tests/tools/plot_curves.py --runs ../learn/runs --out curves.png    # from run folders
    python tests/tools/plot_curves.py --scores runs/breakout-10M-seed1/eval --export tests/results/figures

A curve is charts/avg_episodic_return (the mean of the last 100 finished games) against the
agent step, read from each run folder's events (TensorBoard's view: events after a resumed
checkpoint are purged) or from a CSV file this script exported. The CSV files hold one row per
25 iterations, the last iteration before each budget below, and the last one: step,
avg_return_last100, games (the games finished by then), training_seconds (the sum of the
iterations' rollout and update times so far: the run's compute time, without start-ups or the
time it was stopped), and the run's env_id and total_timesteps (its checkpoint's, else its
logged hyperparameters'; tests/tools/compare_runs.py takes the game and the plan from them); each
file is named after its run folder, which names the game and the seed (breakout-10M-seed1.csv;
a suffix after the seed, as in breakout-10M-seed1-unfinished-9.6M.csv, keeps the seed). The mean
over seeds takes one run per seed: pass one file per seed.

One panel per game: each curve, and the published points at the same budgets, each marked with
its source: CleanRL's ppo_atari.py docs figures (values read off the plotted curves) and SB3
rl-zoo's PPO monitor files (DLR-RM/rl-trained-agents, the mean of the last 100 training games,
one seed), both runs planned for 10M steps, as ours are; at 10M, the 3-seed means of CleanRL's
ppo_atari.py and of baselines ppo2 (shared/REFERENCES.md). Prints our values at each budget and,
with several seeds of a game, their mean and sample standard deviation (ddof 1).

Scored games: --scores takes a run's eval/ folder (one sub-folder per --eval-checkpoint call,
named after the id when it is not the training one: ALE-Breakout-v5-step...) and --export writes
its games to {run}-scores.csv (evaluation, game, score); --csv reads such a file back and prints
each evaluation's mean ± sample std (ddof 1) over its games.
"""
import argparse
import csv
import glob
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from events import Bad, run_settings, scalars  # noqa: E402

BUDGETS = [250_000, 500_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000, 10_000_000]
PUBLISHED = {  # game: {source: {steps: value}} (shared/REFERENCES.md)
    "Pong": {"CleanRL ppo_atari.py docs figure": {250_000: -20.5, 500_000: -19.5,
                                                  1_000_000: -8.9, 2_000_000: 12.7,
                                                  3_000_000: 17.1, 5_000_000: 19.5},
             "SB3 rl-zoo PPO, 1 seed": {250_000: -20.3, 500_000: -18.8, 1_000_000: -12.1,
                                        2_000_000: 14.8, 3_000_000: 20.3, 5_000_000: 20.8},
             "CleanRL ppo_atari.py, 3 seeds": {10_000_000: 20.36},
             "baselines ppo2, 3 seeds": {10_000_000: 20.51}},
    "Breakout": {"CleanRL ppo_atari.py docs figure": {250_000: 6.3, 500_000: 10.3,
                                                      1_000_000: 19.3, 2_000_000: 48.7,
                                                      3_000_000: 101.8, 5_000_000: 203.1},
                 "SB3 rl-zoo PPO, 1 seed": {250_000: 9.3, 500_000: 14.7, 1_000_000: 25.7,
                                            2_000_000: 58.3, 3_000_000: 113.8,
                                            5_000_000: 243.3},
                 "CleanRL ppo_atari.py, 3 seeds": {10_000_000: 414.66},
                 "baselines ppo2, 3 seeds": {10_000_000: 406.57}},
}
SPREAD = {"CleanRL ppo_atari.py, 3 seeds": {"Pong": 0.20, "Breakout": 28.09},  # the std over
          "baselines ppo2, 3 seeds": {"Pong": 0.50, "Breakout": 31.55}}  # 3 seeds, as published
RANDOM = {"Pong": -20.7, "Breakout": 1.7}  # Mnih et al. 2015
COLUMNS = ["step", "avg_return_last100", "games", "training_seconds"]
SETTINGS = ["env_id", "total_timesteps"]  # the run's, on every row (compare_runs.py reads them)
SCORE_COLUMNS = ["evaluation", "game", "score"]
EVERY = 25  # iterations per CSV row


def from_run(run: str) -> np.ndarray:
    """(rows, 4): step, mean of the last 100 games, games finished, and the seconds of training
    so far (the sum of each iteration's rollout and update time: no start-up, no time stopped),
    at every iteration."""
    logged = scalars(run, checked=True)
    avg = logged.get("charts/avg_episodic_return", [])
    ends = np.array([s for s, _ in logged.get("charts/episodic_return", [])])
    times = [(s, r + u) for (s, r), (_, u) in zip(logged.get("charts/rollout_time", []),
                                                 logged.get("charts/update_time", []))]
    steps, seconds = np.array([s for s, _ in times]), np.cumsum([t for _, t in times])
    return np.array([(s, v, int((ends <= s).sum()), seconds[steps <= s][-1] if (steps <= s).any()
                      else 0.0) for s, v in avg]).reshape(-1, 4)


def export(run: str, folder: str) -> str:
    rows = from_run(run)
    keep = {i for i in range(len(rows)) if i % EVERY == EVERY - 1 or i == len(rows) - 1}
    keep |= {int(np.searchsorted(rows[:, 0], b, side="right")) - 1 for b in BUDGETS
             if len(rows) and rows[-1, 0] >= b}  # the last iteration before each budget
    keep = sorted(keep)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{os.path.basename(run.rstrip('/'))}.csv")
    settings = run_settings(run)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(COLUMNS + SETTINGS)
        out.writerows([int(r[0]), f"{r[1]:.3f}", int(r[2]), f"{r[3]:.0f}",
                       *(settings.get(k, "") for k in SETTINGS)] for r in rows[keep])
    return path


def export_scores(eval_folder: str, folder: str) -> str:
    """One row per scored game of every evaluation in a run's eval/ folder, in game order."""
    rows = []
    for evaluation in sorted(glob.glob(os.path.join(eval_folder, "*"))):
        games = scalars(evaluation, checked=True).get("eval/episodic_return", [])
        rows += [(os.path.basename(evaluation), int(game), f"{score:.0f}")
                 for game, score in games]
    if not rows:
        sys.exit(f"{eval_folder}: no scored games (expected a run's eval/ folder)")
    run = os.path.basename(os.path.dirname(os.path.abspath(eval_folder)))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{run}-scores.csv")
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([SCORE_COLUMNS, *rows])
    return path


def read_csv(path: str):
    """A curve (rows of numbers) or, for a scores file, {evaluation: [score, ...]}."""
    with open(path) as f:
        rows = list(csv.reader(f))
    if rows[0] == SCORE_COLUMNS:
        games = {}
        for evaluation, _, score in rows[1:]:
            games.setdefault(evaluation, []).append(float(score))
        return games
    if rows[0][:2] != COLUMNS[:2]:
        sys.exit(f"{path}: not a curve or scores file (its header is {rows[0]}, expected "
                 f"{COLUMNS} or {SCORE_COLUMNS})")
    numeric = [c for c in rows[0] if c not in SETTINGS]  # the env id is a word
    return np.array([[float(x) for c, x in zip(rows[0], r) if c in numeric]
                     for r in rows[1:]]).reshape(-1, len(numeric))


def at(curve: np.ndarray, budget: int):
    """The value at the last iteration at or before `budget` steps (exported CSV files keep
    that row), if the curve gets that far: to the budget, or to the last whole iteration before
    it (a run planned for 10M steps ends at 9,999,360 with 1,024 steps an iteration; every step
    logged is a multiple of that batch)."""
    steps, values = curve[:, 0], curve[:, 1]
    before = steps <= budget
    batch = np.gcd.reduce(steps.astype(np.int64)) if len(steps) else 0
    return values[before][-1] if before.any() and steps.max() > budget - batch else None


def game_of(name: str) -> str:
    """The game of PUBLISHED a run's name starts with ("-": none; its curve has no panel)."""
    for game in PUBLISHED:
        if name.lower().startswith(game.lower()):
            return game
    return "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", help="a folder of run folders named {game}-...")
    parser.add_argument("--csv", nargs="*", default=[], help="curve files written by --export")
    parser.add_argument("--scores", help="a run's eval/ folder: its scored games (--export)")
    parser.add_argument("--export", help="write one CSV file per run folder into this folder")
    parser.add_argument("--out", help="the figure to write (PNG)")
    parser.add_argument("--until", type=int, default=2_000_000, help="the x-axis's end")
    a = parser.parse_args()
    curves = {}  # name: rows
    runs = sorted(glob.glob(os.path.join(a.runs, "*"))) if a.runs else []
    for run in runs:
        if a.export:
            print(f"wrote {export(run, a.export)}")
        curves[os.path.basename(run)] = from_run(run)
    if a.scores:
        if not a.export:
            sys.exit("--scores writes a CSV file: give --export FOLDER too")
        print(f"wrote {export_scores(a.scores, a.export)}")
    scored = {}  # evaluation: scores
    for path in [p for pattern in a.csv for p in sorted(glob.glob(pattern)) or [pattern]]:
        read = read_csv(path)  # (a quoted glob is expanded here)
        if isinstance(read, dict):
            scored.update(read)
        else:
            curves[os.path.basename(path)[:-len(".csv")]] = read
    curves = {k: v for k, v in curves.items() if len(v)}
    if scored:
        print("| evaluation | games | mean ± std |\n|---|---|---|")
        for evaluation, scores in scored.items():
            print(f"| {evaluation} | {len(scores)} | "
                  f"{np.mean(scores):.2f} ± {np.std(scores, ddof=1):.2f} |")
    budgets = [b for b in BUDGETS if b <= a.until]
    if curves:
        print("| game | run | last step | " + " | ".join(f"{b / 1e6:g}M" for b in budgets) +
              " |\n|---|---|---|" + "---|" * len(budgets))
    cells = {}
    for name, rows in curves.items():
        cells[name] = [at(rows, b) for b in budgets]
        print(f"| {game_of(name)} | {name} | {int(rows[-1, 0]):,} | " + " | ".join(
            "-" if c is None else f"{c:.1f}" for c in cells[name]) + " |")
    for game in PUBLISHED:  # several seeds of one plan: mean and std where all reached a budget
        names = [n for n in cells if game_of(n) == game]
        plan_of = {n: re.sub(r"seed\d+.*", "seed*", n) for n in names}  # seed1-unfinished-...: 1
        for plan in sorted(set(plan_of.values())):
            members = [n for n in names if plan_of[n] == plan]
            seeds = [m.group(1) for m in map(re.compile(r"seed(\d+)").search, members) if m]
            twice = sorted({s for s in seeds if seeds.count(s) > 1})
            if twice:
                print(f"| {game} | {plan}: no mean, seed {', '.join(twice)} has several runs "
                      f"({', '.join(members)}); pass one file per seed | |")
                continue
            group = [cells[n] for n in members]
            if len(group) > 1:
                columns = [[g[i] for g in group] for i in range(len(budgets))]
                means = [None if None in c else f"{np.mean(c):.1f} ± {np.std(c, ddof=1):.1f}"
                         for c in columns]
                print(f"| {game} | {plan}, mean ± std of {len(group)} | | " +
                      " | ".join(m or "-" for m in means) + " |")
    timed = {name: rows for name, rows in curves.items() if rows.shape[1] > 3 and rows[-1, 3]}
    if timed:  # steps/s overall, and the median over the stretches between rows (a stretch
        # the run spent stopped or beside heavier work moves the first, hardly the second)
        print("\n| run | last step | hours of training | steps/s | median steps/s |")
        print("|---|---|---|---|---|")
        for name, rows in timed.items():
            stretches = np.diff(rows[:, 0]) / np.maximum(np.diff(rows[:, 3]), 1e-9)
            median = f"{np.median(stretches):.0f}" if len(stretches) else "-"
            print(f"| {name} | {int(rows[-1, 0]):,} | {rows[-1, 3] / 3600:.2f} | "
                  f"{rows[-1, 0] / rows[-1, 3]:.0f} | {median} |")
    if a.out:
        plot(curves, a.out, a.until)


def plot(curves: dict, out: str, until: int):
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"error: --out {out} draws with matplotlib, which is not installed: "
                 f"pip install matplotlib (the tables above need nothing more)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    games = [g for g in PUBLISHED if any(game_of(n) == g for n in curves)]
    fig, axes = plt.subplots(1, len(games), figsize=(7 * len(games), 4.8), dpi=110,
                             squeeze=False)
    for ax, game in zip(axes[0], games):
        mine = {n: rows[rows[:, 0] <= until] for n, rows in curves.items() if game_of(n) == game}
        short = max((rows[-1, 0] for rows in mine.values()), default=until) > 4 * min(
            (rows[-1, 0] for rows in mine.values()), default=until)
        # an inset shows the first stretch, where the shorter runs would hide under the longer
        panels = [ax] + ([ax.inset_axes([0.06, 0.52, 0.36, 0.36], zorder=20)] if short else [])
        shortest = min(rows[-1, 0] for rows in mine.values())
        for panel, end in zip(panels, [until, shortest]):
            for i, (name, rows) in enumerate(mine.items()):
                rows = rows[rows[:, 0] <= end]
                panel.plot(rows[:, 0], rows[:, 1], lw=1.4, ls=("-", "--", "-.", ":")[i % 4],
                           zorder=2 + i, label=f"ppo_atari.py, {name}")
            markers = iter(("o", "s", "^", "v"))
            for source, points in PUBLISHED[game].items():
                shown = {s: v for s, v in points.items() if s <= end}
                spread = [SPREAD.get(source, {}).get(game, 0.0)] * len(shown)
                if shown:
                    panel.errorbar(list(shown), list(shown.values()), yerr=spread,
                                   fmt=next(markers), ms=5, capsize=3, zorder=9, label=source)
            panel.axhline(RANDOM[game], color="gray", linestyle=":",
                          label=f"random ({RANDOM[game]})")
            panel.set_xlim(0, end * 1.03)
            panel.grid(alpha=0.3)
        if short:
            panels[1].set_title(f"0 to {shortest / 1e6:.1f}M steps", fontsize=8)
            panels[1].tick_params(labelsize=7)
        ax.set_title(f"{game}NoFrameskip-v4, 0 to {until / 1e6:g}M agent steps (runs planned "
                     f"for 10M)\npublished 3-seed means with their std", fontsize=9)
        ax.set_xlabel("agent steps")
        ax.set_ylabel("average return of the last 100 games")
        ax.legend(fontsize=7, loc="lower right")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    try:
        main()
    except Bad as e:  # a corrupt events file or checkpoint: one line
        sys.exit(f"plot_curves.py: {e}")
