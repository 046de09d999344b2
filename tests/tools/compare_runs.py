"""Is my fork better? Groups of runs compared as Agarwal et al. (NeurIPS 2021, "Deep
Reinforcement Learning at the Edge of the Statistical Precipice") ask, with their figures computed
as their library rliable computes them (not collected by pytest; numpy only, matplotlib for
--plot, tensorboard and torch to read run folders).

    python tests/tools/compare_runs.py baseline='runs/base-*' fork='runs/fork-*'
    python tests/tools/compare_runs.py ours='tests/results/figures/breakout-10M-seed[123].csv' --at 2000000
    python tests/tools/compare_runs.py baseline='runs/base-*' fork='runs/fork-*' --plot compare.png \\
        --json compare.json

Each NAME=PATHS names a group; PATHS is a glob (or several, comma-separated) of run folders
(their TensorBoard events, read as TensorBoard reads them: a resume purges the events a crash
left past its checkpoint) or of CSV files exported by tests/tools/plot_curves.py. A run's score is
charts/avg_episodic_return (the mean of its last 100 games) at the last step logged at or before
the budget.

The budget is one step for every run of every group: --at STEP (a run that ended more than one
iteration before it is refused), else the largest step every run reached, else, when every run
finished the same plan, each run's last step. The game is the run's env id (its checkpoint, else
its logged hyperparameters, else the CSV's env_id column), else an Atari-57 game named by a word
of its file or folder name, else --game; a run with no game is refused. Two env ids of one game
(NoFrameskip-v4 and v5 with sticky actions) are two protocols and are refused together.

Per group: the mean and the median over games of the per-game mean, the interquartile mean (IQM)
and the optimality gap (1 - the mean of min(score, 1), human-normalized scores), each with a
stratified-bootstrap percentile interval (runs drawn with replacement within each game; one
seeded generator per group). Games weigh equally: with equal runs per game these are rliable's
figures (IQM: scipy.stats.trim_mean(x, 0.25) over all runs x games); with unequal runs per game
(which rliable cannot represent) each run weighs 1 / (games x runs of its game) and the IQM keeps
the middle half of that weight. With two groups or more, for each against the first: the
probability of improvement P(X > Y) (the mean over games of the share of run pairs X wins, ties
half) with its interval (both groups resampled), an exact permutation p-value (Mann-Whitney with
ties, labels permuted within each game), and the seeds per group at which a difference of the
size observed gives p < 0.05 in 80% of experiments drawn from these runs. Scores are
human-normalized, (score - random) / (human - random), when every game has a row in DeepMind's
Atari-57 table (dqn_zoo atari_data.py, the table Agarwal et al. use); otherwise raw. Then a
per-game table and a markdown table; --json PATH writes every figure, --plot OUT.png the IQM over
steps and the performance profile. Bad input: one line naming what is wrong, exit 2.
"""
import argparse
import csv
import glob
import json
import math
import os
import re
import sys
import zlib

import numpy as np

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
AGGREGATES = ["mean", "median", "iqm", "optimality gap"]
POWER_RUNS, POWER_SIMS = 20, 200  # "how many seeds would tell": up to 20 runs, 200 experiments
CURVE_POINTS, CURVE_REPS = 60, 1000  # the IQM over steps: points and resamples of its band


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from events import Bad, run_settings, scalars  # noqa: E402  (the one events reader)


# ---- the statistics: scores per game, each (..., runs of that game); leading axes: resamples ---

def equal_counts(per_game) -> bool:
    return len({g.shape[-1] for g in per_game}) == 1


def iqm(per_game):
    """The interquartile mean. Equal runs per game: rliable's, scipy.stats.trim_mean(x, 0.25)
    over all runs x games (floor(n / 4) values cut at each end). Unequal: each run weighs
    1 / (games x runs of its game) and the middle half of the weight is kept (the values at the
    25% and 75% marks counting by the share of their weight inside)."""
    x = np.concatenate(per_game, axis=-1)
    n = x.shape[-1]
    if equal_counts(per_game):
        cut = n // 4
        return np.sort(x, axis=-1)[..., cut:n - cut].mean(axis=-1)
    weight = np.concatenate([np.full(g.shape[-1], 1 / (len(per_game) * g.shape[-1]))
                             for g in per_game])
    order = np.argsort(x, axis=-1)
    w = weight[order]
    above = np.cumsum(w, axis=-1)
    kept = np.clip(np.minimum(above, 0.75) - np.maximum(above - w, 0.25), 0, None)
    return (np.take_along_axis(x, order, axis=-1) * kept).sum(axis=-1) / 0.5


