"""The same file under torchrun, or launched by hand: 2 CPU processes with gloo."""
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

import ppo_atari as P
from conftest import SCRIPT, TINY, free_port, launch, need, obs_shape, run_dirs, scalars


# Runs the file under test (PPO_ATARI_SCRIPT) and saves each rank's final weights; FREEZE=1
# trains an Agent whose first layer (the first module with parameters of its own) is frozen.
HARNESS = """
import importlib.util, os, sys
import torch, tyro
spec = importlib.util.spec_from_file_location("ppo_atari", os.environ["PPO_ATARI_SCRIPT"])
P = importlib.util.module_from_spec(spec)
sys.modules["ppo_atari"] = P
spec.loader.exec_module(P)
if os.environ.get("FREEZE"):
    class Frozen(P.Agent):
        def __init__(self, *a):
            super().__init__(*a)
            next(m for m in self.modules() if list(m.parameters(False))).requires_grad_(False)
    P.Agent = Frozen
rank = os.environ["RANK"]
if os.environ.get("TALLY"):  # a fork's wrapper state that differs by rank: r + 1 a step
    import gymnasium as gym, numpy as np
    class Tally(gym.Wrapper):
        def __init__(self, env):
            super().__init__(env)
            self.by, self.steps_state = 1 + int(os.environ["RANK"]), np.zeros(1, np.int64)
        def step(self, action):
            self.steps_state += self.by
            return self.env.step(action)
    real_make_env = P.make_env
    def make_env(*a, **kw):
        thunk = real_make_env(*a, **kw)
        return lambda: Tally(thunk())
    P.make_env = make_env
if os.environ.get("RECORD"):  # this rank's env seed, and its first gradient before/after the mean
    real_envs, real_reduce = P.make_envs, P.all_reduce_gradients
    def make_envs(args, seed, *a, **kw):
        open(f"seed{rank}.txt", "w").write(f"{seed} {args.num_envs}")
        return real_envs(args, seed, *a, **kw)
    def all_reduce_gradients(agent, *a, **kw):
        grads = [p.grad.clone() for p in agent.parameters() if p.grad is not None]
        real_reduce(agent, *a, **kw)
        if not os.path.exists(f"grads{rank}.pt"):
            torch.save({"local": grads, "reduced": [p.grad.clone() for p in agent.parameters()
                                                    if p.grad is not None]}, f"grads{rank}.pt")
    P.make_envs, P.all_reduce_gradients = make_envs, all_reduce_gradients
if os.environ.get("KL_BY_RANK"):  # each rank's approx_kl forced, its optimizer steps counted
    real_loss, real_step, calls = P.minibatch_loss, torch.optim.Adam.step, []
    kl = float(os.environ["KL_BY_RANK"].split(",")[int(rank)])
    def minibatch_loss(*a, **kw):
        loss, metrics = real_loss(*a, **kw)
        return loss, metrics | {"approx_kl": torch.tensor(kl)}
    def step(self, *a, **kw):
        calls.append(1)
        open(f"calls{rank}.txt", "w").write(str(len(calls)))
        return real_step(self, *a, **kw)
    P.minibatch_loss, torch.optim.Adam.step = minibatch_loss, step
if __name__ == "__main__":  # async env workers import this file as their main module
    if os.environ.get("LATE_RANK") == rank:  # this rank starts seconds after the others
        import time; time.sleep(float(os.environ.get("LATE_BY", "3")))
    agent = P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
    open(f"group{rank}.txt", "w").write(str(torch.distributed.is_initialized()))
    if agent is not None:
        torch.save(agent.state_dict(), f"rank{os.environ['RANK']}.pt")
"""


def torchrun(cwd, *args, script="harness.py", env=None):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(cwd / script), *args],
        cwd=cwd, capture_output=True, text=True, timeout=400,
        env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **(env or {})))


