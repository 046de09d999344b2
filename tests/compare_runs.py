"""Is my fork better? Seeds and games of several groups of runs compared the way Agarwal et al.
(NeurIPS 2021, "Deep Reinforcement Learning at the Edge of the Statistical Precipice") ask (not
collected by pytest; numpy only, matplotlib for --plot).

    python tests/compare_runs.py baseline='runs/base-*' fork='runs/fork-*'
    python tests/compare_runs.py ours='tests/figures/breakout-10M-seed[123].csv' --at 2000000
    python tests/compare_runs.py baseline='runs/base-*' fork='runs/fork-*' --plot compare.png

Each NAME=PATHS names a group; PATHS is a glob (or several, comma-separated) of run folders
(their TensorBoard events, read as TensorBoard reads them: a resume purges the events a crash
left past its checkpoint) or of CSV files exported by tests/plot_curves.py. A run's score is
charts/avg_episodic_return (the mean of its last 100 games) at its last logged step, or at the
last step logged at or before --at STEP. Its game comes from its checkpoint (args.env_id), else
from its folder or file name (breakout-10M-seed1.csv: Breakout).

Per group: the runs and games found; the mean and the median over games of the per-game mean
score and the interquartile mean (IQM: the mean of the middle 50% of all runs x games, a score at
a quartile counting by the share of it inside), each with a 95% stratified-bootstrap interval
(runs resampled with replacement within each game, 2,000 times, seeded: the same command prints
the same figures). With two groups or more, the probability of improvement of each over the
first, P(X > Y) = the mean over games of the chance that a run of X beats a run of Y (ties
half), with its interval. Scores are human-normalized, (score - random) / (human - random), when
every game has a row in DeepMind's Atari-57 table (dqn_zoo's atari_data.py; the table Agarwal
et al. use); otherwise raw, which pools only over one game honestly. Last: a markdown table.
--plot OUT.png draws the IQM over steps with its interval per group and the performance profile
(the share of runs scoring above tau, averaged over games). Bad input: one line, exit 2.
"""
import argparse
import csv
import glob
import os
import re
import sys
from math import comb

import numpy as np

REPS, SEED = 2000, 0
# game: (random, human) scores, Atari-57, no-op starts: DeepMind dqn_zoo, dqn_zoo/atari_data.py
ATARI_57 = {
    "Alien": (227.8, 7127.7), "Amidar": (5.8, 1719.5), "Assault": (222.4, 742.0),
    "Asterix": (210.0, 8503.3), "Asteroids": (719.1, 47388.7), "Atlantis": (12850.0, 29028.1),
    "BankHeist": (14.2, 753.1), "BattleZone": (2360.0, 37187.5), "BeamRider": (363.9, 16926.5),
    "Berzerk": (123.7, 2630.4), "Bowling": (23.1, 160.7), "Boxing": (0.1, 12.1),
    "Breakout": (1.7, 30.5), "Centipede": (2090.9, 12017.0), "ChopperCommand": (811.0, 7387.8),
    "CrazyClimber": (10780.5, 35829.4), "Defender": (2874.5, 18688.9),
    "DemonAttack": (152.1, 1971.0), "DoubleDunk": (-18.6, -16.4), "Enduro": (0.0, 860.5),
    "FishingDerby": (-91.7, -38.7), "Freeway": (0.0, 29.6), "Frostbite": (65.2, 4334.7),
    "Gopher": (257.6, 2412.5), "Gravitar": (173.0, 3351.4), "Hero": (1027.0, 30826.4),
    "IceHockey": (-11.2, 0.9), "Jamesbond": (29.0, 302.8), "Kangaroo": (52.0, 3035.0),
    "Krull": (1598.0, 2665.5), "KungFuMaster": (258.5, 22736.3),
    "MontezumaRevenge": (0.0, 4753.3), "MsPacman": (307.3, 6951.6),
    "NameThisGame": (2292.3, 8049.0), "Phoenix": (761.4, 7242.6), "Pitfall": (-229.4, 6463.7),
    "Pong": (-20.7, 14.6), "PrivateEye": (24.9, 69571.3), "Qbert": (163.9, 13455.0),
    "Riverraid": (1338.5, 17118.0), "RoadRunner": (11.5, 7845.0), "Robotank": (2.2, 11.9),
    "Seaquest": (68.4, 42054.7), "Skiing": (-17098.1, -4336.9), "Solaris": (1236.3, 12326.7),
    "SpaceInvaders": (148.0, 1668.7), "StarGunner": (664.0, 10250.0), "Surround": (-10.0, 6.5),
    "Tennis": (-23.8, -8.3), "TimePilot": (3568.0, 5229.2), "Tutankham": (11.4, 167.6),
    "UpNDown": (533.4, 11693.2), "Venture": (0.0, 1187.5), "VideoPinball": (16256.9, 17667.9),
    "WizardOfWor": (563.5, 4756.5), "YarsRevenge": (3092.9, 54576.9), "Zaxxon": (32.5, 9173.3),
}
TABLE = "DeepMind's Atari-57 random and human scores (dqn_zoo atari_data.py)"
TAG = "charts/avg_episodic_return"