def aggregates(per_game, bounds=None) -> dict:
    """{mean, median, iqm} and, given each game's (random, human) scores, the optimality gap of
    the human-normalized scores: games weigh equally in each."""
    means = np.stack([g.mean(axis=-1) for g in per_game], axis=-1)
    out = {"mean": means.mean(axis=-1), "median": np.median(means, axis=-1),
           "iqm": iqm(per_game)}
    if bounds is not None:
        below_one = np.stack([np.minimum((g - random) / (human - random), 1.0).mean(axis=-1)
                              for g, (random, human) in zip(per_game, bounds)], axis=-1)
        out["optimality gap"] = 1.0 - below_one.mean(axis=-1)
    return out


def improvement(xs, ys):
    """P(X > Y): over games, the share of (x run, y run) pairs in which x scores higher, ties
    counting half (Mann-Whitney's U / (n m)); xs, ys: per game (..., runs)."""
    per_game = [((x[..., :, None] > y[..., None, :]) + 0.5 * (x[..., :, None] == y[..., None, :])
                 ).mean(axis=(-2, -1)) for x, y in zip(xs, ys)]
    return np.mean(per_game, axis=0)


def resample(per_game, rng, reps):
    """Stratified bootstrap: each game's runs drawn with replacement, (reps, runs) each."""
    return [g[rng.integers(0, g.shape[-1], size=(reps, g.shape[-1]))] for g in per_game]


def interval(draws, confidence):
    """The percentile interval of bootstrap draws (as arch's conf_int(method="percentile"))."""
    tail = 100 * (1 - confidence) / 2
    lower, upper = np.percentile(draws, [tail, 100 - tail], axis=0)
    return lower, upper


def profile(per_game, taus):
    """The performance profile: at each tau, the share of runs scoring above it, mean over games
    (rliable's score distribution when every game has as many runs)."""
    return np.mean([(g[..., :, None] > taus).mean(axis=-2) for g in per_game], axis=0)


def group_rng(seed: int, *names: str):
    """A generator of a group's own (or a pair's): the figures of a group never depend on which
    other groups are compared, nor on their order."""
    return np.random.default_rng([seed, *(zlib.crc32(n.encode()) for n in names)])


# ---- the exact permutation test ------------------------------------------------------------------

