"""README's commands that run in seconds, run as written: the forking lines, and the commands
under "What to expect" on the committed files in tests/figures/ (figures only where matplotlib
is installed), whose printed figures must be README's."""
import glob
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

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


def raw_block(first_line: str) -> str:
    """The ```bash block of README that starts with this line, as written."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", readme(), re.S)
                if b.startswith(first_line)]
    return block


def test_the_slurm_array_script_runs_as_written_with_srun_and_scontrol_stood_in(tmp_path):
    """README's job array script under bash, `srun` and `scontrol` stood in by scripts that
    record their arguments (srun exits as the training would): task 3 runs the fork, seed 2,
    under a slurm- name; a task stopped by SLURM (143) requeues itself and exits 143; a task
    that finished (0) does not requeue. Its #SBATCH lines ask for CPUs and an appended log."""
    script = raw_block("#!/bin/bash")
    assert "--cpus-per-task=" in script and "--open-mode=append" in script
    (tmp_path / "job.sh").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/{tool}.txt\n' +
                                    ('exit "$SRUN_EXIT"\n' if tool == "srun" else ""))
        (bin_dir / tool).chmod(0o755)
    for code in (143, 0):
        for record in ("srun.txt", "scontrol.txt"):
            (tmp_path / record).unlink(missing_ok=True)
        out = subprocess.run(["bash", "job.sh"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60, env=dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin",
                                                  SLURM_ARRAY_TASK_ID="3",
                                                  SLURM_ARRAY_JOB_ID="99", SRUN_EXIT=str(code)))
        assert out.returncode == code, out.stderr
        assert (tmp_path / "srun.txt").read_text().split() == [
            "python", "fork.py", "--seed", "2", "--run-name", "slurm-fork-breakout-s2"]
        requeued = (tmp_path / "scontrol.txt").read_text().split() if code else None
        assert requeued == (["requeue", "99_3"] if code else None), requeued


def test_the_fork_loop_runs_as_written_and_a_ctrl_c_stops_every_run(tmp_path):
    """README's fork loop, one seed in place of five, `python` stood in by a wrapper that gives
    the two training runs a tiny configuration (2 envs x 32 steps): a Ctrl-C to the loop's
    shell reaches both background runs (the trap passes it on as SIGTERM), each writes its
    checkpoint, and the loop exits 130; the block's last line then compares them (at the
    largest step both reached)."""
    loop = raw_block("cp ppo_atari.py fork.py").replace("for seed in 1 2 3 4 5", "for seed in 1")
    compare = loop.strip().splitlines()[-1]
    assert compare.startswith("python tests/compare_runs.py"), compare
    if importlib.util.find_spec("matplotlib") is None:
        compare = compare.replace(" --plot compare.png", "")
    shutil.copy(os.path.join(ROOT, "ppo_atari.py"), tmp_path / "ppo_atari.py")
    (tmp_path / "tests").mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "compare_runs.py"), tmp_path / "tests")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text(
        f'#!/bin/sh\ncase "$1" in ppo_atari.py|fork.py) exec {sys.executable} "$@" --num-envs 2 '
        f'--num-steps 32 --num-minibatches 2 --update-epochs 1;; esac\n'
        f'exec {sys.executable} "$@"\n')
    (tmp_path / "bin" / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", OMP_NUM_THREADS="1")
    (tmp_path / "loop.sh").write_text(loop)
    shell = subprocess.Popen(["bash", "loop.sh"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs = [tmp_path / f"{script}-1.log" for script in ("ppo_atari", "fork")]
    deadline = time.time() + 200
    while time.time() < deadline and not all(
            log.exists() and "step " in log.read_text() for log in logs):
        time.sleep(0.2)
    time.sleep(3)  # some games finish (a game lasts about 200 steps of an env)
    shell.send_signal(signal.SIGINT)
    out, err = shell.communicate(timeout=120)
    assert shell.returncode == 130, (out, err)
    for log in logs:
        assert "by SIGTERM; checkpoint written" in log.read_text(), log.read_text()[-2000:]
    out = subprocess.run(["bash", "-c", compare], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "P(fork > baseline) = " in out.stdout, (out.stdout[-2000:],
                                                                          out.stderr)