class Bad(Exception):
    """Bad input: main prints it in one line and exits 2."""


# ---- the statistics: each takes scores with a leading axis of bootstrap replicates -----------

def iqm(x):
    """Interquartile mean over the last axis: the mean of the middle 50% of the values, those at
    the 25th and 75th percentiles weighted by the share of them inside (n = 4k: the middle 2k)."""
    n = x.shape[-1]
    lo, hi = np.arange(n) / n, np.arange(1, n + 1) / n
    weights = np.clip(np.minimum(hi, 0.75) - np.maximum(lo, 0.25), 0, None) / 0.5
    return np.sort(x, axis=-1) @ weights


def aggregates(per_game):
    """{mean, median, iqm} of scores per game, each (reps, runs of that game)."""
    means = np.stack([g.mean(axis=-1) for g in per_game], axis=-1)
    return {"mean": means.mean(axis=-1), "median": np.median(means, axis=-1),
            "iqm": iqm(np.concatenate(per_game, axis=-1))}


def improvement(xs, ys):
    """P(X > Y): over games, the share of (x run, y run) pairs in which x scores higher, ties
    counting half; xs, ys: per game (reps, runs)."""
    per_game = [((x[..., :, None] > y[..., None, :]) + 0.5 * (x[..., :, None] == y[..., None, :])
                 ).mean(axis=(-2, -1)) for x, y in zip(xs, ys)]
    return np.mean(per_game, axis=0)


def resample(per_game, rng, reps=REPS):
    """Stratified bootstrap: each game's runs drawn with replacement, reps times, (reps, n) each."""
    return [g[rng.integers(0, len(g), size=(reps, len(g)))] for g in per_game]


def interval(draws):
    """The 95% percentile interval of bootstrap draws."""
    return tuple(np.percentile(draws, [2.5, 97.5]))


def profile(per_game, taus):
    """The performance profile: at each tau, the share of runs scoring above it, mean over games."""
    return np.mean([(g[..., :, None] > taus).mean(axis=-2) for g in per_game], axis=0)


# ---- reading runs -------------------------------------------------------------------------------

def game_of(text: str) -> str:
    """The game an env id or a run's folder or file name names: BreakoutNoFrameskip-v4,
    ALE/Breakout-v5, breakout-10M-seed1.csv: Breakout."""
    base = os.path.basename(text.replace("ALE/", "")).removeprefix("ALE-")
    word = re.split(r"NoFrameskip|Deterministic|-v\d|__|[-_.]", base)[0]
    return {g.lower(): g for g in ATARI_57}.get(word.lower(), word)


