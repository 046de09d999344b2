"""Shared helpers: the script's path, subprocess runs of it, and TensorBoard read-back."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "ppo_atari.py")
sys.path.insert(0, ROOT)

# A tiny but complete configuration: 2 envs x 32 steps, 2 minibatches, 2 epochs, on the CPU.
TINY = ["--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "2",
        "--no-cuda"]


def run_script(args, cwd, script=SCRIPT, timeout=300, env=None):
    """Runs the script in a subprocess; returns the CompletedProcess (text mode)."""
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run([sys.executable, script, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def run_dirs(cwd):
    return sorted(glob.glob(os.path.join(cwd, "runs", "*")))


def scalars(run_dir, raw=False):
    """{tag: [(step, value), ...]} from the run folder's event files. raw=True reads every event
    as written (so a step logged twice shows twice); otherwise TensorBoard's own view."""
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader
    from tensorboard.util import tensor_util

    if not raw:
        acc = event_accumulator.EventAccumulator(run_dir, size_guidance={"scalars": 0})
        acc.Reload()
        return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
        for event in event_file_loader.EventFileLoader(path).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "scalars":
                    value = float(tensor_util.make_ndarray(v.tensor).item())
                    out.setdefault(v.tag, []).append((event.step, value))
    return out


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path
