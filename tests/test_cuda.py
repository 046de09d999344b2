"""The CUDA path, run for real: skipped with a reason on a machine without CUDA (CI has none).
tests/dev/gpu_check.sh runs this file on a machine with a GPU and keeps what it prints."""
import os
import subprocess
import sys

import pytest
import torch

import ppo_atari as P
from conftest import SCRIPT, free_port, need, obs_shape, run_dirs, run_script, scalars

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA on this machine (tests/dev/gpu_check.sh runs these "
                                       "where there is)")

TWO = ["--total-timesteps", "2048"]  # two iterations of the default 8 envs x 128 steps


@pytest.mark.parametrize("flags", [[], ["--env-backend", "async"], ["--precision", "bf16"],
                                   ["--compile"]], ids=["default", "async", "bf16", "compile"])
def test_two_iterations_on_cuda(tmp_path, flags):
    out = run_script([*TWO, *flags], cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "device: cuda:0" in out.stdout, out.stdout[-2000:]
    (run,) = run_dirs(tmp_path)
    assert [s for s, _ in scalars(run)["charts/SPS"]] == [1024, 2048]
    assert all(v == v for _, v in scalars(run)["losses/value_loss"]), "NaN value loss"


NO_CUDA = """
import importlib.util, os, sys
import torch, tyro
spec = importlib.util.spec_from_file_location("ppo_atari", os.environ["PPO_ATARI_SCRIPT"])
P = importlib.util.module_from_spec(spec)
spec.loader.exec_module(P)
P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
print("cuda initialized:", torch.cuda.is_initialized())
"""


@pytest.mark.parametrize("flags", [[], ["--compile"]], ids=["plain", "compile"])
def test_a_no_cuda_run_leaves_cuda_uninitialized(tmp_path, flags):
    """A --no-cuda run and its resume on a GPU machine, torch's own optimizer steps included,
    never initialize CUDA (a CPU seed or gloo rank would hold GPU memory); with --compile too,
    whose tracing saves the CUDA RNG state wherever CUDA is available."""
    (tmp_path / "no_cuda.py").write_text(NO_CUDA)
    for stop in (["--stop-at-step", "64"], []):
        out = run_script(["--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2",
                          "--total-timesteps", "128", "--run-name", "cpu", "--no-cuda", *flags,
                          *stop],
                         cwd=tmp_path, script=str(tmp_path / "no_cuda.py"))
        assert out.returncode == 0, out.stderr[-3000:]
        assert "cuda initialized: False" in out.stdout, out.stdout[-2000:]


def test_resume_evaluation_and_files_a_cpu_machine_can_load(tmp_path):
    """Stopped at the first iteration and continued on CUDA; the agent scored on CUDA; then
    checkpoint.pt and agent.pt loaded by a plain torch.load in a process that sees no GPU."""
    command = [*TWO, "--run-name", "gpu"]
    first = run_script([*command, "--stop-at-step", "1024"], cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_script(command, cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing runs/gpu at step 1,024 of 2,048" in again.stdout
    run = str(tmp_path / "runs" / "gpu")
    scored = run_script(["--eval-checkpoint", os.path.join(run, "agent.pt"), "--eval-episodes",
                         "1"], cwd=tmp_path, timeout=600)
    assert scored.returncode == 0 and "over 1 game" in scored.stdout, scored.stderr[-3000:]
    check = ("import sys, torch\n"
             "for path in sys.argv[1:]:\n"
             "    state, devices = torch.load(path, weights_only=True), set()\n"
             "    def walk(o):\n"
             "        if isinstance(o, torch.Tensor): devices.add(o.device.type)\n"
             "        elif isinstance(o, dict): [walk(v) for v in o.values()]\n"
             "        elif isinstance(o, (list, tuple)): [walk(v) for v in o]\n"
             "    walk(state)\n"
             "    print(path, sorted(devices))\n")
    plain = subprocess.run([sys.executable, "-c", check, os.path.join(run, "checkpoint.pt"),
                            os.path.join(run, "agent.pt")], capture_output=True, text=True,
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), timeout=120)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.count("['cpu']") == 2, plain.stdout


def test_the_first_update_on_cpu_and_cuda_agree_in_every_loss_metric(monkeypatch):
    """The same weights, the same batch and the same minibatch order on both devices: every
    metric of the update (summed over its minibatches) agrees to within float rounding
    (TF32 convolutions on CUDA included)."""
    need("main")
    torch.manual_seed(1)
    shape, n = obs_shape(), 256
    cpu_agent = P.Agent(shape, 4)
    batch = {"obs": torch.randint(0, 255, (n, *shape), dtype=torch.uint8),
             "actions": torch.randint(0, 4, (n,)), "logprobs": torch.full((n,), -1.386),
             "values": torch.randn(n) * 0.1, "advantages": torch.randn(n),
             "returns": torch.randn(n) * 0.1}
    perms = [torch.randperm(n) for _ in range(4)]
    args = P.Args(num_minibatches=4, update_epochs=2, cuda=False)
    results = {}
    for device in ("cpu", "cuda"):
        agent = P.Agent(shape, 4).to(device, memory_format=torch.channels_last)
        agent.load_state_dict(cpu_agent.state_dict())
        optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
        order = iter(perms)
        monkeypatch.setattr(torch, "randperm", lambda k, device=None, **kw: next(order).to(device))
        totals, count = P.update(agent, optimizer, P.minibatch_loss,
                                 {k: v.to(device) for k, v in batch.items()},
                                 torch.tensor(0.1, device=device), torch.autocast(
                                     device, enabled=False), args, 1, {})
        results[device] = {k: float(v) / count for k, v in totals.items()}
    for name, on_cpu in results["cpu"].items():
        on_cuda = results["cuda"][name]
        assert abs(on_cuda - on_cpu) <= 2e-2 * abs(on_cpu) + 1e-4, (
            f"losses/{name}: {on_cpu:.6g} on the CPU, {on_cuda:.6g} on CUDA")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than two GPUs: no NCCL run")
def test_two_processes_on_two_gpus_with_nccl(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
         str(free_port()), SCRIPT, *TWO], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = run_dirs(tmp_path)
    assert P.load_checkpoint(run)["global_step"] == 2048  # one iteration of 2 x 1024 steps
