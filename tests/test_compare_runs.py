"""tests/compare_runs.py: its statistics against values worked by hand, the tool on real run
folders (one crashed and resumed) and on the committed CSV files, and its answers to bad input."""
import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ppo_atari as P
from conftest import Truncating, bound, need, run_in_process, scalars, stand_in_envs, TINY

TESTS = os.path.dirname(os.path.abspath(__file__))
FIGURES = os.path.join(TESTS, "figures")
SEEDS = [os.path.join(FIGURES, f"breakout-10M-seed{s}.csv") for s in (1, 2, 3)]
spec = importlib.util.spec_from_file_location("compare_runs", os.path.join(TESTS,
                                                                           "compare_runs.py"))
C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(C)


def tool(*args, cwd=TESTS):
    return subprocess.run([sys.executable, os.path.join(TESTS, "compare_runs.py"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_iqm_of_4_5_and_8_values_worked_by_hand():
    # 4 values: the middle two; 8: the middle four (outliers at both ends left out)
    assert C.iqm(np.array([4.0, 1.0, 3.0, 2.0])) == pytest.approx(2.5)
    assert C.iqm(np.array([-100.0, 6, 1, 2, 1000, 3, 4, 5])) == pytest.approx(3.5)
    # 5 values, 20% each: the middle 50% (25% to 75%) holds 3/4 of the 2nd and of the 4th
    # value and all of the 3rd: (0.15 * 0 + 0.2 * 1 + 0.15 * 5) / 0.5 = 1.9
    assert C.iqm(np.array([100.0, 0, 5, 1, 0])) == pytest.approx(1.9)
    # a leading axis of bootstrap replicates: one IQM each
    np.testing.assert_allclose(C.iqm(np.array([[4.0, 1, 3, 2], [8, 2, 6, 4]])), [2.5, 5.0])


def test_a_bootstrap_interval_holds_its_point_estimate_and_narrows_with_more_runs():
    rng = np.random.default_rng(1)
    widths = []
    for runs in (3, 10, 40):
        per_game = [rng.normal(10, 2, runs), rng.normal(50, 5, runs)]  # two games
        point = {k: v[0] for k, v in C.aggregates([g[None] for g in per_game]).items()}
        draws = C.aggregates(C.resample(per_game, np.random.default_rng(0)))
        for name in ("mean", "median", "iqm"):
            lo, hi = C.interval(draws[name])
            assert lo <= point[name] <= hi, (runs, name, lo, point[name], hi)
        lo, hi = C.interval(draws["iqm"])
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2] > 0, widths
    # stratified: every resample keeps each game's own runs (no run moves to another game)
    drawn = C.resample([np.array([1.0, 2.0]), np.array([10.0, 20.0, 30.0])], rng, reps=50)
    assert drawn[0].shape == (50, 2) and set(drawn[0].ravel()) <= {1.0, 2.0}
    assert drawn[1].shape == (50, 3) and set(drawn[1].ravel()) <= {10.0, 20.0, 30.0}


def test_the_probability_of_improvement_by_hand():
    same = [np.array([[1.0, 5.0, 3.0]]), np.array([[10.0, 20.0]])]
    assert C.improvement(same, same)[0] == pytest.approx(0.5)  # identical groups
    better = [np.array([[6.0, 7.0]]), np.array([[30.0, 31.0]])]
    assert C.improvement(better, same)[0] == 1.0 and C.improvement(same, better)[0] == 0.0
    # one game: x = (1, 3) against y = (2, 2): 3 beats both 2s, 1 neither: 2 of 4 pairs
    assert C.improvement([np.array([[1.0, 3.0]])], [np.array([[2.0, 2.0]])])[0] == 0.5
    # a tie counts half: (2, 4) against (2,): 0.5 + 1, over 2 pairs
    assert C.improvement([np.array([[2.0, 4.0]])], [np.array([[2.0]])])[0] == 0.75
    # games weigh alike: 1.0 in one, 0.0 in the other
    assert C.improvement([np.array([[9.0]]), np.array([[0.0]])],
                         [np.array([[1.0]]), np.array([[5.0]])])[0] == 0.5


class Rich(Truncating):
    """The stand-in game paying 100 a step while RICH holds a True."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward + 100.0 * bool(RICH), terminated, truncated, info


RICH = []


def test_the_tool_reads_run_folders_a_crashed_and_resumed_one_as_tensorboard_does(
        workdir, monkeypatch):
    """Four tiny runs in the stand-in game that ends every 5 steps (games finish), two groups.
    b-4 crashes at the start of iteration 4, after its 3rd iteration logged (and flushed) a mean
    above 100 with no checkpoint after iteration 2; resumed, that iteration's events are purged
    and logged anew. The tool prints each run's last mean of 100 games, and at --at 192 b-4's
    resumed one, as TensorBoard shows them."""
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

    out = tool("a=runs/a-*", "b=runs/b-*", cwd=workdir)
    assert out.returncode == 0, out.stderr
    for run in ("a-1", "a-2", "b-3", "b-4"):
        last = scalars(f"runs/{run}")[C.TAG][-1]
        assert f"  runs/{run}: Truncating {C.fmt(last[1])} at step {last[0]:,}" in out.stdout, (
            run, last, out.stdout)
    assert "P(b > a) = " in out.stdout and "| b | 2 | 1 |" in out.stdout, out.stdout
    at = tool("a=runs/a-*", "b=runs/b-*", "--at", "192", cwd=workdir)
    assert f"  runs/b-4: Truncating {C.fmt(crashed[1])} at step 192" in at.stdout, at.stdout


def test_the_tool_on_the_committed_breakout_seeds():
    """The three Breakout seeds at 2M (human-normalized by the Atari-57 table: random 1.7,
    human 30.5): each seed's score is its CSV's last row at or before 2M, the IQM of three is
    (x1 / 6 + 2 x2 / 3 + x3 / 6) of the sorted scores, and 3 runs get an interval and the line
    on what they cannot tell; one run against one run gets no interval and says so."""
    out = tool(f"ours={os.path.join(FIGURES, 'breakout-10M-seed[123].csv')}", "--at", "2000000")
    assert out.returncode == 0, out.stderr
    scores = []
    for path in SEEDS:
        rows = np.loadtxt(path, delimiter=",", skiprows=1)
        step, score = rows[rows[:, 0] <= 2_000_000][-1, :2]
        scores.append(score)
        assert f"{path}: Breakout {C.fmt(score)} at step {int(step):,}" in out.stdout, out.stdout
    a, b, c = sorted(scores)
    by_hand = a / 6 + 2 * b / 3 + c / 6
    normalized = (by_hand - 1.7) / (30.5 - 1.7)
    assert f"IQM {C.fmt(by_hand)} [" in out.stdout and f"IQM {C.fmt(normalized)} [" in \
        out.stdout, out.stdout
    assert "3 runs of a game: the interval resamples just these runs" in out.stdout
    assert f"Breakout: mean {C.fmt(np.mean(scores))} ± {C.fmt(np.std(scores))}" in out.stdout
    assert out.stdout == tool(*out.args[2:]).stdout, "the same command printed other figures"
    single = tool(f"one={SEEDS[0]}", f"two={SEEDS[1]}", "--at", "2000000")
    assert single.returncode == 0, single.stderr
    assert "one run per game: no interval can be drawn" in single.stdout
    p = 1.0 if scores[1] > scores[0] else 0.0
    assert f"P(two > one) = {C.fmt(p)}: " in single.stdout, single.stdout
    assert "(one run a game in both: no interval)" in single.stdout


def test_plot_draws_the_iqm_over_steps_and_the_performance_profile(tmp_path):
    """--plot writes the figure where matplotlib is installed; without it (hidden here by a
    module that fails to import), the report, then one line saying what --plot needs, exit 2."""
    args = [f"s1={SEEDS[0]}", f"s23={SEEDS[1]},{SEEDS[2]}", "--at", "2000000", "--plot"]
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "matplotlib.py").write_text("raise ImportError('hidden')\n")
    out = subprocess.run([sys.executable, os.path.join(TESTS, "compare_runs.py"), *args,
                          str(tmp_path / "none.png")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(tmp_path / "hidden")))
    assert out.returncode == 2 and "| s23 | 2 | 1 |" in out.stdout, out
    assert out.stderr.strip() == ("compare_runs.py: --plot needs matplotlib, which is not "
                                  "installed: pip install matplotlib"), out.stderr
    assert not (tmp_path / "none.png").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        out = tool(*args, str(tmp_path / "c.png"))
        assert out.returncode == 0 and (tmp_path / "c.png").stat().st_size > 10_000, out.stderr


def test_bad_input_is_one_line_and_exit_2(workdir):
    (workdir / "empty").mkdir()
    shutil.copy(SEEDS[0], workdir / "pong-seed1.csv")
    out = run_in_process([*TINY, "--total-timesteps", "64", "--run-name", "short"], workdir)
    assert out.returncode == 0, out.stderr
    cases = [(["a=nothing-*"], "a=nothing-*: no run folder or CSV file matches nothing-*"),
             (["a=empty"], "empty holds no TensorBoard events"),
             (["a=runs/short"], "runs/short finished no game by step 64"),
             ([f"a={SEEDS[0]}", "b=pong-seed1.csv"], "the groups cover different games: a "
              "Breakout; b Pong"),
             (["runs/short"], "'runs/short' is not NAME=PATHS"),
             ([f"a={SEEDS[0]}", "--at", "100"], "finished no game by step 100")]
    for args, message in cases:
        out = tool(*args, cwd=workdir)
        err = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(err) == 1 and message in err[0], (args, out.stderr)