def midranks(values):
    """Ranks 1..N, ties sharing the mean of their ranks."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    return (np.cumsum(counts) - (counts - 1) / 2)[inverse]


def null_of_u(x, y):
    """Under the permutation null (every split of the pooled runs into len(x) and len(y) alike
    likely), the distribution of 2U, U = Mann-Whitney's statistic for x with ties counting half:
    an array of probabilities indexed by 2U = 0 .. 2 len(x) len(y), and the observed 2U."""
    n, pooled = len(x), np.concatenate([x, y])
    doubled = np.rint(2 * midranks(pooled)).astype(int)  # twice a midrank: an integer
    ways = np.zeros((n + 1, doubled.sum() + 1))
    ways[0, 0] = 1.0
    for r in doubled:  # ways[k, s]: the subsets of k runs whose doubled ranks sum to s
        ways[1:, r:] = ways[1:, r:] + ways[:-1, :-r]
    shift = n * (n + 1)  # 2U = 2 (rank sum) - n (n + 1)
    null = ways[n, shift:shift + 2 * n * len(y) + 1]
    return null / null.sum(), int(doubled[:n].sum()) - shift


def normal_p(xs, ys) -> float:
    """The two-sided p-value of the stratified statistic by its normal approximation (used only
    in the power simulation, above 8 runs a group)."""
    mean_p, variance = [], 0.0
    for x, y in zip(xs, ys):
        n, m = len(x), len(y)
        _, ties = np.unique(np.concatenate([x, y]), return_counts=True)
        big = n + m
        var_u = n * m / 12 * ((big + 1) - (ties ** 3 - ties).sum() / (big * (big - 1)))
        variance += var_u / (n * m) ** 2
        mean_p.append(improvement([x], [y]))
    z = abs(np.mean(mean_p) - 0.5) / (math.sqrt(variance) / len(xs) or math.inf)
    return math.erfc(z / math.sqrt(2))


def p_value(xs, ys) -> float:
    """The exact two-sided permutation p-value of P(X > Y) - 0.5: the labels X, Y permuted within
    each game (a stratified test; one game: the exact Mann-Whitney test with ties); the share of
    permutations whose statistic, the mean over games of U / (n m), lies at least as far from
    0.5 as the observed one."""
    scale = math.lcm(*(2 * len(x) * len(y) for x, y in zip(xs, ys)))  # a common integer grid
    total, observed = np.ones(1), 0
    for x, y in zip(xs, ys):
        null, seen = null_of_u(x, y)
        step = scale // (2 * len(x) * len(y))
        spread = np.zeros(len(null) * step - step + 1)
        spread[::step] = null
        total, observed = np.convolve(total, spread), observed + seen * step
    centre = len(xs) * scale / 2
    far = np.abs(np.arange(len(total)) - centre) >= abs(observed - centre) - 1e-9
    return float(min(1.0, total[far].sum()))


def seeds_needed(xs, ys, rng, alpha=0.05, power=0.8):
    """The runs per group at which experiments drawn from these runs (each game's runs of each
    group resampled with replacement) give p < alpha in `power` of POWER_SIMS experiments; None
    above POWER_RUNS. Exact p-values up to 8 runs, the normal approximation above."""
    for n in range(2, POWER_RUNS + 1):
        hits = 0
        for _ in range(POWER_SIMS):
            x = [g[rng.integers(0, len(g), n)] for g in xs]
            y = [g[rng.integers(0, len(g), n)] for g in ys]
            hits += (p_value(x, y) if n <= 8 else normal_p(x, y)) < alpha
        if hits >= power * POWER_SIMS:
            return n
    return None


# ---- reading runs -------------------------------------------------------------------------------

def games_named(text: str) -> list[str]:
    """The Atari-57 games a name or an env id names in any of its words: BreakoutNoFrameskip-v4,
    ALE/Breakout-v5, base-breakout-s1.csv: Breakout."""
    lower = {g.lower(): g for g in ATARI_57}
    found = []
    for word in re.split(r"[^A-Za-z0-9]+", text):
        word = re.sub(r"(noframeskip|deterministic)$", "", word.lower())
        if word in lower and lower[word] not in found:
            found.append(lower[word])
    return found


def protocol(env_id: str) -> str:
    """How an env id's game is played, in words, for the refusal of two protocols of a game."""
    if re.search(r"-v5$", env_id):
        return "v5: sticky actions 0.25, full action set"
    if "NoFrameskip-v4" in env_id:
        return "NoFrameskip-v4: no sticky actions"
    return env_id


def read_folder(path: str) -> dict:
    """A run folder: its curve (TensorBoard's view), its env id and its plan."""
    logged, settings = scalars(path, checked=True), run_settings(path)
    if not logged.get(TAG):
        last = max((s for tag in logged.values() for s, _ in tag), default=0)
        raise Bad(f"{path} finished no game by step {last:,}: it has no {TAG}")
    steps, values = zip(*logged[TAG])
    return {"path": path, "steps": np.array(steps), "values": np.array(values),
            "env_id": settings.get("env_id"), "from": settings["from"],
            "planned": number(settings.get("total_timesteps"))}


def number(text):
    try:
        return int(float(text))
    except (TypeError, ValueError):
        return None


