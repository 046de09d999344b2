"""tests/tools/plot_curves.py, the script behind README's learning-curve tables: the value at a budget
is the last row at or before it, the mean over seeds takes one run per seed."""
import os
import subprocess
import sys

import numpy as np

PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "plot_curves.py")


def write_curve(path, rows):
    with open(path, "w") as f:
        f.write("step,avg_return_last100,games,training_seconds\n")
        f.writelines(f"{s},{v:.3f},{g},{t}\n" for s, v, g, t in rows)


def table(*paths, flags=()):
    out = subprocess.run([sys.executable, PLOT, *flags, "--csv", *map(str, paths)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_budget_value_is_the_last_row_at_or_before_it_and_seeds_are_averaged(tmp_path):
    finals = {1: 40.0, 2: 65.0, 3: 37.0}
    for seed, final in finals.items():
        write_curve(tmp_path / f"breakout-10M-seed{seed}.csv",
                    [(249_856, 5.0 + seed, 900, 500), (256_000, 99.0, 910, 510),
                     (499_712, 12.0, 1800, 1000), (999_424, 20.0 + seed, 3000, 2000),
                     (1_999_872, final, 5000, 4000), (2_000_896, 99.0, 5001, 4002)])
    out = table(*sorted(tmp_path.glob("*.csv")))
    assert "| Breakout | breakout-10M-seed2 | 2,000,896 | 7.0 | 12.0 | 22.0 | 65.0 |" in out
    mean = f"{np.mean(list(finals.values())):.1f} ± {np.std(list(finals.values()), ddof=1):.1f}"
    assert f"mean ± std of 3 | | 7.0 ± 1.0 | 12.0 ± 0.0 | 22.0 ± 1.0 | {mean} |" in out


def test_a_seed_with_two_runs_gives_no_mean(tmp_path):
    rows = [(999_424, 20.0, 3000, 2000), (2_000_896, 50.0, 5000, 4000)]
    for name in ("breakout-10M-seed1", "breakout-10M-seed1-unfinished-9.6M", "breakout-10M-seed2"):
        write_curve(tmp_path / f"{name}.csv", rows)
    out = table(*sorted(tmp_path.glob("*.csv")))
    assert "mean ± std" not in out
    assert "no mean, seed 1 has several runs" in out
    out = table(tmp_path / "breakout-10M-seed1-unfinished-9.6M.csv",
                tmp_path / "breakout-10M-seed2.csv")
    assert "breakout-10M-seed*, mean ± std of 2" in out


def test_a_run_planned_for_a_budget_reaches_it_at_its_last_whole_iteration(tmp_path):
    """10M steps at 1,024 a batch end at 9,999,360: that row is the 10M value; a run that stopped
    one iteration earlier has none."""
    rows = [(25_600 * i, float(i), 100 * i, 10 * i) for i in range(1, 390)]
    write_curve(tmp_path / "breakout-10M-seed1.csv", rows + [(9_999_360, 453.9, 7426, 26345)])
    write_curve(tmp_path / "breakout-10M-seed2.csv", rows + [(9_998_336, 450.0, 7425, 26344)])
    out = table(*sorted(tmp_path.glob("*.csv")), flags=["--until", "10000000"])
    ends = {line.split(" | ")[1]: line.split(" | ")[-1] for line in out.splitlines()
            if line.startswith("| Breakout | breakout-10M-seed") and "mean" not in line}
    assert ends == {"breakout-10M-seed1": "453.9 |", "breakout-10M-seed2": "- |"}, out


def test_scored_games_are_exported_from_the_eval_events_and_averaged(tmp_path):
    """A run's eval/ folder, as --eval-checkpoint writes it (real event files), to the scores
    file and back: each evaluation's mean and std over its games."""
    from torch.utils.tensorboard import SummaryWriter

    games = {"step2048-seed1-1": [10, 30, 20], "ALE-Breakout-v5-step2048-seed1-2": [5, 7]}
    for evaluation, scores in games.items():
        writer = SummaryWriter(tmp_path / "breakout-run" / "eval" / evaluation)
        for game, score in enumerate(scores, 1):
            writer.add_scalar("eval/episodic_return", score, game)
        writer.add_scalar("eval/mean_episodic_return", np.mean(scores), 2048)
        writer.close()
    out = subprocess.run([sys.executable, PLOT, "--scores", str(tmp_path / "breakout-run" / "eval"),
                          "--export", str(tmp_path / "figures")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = tmp_path / "figures" / "breakout-run-scores.csv"
    assert path.read_text().splitlines()[:3] == [
        "evaluation,game,score", "ALE-Breakout-v5-step2048-seed1-2,1,5",
        "ALE-Breakout-v5-step2048-seed1-2,2,7"]
    out = table(path)
    assert "| step2048-seed1-1 | 3 | 20.00 ± 10.00 |" in out, out
    assert "| ALE-Breakout-v5-step2048-seed1-2 | 2 | 6.00 ± 1.41 |" in out, out


def test_a_figure_without_matplotlib_is_one_line_not_a_traceback(tmp_path):
    """Without matplotlib: the table is printed, then one line says what --out needs; exit 1."""
    write_curve(tmp_path / "breakout-10M-seed1.csv", [(999_424, 20.0, 3000, 2000)])
    (tmp_path / "nomatplotlib").mkdir()
    (tmp_path / "nomatplotlib" / "matplotlib.py").write_text("raise ImportError('hidden')\n")
    hidden = dict(os.environ, PYTHONPATH=str(tmp_path / "nomatplotlib"))
    out = subprocess.run([sys.executable, PLOT, "--csv", str(tmp_path / "breakout-10M-seed1.csv"),
                          "--out", str(tmp_path / "f.png")], capture_output=True, text=True,
                         timeout=120, env=hidden)
    assert out.returncode == 1 and "| breakout-10M-seed1 |" in out.stdout, out
    assert out.stderr.strip().splitlines() == [
        f"error: --out {tmp_path / 'f.png'} draws with matplotlib, which is not installed: "
        "pip install matplotlib (the tables above need nothing more)"], out.stderr
