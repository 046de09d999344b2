"""tests/plot_curves.py, the script behind README's learning-curve tables: the value at a budget
is the last row at or before it, the mean over seeds takes one run per seed."""
import os
import subprocess
import sys

import numpy as np

PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plot_curves.py")


def write_curve(path, rows):
    with open(path, "w") as f:
        f.write("step,avg_return_last100,games,training_seconds\n")
        f.writelines(f"{s},{v:.3f},{g},{t}\n" for s, v, g, t in rows)


def table(*paths):
    out = subprocess.run([sys.executable, PLOT, "--csv", *map(str, paths)],
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
    mean = f"{np.mean(list(finals.values())):.1f} ± {np.std(list(finals.values())):.1f}"
    assert f"mean ± std of 3 | | 7.0 ± 0.8 | 12.0 ± 0.0 | 22.0 ± 0.8 | {mean} |" in out


def test_a_seed_with_two_runs_gives_no_mean(tmp_path):
    rows = [(999_424, 20.0, 3000, 2000), (2_000_896, 50.0, 5000, 4000)]
    for name in ("breakout-10M-seed1", "breakout-10M-seed1-lost", "breakout-10M-seed2"):
        write_curve(tmp_path / f"{name}.csv", rows)
    out = table(*sorted(tmp_path.glob("*.csv")))
    assert "mean ± std" not in out
    assert "no mean, seed 1 has several runs" in out
    out = table(tmp_path / "breakout-10M-seed1-lost.csv", tmp_path / "breakout-10M-seed2.csv")
    assert "breakout-10M-seed*, mean ± std of 2" in out
