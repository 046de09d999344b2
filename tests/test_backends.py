"""The default environment: the in-file wrappers, in this process (sync) or a process per env
(async) with the same numbers; the opt-in ale backend keeps the FIRE it plays out of the policy."""
import os
import signal
import subprocess
import sys

import numpy as np
import torch

import ppo_atari as P
from conftest import SCRIPT, TINY, run_dirs, run_script, scalars


def test_sync_and_async_step_identically():
    args = P.Args(num_envs=3, env_backend="sync")
    sync = P.make_envs(args, seed=5)
    asyn = P.make_envs(P.Args(num_envs=3, env_backend="async"), seed=5)
    assert type(asyn).__name__ == "AsyncVectorEnv"
    a, _ = sync.reset(seed=5)
    b, _ = asyn.reset(seed=5)
    assert np.array_equal(a, b)
    rng, terminations = np.random.default_rng(0), 0
    for _ in range(400):
        actions = rng.integers(0, 4, size=3)
        a, ra, ta, ua, ia = sync.step(actions)
        b, rb, tb, ub, ib = asyn.step(actions)
        assert np.array_equal(a, b) and np.array_equal(ra, rb)
        assert np.array_equal(ta, tb) and np.array_equal(ua, ub)
        assert P.finished_games(ia) == P.finished_games(ib)
        terminations += ta.sum()
    sync.close()
    asyn.close()
    assert terminations > 0, "no life was lost: the comparison saw no episode boundary"


def test_sync_and_async_train_to_the_same_losses(workdir, monkeypatch):
    logged = {}
    for backend in ("sync", "async"):
        (workdir / backend).mkdir()
        monkeypatch.chdir(workdir / backend)
        P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=2, cuda=False,
                      total_timesteps=3 * 64, env_backend=backend, seed=3))
        (run,) = run_dirs(workdir / backend)
        logged[backend] = scalars(run)
    losses = [t for t in logged["sync"] if t.startswith("losses/")]
    assert len(losses) == 8
    for tag in losses:
        assert len(logged["sync"][tag]) == 3
        assert logged["sync"][tag] == logged["async"][tag], tag


def test_auto_picks_the_in_file_wrappers_on_every_machine(monkeypatch):
    args = P.Args()
    assert args.env_backend == "auto"
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert P.choose_backend(args, use_cuda=True, local_processes=1) == "async"
    assert P.choose_backend(args, use_cuda=False, local_processes=1) == "sync"
    assert P.choose_backend(args, use_cuda=True, local_processes=8) == "sync"  # 2 cores each
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert P.choose_backend(args, use_cuda=True, local_processes=1) == "sync"
    assert P.choose_backend(P.Args(env_backend="ale"), True, 1) == "ale"  # asked for: kept


def test_an_edited_wrapper_changes_what_a_default_run_does(tmp_path):
    source = open(SCRIPT).read()
    original = "        return float(np.sign(reward))\n"
    assert source.count(original) == 1
    edited = source.replace(original, "        raise RuntimeError('edited ClipReward ran')\n")
    (tmp_path / "ppo_atari.py").write_text(edited)
    out = run_script([*TINY, "--total-timesteps", "64"], cwd=tmp_path,
                     script=str(tmp_path / "ppo_atari.py"))
    assert out.returncode != 0 and "edited ClipReward ran" in out.stderr


