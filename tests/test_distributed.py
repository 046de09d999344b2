"""The same file under torchrun: 2 CPU processes with gloo."""
import os
import shutil
import subprocess
import sys

import torch

import ppo_atari as P
from conftest import ROOT, SCRIPT, TINY, run_dirs, scalars

HARNESS = f"""
import os, sys
sys.path.insert(0, {ROOT!r})
import torch, tyro
import ppo_atari as P
agent = P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
torch.save(agent.state_dict(), f"rank{{os.environ['RANK']}}.pt")
"""


def torchrun(cwd, *args, script="harness.py"):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", "29517", str(cwd / script), *args],
        cwd=cwd, capture_output=True, text=True, timeout=400,
        env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))


def test_two_processes_train_in_step_and_resume(tmp_path):
    (tmp_path / "harness.py").write_text(HARNESS)
    # 2 ranks x 2 envs x 32 steps = 128 steps an iteration; 2 iterations
    out = torchrun(tmp_path, *TINY, "--total-timesteps", "256", "--num-steps", "32")
    assert out.returncode == 0, out.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(r0[k], r1[k]) for k in r0), "ranks' parameters differ"
    (run,) = run_dirs(tmp_path)
    events = [f for f in os.listdir(run) if f.startswith("events.out.tfevents")]
    assert len(events) == 1, events
    logged = scalars(run)
    assert [s for s, _ in logged["charts/SPS"]] == [128, 256]  # both ranks' steps counted
    ckpt = P.load_checkpoint(run)
    assert ckpt["global_step"] == 256
    assert all(torch.equal(ckpt["model"][k], r0[k]) for k in r0)  # rank 0 saved its own

    # resume under torchrun: one more iteration, still one writer
    out = torchrun(tmp_path, "--resume", run, "--total-timesteps", "384")
    assert out.returncode == 0, out.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    assert P.load_checkpoint(run)["global_step"] == 384
    assert [s for s, _ in scalars(run, raw=True)["charts/SPS"]] == [128, 256, 384]
    assert run_dirs(tmp_path) == [run]

    # evaluation under torchrun: rank 0 alone plays and reports
    shutil.copy(SCRIPT, tmp_path / "ppo_atari.py")
    out = torchrun(tmp_path, "--eval-checkpoint", run, "--eval-episodes", "1", "--no-cuda",
                   script="ppo_atari.py")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("game 1: score") == 1
    assert "over 1 game (agent at step 384)" in out.stdout


def test_async_workers_start_after_the_process_group(tmp_path):
    """Spawned env workers under torchrun: the parent has already joined the (gloo) group."""
    shutil.copy(SCRIPT, tmp_path / "ppo_atari.py")
    out = torchrun(tmp_path, *TINY, "--total-timesteps", "128", "--env-backend", "async",
                   script="ppo_atari.py")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = run_dirs(tmp_path)
    assert P.load_checkpoint(run)["global_step"] == 128
