"""compute_gae against hand-computed cases and a plain reference; ppo_loss on crafted inputs."""
import importlib.util

import numpy as np
import pytest
import torch

import ppo_atari as P
from conftest import SCRIPT, expect, need, need_text, obs_shape

pytestmark = pytest.mark.details  # the published details: `pytest tests -m details`

OBS = obs_shape()


def reference_gae(rewards, values, dones, next_value, gamma, lam):
    """Straight from the definition: A_t = sum_l (gamma*lam)^l delta_{t+l}, cut at a done."""
    T, N = rewards.shape
    values_ext = np.vstack([values, next_value[None]])
    adv = np.zeros((T, N))
    for n in range(N):
        for t in range(T):
            total, discount = 0.0, 1.0
            for k in range(t, T):
                nonterminal = 1.0 - dones[k, n]
                delta = rewards[k, n] + gamma * values_ext[k + 1, n] * nonterminal - values[k, n]
                total += discount * delta
                if dones[k, n]:
                    break
                discount *= gamma * lam
            adv[t, n] = total
    return adv


def gae(rewards, values, dones, next_value, gamma, lam):
    need("compute_gae")
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    a, r = P.compute_gae(t(rewards), t(values), t(dones), t(next_value), gamma, lam)
    return a.numpy(), r.numpy()


def test_hand_computed_done_mid_rollout():
    # rewards 1 each step, values 0, episode ends after step 1, bootstrap value 10
    adv, ret = gae([[1.0], [1.0], [1.0]], [[0.0], [0.0], [0.0]], [[0.0], [1.0], [0.0]], [10.0],
                   gamma=0.9, lam=1.0)
    expect((np.allclose(adv[:, 0], [1.9, 1.0, 10.0]),
            f"GAE cut at a done (gamma 0.9, lambda 1, done after step 1, bootstrap 10): "
            f"advantages [1.9, 1.0, 10.0]; this copy's {adv[:, 0].round(6).tolist()}"),
           (np.allclose(ret, adv), f"returns = advantages + values (values 0 here): "
            f"{adv[:, 0].round(6).tolist()}; this copy's {ret[:, 0].round(6).tolist()}"))


