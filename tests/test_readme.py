"""README's commands that run in seconds, run as written: the forking lines, and the commands
under "What to expect" on the committed files in tests/figures/ (figures only where matplotlib
is installed), whose printed figures must be README's."""
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, is_repository_file

def readme() -> str:
    return open(os.path.join(ROOT, "README.md")).read()


def blocks() -> list[str]:
    """README's ```bash blocks, with backslash-continued lines joined."""
    return [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)```", readme(), re.S)]


def commands(starts: str) -> list[str]:
    return [x.split("  #")[0].strip() for b in blocks() for x in b.splitlines()
            if x.startswith(starts)]


def command(starts: str) -> str:
    (line,) = commands(starts)
    return line


@pytest.fixture(autouse=True)
def only_the_repository():
    if not is_repository_file():
        pytest.skip("README describes the repository's file, not a copy")


def test_the_forking_lines_run_as_written(tmp_path):
    home = dict(os.environ, HOME=str(tmp_path), PATH=os.path.dirname(sys.executable) + ":" +
                os.environ["PATH"])
    for line in (command("mkdir -p ~/my-experiment"), command("python ~/my-experiment")):
        out = subprocess.run(line, shell=True, cwd=ROOT, env=home, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, (line, out.stderr[-2000:])
    assert "--env-id" in out.stdout and (tmp_path / "my-experiment" / "ppo_atari.py").exists()


def printed_by_readme(tmp_path, tool="plot_curves.py") -> list[str]:
    """What README's commands of the tool print, run as written on the committed files (each
    figure drawn into the test's folder, never the checkout; without matplotlib, no figure)."""
    printed = []
    for line in [c for c in commands(f"python tests/{tool}") if "tests/figures/" in c]:
        args = shlex.split(line)[1:]
        if "--out" in args and importlib.util.find_spec("matplotlib") is None:
            args = args[:args.index("--out")] + args[args.index("--out") + 2:]
        elif "--out" in args:
            args[args.index("--out") + 1] = str(tmp_path / args[args.index("--out") + 1])
        out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, (line, out.stderr[-2000:])
        printed.append(out.stdout)
    return printed


def rows(text: str, key: int = 0) -> dict[str, list[str]]:
    """A markdown table's rows as {the key column's cell: the cells after it}, bold dropped."""
    split = [[c.strip() for c in r.replace("**", "").split("|")[1:-1]]
             for r in text.splitlines() if r.startswith("|")]
    return {r[key]: r[key + 1:] for r in split}


def what_to_expect() -> str:
    text = readme()
    return text[text.index("## What to expect"):text.index("Seed 1's 10M figure")]


def test_the_curve_table_comes_from_the_committed_curve_files(tmp_path):
    """Every figure of ours in README's Breakout table (each seed at 0.5M, 1M, 2M and 10M, their
    mean ± std, the 10M agent's scored games) is what README's commands print from
    tests/figures/."""
    printed = printed_by_readme(tmp_path)
    (curves,) = [p for p in printed if "| 10M |" in p]  # the table with every budget
    (scores,) = [p for p in printed if "| evaluation |" in p]
    shown = rows(what_to_expect())
    runs = rows(curves, key=1)  # {run: [last step, value at 0.25M, ...]}, "run": the header
    by_run = {run: dict(zip(runs["run"], cells)) for run, cells in runs.items()}
    budgets = ["0.5M", "1M", "2M", "10M"]
    for seed, label in [(1, "ours, seed 1 (one seed)"), (2, "ours, seed 2"),
                        (3, "ours, seed 3")]:
        ours = by_run[f"breakout-10M-seed{seed}"]
        for budget, cell in zip(budgets, shown[label]):
            if ours[budget] == "-":
                assert not any(ch.isdigit() for ch in cell), (label, budget, cell)
            else:
                assert cell.split()[0] == ours[budget], \
                    f"README's {label} at {budget}: {cell!r}; the curve file: {ours[budget]}"
        if ours["10M"] != "-":  # and the step it was read at
            assert ours["last step"] in shown[label][-1], (ours["last step"], shown[label])
    mean = by_run["breakout-10M-seed*, mean ± std of 3"]
    assert shown["ours, mean ± std of 3 seeds"][:3] == [mean[b] for b in budgets[:3]]
    label = {"step": "ours, seed 1's agent at 10M scored in 30 full games",  # trained id
             "ALE": "the same agent, 30 games on ALE/Breakout-v5 (sticky actions 0.25)"}
    scored = rows(scores)
    scored.pop("evaluation"), scored.pop("---")
    assert sorted(e[:3] for e in scored) == ["ALE", "ste"], scores  # one file, two evaluations
    ours = [label for label in shown if label.startswith(("ours", "the same agent"))]
    assert sorted(ours) == sorted([*label.values(), "ours, seed 1 (one seed)", "ours, seed 2",
                                   "ours, seed 3", "ours, mean ± std of 3 seeds",
                                   "ours, IQM of 3 seeds [bootstrap interval: min, max]"]), ours
    for evaluation, (games, score) in scored.items():
        name = label[evaluation[:3].replace("ste", "step")]
        assert games == "30" and shown[name][3] == score, (name, games, score, shown[name])


def test_the_iqm_row_is_what_compare_runs_prints_from_the_committed_seeds(tmp_path):
    """README's IQM row: at each budget, `compare_runs.py` on the three seeds' CSV files (its
    raw-score IQM and interval), and the same command's mean ± std is the mean row's."""
    shown = rows(what_to_expect())
    printed = printed_by_readme(tmp_path, "compare_runs.py")
    assert len(printed) == 3, "one compare_runs.py command per budget: 0.5M, 1M, 2M"
    for out, iqm, mean in zip(printed, shown["ours, IQM of 3 seeds [bootstrap interval: min, max]"],
                              shown["ours, mean ± std of 3 seeds"]):
        (table_row,) = [r for r in out.splitlines() if r.startswith("| ours |")]
        assert table_row.split(" | ")[5].rstrip(" |") == iqm, (table_row, iqm)
        (spread,) = [r for r in out.splitlines() if r.startswith("  Breakout: mean ")]
        m, sd = (float(x) for x in mean.split(" ± "))
        assert spread.startswith(f"  Breakout: mean {m:.1f} ± ") and abs(float(
            spread.split(" ± ")[1].split()[0]) - sd) <= 0.05, (spread, mean)


def test_each_figure_is_drawn_by_the_command_under_it_from_files_in_tests_figures():
    """Each PNG README shows is the --out of one of its commands, and tests/figures/ holds the
    files README uses, no others."""
    text = readme()
    images = re.findall(r"\]\((tests/figures/[^)]+\.png)\)", text)
    outs = [shlex.split(c)[shlex.split(c).index("--out") + 1] for c in
            commands("python tests/plot_curves.py") if "--out" in c]
    assert images and sorted(images) == sorted(outs), (images, outs)
    used = set(images) | {p for c in commands("python tests/") for a in shlex.split(c)
                          for p in glob.glob(os.path.join(ROOT, a)) if "tests/figures/" in a}
    used = {os.path.relpath(os.path.join(ROOT, p), ROOT) for p in used}
    held = {f"tests/figures/{f}" for f in os.listdir(os.path.join(ROOT, "tests", "figures"))}
    assert held == used, f"in tests/figures but unused: {sorted(held - used)}; used but " \
        f"missing: {sorted(used - held)}"