def read_run(path: str) -> dict:
    """{path, game, steps, values}: the run's curve of charts/avg_episodic_return."""
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or not {"step", "avg_return_last100"} <= set(rows[0]):
            raise Bad(f"{path} is not a curve exported by tests/plot_curves.py (columns step, "
                      f"avg_return_last100)")
        steps, values = ([float(r[k]) for r in rows] for k in ("step", "avg_return_last100"))
        game = game_of(path)
    else:
        if not glob.glob(os.path.join(path, "events.out.tfevents.*")):
            raise Bad(f"{path} holds no TensorBoard events: not a run folder of ppo_atari.py")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from conftest import scalars  # TensorBoard's own view: purged events left out
        logged = scalars(path)
        if not logged.get(TAG):
            last = max((s for tag in logged.values() for s, _ in tag), default=0)
            raise Bad(f"{path} finished no game by step {last:,}: it has no {TAG}")
        steps, values = zip(*logged[TAG])
        game = game_of(path)
        if os.path.isfile(checkpoint := os.path.join(path, "checkpoint.pt")):
            import torch
            saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
            game = game_of(saved.get("args", {}).get("env_id", path))
    return {"path": path, "game": game, "steps": np.array(steps), "values": np.array(values)}


def score_at(run: dict, at: int | None) -> tuple[int, float]:
    """(step, score): the run's last logged value, or the last at or before `at`."""
    keep = run["steps"] <= (np.inf if at is None else at)
    if not keep.any():
        raise Bad(f"{run['path']} finished no game by step {at:,} (its first score is at step "
                  f"{int(run['steps'][0]):,}); raise --at")
    i = np.flatnonzero(keep)[-1]
    return int(run["steps"][i]), float(run["values"][i])


def read_groups(specs: list[str]) -> dict:
    """{name: [run, ...]} from NAME=PATHS arguments."""
    groups = {}
    for spec in specs:
        name, sep, patterns = spec.partition("=")
        if not sep or not name or not patterns:
            raise Bad(f"{spec!r} is not NAME=PATHS (as in baseline='runs/base-*')")
        if name in groups:
            raise Bad(f"the group name {name} is given twice; name each group once")
        paths = sorted({p for pattern in patterns.split(",") for p in glob.glob(pattern)})
        if not paths:
            raise Bad(f"{name}={patterns}: no run folder or CSV file matches {patterns}")
        groups[name] = [read_run(p) for p in paths]
    return groups


# ---- the comparison ------------------------------------------------------------------------------

def per_game_scores(runs: list, at, normalize: bool) -> dict:
    """{game: array of the runs' scores}, human-normalized or raw."""
    out = {}
    for run in runs:
        score = score_at(run, at)[1]
        if normalize:
            random, human = ATARI_57[run["game"]]
            score = (score - random) / (human - random)
        out.setdefault(run["game"], []).append(score)
    return {game: np.array(scores) for game, scores in sorted(out.items())}


def compare(groups: dict, at=None) -> dict:
    """Every figure the report prints. "scales": the scores aggregated ("human-normalized" where
    the table has every game; "raw" for one game, or where it has not); per group: its runs,
    their steps and raw scores per game, and per scale the point estimates and intervals (None:
    one run a game); P(group > first) and its interval (the same on either scale)."""
    games = {name: sorted({r["game"] for r in runs}) for name, runs in groups.items()}
    first = next(iter(groups))
    for name in groups:
        if games[name] != games[first]:
            raise Bad(f"the groups cover different games: {first} {', '.join(games[first])}; "
                      f"{name} {', '.join(games[name])}; compare groups over the same games")
    normalize = all(g in ATARI_57 for g in games[first])
    scales = ["human-normalized"] * normalize + ["raw"] * (len(games[first]) == 1 or not normalize)
    out = {"scales": scales, "games": games[first], "groups": {}}
    rng = np.random.default_rng(SEED)
    for name, runs in groups.items():
        raw = per_game_scores(runs, at, False)
        single = all(len(g) == 1 for g in raw.values())
        entry = {"runs": runs, "per game": raw, "single": single, "steps": [score_at(r, at)[0]
                                                                     for r in runs]}
        for scale in scales:
            per_game = list(per_game_scores(runs, at, scale != "raw").values())
            entry[scale] = {k: float(v[0]) for k, v in aggregates([g[None] for g in per_game])
                            .items()}
            entry[scale + " ci"] = None if single else {
                k: interval(v) for k, v in aggregates(resample(per_game, rng)).items()}
            entry[scale + " scores"] = per_game
        if name != first:
            base, mine = list(out["groups"][first]["per game"].values()), list(raw.values())
            entry["p"] = float(improvement([g[None] for g in mine], [g[None] for g in base])[0])
            entry["p ci"] = None if single and out["groups"][first]["single"] else interval(
                improvement(resample(mine, rng), resample(base, rng)))
        out["groups"][name] = entry
    return out