def read_csv(path: str) -> dict:
    """A curve exported by tests/tools/plot_curves.py, every row checked."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as e:
        raise Bad(f"{path}: cannot be read ({e})")
    if not rows or rows[0][:2] != ["step", "avg_return_last100"]:
        raise Bad(f"{path} is not a curve exported by tests/tools/plot_curves.py (its first line "
                  f"should start step,avg_return_last100)")
    header, steps, values, env_ids, plans = rows[0], [], [], set(), set()
    for line, row in enumerate(rows[1:], start=2):
        cells = dict(zip(header, row))
        if len(row) != len(header):
            raise Bad(f"{path}, line {line}: {len(row)} values for {len(header)} columns")
        try:
            step, value = float(cells["step"]), float(cells["avg_return_last100"])
        except ValueError:
            raise Bad(f"{path}, line {line}: step {cells['step']!r} and avg_return_last100 "
                      f"{cells['avg_return_last100']!r} must both be numbers")
        if not (math.isfinite(step) and step == int(step) and step >= 0):
            raise Bad(f"{path}, line {line}: the step {cells['step']!r} is not a whole number "
                      f"of agent steps")
        if not math.isfinite(value):
            raise Bad(f"{path}, line {line}: avg_return_last100 is {cells['avg_return_last100']}"
                      f" at step {int(step):,}; a score must be a finite number")
        if steps and step <= steps[-1]:
            raise Bad(f"{path}, line {line}: step {int(step):,} does not follow step "
                      f"{steps[-1]:,} (steps must increase, each once)")
        steps.append(int(step))
        values.append(value)
        env_ids.add(cells.get("env_id", "").strip())
        plans.add(cells.get("total_timesteps", "").strip())
    if not steps:
        raise Bad(f"{path} holds no rows after its header: no curve to compare")
    if len(env_ids) > 1:
        raise Bad(f"{path}: its env_id column names {len(env_ids)} env ids "
                  f"({', '.join(sorted(env_ids))}); one file holds one run")
    env_id = env_ids.pop() or None
    return {"path": path, "steps": np.array(steps), "values": np.array(values),
            "env_id": env_id, "from": "env_id column" if env_id else None,
            "planned": number(plans.pop()) if len(plans) == 1 else None}


def identify(run: dict, game: str | None):
    """The run's game: its env id's, else an Atari-57 game a word of its name names, else
    --game; one line otherwise."""
    if run["env_id"]:
        run["game"] = (games_named(run["env_id"]) or [run["env_id"]])[0]
        return
    name = os.path.normpath(run["path"])
    for part in [os.path.basename(name), os.path.basename(os.path.dirname(name))]:
        named = games_named(re.sub(r"\.csv$", "", part))
        if len(named) > 1:
            raise Bad(f"{run['path']}: its name names {' and '.join(named)}; say the game with "
                      f"--game NAME")
        if named:
            run["game"], run["from"] = named[0], "the name"
            return
    if game:
        run["game"], run["from"] = (games_named(game) or [game])[0], "--game"
        return
    raise Bad(f"{run['path']}: no env id (no checkpoint, logged hyperparameters or env_id "
              f"column) and no Atari-57 game in its name; say it with --game NAME (as in "
              f"--game Breakout)")


def read_groups(specs: list[str], game=None) -> dict:
    """{name: [run, ...]} from NAME=PATHS arguments; each file or folder once in all groups."""
    groups, seen = {}, {}
    for spec in specs:
        name, sep, patterns = spec.partition("=")
        if not sep or not name or not patterns:
            raise Bad(f"{spec!r} is not NAME=PATHS (as in baseline='runs/base-*')")
        if name in groups:
            raise Bad(f"the group name {name} is given twice; name each group once")
        paths = sorted({p for pattern in patterns.split(",") for p in glob.glob(pattern)})
        if not paths:
            raise Bad(f"{name}={patterns}: no run folder or CSV file matches {patterns}")
        for path in paths:
            real = os.path.realpath(path)
            if real in seen:
                raise Bad(f"{path} and {seen[real]} are the same run (given twice); give each "
                          f"run once")
            seen[real] = path
        groups[name] = [read_csv(p) if p.endswith(".csv") else read_folder(p) for p in paths]
        for run in groups[name]:
            identify(run, game)
            run["batch"] = int(np.gcd.reduce(run["steps"])) or 1  # steps are whole iterations
    games = {name: sorted({r["game"] for r in runs}) for name, runs in groups.items()}
    first = next(iter(groups))
    for name in groups:
        if games[name] != games[first]:
            raise Bad(f"the groups cover different games: {first} {', '.join(games[first])}; "
                      f"{name} {', '.join(games[name])}; compare groups over the same games")
    ids = {}
    for run in [r for runs in groups.values() for r in runs if r["env_id"]]:
        ids.setdefault(run["game"], {}).setdefault(run["env_id"], run["path"])
    for game_name, found in ids.items():
        if len(found) > 1:
            (a, pa), (b, pb) = sorted(found.items())[:2]
            raise Bad(f"{pa} ran {a} and {pb} ran {b}: two protocols of {game_name} "
                      f"({protocol(a)}; {protocol(b)}) that score differently; compare runs of "
                      f"one env id")
    return groups


# ---- one budget ----------------------------------------------------------------------------------

def choose_budget(groups: dict, at) -> tuple:
    """(the step every run is scored at or before, or None for each run's last; the line that
    says so)."""
    runs = [r for rs in groups.values() for r in rs]
    last = {r["path"]: int(r["steps"][-1]) for r in runs}
    if at is not None:
        for r in runs:
            if last[r["path"]] < at - r["batch"]:
                raise Bad(f"{r['path']} ended at step {last[r['path']]:,}, more than one "
                          f"iteration ({r['batch']:,} steps) before --at {at:,}; compare at a "
                          f"step every run reached (at most {min(last.values()):,}), or let it "
                          f"run further")
        return at, f"at step {at:,} (--at): each run's last score at or before it"
    plans = {r["planned"] for r in runs}
    done = all(r["planned"] and last[r["path"]] > r["planned"] - r["batch"] for r in runs)
    if done and len(plans) == 1:
        return None, (f"at each run's last step: every run finished its plan of "
                      f"{plans.pop():,} steps")
    common = min(last.values())
    spread = "" if len(set(last.values())) == 1 else (
        f"; the runs end at steps {min(last.values()):,} to {max(last.values()):,}, so "
        f"the longer ones are cut there (--at STEP chooses another)")
    return common, (f"at step {common:,}, the largest step every run reached: each run's last "
                    f"score at or before it{spread}")


def score_at(run: dict, at) -> tuple[int, float]:
    """(step, score): the run's last logged value at or before `at` (None: its last)."""
    keep = run["steps"] <= (np.inf if at is None else at)
    if not keep.any():
        raise Bad(f"{run['path']} finished no game by step {at:,} (its first score is at step "
                  f"{int(run['steps'][0]):,}); compare at a later step")
    i = np.flatnonzero(keep)[-1]
    return int(run["steps"][i]), float(run["values"][i])