def by_hand(folders, *args, env=None):
    """Two processes started by hand (as a multi-node launcher would): RANK, WORLD_SIZE and
    MASTER_ADDR/PORT set, each in its own working folder, so each has its own runs/."""
    port = free_port()
    procs = [launch(args, folder, script=folder.parent / "harness.py", env=dict(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1", **(env or {})))
        for rank, folder in enumerate(folders)]
    return [(p.wait(timeout=300), *p.communicate()) for p in procs]


PAIR = [*TINY, "--run-name", "job", "--dist-timeout", "60"]


@pytest.fixture(scope="module")
def recorded_pair(tmp_path_factory):
    """Two hand-launched ranks, each in a folder of its own (node-local runs/ folders), one
    iteration: each records its env seed and its first gradient before and after the mean;
    rank 0's approx_kl is forced to 0.6 and rank 1's to 0.0 against --target-kl 0.4, and each
    counts its loss calls. Rank 1 starts 3 s after rank 0, with TORCH_GLOO_LAZY_INIT=1 (see
    test_a_rank_that_starts_late_joins_when_init_returns_at_once). The ranks' final weights and
    the step the checkpoint holds are kept as the launch left them."""
    need("main")
    cwd = tmp_path_factory.mktemp("pair")
    (cwd / "harness.py").write_text(HARNESS)
    folders = [cwd / "node0", cwd / "node1"]
    for f in folders:
        f.mkdir()
    results = by_hand(folders, *PAIR, "--total-timesteps", "128", "--target-kl", "0.4",
                      env={"RECORD": "1", "KL_BY_RANK": "0.6,0.0", "TORCH_GLOO_LAZY_INIT": "1",
                           "LATE_RANK": "1"})
    for code, out, err in results:
        assert code == 0, err[-3000:]
    weights = [torch.load(f / f"rank{r}.pt") for r, f in enumerate(folders)]
    held = P.load_checkpoint(str(folders[0] / "runs" / "job"))["global_step"]
    return folders, weights, held


def test_rank_0_decides_the_resume_when_runs_folders_are_node_local(recorded_pair):
    """Only rank 0's folder holds the checkpoint (node-local disks): rank 1 must continue the
    same run from rank 0's state, not start afresh (which would hang or diverge)."""
    folders = recorded_pair[0]
    assert not (folders[1] / "runs").exists(), "rank 1 wrote a run folder"
    results = by_hand(folders, *PAIR, "--total-timesteps", "384")
    for code, out, err in results:
        assert code == 0, err[-3000:]
    assert "continuing runs/job at step 128 of 384" in results[0][1]
    r0, r1 = torch.load(folders[0] / "rank0.pt"), torch.load(folders[1] / "rank1.pt")
    assert all(torch.equal(r0[k], r1[k]) for k in r0), "the ranks trained different weights"
    ckpt = P.load_checkpoint(str(folders[0] / "runs" / "job"))
    assert ckpt["global_step"] == 384 and ckpt["iteration"] == 3


def test_ranks_play_apart_and_average_their_gradients(recorded_pair):
    """Each rank's envs get seeds of their own (the same seeds would play the same games), and
    the gradient every rank steps with is the mean of the ranks' gradients (not their sum)."""
    folders = recorded_pair[0]
    seeds = [range(s, s + n) for s, n in (map(int, (f / f"seed{r}.txt").read_text().split())
                                          for r, f in enumerate(folders))]
    assert not set(seeds[0]) & set(seeds[1]), f"the ranks' env seeds overlap: {seeds}"
    g0, g1 = (torch.load(f / f"grads{r}.pt") for r, f in enumerate(folders))
    assert any(not torch.equal(a, b) for a, b in zip(g0["local"], g1["local"])), "same data?"
    for reduced in (g0["reduced"], g1["reduced"]):
        for a, b, mean in zip(g0["local"], g1["local"], reduced):
            torch.testing.assert_close(mean, (a + b) / 2, msg="gradients of record: the mean "
                                       "over ranks (DDP), not the sum")


def test_target_kl_is_decided_on_the_mean_over_ranks(recorded_pair):
    """Rank 0's approx_kl 0.6 and rank 1's 0.0 against --target-kl 0.4: the mean, 0.3, stops
    no epoch, on both ranks alike (a rank deciding alone would stop while the other goes on,
    and a sum would stop both)."""
    calls = [int((f / f"calls{r}.txt").read_text()) for r, f in enumerate(recorded_pair[0])]
    assert calls == [1 * 2 * 2] * 2, (f"optimizer steps per rank {calls}: 1 iteration x 2 "
                                      f"epochs x 2 minibatches")


def test_a_rank_that_starts_late_joins_when_init_returns_at_once(recorded_pair):
    """Stands in for NCCL, whose init_process_group returns before the other ranks arrive (its
    communicator is created lazily, at the first collective): TORCH_GLOO_LAZY_INIT=1 makes
    gloo's init return at once the same way. Rank 1 starts 3 s after rank 0 (the recorded pair)
    and must still join and train. What it cannot show: NCCL itself, its communicator on GPUs,
    or a late rank under torchrun's own rendezvous (tests/test_crashes.py's two-agent restart
    test covers torchrun across two nodes)."""
    folders, (r0, r1), held = recorded_pair
    assert held == 128, held
    assert all(torch.equal(r0[k], r1[k]) for k in r0), "ranks' parameters differ"


def test_two_processes_train_in_step_stop_resume_and_evaluate(tmp_path):
    """torchrun, 2 processes, 4 iterations (a fork's phase every k <= 4 iterations that skips
    the gradient all-reduce makes the ranks' weights part): identical weights, one writer
    counting both ranks' steps; a stop prints the script's line to run under the same torchrun
    launcher (a plain python launch would be refused by the world-size check), which continues
    the run, here with async env workers
    started after the process group; once more it has nothing to train and each rank leaves
    its group destroyed; rank 0 alone evaluates. The Agent's first layer is frozen throughout:
    parameters without a gradient (frozen, or an unused head) are left out of the all-reduce
    instead of crashing it, and stay as they were. Each env also carries a fork's wrapper whose
    state differs by rank: the checkpoint holds every rank's envs' (rank 0's first) and the
    resume gives each rank its own back, so both counts go on (rank 1 does not take rank 0's).
    Two processes of one node: what it cannot show is two nodes."""
    (tmp_path / "harness.py").write_text(HARNESS)
    # 2 ranks x 2 envs x 32 steps = 128 steps an iteration; 4 iterations, then a stop
    out = torchrun(tmp_path, *TINY, "--total-timesteps", "640", "--stop-at-step", "512",
                   env={"FREEZE": "1", "TALLY": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(r0[k], r1[k]) for k in r0), "ranks' parameters differ"
    (run,) = run_dirs(tmp_path)
    events = [f for f in os.listdir(run) if f.startswith("events.out.tfevents")]
    assert len(events) == 1, events
    assert [s for s, _ in scalars(run)["charts/SPS"]] == [128, 256, 384, 512]  # both ranks'
    ckpt = P.load_checkpoint(run)
    assert ckpt["global_step"] == 512
    assert all(torch.equal(ckpt["model"][k], r0[k]) for k in r0)  # rank 0 saved its own
    tallies = lambda: [int(P.from_saved(v)[0]) for v in  # noqa: E731  (per env, rank 0's first)
                       P.load_checkpoint(run)["env_statistics"]["Tally.steps_state"]]
    assert tallies() == [128, 128, 256, 256], tallies()
    line = next(x for x in out.stdout.splitlines()
                if "by --stop-at-step; checkpoint written; continue with: " in x)
    assert " with: the same torchrun launcher and options, then: " in line, line
    command = shlex.split(line.split(", then: ", 1)[1])
    at = next(i for i, token in enumerate(command) if token.endswith("harness.py"))
    assert at == 0 and command[1] == "--resume" and "--no-cuda" in command, line

    for backend in ("async", "sync"):  # the rest of the run, then nothing left to train
        out = torchrun(tmp_path, *command[at + 1:], "--env-backend", backend,
                       env={"FREEZE": "1", "TALLY": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        assert [(tmp_path / f"group{r}.txt").read_text() for r in (0, 1)] == ["False"] * 2, \
            "a rank returned with its process group still initialized"
    assert "is already complete" in out.stdout
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    assert P.load_checkpoint(run)["global_step"] == 640
    assert tallies() == [160, 160, 320, 320], f"each rank's own count, continued: {tallies()}"
    assert [s for s, _ in scalars(run, raw=True)["charts/SPS"]] == [128, 256, 384, 512, 640]
    assert run_dirs(tmp_path) == [run]
    torch.manual_seed(1)  # rank 0's seed: its initial weights are broadcast to every rank
    agent = P.Agent(obs_shape(), 4)
    initial = agent.state_dict()
    name, first = next((n, m) for n, m in agent.named_modules() if list(m.parameters(False)))
    frozen = [f"{name}.{k}" for k, _ in first.named_parameters(recurse=False)]
    # (orthogonal init may differ in the last bits with another thread count; a step moves ~1e-4)
    moved = {k: not torch.allclose(initial[k], r0[k], atol=1e-6, rtol=0) for k in r0}
    assert frozen and not any(moved[k] for k in frozen), f"the frozen layer {frozen} moved"
    assert any(moved[k] for k in r0 if k not in frozen), "the other layers did not train"

    shutil.copy(SCRIPT, tmp_path / "ppo_atari.py")  # rank 0 alone plays and reports
    out = torchrun(tmp_path, "--eval-checkpoint", run, "--eval-episodes", "1", "--no-cuda",
                   script="ppo_atari.py")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("game 1: score") == 1
    assert "over 1 game (agent at step 640)" in out.stdout


RESTARTING = """
import os, sys
sys.path.insert(0, os.environ["SCRIPT_DIR"])
import tyro
import ppo_atari as P
real = P.save_checkpoint
def save_checkpoint(*a, **kw):  # the first start dies (a node failure) after its 2nd iteration
    real(*a, **kw)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and a[6] == 2:
        os._exit(1)
P.save_checkpoint = save_checkpoint
if __name__ == "__main__":
    P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
"""


def test_a_torchrun_restart_without_a_run_name_continues_its_run(tmp_path):
    """torchrun --max-restarts 1 and no --run-name: the first start names the run in torchrun's
    store; its worker dies after the 2nd iteration's checkpoint; the restarted worker continues
    that folder from step 128 instead of starting a second run at step 0."""
    need("main")
    (tmp_path / "restarting.py").write_text(RESTARTING)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         "--max-restarts", "1", "restarting.py", *TINY, "--total-timesteps", "256",
         "--checkpoint-interval", "1"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                              SCRIPT_DIR=os.path.dirname(SCRIPT)))
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = run_dirs(tmp_path)
    assert f"continuing runs/{os.path.basename(run)} at step 128 of 256" in out.stdout, out.stdout
    assert P.load_checkpoint(run)["global_step"] == 256