def fmt(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def with_ci(value, ci) -> str:
    return fmt(value) + (f" [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "")


def report(result: dict, at) -> list[str]:
    """The lines the command prints."""
    names, scales = list(result["groups"]), result["scales"]
    where = f"at the last step logged at or before {at:,} (--at)" if at else "at each run's " \
        "last logged step"
    lines = [f"scores: charts/avg_episodic_return (the mean of the last 100 games) {where}"]
    if "human-normalized" in scales:
        lines.append(f"human-normalized: (score - random) / (human - random), {TABLE}")
    elif len(result["games"]) > 1:
        lines.append("raw scores of several games pooled (not all are in the Atari-57 table): "
                     "a game with larger scores weighs more")
    lines.append(f"intervals: 95% stratified bootstrap (runs resampled within each game), "
                 f"{REPS:,} resamples, seed {SEED}")
    for name, g in result["groups"].items():
        counts = ", ".join(f"{game} {len(s)} run{'s' * (len(s) > 1)}"
                           for game, s in g["per game"].items())
        lines.append(f"\n{name}: {len(g['runs'])} run{'s' * (len(g['runs']) > 1)} of "
                     f"{len(g['per game'])} game{'s' * (len(g['per game']) > 1)} ({counts})")
        for run, step in zip(g["runs"], g["steps"]):
            lines.append(f"  {run['path']}: {run['game']} {fmt(score_at(run, at)[1])} at step "
                         f"{step:,}")
        if len(set(g["steps"])) > 1:
            lines.append(f"  note: these runs' scores are from different steps "
                         f"({min(g['steps']):,} to {max(g['steps']):,}); --at STEP compares "
                         f"them at one budget")
        for game, s in g["per game"].items():
            if len(s) > 1:
                lines.append(f"  {game}: mean {fmt(s.mean())} ± {fmt(s.std())} (the standard "
                             f"deviation over runs, population: ddof 0)")
        for scale in scales:
            p, ci = g[scale], g[scale + " ci"] or {}
            lines.append(f"  {scale}: mean {with_ci(p['mean'], ci.get('mean'))}, median "
                         f"{with_ci(p['median'], ci.get('median'))}, IQM "
                         f"{with_ci(p['iqm'], ci.get('iqm'))}")
        fewest = min(len(s) for s in g["per game"].values())
        if g["single"]:
            lines.append("  one run per game: no interval can be drawn (a bootstrap of one run "
                         "is that run); these are single runs' scores, compared as they are")
        elif fewest < 5:
            lines.append(f"  {fewest} runs of a game: the interval resamples just these runs "
                         f"({comb(2 * fewest - 1, fewest)} distinct resamples); it shows their "
                         f"spread, tends to be too narrow, and cannot tell a small gain from "
                         f"seed noise: more seeds (or games) narrow it")
    for name in names[1:]:
        g = result["groups"][name]
        lines.append(f"\nP({name} > {names[0]}) = {with_ci(g['p'], g['p ci'])}: the chance that "
                     f"a {name} run beats a {names[0]} run of the same game, mean over games"
                     + ("" if g["p ci"] else " (one run a game in both: no interval)"))
    scale = scales[-1] if len(result["games"]) == 1 else scales[0]
    lines += ["", f"| group | runs | games | mean | median | IQM [95% CI] |" +
              f" P(> {names[0]}) [95% CI] |" * (len(names) > 1),
              "|---|---|---|---|---|---|" + "---|" * (len(names) > 1)]
    for name, g in result["groups"].items():
        p, ci = g[scale], g[scale + " ci"] or {}
        row = (f"| {name} | {len(g['runs'])} | {len(g['per game'])} | {fmt(p['mean'])} | "
               f"{fmt(p['median'])} | {with_ci(p['iqm'], ci.get('iqm'))} |")
        if len(names) > 1:
            row += " |" if name == names[0] else f" {with_ci(g['p'], g['p ci'])} |"
        lines.append(row)
    lines.append(f"({scale} scores)")
    return lines


def plot(groups: dict, result: dict, at, out: str):
    """IQM over steps with its interval band per group, and the performance profile."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise Bad("--plot needs matplotlib, which is not installed: pip install matplotlib")
    normalize, rng = result["scales"][0] != "raw", np.random.default_rng(SEED)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    everything = [r for runs in groups.values() for r in runs]
    start = max(r["steps"][0] for r in everything)
    end = min([r["steps"][-1] for r in everything] + ([at] if at else []))
    grid = np.linspace(start, end, 60)
    for name, runs in groups.items():
        curves = {}
        for run in runs:
            index = np.searchsorted(run["steps"], grid, side="right") - 1
            value = run["values"][index]
            if normalize:
                random, human = ATARI_57[run["game"]]
                value = (value - random) / (human - random)
            curves.setdefault(run["game"], []).append(value)
        per_game = [np.array(c).T for c in curves.values()]  # (steps, runs) each
        line = iqm(np.concatenate(per_game, axis=-1))
        (drawn,) = left.plot(grid, line, label=name)
        if not result["groups"][name]["single"]:
            draws = iqm(np.concatenate([g[:, rng.integers(0, g.shape[1], (500, g.shape[1]))]
                                        for g in per_game], axis=-1))  # (steps, 500)
            left.fill_between(grid, *np.percentile(draws, [2.5, 97.5], axis=1), alpha=0.25,
                              color=drawn.get_color())
    unit = "human-normalized score" if normalize else "score"
    left.set(xlabel="agent steps", ylabel=f"IQM of the {unit}", title=f"IQM over steps "
             f"({start:,.0f} to {end:,.0f}), 95% bootstrap band")
    left.legend()
    scores = {n: g[result["scales"][0] + " scores"] for n, g in result["groups"].items()}
    allscores = np.concatenate([s for per_game in scores.values() for s in per_game])
    margin = 0.05 * (allscores.max() - allscores.min() or 1.0)
    taus = np.linspace(allscores.min() - margin, allscores.max() + margin, 200)
    for name, per_game in scores.items():
        (drawn,) = right.plot(taus, profile(per_game, taus), label=name)
        if not result["groups"][name]["single"]:
            band = profile(resample(per_game, rng, 500), taus)
            right.fill_between(taus, *np.percentile(band, [2.5, 97.5], axis=0), alpha=0.25,
                               color=drawn.get_color())
    right.set(xlabel=f"{unit} tau", ylabel="share of runs scoring above tau",
              title="performance profile" + (f" at step {at:,}" if at else " (each run's last "
                                                                          "step)"))
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="+", metavar="NAME=PATHS")
    parser.add_argument("--at", type=int, help="compare at this step (each run's last logged "
                        "step at or before it)")
    parser.add_argument("--plot", metavar="OUT.png")
    args = parser.parse_args(argv)
    try:
        if args.at is not None and args.at <= 0:
            raise Bad(f"--at must be a positive step, got {args.at}")
        groups = read_groups(args.groups)
        result = compare(groups, args.at)
        print("\n".join(report(result, args.at)))
        if args.plot:
            plot(groups, result, args.at, args.plot)
    except Bad as e:
        print(f"compare_runs.py: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