def normalized(game: str, score):
    random, human = ATARI_57[game]
    return (score - random) / (human - random)


# ---- the comparison ------------------------------------------------------------------------------

def summary(per_game, bounds, rng, reps, confidence) -> dict:
    """Points and intervals of the aggregates (no interval with one run a game)."""
    points = {k: float(v) for k, v in aggregates(per_game, bounds).items()}
    if all(len(g) == 1 for g in per_game):
        return {"point": points, "interval": None}
    draws = aggregates(resample(per_game, rng, reps), bounds)
    return {"point": points, "interval": {k: interval(v, confidence) for k, v in draws.items()}}


def compare(groups: dict, at, reps=10_000, seed=0, confidence=0.95, power=True) -> dict:
    """Every figure the report prints, as the --json file holds it."""
    games = {name: sorted({r["game"] for r in runs}) for name, runs in groups.items()}
    first = next(iter(groups))
    in_table = all(g in ATARI_57 for g in games[first])
    normalize = in_table and len(games[first]) > 1  # one game: its own scores, the gap beside
    scale = "human-normalized" if normalize else "raw"
    bounds = None if not in_table else [(0.0, 1.0) if normalize else ATARI_57[g]
                                        for g in games[first]]
    out = {"games": games[first], "scale": scale, "budget": at, "reps": reps, "seed": seed,
           "confidence": confidence, "groups": {}, "against": {}}
    per_game = {}
    for name, runs in groups.items():
        scored = [(r, *score_at(r, at)) for r in runs]
        raw = {g: np.array([s for r, _, s in scored if r["game"] == g]) for g in games[first]}
        per_game[name] = [normalized(g, raw[g]) if normalize else raw[g] for g in games[first]]
        entry = {
            "runs": [{"path": r["path"], "env_id": r["env_id"], "game": r["game"],
                      "from": r["from"], "step": step, "score": score} for r, step, score in
                     scored],
            "per game": {g: {"runs": len(raw[g]), "scores": raw[g].tolist(),
                             "mean": float(raw[g].mean()),
                             "std": float(raw[g].std(ddof=1)) if len(raw[g]) > 1 else None,
                             "iqm": float(iqm([raw[g]]))} for g in games[first]},
            "equal runs per game": equal_counts(per_game[name]),
            **summary(per_game[name], bounds, group_rng(seed, name), reps, confidence)}
        out["groups"][name] = entry
    for name in list(groups)[1:]:
        xs, ys = per_game[name], per_game[first]
        rng = group_rng(seed, name, first)
        single = all(len(g) == 1 for g in xs + ys)
        draws = None if single else improvement(resample(xs, rng, reps), resample(ys, rng, reps))
        many = all(len(g) > 1 for g in xs + ys)
        out["against"][name] = {
            "P": float(improvement(xs, ys)), "interval": None if single else interval(
                draws, confidence), "p": p_value(xs, ys),
            "per game": {g: {"P": float(improvement([x], [y])), "p": p_value([x], [y])}
                         for g, x, y in zip(games[first], xs, ys)},
            "seeds needed": seeds_needed(xs, ys, rng) if power and many else None,
            "power estimated": bool(power and many)}
    out["curves"] = curves(groups, out, at)
    out["profile"] = profiles(per_game, out)
    return out


