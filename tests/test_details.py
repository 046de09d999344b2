"""Small, fast checks that pin the implementation details of PPO one by one (the "37 details"
of Huang et al. 2022): the loss's terms and weights, initialization, the optimizer and what the
training loop feeds them. tests/mutate.py breaks each detail and checks that a test fails."""
import math

import gymnasium as gym
import pytest
import torch
import torch.nn as nn

import ppo_atari as P
from conftest import Truncating, obs_shape, random_minibatch

OBS = obs_shape()


def batch(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logprob = torch.randn(n, generator=g) * 0.1 - 1.4
    return dict(newlogprob=logprob + torch.randn(n, generator=g) * 0.05,
                entropy=torch.rand(n, generator=g) + 0.5, newvalue=torch.randn(n, generator=g),
                logprob=logprob, advantages=torch.randn(n, generator=g) * 3 + 1,
                returns=torch.randn(n, generator=g), values=torch.randn(n, generator=g))


def test_loss_is_pg_minus_entropy_bonus_plus_weighted_value_loss():
    for ent_coef, vf_coef in [(0.01, 0.5), (0.3, 2.0)]:
        loss, m = P.ppo_loss(**batch(), clip_coef=0.1, ent_coef=ent_coef, vf_coef=vf_coef)
        expected = m["policy_loss"] - ent_coef * m["entropy"] + vf_coef * m["value_loss"]
        torch.testing.assert_close(loss, expected, msg="the loss of record is pg_loss - "
                                   "ent_coef * entropy + vf_coef * v_loss (CleanRL, baselines)")


def test_the_minibatch_loss_is_the_ppo_loss_of_record():
    """Pins the published objective at the level the update uses: minibatch_loss is exactly
    pg_loss - ent_coef * entropy + vf_coef * v_loss, with no other term (a fork that adds an
    auxiliary loss fails here, and only here)."""
    torch.manual_seed(0)
    agent = P.Agent(OBS, 4)
    mb = random_minibatch(agent, 16)
    mb["logprobs"] = mb["logprobs"] + 0.1 * torch.randn(16)  # ratios away from 1
    args = P.Args()
    loss, m = P.minibatch_loss(agent, mb, 0.1, args)
    expected = m["policy_loss"] - args.ent_coef * m["entropy"] + args.vf_coef * m["value_loss"]
    torch.testing.assert_close(loss, expected, msg="the loss of record is pg_loss - ent_coef * "
                               "entropy + vf_coef * v_loss; this file's minibatch_loss differs")


def test_the_entropy_term_pushes_towards_more_entropy():
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5]], requires_grad=True)
    logp_all = torch.log_softmax(logits, -1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros(1)
    loss, _ = P.ppo_loss(logp_all[:, 0], entropy, zero, logp_all[:, 0].detach(), zero, zero,
                         zero, 0.1, norm_adv=False, ent_coef=0.01)
    loss.backward()
    with torch.no_grad():  # a small step against the gradient must raise the entropy
        stepped = torch.log_softmax(logits - 0.1 * logits.grad, -1)
    assert -(stepped.exp() * stepped).sum() > entropy.detach().sum()


def test_entropy_is_that_of_the_categorical_policy():
    agent = P.Agent(OBS, 4)
    with torch.no_grad():  # a uniform policy: entropy log 4, whatever the network
        for p in agent.parameters():
            p.zero_()
    obs = torch.randint(0, 255, (8, *OBS), dtype=torch.uint8)
    _, value = agent(obs)
    mb = dict(obs=obs, actions=torch.zeros(8, dtype=torch.long), logprobs=torch.zeros(8),
              advantages=torch.randn(8), returns=value.detach(), values=value.detach())
    _, m = P.minibatch_loss(agent, mb, 0.1, P.Args())
    assert math.isclose(m["entropy"].item(), math.log(4), rel_tol=1e-5)


def test_policy_gradient_flows_through_the_ratio():
    b = batch(8)
    newlogprob = b.pop("newlogprob").clone().requires_grad_(True)
    b["newlogprob"] = newlogprob
    loss, _ = P.ppo_loss(**b, clip_coef=10.0, ent_coef=0.0, vf_coef=0.0)  # nothing clipped
    loss.backward()
    adv = b["advantages"]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = (newlogprob - b["logprob"]).exp().detach()
    torch.testing.assert_close(newlogprob.grad, -adv * ratio / 8)


def test_advantage_normalization_is_per_minibatch_and_affine_invariant():
    b = batch()
    _, base = P.ppo_loss(**b, clip_coef=0.1)
    b["advantages"] = b["advantages"] * 7.0 + 5.0
    _, moved = P.ppo_loss(**b, clip_coef=0.1)
    # the same pg_loss: mean and scale removed
    torch.testing.assert_close(base["policy_loss"], moved["policy_loss"])
    _, raw = P.ppo_loss(**b, clip_coef=0.1, norm_adv=False)
    assert not torch.isclose(raw["policy_loss"], base["policy_loss"])


def test_value_loss_is_half_the_clipped_squared_error():
    zero = torch.zeros(2)
    values, returns = torch.tensor([0.0, 0.0]), torch.tensor([1.0, -2.0])
    newvalue = torch.tensor([0.5, 0.05])  # the first moved more than clip 0.2: clipped to 0.2
    _, m = P.ppo_loss(zero, zero, newvalue, zero, zero, returns, values, 0.2)
    expected = 0.5 * (max((0.5 - 1) ** 2, (0.2 - 1) ** 2) + max(2.05 ** 2, 2.05 ** 2)) / 2
    assert math.isclose(m["value_loss"].item(), expected, rel_tol=1e-6)
    _, plain = P.ppo_loss(zero, zero, newvalue, zero, zero, returns, values, 0.2,
                          clip_vloss=False)
    assert math.isclose(plain["value_loss"].item(), 0.5 * ((0.5 - 1) ** 2 + 2.05 ** 2) / 2,
                        rel_tol=1e-6)


def singular_values(layer):
    return torch.linalg.svdvals(layer.weight.detach().reshape(layer.weight.shape[0], -1))


def test_orthogonal_init_gains_and_zero_biases():
    """Pins the published network: NatureCNN (3 convs, a 512 Linear) with orthogonal init,
    gains sqrt 2 (hidden), 0.01 (actor), 1 (critic), zero biases (CleanRL, baselines)."""
    agent = P.Agent(OBS, 6)
    hidden = [m for m in agent.network if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(hidden) == 4, "NatureCNN of record: 3 conv layers and a Linear(., 512)"
    for layer in hidden:  # orthogonal with gain sqrt(2): every singular value sqrt(2)
        torch.testing.assert_close(singular_values(layer),
                                   torch.full_like(singular_values(layer), math.sqrt(2)),
                                   msg="hidden layers: orthogonal init, gain sqrt(2)")
    torch.testing.assert_close(singular_values(agent.actor), torch.full((6,), 0.01),
                               msg="actor head: orthogonal init, gain 0.01")
    torch.testing.assert_close(singular_values(agent.critic), torch.ones(1),
                               msg="critic head: orthogonal init, gain 1")
    for layer in hidden + [agent.actor, agent.critic]:
        assert torch.count_nonzero(layer.bias) == 0, "biases start at zero"


def test_observations_are_scaled_to_unit_range():
    agent = P.Agent(OBS, 4)
    obs = torch.randint(0, 256, (3, *OBS), dtype=torch.uint8)
    logits, value = agent(obs)
    hidden = agent.network(obs.float() / 255.0)
    torch.testing.assert_close(value, agent.critic(hidden).squeeze(-1))
    torch.testing.assert_close(logits, agent.actor(hidden))


@pytest.fixture(scope="module")
def instrumented(tmp_path_factory):
    """Two iterations of main() on the stand-in env, with the optimizer, gradient clipping, GAE
    and every minibatch loss recorded."""
    seen = {"adam": [], "clip": [], "loss": [], "gae": []}

    class Adam(torch.optim.Adam):
        def __init__(self, params, **kw):
            seen["adam"].append(kw)
            super().__init__(params, **kw)
            seen["optimizer"] = self

    real_clip, real_loss, real_gae = nn.utils.clip_grad_norm_, P.minibatch_loss, P.compute_gae

    def clip(params, max_norm, *a, **kw):
        seen["clip"].append(max_norm)
        return real_clip(params, max_norm, *a, **kw)

    def loss(agent, mb, clip_coef, args):
        logits, _ = agent(mb["obs"])
        now = torch.log_softmax(logits, -1).gather(-1, mb["actions"][:, None]).squeeze(-1)
        seen["loss"].append((mb["actions"].clone(), (now - mb["logprobs"]).abs().max().item(),
                             float(clip_coef), seen["optimizer"].param_groups[0]["lr"]))
        return real_loss(agent, mb, clip_coef, args)

    def gae(rewards, values, dones, next_value, *a):
        seen["gae"].append((dones.clone(), next_value.clone()))
        return real_gae(rewards, values, dones, next_value, *a)

    def make_envs(args, seed, video_folder=None, every_game=False):
        thunk = lambda: gym.wrappers.RecordEpisodeStatistics(Truncating())  # noqa: E731
        return gym.vector.SyncVectorEnv([thunk] * args.num_envs,
                                        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)

    with pytest.MonkeyPatch.context() as mp:  # one run shared by the tests below
        mp.chdir(tmp_path_factory.mktemp("instrumented"))
        mp.setattr(torch.optim, "Adam", Adam)
        mp.setattr(nn.utils, "clip_grad_norm_", clip)
        mp.setattr(P, "minibatch_loss", loss)
        mp.setattr(P, "compute_gae", gae)
        mp.setattr(P, "make_envs", make_envs)
        mp.setattr(P, "check_env_id", lambda env_id: None)
        P.main(P.Args(env_id="Truncating", num_envs=2, num_steps=16, num_minibatches=4,
                      update_epochs=3, total_timesteps=64, anneal_clip=True, cuda=False))
    return seen


def test_adam_eps_and_gradient_clipping(instrumented):
    (kw,) = instrumented["adam"]
    assert kw["eps"] == 1e-5 and kw["lr"] == 2.5e-4
    assert instrumented["clip"] == [0.5] * (2 * 3 * 4)  # every minibatch step, norm 0.5


def test_epochs_shuffled_minibatches_and_annealing(instrumented):
    calls = instrumented["loss"]
    assert len(calls) == 2 * 3 * 4  # 2 iterations x 3 epochs x 4 minibatches
    # lr 2.5e-4 and clip_coef 0.1 annealed linearly: full in iteration 1, half in iteration 2
    assert [round(c, 6) for _, _, c, _ in calls] == [0.1] * 12 + [0.05] * 12
    assert [lr for *_, lr in calls] == [2.5e-4] * 12 + [1.25e-4] * 12
    first_epoch = torch.cat([a for a, *_ in calls[:4]])
    second_epoch = torch.cat([a for a, *_ in calls[4:8]])
    assert len(first_epoch) == 32
    assert not torch.equal(first_epoch, second_epoch), "minibatches not reshuffled"


def test_stored_log_probabilities_are_the_rollout_policys(instrumented):
    # before the first optimizer step the policy is the rollout's: ratio exactly 1
    first_minibatch_gap = instrumented["loss"][0][1]
    assert first_minibatch_gap < 1e-5


def test_truncation_is_a_done_and_gae_bootstraps_from_the_next_value(instrumented):
    dones, next_value = instrumented["gae"][0]
    assert dones.shape == (16, 2)
    assert torch.equal(dones[:, 0], torch.tensor([float((t + 1) % 5 == 0) for t in range(16)]))
    assert torch.all(next_value != 0), "the last observation's value was not used"
