"""README's commands that run in seconds, run as written: the forking lines, and the commands
under "What to expect" on the committed files in tests/results/figures/ (figures only where matplotlib
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

from conftest import ROOT, is_repository_file, left_in_session

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


def printed_by_readme(tmp_path, tool="tools/plot_curves.py") -> list[str]:
    """What README's commands of the tool print, run as written on the committed files (each
    figure drawn into the test's folder, never the checkout; without matplotlib, no figure)."""
    printed = []
    for line in [c for c in commands(f"python tests/{tool}") if "tests/results/figures/" in c]:
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
    tests/results/figures/."""
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
    printed = printed_by_readme(tmp_path, "tools/compare_runs.py")
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
    """Each PNG README shows is the --out of one of its commands, and tests/results/figures/ holds the
    files README uses, no others."""
    text = readme()
    images = re.findall(r"\]\((tests/results/figures/[^)]+\.png)\)", text)
    outs = [shlex.split(c)[shlex.split(c).index("--out") + 1] for c in
            commands("python tests/tools/plot_curves.py") if "--out" in c]
    assert images and sorted(images) == sorted(outs), (images, outs)
    used = set(images) | {p for c in commands("python tests/") for a in shlex.split(c)
                          for p in glob.glob(os.path.join(ROOT, a)) if "tests/results/figures/" in a}
    used = {os.path.relpath(os.path.join(ROOT, p), ROOT) for p in used}
    held = {f"tests/results/figures/{f}" for f in os.listdir(os.path.join(ROOT, "tests", "results", "figures"))}
    assert held == used, f"in tests/results/figures but unused: {sorted(held - used)}; used but " \
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


def test_the_batch_runs_two_at_a_time_and_a_stop_to_its_group_stops_it_in_a_terminal_or_not(
        tmp_path):
    """README's batch (two seeds in place of three: four runs, two at a time), `python` stood in
    by a wrapper that gives the training runs a tiny configuration (2 envs x 32 steps). Started
    as from a terminal, a Ctrl-C to its process group (what a terminal sends) checkpoints both
    runs in progress and starts no other. Run again as README's background line starts it
    (setsid, SIGINT ignored as under nohup or a script's `&`), each run continues, and README's
    kill line (SIGTERM to the group) checkpoints both and starts no other; the block's last line
    then compares them (at the largest step both reached)."""
    block = raw_block("cp ppo_atari.py fork.py").strip().splitlines()
    batch, compare = "\n".join(block[1:-1]), block[-1]
    assert compare.startswith("python tests/tools/compare_runs.py"), compare
    assert "for seed in 1 2 3;" in batch and "xargs -P 2" in batch, batch
    (tmp_path / "batch.sh").write_text(batch.replace("for seed in 1 2 3;", "for seed in 1 2;"))
    if importlib.util.find_spec("matplotlib") is None:
        compare = compare.replace(" --plot compare.png", "")
    text = readme()
    background = re.search(r"`(setsid bash batch.sh [^`]*&)`", text).group(1)
    kill = re.search(r"`(kill -TERM -- [^`]*)`", text).group(1)
    shutil.copy(os.path.join(ROOT, "ppo_atari.py"), tmp_path / "ppo_atari.py")
    shutil.copytree(os.path.join(ROOT, "tests", "tools"), tmp_path / "tests" / "tools")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text(
        f'#!/bin/sh\ncase "$1" in ppo_atari.py|fork.py) exec {sys.executable} "$@" --num-envs 2 '
        f'--num-steps 32 --num-minibatches 2 --update-epochs 1;; esac\n'
        f'exec {sys.executable} "$@"\n')
    (tmp_path / "bin" / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", OMP_NUM_THREADS="1")
    logs = [tmp_path / f"{script}-1.log" for script in ("ppo_atari", "fork")]

    def both_training():
        deadline = time.time() + 200
        while time.time() < deadline and not all(
                log.exists() and "step " in log.read_text() for log in logs):
            assert not any(log.exists() and "Error" in log.read_text() for log in logs), \
                [log.read_text()[-2000:] for log in logs]
            time.sleep(0.2)
        time.sleep(3)  # some games finish (a game lasts about 200 steps of an env)

    def stopped_by(name: str, sid: int):
        assert left_in_session(sid, within=60) == [], "a run of the batch is still going"
        for log in logs:
            assert f"by {name}; checkpoint written" in log.read_text(), log.read_text()[-2000:]
        assert not list(tmp_path.glob("*-2.log")), "the batch started a run after the stop"

    subprocess.run(block[0].split("  #")[0], shell=True, cwd=tmp_path, check=True)  # cp
    shell = subprocess.Popen(["bash", "batch.sh"], cwd=tmp_path, env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    both_training()
    os.killpg(shell.pid, signal.SIGINT)  # Ctrl-C in the terminal: the foreground group
    shell.communicate(timeout=120)
    stopped_by("SIGINT", shell.pid)

    for log in logs:
        log.rename(log.with_suffix(".first"))
    subprocess.run(["bash", "-c", background], cwd=tmp_path, env=env, timeout=30,
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    (group,) = [int(p) for p in subprocess.run(["pgrep", "-f", "^bash batch.sh"],
                                               capture_output=True, text=True).stdout.split()]
    both_training()
    (tmp_path / "kill.sh").write_text(kill + "\n")
    out = subprocess.run(["bash", "kill.sh"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    stopped_by("SIGTERM", group)
    out = subprocess.run(["bash", "-c", compare], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "P(fork > baseline) = " in out.stdout, (out.stdout[-2000:],
                                                                          out.stderr)
