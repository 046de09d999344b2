"""tests/tools/compare_runs.py: its figures against rliable 1.2.0's on fixed scores, the exact test
against permutations counted by hand, the budget, the game and the weights it compares by, real
run folders (one crashed and resumed) and their CSV exports, and its answers to bad input."""
import contextlib
import glob
import importlib.util
import io
import itertools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ppo_atari as P
from conftest import Truncating, bound, need, run_in_process, scalars, stand_in_envs, TINY

TESTS = os.path.dirname(os.path.abspath(__file__))
FIGURES = os.path.join(TESTS, "results", "figures")
TOOLS = os.path.join(TESTS, "tools")
SEEDS = [os.path.join(FIGURES, f"breakout-10M-seed{s}.csv") for s in (1, 2, 3)]
spec = importlib.util.spec_from_file_location("compare_runs", os.path.join(TOOLS,
                                                                           "compare_runs.py"))
C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(C)

# rliable's reference figures (see test_every_figure_is_rliables_on_the_same_scores)
X = [[0.12, 1.40, 0.55, 2.10], [0.35, 0.95, 0.61, 3.40], [0.08, 1.75, 0.42, 1.20],
     [0.51, 1.10, 0.90, 2.75], [0.27, 2.30, 0.33, 0.60]]  # 5 runs x 4 games
Y = [[0.10, 1.20, 0.40, 1.90], [0.22, 0.70, 0.66, 2.20], [0.05, 1.30, 0.35, 0.90],
     [0.30, 0.85, 0.52, 1.60]]  # 4 runs x 4 games
Z = [[0.9, 0.2, 1.6, 0.45, 3.1], [1.3, 0.5, 0.8, 0.62, 2.4],
     [0.7, 0.35, 1.1, 0.30, 4.0]]  # 3 runs x 5 games
RLIABLE = {  # (scores, confidence): {aggregate: (point, lower, upper)}
    ("X", 0.95): {"mean": (1.0845, 0.8355, 1.3345), "median": (1.031, 0.789, 1.242),
                  "iqm": (0.824, 0.658, 1.112), "optimality gap": (0.3155, 0.2505, 0.381)},
    ("X", 0.9): {"mean": (1.0845, 0.8725, 1.2955), "median": (1.031, 0.821, 1.206),
                 "iqm": (0.824, 0.685, 1.068), "optimality gap": (0.3155, 0.2605, 0.3695)},
    ("Z", 0.95): {"mean": (1.2213, 1.0467, 1.4013), "median": (0.9667, 0.7, 1.1667),
                  "iqm": (0.8856, 0.7244, 1.0433), "optimality gap": (0.2787, 0.226, 0.3333)},
    ("Z", 0.9): {"mean": (1.2213, 1.0727, 1.3727), "median": (0.9667, 0.7667, 1.1667),
                 "iqm": (0.8856, 0.7467, 1.0167), "optimality gap": (0.2787, 0.234, 0.3233)},
}
RLIABLE_P = (0.675, 0.4875, 0.85)  # P(X > Y) and its 95% interval
GAMES = ["Alien", "Amidar", "Assault", "Asterix", "Asteroids"]