def curves(groups: dict, out: dict, at) -> dict:
    """The IQM over steps per group, with its interval band ({steps, iqm, lower, upper})."""
    everything = [r for runs in groups.values() for r in runs]
    start = max(r["steps"][0] for r in everything)
    end = min([r["steps"][-1] for r in everything] + ([at] if at else []))
    grid = np.unique(np.linspace(start, max(start, end), CURVE_POINTS).astype(int))
    result = {}
    for name, runs in groups.items():
        per_game = []
        for game in out["games"]:
            values = [r["values"][np.searchsorted(r["steps"], grid, side="right") - 1]
                      for r in runs if r["game"] == game]
            values = np.array(values).T  # (steps, runs)
            per_game.append(normalized(game, values) if out["scale"] != "raw" else values)
        line = {"steps": grid.tolist(), "iqm": iqm(per_game).tolist(), "lower": None,
                "upper": None}
        if not all(g.shape[1] == 1 for g in per_game):
            rng = group_rng(out["seed"], name, "curve")
            drawn = [g[:, rng.integers(0, g.shape[1], (CURVE_REPS, g.shape[1]))]
                     for g in per_game]  # (steps, resamples, runs) each
            line["lower"], line["upper"] = (list(v) for v in interval(
                np.moveaxis(iqm(drawn), 1, 0), out["confidence"]))
        result[name] = line
    return result


def profiles(per_game: dict, out: dict) -> dict:
    """The performance profile per group on a grid of tau from 0 (or below, for scores below
    0) to the highest score, with its interval band."""
    everything = np.concatenate([g for games in per_game.values() for g in games])
    top = everything.max() * 1.05 if everything.max() > 0 else 1.0
    taus = np.linspace(min(0.0, everything.min()), top, 101)
    result = {"tau": taus.tolist()}
    for name, games in per_game.items():
        line = {"share": profile(games, taus).tolist(), "lower": None, "upper": None}
        if not all(len(g) == 1 for g in games):
            band = profile(resample(games, group_rng(out["seed"], name, "profile"),
                                    CURVE_REPS), taus)
            line["lower"], line["upper"] = (list(v) for v in interval(band, out["confidence"]))
        result[name] = line
    return result


# ---- the report ----------------------------------------------------------------------------------

