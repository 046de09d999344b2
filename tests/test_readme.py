"""README's commands that run in seconds, run as written: the forking lines and the curve
table's command on the committed CSV files (its figure only where matplotlib is installed)."""
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


def command(starts: str) -> str:
    (line,) = [x for b in blocks() for x in b.splitlines() if x.startswith(starts)]
    return line.split("  #")[0].strip()


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


def test_the_curve_table_comes_from_the_committed_curve_files(tmp_path):
    """The command under "What to expect" prints the rows README's table shows."""
    args = shlex.split(command("python tests/plot_curves.py"))[1:]
    if importlib.util.find_spec("matplotlib") is None:  # the table without the figure
        args = args[:args.index("--out")]
    else:  # the figure goes to the test's folder, never the checkout
        args[args.index("--out") + 1] = str(tmp_path / args[args.index("--out") + 1])
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    text = readme()
    table = text[text.index("## What to expect"):text.index("## Forking")]
    for seed, row in [("seed1-lost", "| 13.7 | 22.1 | 52.0 |"), ("seed2", "| 12.9 | 25.4 | 64.7 |"),
                      ("seed3", "| 12.1 | 24.4 | 36.5 |"),
                      ("mean", "| 12.9 ± 0.7 | 24.0 ± 1.4 | 51.0 ± 11.5 |")]:
        assert row in out.stdout, (seed, out.stdout)
        assert row in table.replace("**", ""), f"README's table lacks {seed}'s row {row}"