def test_hand_computed_done_at_last_step_ignores_bootstrap():
    adv, ret = gae([[0.0], [2.0]], [[1.0], [0.5]], [[0.0], [1.0]], [100.0], gamma=0.5, lam=0.5)
    # t=1: 2 - 0.5 = 1.5 (no bootstrap); t=0: 0 + 0.5*0.5 - 1 + 0.25*1.5 = -0.375
    expect((np.allclose(adv[:, 0], [-0.375, 1.5]),
            f"GAE with a done at the last step takes no bootstrap value: advantages "
            f"[-0.375, 1.5]; this copy's {adv[:, 0].round(6).tolist()}"),
           (np.allclose(ret[:, 0], [0.625, 2.0]), f"returns = advantages + values: "
            f"[0.625, 2.0]; this copy's {ret[:, 0].round(6).tolist()}"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_on_random_rollouts(seed):
    rng = np.random.default_rng(seed)
    T, N = 16, 3
    rewards, values = rng.normal(size=(T, N)), rng.normal(size=(T, N))
    dones = (rng.random((T, N)) < 0.2).astype(float)
    dones[-1, 0] = 1.0
    next_value = rng.normal(size=N)
    adv, ret = gae(rewards, values, dones, next_value, 0.99, 0.95)
    reference = reference_gae(rewards, values, dones, next_value, 0.99, 0.95)
    expect((np.allclose(adv, reference, rtol=1e-10, atol=1e-12),
            f"GAE of record (Schulman et al. 2016, gamma 0.99, lambda 0.95, cut at each done): "
            f"this copy's advantages differ from it by up to {np.abs(adv - reference).max():.3g}"),
           (np.allclose(ret, adv + values), f"returns = advantages + values; this copy's differ "
            f"by up to {np.abs(ret - adv - values).max():.3g}"))


def test_forward_scales_a_copy_and_matches_float_input():
    """The in-place /255 in Agent.forward must act on its own copy: a float32 channels_last
    input (which .to() would otherwise return as is) stays untouched, and gives the same
    outputs as the uint8 frames it holds."""
    need("Agent.forward")
    torch.manual_seed(0)
    agent = P.Agent(OBS, 4)
    frames = torch.randint(0, 256, (8, *OBS), dtype=torch.uint8)
    as_float = frames.to(torch.float32, memory_format=torch.channels_last)
    before = as_float.clone()
    with torch.no_grad():
        logits_u8, value_u8 = agent(frames)
        logits_f, value_f = agent(as_float)
        agent(as_float)
    expect((torch.equal(as_float, before), "Agent.forward scales its own copy of the frames: "
            "this copy's changed the float tensor it was given"),
           (torch.equal(logits_u8, logits_f) and torch.equal(value_u8, value_f),
            "uint8 frames and the same frames as float32 give the same outputs (x / 255); "
            "this copy's differ"),
           (logits_u8.dtype == torch.float32 and value_u8.shape == (8,),
            f"outputs float32 logits and (B,) values; this copy's {logits_u8.dtype} and "
            f"{tuple(value_u8.shape)}"))


def crafted(ratio, advantage, newvalue=0.0, value=0.0, ret=0.0, clip=0.2, clip_vloss=True):
    need("ppo_loss")
    logprob = torch.zeros(1)
    newlogprob = torch.log(torch.tensor([ratio])).requires_grad_()
    newv = torch.tensor([newvalue], requires_grad=True)
    loss, m = P.ppo_loss(newlogprob, torch.zeros(1), newv, logprob, torch.tensor([advantage]),
                         torch.tensor([ret]), torch.tensor([value]), clip, norm_adv=False,
                         clip_vloss=clip_vloss, ent_coef=0.0, vf_coef=1.0)
    loss.backward()
    return m, newlogprob.grad.item(), newv.grad.item()


@pytest.mark.parametrize("ratio, advantage, expected, clipped", [
    (1.5, 2.0, -2.0 * 1.2, True),     # good action pushed too far up: gain capped at 1+clip
    (0.5, -2.0, 2.0 * 0.8, True),     # bad action pushed too far down: capped at 1-clip
    (0.5, 2.0, -2.0 * 0.5, False),    # good action made less likely: pessimistic, unclipped
    (1.5, -2.0, 2.0 * 1.5, False),    # bad action made more likely: pessimistic, unclipped
    (1.1, 1.0, -1.1, False),          # inside the trust region
])
def test_surrogate_clipping(ratio, advantage, expected, clipped):
    m, grad, _ = crafted(ratio, advantage)
    case = f"ratio {ratio}, advantage {advantage}, clip 0.2"
    expect((m["policy_loss"].item() == pytest.approx(expected, rel=1e-5),
            f"clipped surrogate (pessimistic min of ratio and clipped ratio) at {case}: "
            f"pg_loss {expected:.4g}; this copy's {m['policy_loss'].item():.4g}"),
           (m["clipfrac"].item() == float(abs(ratio - 1) > 0.2),
            f"clipfrac = share of |ratio - 1| > clip at {case}: {float(abs(ratio - 1) > 0.2)}; "
            f"this copy's {m['clipfrac'].item()}"),
           ((grad == 0.0) == clipped, f"a clipped term passes no gradient to the policy at "
            f"{case}: {'zero' if clipped else 'non-zero'} gradient published; this copy's "
            f"{grad:.4g}"))


def test_value_clipping():
    # value moved 0 -> 0.5 towards the return 1; clip 0.2 keeps the pessimistic (clipped) error
    clipped, _, vgrad = crafted(1.0, 0.0, newvalue=0.5, value=0.0, ret=1.0)
    plain, _, plain_grad = crafted(1.0, 0.0, newvalue=0.5, value=0.0, ret=1.0, clip_vloss=False)
    inside, _, _ = crafted(1.0, 0.0, newvalue=0.1, value=0.0, ret=1.0)  # unclipped error
    expect((clipped["value_loss"].item() == pytest.approx(0.5 * 0.8 ** 2),
            f"clipped value loss (value 0 -> 0.5, return 1, clip 0.2: the pessimistic clipped "
            f"error) 0.32; this copy's {clipped['value_loss'].item():.4g}"),
           (clipped["value_clipfrac"].item() == 1.0, f"value_clipfrac when the value moved past "
            f"the clip: 1.0; this copy's {clipped['value_clipfrac'].item()}"),
           (vgrad == 0.0, f"a clipped value error passes no gradient: 0; this copy's {vgrad:.4g}"),
           (plain["value_loss"].item() == pytest.approx(0.5 * 0.5 ** 2), f"--no-clip-vloss: "
            f"0.5 * (0.5 - 1)^2 = 0.125; this copy's {plain['value_loss'].item():.4g}"),
           (plain_grad == pytest.approx(-0.5), f"--no-clip-vloss gradient (value - return): "
            f"-0.5; this copy's {plain_grad:.4g}"),
           (inside["value_loss"].item() == pytest.approx(0.5 * 0.9 ** 2), f"a value inside the "
            f"clip range keeps its error: 0.405; this copy's {inside['value_loss'].item():.4g}"),
           (inside["value_clipfrac"].item() == 0.0, f"value_clipfrac inside the clip range: "
            f"0.0; this copy's {inside['value_clipfrac'].item()}"))


def test_approx_kl_keeps_its_gradient_so_a_kl_penalty_is_one_line(tmp_path):
    """A KL penalty is `+ kl_coef * approx_kl` in ppo_loss's loss line: approx_kl must carry its
    gradient there (only the logged metric is detached), and be (r - 1) - log r."""
    line = "    loss = pg_loss - ent_coef * entropy_loss + vf_coef * v_loss\n"
    need_text(line, "ppo_loss's loss line `loss = pg_loss - ent_coef * entropy_loss + vf_coef * "
              "v_loss`, which it extends with a KL penalty")
    (tmp_path / "kl_penalty.py").write_text(
        open(SCRIPT).read().replace(line, line[:-1] + " + 10.0 * approx_kl\n"))
    spec = importlib.util.spec_from_file_location("kl_penalty", tmp_path / "kl_penalty.py")
    penalized = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(penalized)
    g = torch.Generator().manual_seed(0)
    logprob = torch.randn(16, generator=g) * 0.1 - 1.4
    moved, advantages = logprob + torch.randn(16, generator=g) * 0.1, torch.randn(16, generator=g)
    grads = []
    for module in (P, penalized):
        newlogprob = moved.clone().requires_grad_()
        loss, metrics = module.ppo_loss(newlogprob, torch.ones(16), torch.zeros(16), logprob,
                                        advantages, torch.zeros(16), torch.zeros(16), 0.2)
        loss.backward()
        grads.append(newlogprob.grad)
        assert not metrics["approx_kl"].requires_grad, ("the logged approx_kl is a detached copy; "
                                                        "this copy's carries a gradient")
    ratio = (moved - logprob).exp()
    # d/dlogp_i of mean((r - 1) - log r) is (r_i - 1) / B
    torch.testing.assert_close(grads[1] - grads[0], 10.0 * (ratio - 1) / 16, msg=(
        "approx_kl in ppo_loss must keep its gradient, (r - 1) - log r, for a KL penalty"))