def tool(*args, cwd=TESTS):
    return subprocess.run([sys.executable, os.path.join(TOOLS, "compare_runs.py"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def tool_here(*args, code=0):
    """The command run in this process (torch and tensorboard already imported, which a process
    of its own spends seconds on): its stdout, or with code 2 its stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            C.main(list(args))
            exited = 0
        except SystemExit as e:
            exited = e.code
    assert exited == code, (args, exited, err.getvalue()[-2000:])
    return err.getvalue() if code else out.getvalue()


def write_run(path, rows, env_id="BreakoutNoFrameskip-v4", plan=10_000_000):
    """A CSV as tests/tools/plot_curves.py exports it: rows of (step, score)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("step,avg_return_last100,games,training_seconds,env_id,total_timesteps\n")
        f.writelines(f"{s},{v},{i},{i},{env_id},{plan}\n" for i, (s, v) in enumerate(rows))


def matrix_runs(folder, name, scores, games=GAMES):
    """One CSV per run and game, each run's score on its game at step 1,024: raw scores whose
    human-normalized values are the matrix's."""
    for run, row in enumerate(scores):
        for game, value in zip(games, row):
            random, human = C.ATARI_57[game]
            write_run(folder / name / f"{name}-{game}-{run}.csv",
                      [(1024, random + value * (human - random))], env_id=f"{game}NoFrameskip-v4",
                      plan=1024)
    return f"{name}={folder / name}/*.csv"


def figures(out_json) -> dict:
    with open(out_json) as f:
        return json.load(f)


def test_every_figure_is_rliables_on_the_same_scores(tmp_path):
    """The mean, median, IQM and optimality gap with their 95% and 90% intervals, and P(X > Y)
    with its interval, of the command at its defaults, against rliable 1.2.0 on the same scores
    (X, Y, Z above; rliable is not a dependency: the figures were printed once by

        from rliable import library as rly, metrics
        agg = lambda x: np.array([metrics.aggregate_mean(x), metrics.aggregate_median(x),
                                  metrics.aggregate_iqm(x), metrics.aggregate_optimality_gap(x)])
        rs = np.random.RandomState(0)
        rly.get_interval_estimates({"X": np.array(X)}, agg, reps=50000,
                                   confidence_interval_size=conf, random_state=rs)   # and Z
        rly.get_interval_estimates({"XY": [np.array(X), np.array(Y)]}, lambda x, y: np.array(
            [metrics.probability_of_improvement(x, y)]), reps=50000, random_state=rs)

    with rliable 1.2.0, arch 7.2.0, numpy 2.4.6, scipy 1.17.1). Points agree to rliable's 4
    decimals; interval ends within 3% of the interval's width (two bootstraps' own noise: 10,000
    and 50,000 resamples put them about 1% apart; a 25-75% interval, 20 resamples or a P interval
    that holds the baseline fixed each miss by more)."""
    for name, scores in (("X", X), ("Z", Z)):
        groups = [matrix_runs(tmp_path, name, scores)]
        if name == "X":
            groups.insert(0, matrix_runs(tmp_path, "Y", Y))
        for confidence in (0.95, 0.9):
            out = tool(*groups, "--confidence", str(confidence), "--json",
                       str(tmp_path / "f.json"))
            assert out.returncode == 0, out.stderr
            got = figures(tmp_path / "f.json")
            assert got["scale"] == "human-normalized" and got["reps"] == 10_000
            mine = got["groups"][name]
            for aggregate, (point, lower, upper) in RLIABLE[(name, confidence)].items():
                width = upper - lower
                assert mine["point"][aggregate] == pytest.approx(point, abs=6e-5), aggregate
                low, high = mine["interval"][aggregate]
                assert abs(low - lower) <= 0.03 * width and abs(high - upper) <= 0.03 * width, (
                    name, confidence, aggregate, (low, high), (lower, upper))
            if name == "X" and confidence == 0.95:
                point, lower, upper = RLIABLE_P
                p = got["against"]["X"]
                assert p["P"] == pytest.approx(point, abs=1e-9)
                assert abs(p["interval"][0] - lower) <= 0.03 * (upper - lower) and abs(
                    p["interval"][1] - upper) <= 0.03 * (upper - lower), p["interval"]


def test_three_runs_of_a_game_give_exactly_their_min_and_max_and_say_so(tmp_path):
    """A game's bootstrap of 3 runs draws all three the same run 1 time in 27, more than 2.5%:
    its 95% interval is [min, max], which holds the median of the scores' distribution 75% of
    the time; the IQM of 3 runs is their mean (trim_mean cuts floor(3 / 4) = 0)."""
    for seed, score in zip((1, 2, 3), (31.0, 12.5, 20.0)):
        write_run(tmp_path / f"breakout-s{seed}.csv", [(2048, score)])
    out = tool(f"three={tmp_path}/breakout-s*.csv", "--json", str(tmp_path / "f.json"))
    assert out.returncode == 0, out.stderr
    got = figures(tmp_path / "f.json")["groups"]["three"]
    for aggregate in ("mean", "median", "iqm"):
        assert got["interval"][aggregate] == [12.5, 31.0], (aggregate, got["interval"])
    assert got["point"]["iqm"] == pytest.approx(np.mean([31.0, 12.5, 20.0]))
    assert "3 runs of a game: a resample can only repeat these runs, so a game's interval is " \
           "[min, max] of its runs, which holds the median of its scores' distribution 75% of " \
           "the time, not 95%" in out.stdout, out.stdout
    spread = C.fmt(np.std([31.0, 12.5, 20.0], ddof=1))  # 9.31; ddof 0 gives 7.60
    assert f"Breakout: mean 21.2 ± {spread} (the sample standard deviation over 3 runs, ddof 1)" \
        in out.stdout, out.stdout


def brute_force_p(xs, ys) -> float:
    """Every relabelling within each game, counted: the share whose mean over games of U / (n m)
    is as far from 0.5 as the observed one or farther."""
    def statistic(pairs):
        return np.mean([np.mean([(a > b) + 0.5 * (a == b) for a in x for b in y])
                        for x, y in pairs])
    observed = abs(statistic(list(zip(xs, ys))) - 0.5)
    splits = []
    for x, y in zip(xs, ys):
        pooled = list(x) + list(y)
        splits.append([([pooled[i] for i in chosen],
                         [pooled[i] for i in range(len(pooled)) if i not in chosen])
                       for chosen in itertools.combinations(range(len(pooled)), len(x))])
    far = [abs(statistic(pairs) - 0.5) >= observed - 1e-12 for pairs in itertools.product(*splits)]
    return sum(far) / len(far)


def test_the_exact_p_value_against_permutations_counted_by_hand(tmp_path):
    """One game with ties, two games of unequal sizes (stratified), and the case a reviewer
    asks about: 3 runs that all beat 3 runs, p = 2 / 20 = 0.10 (two-sided), printed beside P."""
    cases = [([np.array([3.0, 5.0, 5.0])], [np.array([1.0, 5.0, 2.0, 3.0])]),
             ([np.array([4.0, 6.0, 9.0]), np.array([1.0, 1.0])],
              [np.array([2.0, 6.0, 3.0]), np.array([0.5, 1.0, 3.0])]),
             ([np.array([7.0, 8.0, 9.0])], [np.array([1.0, 2.0, 3.0])])]
    for xs, ys in cases:
        assert C.p_value(xs, ys) == pytest.approx(brute_force_p(xs, ys), abs=1e-12), (xs, ys)
    assert C.p_value(*cases[2]) == pytest.approx(0.1)
    for group, scores in (("base", (1.0, 2.0, 3.0)), ("fork", (7.0, 8.0, 9.0))):
        for seed, score in enumerate(scores):
            write_run(tmp_path / f"{group}-breakout-s{seed}.csv", [(2048, score)])
    out = tool(f"base={tmp_path}/base-*", f"fork={tmp_path}/fork-*")
    assert out.returncode == 0, out.stderr
    assert "P(fork > base) = 1.00 [1.00, 1.00]:" in out.stdout, out.stdout
    assert "exact permutation p = 0.10 (two-sided" in out.stdout, out.stdout
    assert "note: P(fork > base) has a zero-width interval" in out.stdout, out.stdout
    assert "0.5 is no difference" in out.stdout
    assert "seeds needed: " in out.stdout


def test_seeds_needed_grows_as_the_difference_shrinks(tmp_path):
    """Groups far apart need few runs; a small shift in the same spread needs more; no
    difference at all needs more than 20."""
    base = np.array([10.0, 14.0, 12.0, 9.0, 15.0])
    needed = [C.seeds_needed([base + shift], [base], np.random.default_rng(0))
              for shift in (20.0, 2.5, 0.0)]
    assert needed[0] is not None and needed[1] is not None, needed
    assert needed[0] < needed[1] and needed[2] is None, needed
    # p < 0.05 is out of reach at 3 runs a group (the smallest two-sided p is 0.10)
    assert needed[0] >= 4, needed


def test_unequal_runs_per_game_weigh_games_equally(tmp_path):
    """Identical per-game scores with swapped run counts (Pong 9 and Breakout 3 runs, against 3
    and 9) give identical aggregates: each run weighs 1 / (games x runs of its game). The
    weighted IQM by hand: Pong (0.2, 0.4, 0.6) x 3 each and Breakout (3, 5, 7): weights 1/6 per
    distinct value; the middle half holds 0.6 (1/6, from 1/4 to 1/3 partly: 1/12) ..."""
    pong, breakout = [-18.0, -11.0, -4.0], [10.0, 20.0, 30.0]
    for name, counts in (("a", (3, 1)), ("b", (1, 3))):
        for game, scores, times in (("pong", pong, counts[0]), ("breakout", breakout, counts[1])):
            env = "PongNoFrameskip-v4" if game == "pong" else "BreakoutNoFrameskip-v4"
            for i, score in enumerate(scores * times):
                write_run(tmp_path / name / f"{game}-{i}.csv", [(2048, score)], env_id=env)
    out = tool(f"a={tmp_path}/a/*", f"b={tmp_path}/b/*", "--json", str(tmp_path / "f.json"))
    assert out.returncode == 0, out.stderr
    got = figures(tmp_path / "f.json")["groups"]
    for aggregate in ("mean", "median", "iqm", "optimality gap"):
        assert got["a"]["point"][aggregate] == pytest.approx(got["b"]["point"][aggregate]), \
            aggregate
    normalized = [C.normalized("Pong", np.array(pong)), C.normalized("Breakout",
                                                                     np.array(breakout))]
    values = np.sort(np.concatenate(normalized))  # six values, 1/6 of the weight each
    assert got["a"]["point"]["iqm"] == pytest.approx(
        (values[1] / 12 + values[2] / 6 + values[3] / 6 + values[4] / 12) / 0.5)
    assert "unequal runs per game (rliable cannot represent this)" in out.stdout, out.stdout
    assert "| a | 12 | 3, 9 |" in out.stdout and "| b | 12 | 9, 3 |" in out.stdout, out.stdout
    assert "| Breakout | 3 | 20.0 | 20.0 | 9 | 20.0 | 20.0 | 0.50 | 1.00 |" in out.stdout, \
        out.stdout


def test_two_protocols_of_a_game_are_refused_together(tmp_path):
    write_run(tmp_path / "a" / "s1.csv", [(2048, 30.0)], env_id="BreakoutNoFrameskip-v4")
    write_run(tmp_path / "b" / "s1.csv", [(2048, 10.0)], env_id="ALE/Breakout-v5")
    out = tool(f"a={tmp_path}/a/*", f"b={tmp_path}/b/*")
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr
    assert "ran ALE/Breakout-v5" in err[0] and "ran BreakoutNoFrameskip-v4" in err[0] and \
        "two protocols of Breakout" in err[0] and "sticky actions" in err[0], err[0]


def test_one_budget_across_groups(tmp_path):
    """A finished 10M baseline against a fork still at 2M: both at 2M, said; --at 10M refuses
    the fork's run, naming its last step; --at 2e6 is read as 2,000,000; runs that all finished
    one plan are each taken at their last step, though their last steps differ."""
    curve = [(1024 * k, float(k)) for k in range(1, 9766)]  # to 10,000,384 > 10M - 1,024
    write_run(tmp_path / "base" / "s1.csv", curve[:9765])  # ends at 9,999,360
    write_run(tmp_path / "fork" / "s1.csv", curve[:1953])  # ends at 1,999,872
    out = tool(f"base={tmp_path}/base/*", f"fork={tmp_path}/fork/*")
    assert out.returncode == 0, out.stderr
    assert "at step 1,999,872, the largest step every run reached" in out.stdout, out.stdout
    assert "base/s1.csv: BreakoutNoFrameskip-v4 1953.0 at step 1,999,872" in out.stdout, out.stdout
    out = tool(f"base={tmp_path}/base/*", f"fork={tmp_path}/fork/*", "--at", "10000000")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "fork/s1.csv ended at step 1,999,872, more than one iteration (1,024 steps) before " \
           "--at 10,000,000" in out.stderr, out.stderr
    out = tool(f"base={tmp_path}/base/*", f"fork={tmp_path}/fork/*", "--at", "2e6")
    assert out.returncode == 0 and "at step 2,000,000 (--at)" in out.stdout, out.stderr
    # a fork of 2,048 steps an iteration finishes 10M at 9,998,336: both finished
    write_run(tmp_path / "fork" / "s1.csv", [(2048 * k, float(k)) for k in range(1, 4883)])
    out = tool(f"base={tmp_path}/base/*", f"fork={tmp_path}/fork/*")
    assert "at each run's last step: every run finished its plan of 10,000,000 steps" in \
        out.stdout, out.stdout
    assert "fork/s1.csv: BreakoutNoFrameskip-v4 4882.0 at step 9,998,336" in out.stdout


def test_the_game_from_readmes_run_names_or_said_with_game(tmp_path):
    """README's recipe names runs base-breakout-s1: Breakout, whatever word comes first (CSVs
    from before the env_id column); files named seed1.csv in a folder base/ name no game and are
    refused unless --game says it."""
    for group in ("base", "fork"):
        for seed, source in zip((1, 2, 3), SEEDS):
            rows = np.genfromtxt(source, delimiter=",", skip_header=1, usecols=(0, 1))
            with open(tmp_path / f"{group}-breakout-s{seed}.csv", "w") as f:
                f.write("step,avg_return_last100\n")
                f.writelines(f"{int(s)},{v + (group == 'fork')}\n" for s, v in rows)
            os.makedirs(tmp_path / group, exist_ok=True)
            shutil.copy(tmp_path / f"{group}-breakout-s{seed}.csv",
                        tmp_path / group / f"seed{seed}.csv")
    out = tool(f"baseline={tmp_path}/base-*", f"fork={tmp_path}/fork-*", "--at", "2e6")
    assert out.returncode == 0, out.stderr
    assert "base-breakout-s1.csv: Breakout (env id unknown; the game from the name)" in \
        out.stdout and "| Breakout |" in out.stdout, out.stdout
    assert "P(fork > baseline) = 0.67" in out.stdout, out.stdout  # +1 turns 6 of 9 pairs
    out = tool(f"baseline={tmp_path}/base/*", f"fork={tmp_path}/fork/*", "--at", "2e6")
    assert out.returncode == 2 and "base/seed1.csv: no env id" in out.stderr and \
        "--game NAME" in out.stderr, out.stderr
    out = tool(f"baseline={tmp_path}/base/*", f"fork={tmp_path}/fork/*", "--at", "2e6",
               "--game", "Breakout")
    assert out.returncode == 0 and "Breakout (env id unknown; the game from --game)" in \
        out.stdout, out.stderr


class Rich(Truncating):
    """The stand-in game paying 100 a step while RICH holds a True."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward + 100.0 * bool(RICH), terminated, truncated, info


RICH = []


def test_the_tool_reads_run_folders_a_crashed_and_resumed_one_and_their_exports(
        workdir, monkeypatch):
    """Four tiny runs in the stand-in game that ends every 5 steps (games finish), two groups.
    b-4 crashes at the start of iteration 4, after its 3rd iteration logged (and flushed) a mean
    above 100 with no checkpoint after iteration 2; resumed, that iteration's events are purged
    and logged anew. The tool prints each run's env id (its checkpoint's) and last mean of 100
    games, and at --at 192 b-4's resumed one, as TensorBoard shows them; the runs' CSV exports
    carry the env id and compare the same; without its checkpoint a folder's env id is its
    logged hyperparameters'."""
    need("main")
    monkeypatch.setattr(P, "make_envs", lambda args, seed, *a, **kw: stand_in_envs(
        Rich, args.num_envs))
    monkeypatch.setattr(P, "check_env_id", lambda env_id: None)
    real_rollout, real_log, calls = P.rollout, P.log_iteration, []

    def rollout(*a, **kw):  # b-4's launch: iteration 3 rich, a crash as iteration 4 starts
        calls.append(1)
        if len(calls) == 3:
            RICH.append(1)
        if len(calls) == 4:
            raise RuntimeError("simulated crash")
        return real_rollout(*a, **kw)

    def log_iteration(*a, **kw):  # each iteration's events on disk at once
        real_log(*a, **kw)
        bound(real_log, a, kw)["writer"].flush()

    monkeypatch.setattr(P, "log_iteration", log_iteration)
    small = dict(env_id="Truncating", num_envs=2, num_steps=32, num_minibatches=2,
                 update_epochs=1, cuda=False, total_timesteps=4 * 64)
    for group, seed in (("a", 1), ("a", 2), ("b", 3)):
        P.main(P.Args(**small, seed=seed, run_name=f"{group}-{seed}"))
    with monkeypatch.context() as crash:
        crash.setattr(P, "rollout", rollout)
        with pytest.raises(RuntimeError, match="simulated crash"):
            P.main(P.Args(**small, seed=4, run_name="b-4", checkpoint_interval=2))
    RICH.clear()
    P.main(P.Args(**small, seed=4, run_name="b-4"))
    crashed = [v for s, v in scalars("runs/b-4", raw=True)[C.TAG] if s == 192]
    assert len(crashed) == 2 and crashed[0] > 100 > crashed[1], crashed  # both on disk

    out = tool_here("a=runs/a-*", "b=runs/b-*")
    assert "every run finished its plan of 256 steps" in out, out
    lines = {}
    for run in ("a-1", "a-2", "b-3", "b-4"):
        last = scalars(f"runs/{run}")[C.TAG][-1]
        lines[run] = f"  runs/{run}: Truncating {C.fmt(last[1])} at step {last[0]:,}"
        assert lines[run] in out, (run, last, out)
    assert "P(b > a) = " in out and "| b | 2 | 2 |" in out, out
    at = tool_here("a=runs/a-*", "b=runs/b-*", "--at", "192")
    assert f"  runs/b-4: Truncating {C.fmt(crashed[1])} at step 192" in at, at
    curves = importlib.util.spec_from_file_location("plot_curves", os.path.join(
        TOOLS, "plot_curves.py"))
    plot_curves = importlib.util.module_from_spec(curves)
    curves.loader.exec_module(plot_curves)
    for run in sorted(glob.glob("runs/*")):  # as --runs runs --export csv does
        plot_curves.export(run, "csv")
    out = tool("a=csv/a-*", "b=csv/b-*", cwd=workdir)  # the command as a user runs it
    assert out.returncode == 0, out.stderr
    for run, line in lines.items():
        assert line.replace(f"runs/{run}", f"csv/{run}.csv") in out.stdout, (line, out.stdout)
    shutil.copytree("runs/a-1", "bare/a-1")  # no checkpoint: the logged hyperparameters
    os.remove("bare/a-1/checkpoint.pt")
    tool_here("a=bare/a-1", "--json", "bare.json")
    (run,) = json.load(open(workdir / "bare.json"))["groups"]["a"]["runs"]
    assert (run["env_id"], run["from"]) == ("Truncating", "logged hyperparameters"), run


def test_the_committed_breakout_seeds_at_2m_as_rliable_gives_them():
    """The three Breakout seeds at 2M: each seed's score is its CSV's last row at or before 2M,
    their IQM is rliable's (trim_mean of 3 cuts none: their mean, 52.2), and its 95% interval is
    [min, max]; the sample std (ddof 1) is printed; the same command prints the same figures."""
    out = tool(f"ours={os.path.join(FIGURES, 'breakout-10M-seed[123].csv')}", "--at", "2e6")
    assert out.returncode == 0, out.stderr
    scores = []
    for path in SEEDS:
        rows = np.genfromtxt(path, delimiter=",", skip_header=1, usecols=(0, 1))
        step, score = rows[rows[:, 0] <= 2_000_000][-1]
        scores.append(score)
        assert f"{path}: BreakoutNoFrameskip-v4 {C.fmt(score)} at step {int(step):,}" in \
            out.stdout, out.stdout
    row = [r for r in out.stdout.splitlines() if r.startswith("| ours |")][0]
    iqm = f"{C.fmt(np.mean(scores))} [{C.fmt(min(scores))}, {C.fmt(max(scores))}]"
    assert row.split(" | ")[5] == iqm and C.fmt(np.mean(scores)) == "52.2", (row, iqm)
    assert f"Breakout: mean {C.fmt(np.mean(scores))} ± {C.fmt(np.std(scores, ddof=1))}" in \
        out.stdout
    assert out.stdout == tool(*out.args[2:]).stdout, "the same command printed other figures"


def test_options_and_the_json_file_and_groups_independent_of_each_other(tmp_path):
    """--json holds every figure (points, intervals, p-values, per game, the IQM over steps, the
    profile); --seed and --reps change the resampling and are said; a group's interval is the
    same whichever other groups are compared and in whatever order."""
    for seed in (1, 2):  # b: two of the seeds under other names (a run is in one group)
        shutil.copy(SEEDS[seed - 1], tmp_path / f"b-breakout-{seed}.csv")
    a, b = f"a={','.join(SEEDS)}", f"b={tmp_path}/b-*.csv"
    out = tool(b, a, "--at", "2e6", "--json", str(tmp_path / "both.json"))
    assert out.returncode == 0, out.stderr
    got = figures(tmp_path / "both.json")
    assert set(got) >= {"budget line", "groups", "against", "curves", "profile", "games",
                        "scale", "reps", "seed", "confidence"}
    assert set(got["against"]["a"]) >= {"P", "interval", "p", "per game", "seeds needed"}
    assert got["profile"]["tau"][0] == 0.0 and len(got["curves"]["a"]["iqm"]) > 10
    assert got["groups"]["a"]["per game"]["Breakout"]["runs"] == 3
    alone = tool(a, "--at", "2e6", "--json", str(tmp_path / "alone.json"))
    assert alone.returncode == 0, alone.stderr
    assert figures(tmp_path / "alone.json")["groups"]["a"]["interval"] == \
        got["groups"]["a"]["interval"]
    seeded = tool(a, "--at", "2e6", "--seed", "5", "--reps", "500", "--json",
                  str(tmp_path / "seeded.json"))
    assert "500 resamples, seed 5" in seeded.stdout, seeded.stdout
    assert figures(tmp_path / "seeded.json")["reps"] == 500


def test_plot_draws_the_iqm_over_steps_and_the_performance_profile(tmp_path):
    """--plot writes the figure where matplotlib is installed; without it (hidden here by a
    module that fails to import), the report, then one line saying what --plot needs, exit 2."""
    args = [f"s1={SEEDS[0]}", f"s23={SEEDS[1]},{SEEDS[2]}", "--at", "2000000", "--plot"]
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "matplotlib.py").write_text("raise ImportError('hidden')\n")
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "compare_runs.py"), *args,
                          str(tmp_path / "none.png")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(tmp_path / "hidden")))
    assert out.returncode == 2 and "| s23 | 2 | 2 |" in out.stdout, out
    assert out.stderr.strip() == ("compare_runs.py: --plot needs matplotlib, which is not "
                                  "installed: pip install matplotlib"), out.stderr
    assert not (tmp_path / "none.png").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        out = tool(*args, str(tmp_path / "c.png"))
        assert out.returncode == 0 and (tmp_path / "c.png").stat().st_size > 10_000, out.stderr