def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def with_ci(value, ci) -> str:
    return fmt(value) + (f" [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "")


def p_text(p: float) -> str:
    return f"{p:.3f}" if p < 0.01 else f"{p:.2f}"


def report(result: dict, budget_line: str) -> list[str]:
    """The lines the command prints."""
    names, scale = list(result["groups"]), result["scale"]
    level = f"{100 * result['confidence']:g}%"
    lines = [f"scores: {TAG} (the mean of the last 100 games), {budget_line}"]
    if scale == "human-normalized":
        lines.append(f"human-normalized: (score - random) / (human - random), {TABLE}")
    elif all(g in ATARI_57 for g in result["games"]):
        lines.append(f"raw scores of one game; the optimality gap of its human-normalized "
                     f"scores, (score - random) / (human - random), {TABLE}")
    elif len(result["games"]) > 1:
        lines.append("raw scores of several games pooled (not all are in the Atari-57 table): "
                     "a game with larger scores weighs more")
    equal = all(g["equal runs per game"] for g in result["groups"].values())
    lines.append("games weigh equally: " + (
        "the same runs per game, so these are rliable's figures (IQM: scipy.stats.trim_mean("
        "x, 0.25) over all runs x games)" if equal else
        "unequal runs per game (rliable cannot represent this): in every aggregate each game "
        "weighs alike; in the IQM each run weighs 1 / (games x runs of its game), the middle "
        "half of that weight kept"))
    lines.append(f"intervals: {level} stratified-bootstrap percentile intervals (runs resampled "
                 f"within each game), {result['reps']:,} resamples, seed {result['seed']}, one "
                 f"generator per group")
    flagged = []
    for name, g in result["groups"].items():
        counts = ", ".join(f"{game} {s['runs']}" for game, s in g["per game"].items())
        lines.append(f"\n{name}: {len(g['runs'])} run{'s' * (len(g['runs']) > 1)} of "
                     f"{len(g['per game'])} game{'s' * (len(g['per game']) > 1)} (runs per "
                     f"game: {counts})")
        for run in g["runs"]:
            env = run["env_id"] or f"{run['game']} (env id unknown; the game from {run['from']})"
            lines.append(f"  {run['path']}: {env} {fmt(run['score'])} at step {run['step']:,}")
        for game, s in g["per game"].items():
            if s["runs"] > 1:
                lines.append(f"  {game}: mean {fmt(s['mean'])} ± {fmt(s['std'])} (the sample "
                             f"standard deviation over {s['runs']} runs, ddof 1)")
        ci = g["interval"] or {}
        shown = [k for k in AGGREGATES if k in g["point"]]
        lines.append(f"  {scale}: " + ", ".join(f"{k} {with_ci(g['point'][k], ci.get(k))}"
                                                for k in shown))
        fewest = min(s["runs"] for s in g["per game"].values())
        if g["interval"] is None:
            lines.append("  one run per game: no interval can be drawn (a bootstrap of one run "
                         "is that run); these are single runs' scores, compared as they are")
        elif fewest <= 3:
            lines.append(f"  {fewest} runs of a game: a resample can only repeat these runs, so "
                         f"a game's interval is [min, max] of its runs, which holds the median "
                         f"of its scores' distribution {1 - 2 * 0.5 ** fewest:.0%} of the time, "
                         f"not {level}: read it as these runs' spread")
        for k in shown[:3]:  # a gap of 0 [0, 0]: every run above human, a fact
            if ci.get(k) and ci[k][0] == ci[k][1]:
                flagged.append(f"{name}'s {k}")
    for name in names[1:]:
        a = result["against"][name]
        lines.append(f"\nP({name} > {names[0]}) = {with_ci(a['P'], a['interval'])}: the chance "
                     f"that a {name} run beats a {names[0]} run of the same game, mean over "
                     f"games; 0.5 is no difference" + (
                         "" if a["interval"] else " (one run a game in both: no interval)"))
        lines.append(f"  exact permutation p = {p_text(a['p'])} (two-sided; Mann-Whitney with "
                     f"ties, labels permuted within each game): the chance of a P at least this "
                     f"far from 0.5 if {name} and {names[0]} did not differ")
        if a["interval"] and a["interval"][0] == a["interval"][1]:
            flagged.append(f"P({name} > {names[0]})")
        if not a["power estimated"]:
            lines.append("  seeds needed: not estimated (a game has one run in a group: no "
                         "spread to draw from)")
        elif a["seeds needed"] is None:
            lines.append(f"  seeds needed: more than {POWER_RUNS} runs per group for a "
                         f"difference of this size to give p < 0.05 in 80% of experiments")
        else:
            lines.append(f"  seeds needed: {a['seeds needed']} runs per group give p < 0.05 in "
                         f"80% of {POWER_SIMS} experiments drawn from these runs (a difference "
                         f"of this size; few runs understate the spread, so take it as a "
                         f"lower bound)")
    for what in flagged:
        lines.append(f"note: {what} has a zero-width interval: every resample gives the same "
                     f"value, which says the runs agree or are few, not that it is certain")
    if len(names) > 1:
        lines += ["", "per game (raw scores): runs, mean and IQM per group; P and p against "
                  f"{names[0]}", "| game | " + " | ".join(
                      f"{n} runs | {n} mean | {n} IQM" for n in names) + " | " + " | ".join(
                      f"P({n} > {names[0]}) | p" for n in names[1:]) + " |",
                  "|---|" + "---|---|---|" * len(names) + "---|---|" * (len(names) - 1)]
        for game in result["games"]:
            cells = [f"{s['runs']} | {fmt(s['mean'])} | {fmt(s['iqm'])}" for s in
                     (result["groups"][n]["per game"][game] for n in names)]
            cells += [f"{fmt(a['P'])} | {p_text(a['p'])}" for a in
                      (result["against"][n]["per game"][game] for n in names[1:])]
            lines.append(f"| {game} | " + " | ".join(cells) + " |")
    gap = "optimality gap" in next(iter(result["groups"].values()))["point"]
    lines += ["", f"| group | runs | runs per game | mean [{level} CI] | median [{level} CI] | "
                  f"IQM [{level} CI] |" + f" optimality gap [{level} CI] |" * gap +
              f" P(> {names[0]}) [{level} CI] | p |" * (len(names) > 1),
              "|---|---|---|---|---|---|" + "---|" * gap + "---|---|" * (len(names) > 1)]
    for name, g in result["groups"].items():
        ci = g["interval"] or {}
        per = ", ".join(f"{s['runs']}" for s in g["per game"].values())
        row = f"| {name} | {len(g['runs'])} | {per} | " + " | ".join(
            with_ci(g["point"][k], ci.get(k)) for k in AGGREGATES[:3 + gap]) + " |"
        if len(names) > 1:
            a = result["against"].get(name)
            row += " | |" if a is None else f" {with_ci(a['P'], a['interval'])} | {p_text(a['p'])} |"
        lines.append(row)
    lines.append(f"({scale} scores; runs per game in the order {', '.join(result['games'])})")
    return lines


def plot(result: dict, out: str):
    """The IQM over steps with its band per group, and the performance profile."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise Bad("--plot needs matplotlib, which is not installed: pip install matplotlib")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    unit = "human-normalized score" if result["scale"] != "raw" else "score"
    fewest = min(s["runs"] for g in result["groups"].values() for s in g["per game"].values())
    for name, line in result["curves"].items():
        label = f"{name} ({len(result['groups'][name]['runs'])} runs)"
        (drawn,) = left.plot(line["steps"], line["iqm"], label=label)
        if line["lower"]:
            left.fill_between(line["steps"], line["lower"], line["upper"], alpha=0.25,
                              color=drawn.get_color())
        band = result["profile"][name]
        (drawn,) = right.plot(result["profile"]["tau"], band["share"], label=label)
        if band["lower"]:
            right.fill_between(result["profile"]["tau"], band["lower"], band["upper"],
                               alpha=0.25, color=drawn.get_color())
    level = f"{100 * result['confidence']:g}%"
    note = f"\n{fewest} runs a game: bands span their min to max" if fewest <= 3 else ""
    left.set(xlabel="agent steps", ylabel=f"IQM of the {unit}",
             title=f"IQM over steps, {level} bootstrap band{note}")
    right.set(xlabel=f"{unit} tau", ylabel="share of runs scoring above tau",
              title=("performance profile at step " + f"{result['budget']:,}" if result["budget"]
                     else "performance profile at each run's last step") + note)
    right.set_xlim(left=result["profile"]["tau"][0])
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def step_count(text: str) -> int:
    """--at: a whole number of steps, in any notation Python reads (2000000, 2e6, 2_000_000)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of steps (as in 2000000 or "
                                         f"2e6)")
    if not math.isfinite(value) or value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of steps")
    return int(value)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="+", metavar="NAME=PATHS")
    parser.add_argument("--at", type=step_count, help="compare every run at this step (its "
                        "last score at or before it), as in 2e6")
    parser.add_argument("--game", help="the game of runs with no env id and no game in their "
                        "name (Breakout, or an env id)")
    parser.add_argument("--reps", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    parser.add_argument("--confidence", type=float, default=0.95, help="the intervals' level")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--plot", metavar="OUT.png")
    args = parser.parse_args(argv)
    try:
        if args.reps < 100:
            raise Bad(f"--reps {args.reps}: a percentile interval needs at least 100 resamples "
                      f"(rliable uses 50,000)")
        if not 0 < args.confidence < 1:
            raise Bad(f"--confidence {args.confidence} is not between 0 and 1 (as in 0.95)")
        groups = read_groups(args.groups, args.game)
        at, budget_line = choose_budget(groups, args.at)
        result = compare(groups, at, args.reps, args.seed, args.confidence)
        print("\n".join(report(result, budget_line)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"budget line": budget_line, **result}, f, indent=1)
            print(f"wrote {args.json}")
        if args.plot:
            plot(result, args.plot)
    except Bad as e:
        print(f"compare_runs.py: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