def test_async_workers_survive_sigterm_to_the_process_group(tmp_path):
    """SLURM sends SIGTERM to every process: the workers must keep serving the trainer until
    it has finished its iteration and written the checkpoint."""
    proc = subprocess.Popen([sys.executable, SCRIPT, *TINY, "--total-timesteps", "100000",
                             "--env-backend", "async"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("step "):
            break
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "resume with: " in out, err[-2000:]
    (run,) = run_dirs(tmp_path)
    assert P.load_checkpoint(run)["global_step"] >= 64


def test_masked_sample_has_no_policy_gradient():
    torch.manual_seed(0)
    n = 16
    logits = torch.randn(n, 4, requires_grad=True)
    logp_all = torch.log_softmax(logits, -1)
    actions = torch.randint(0, 4, (n,))
    newlogprob = logp_all.gather(-1, actions[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    old = newlogprob.detach() + 0.05 * torch.randn(n)
    adv, ret, val = torch.randn(n), torch.randn(n), torch.randn(n)
    newvalue = val.clone().requires_grad_(True)
    mask = torch.ones(n)
    mask[[3, 9]] = 0.0
    loss, metrics = P.ppo_loss(newlogprob, entropy, newvalue, old, adv * 50, ret, val, 0.1,
                               mask=mask)
    loss.backward()
    assert torch.all(logits.grad[[3, 9]] == 0), "a replaced action moved the policy"
    assert logits.grad[mask.bool()].abs().sum() > 0
    assert torch.all(newvalue.grad[[3, 9]] != 0), "the value target may still use the step"
    # the kept samples alone, without a mask, give the same policy and entropy terms
    keep = mask.bool()
    _, alone = P.ppo_loss(newlogprob[keep], entropy[keep], newvalue[keep], old[keep],
                          adv[keep] * 50, ret[keep], val[keep], 0.1)
    for i in (0, 2, 3, 4, 5):  # pg_loss, entropy, the KL estimates, clipfrac
        torch.testing.assert_close(metrics[i], alone[i])
    # without a mask every sample counts: the replaced samples then change the policy term
    _, unmasked = P.ppo_loss(newlogprob, entropy, newvalue, old, adv * 50, ret, val, 0.1)
    assert not torch.isclose(unmasked[0], metrics[0])


def test_ale_marks_exactly_the_fire_steps_it_played():
    envs = P.make_envs(P.Args(num_envs=2, env_backend="ale"), seed=0)
    envs.reset(seed=0)
    rng, marked, lives_lost = np.random.default_rng(1), 0, np.zeros(2, bool)
    for _ in range(1500):
        _, _, terminated, truncated, infos = envs.step(rng.choice([0, 2, 3], size=2))
        assert np.array_equal(infos["overridden"], lives_lost), "FIRE step not marked"
        marked += infos["overridden"].sum()
        over = np.zeros(2, bool)
        if "episode" in infos.get("final_info", {}):
            over = infos["final_info"]["_episode"]
        lives_lost = terminated & ~over
    envs.close()
    assert marked >= 4


def test_trainer_masks_the_ale_fire_steps(workdir, monkeypatch):
    seen = []
    real = P.minibatch_loss

    def spy(*a):
        seen.append(a[-1])
        return real(*a)

    monkeypatch.setattr(P, "minibatch_loss", spy)
    P.main(P.Args(num_envs=2, num_steps=256, num_minibatches=1, update_epochs=1, cuda=False,
                  total_timesteps=2 * 512, env_backend="ale", learning_rate=1e-9))
    assert all(m is not None for m in seen)
    assert sum(float((m == 0).sum()) for m in seen) > 0, "no FIRE step was masked"
    seen.clear()
    (workdir / "sync").mkdir()
    monkeypatch.chdir(workdir / "sync")
    P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=1, update_epochs=1, cuda=False,
                  total_timesteps=64, env_backend="sync"))
    assert seen == [None]  # the in-file wrappers: CleanRL's unmasked loss


def test_a_crashing_trainer_does_not_wait_for_its_async_workers(tmp_path):
    """The workers outlive SIGTERM for the trainer's checkpoint; a trainer that crashes must
    still exit at once instead of waiting out their 60 s."""
    source = open(SCRIPT).read()
    line = "    advantages = torch.zeros_like(rewards)\n"
    assert source.count(line) == 1
    (tmp_path / "ppo_atari.py").write_text(source.replace(
        line, "    raise RuntimeError('bug in a fork')\n"))
    proc = subprocess.Popen([sys.executable, str(tmp_path / "ppo_atari.py"), *TINY,
                             "--total-timesteps", "64", "--env-backend", "async"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=50)  # about 70 s when it waits for the workers
    assert proc.returncode == 1 and "bug in a fork" in err