def test_bad_input_is_one_line_naming_the_file_and_the_row_and_exit_2(workdir):
    (workdir / "empty").mkdir()
    header = "step,avg_return_last100,games,training_seconds,env_id,total_timesteps\n"
    good = "1024,5.0,1,1,BreakoutNoFrameskip-v4,2048\n"
    rows = {"blank": good + "2048,,2,2,BreakoutNoFrameskip-v4,2048\n",
            "text": good + "2048,lots,2,2,BreakoutNoFrameskip-v4,2048\n",
            "nan": good + "2048,nan,2,2,BreakoutNoFrameskip-v4,2048\n",
            "inf": good + "2048,inf,2,2,BreakoutNoFrameskip-v4,2048\n",
            "unsorted": "2048,5.0,1,1,BreakoutNoFrameskip-v4,2048\n" + good,
            "twice": good + good}
    for name, text in rows.items():
        (workdir / f"{name}.csv").write_text(header + text)
    (workdir / "pong.csv").write_text(header + good.replace("Breakout", "Pong"))
    out = run_in_process([*TINY, "--total-timesteps", "64", "--run-name", "short"], workdir)
    assert out.returncode == 0, out.stderr
    shutil.copytree(workdir / "runs" / "short", workdir / "broken-ckpt")
    (workdir / "broken-ckpt" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    shutil.copytree(workdir / "runs" / "short", workdir / "broken-events")
    (events,) = (workdir / "broken-events").glob("events.out.tfevents.*")
    data = bytearray(events.read_bytes())
    data[len(data) // 2] ^= 0xFF
    events.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    cases = [(["a=nothing-*"], "a=nothing-*: no run folder or CSV file matches nothing-*"),
             (["a=empty"], "empty holds no TensorBoard events"),
             (["a=runs/short"], "runs/short finished no game by step 64"),
             (["a=blank.csv"], "blank.csv, line 3: step '2048' and avg_return_last100 ''"),
             (["a=text.csv"], "text.csv, line 3: step '2048' and avg_return_last100 'lots'"),
             (["a=nan.csv"], "nan.csv, line 3: avg_return_last100 is nan at step 2,048"),
             (["a=inf.csv"], "inf.csv, line 3: avg_return_last100 is inf at step 2,048"),
             (["a=unsorted.csv"], "unsorted.csv, line 3: step 1,024 does not follow step 2,048"),
             (["a=twice.csv"], "twice.csv, line 3: step 1,024 does not follow step 1,024"),
             (["a=broken-ckpt"], "broken-ckpt/checkpoint.pt: cannot be read as a checkpoint"),
             (["a=broken-events"], "corrupt events file: record"),
             (["a=nan.csv,./nan.csv"], "nan.csv and ./nan.csv are the same run"),
             ([f"a={SEEDS[0]}", "b=pong.csv"], "the groups cover different games: a Breakout; "
              "b Pong"),
             (["runs/short"], "'runs/short' is not NAME=PATHS"),
             ([f"a={SEEDS[0]}", "--at", "100"], "finished no game by step 100")]
    for i, (args, message) in enumerate(cases):  # in this process but the first
        if i == 0:
            out = tool(*args, cwd=workdir)
            assert out.returncode == 2, out.stderr
            err = out.stderr.strip().splitlines()
        else:
            err = tool_here(*args, code=2).strip().splitlines()
        assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], (args, err)
    assert before == {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    for value in ("2.5", "x", "-1e6"):
        out = tool(f"a={SEEDS[0]}", "--at", value)
        assert out.returncode == 2 and "--at" in out.stderr and "Traceback" not in out.stderr
