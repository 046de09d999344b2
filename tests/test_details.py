"""Small, fast checks that pin the implementation details of PPO one by one (the "37 details"
of Huang et al. 2022): the loss's terms and weights, initialization, the optimizer and what the
training loop feeds them. tests/dev/mutate.py breaks each detail and checks that a test fails."""
import copy
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

import ppo_atari as P
from conftest import (bound, expect, gae_calls, loss_calls, need, obs_shape, optimizer_steps,
                      seam_problem, truncating_envs)

pytestmark = pytest.mark.details  # the published details: `pytest tests -m details`

OBS = obs_shape()


def batch(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logprob = torch.randn(n, generator=g) * 0.1 - 1.4
    return dict(newlogprob=logprob + torch.randn(n, generator=g) * 0.05,
                entropy=torch.rand(n, generator=g) + 0.5, newvalue=torch.randn(n, generator=g),
                logprob=logprob, advantages=torch.randn(n, generator=g) * 3 + 1,
                returns=torch.randn(n, generator=g), values=torch.randn(n, generator=g))


def test_loss_is_pg_minus_entropy_bonus_plus_weighted_value_loss():
    need("ppo_loss")
    for ent_coef, vf_coef in [(0.01, 0.5), (0.3, 2.0)]:
        loss, m = P.ppo_loss(**batch(), clip_coef=0.1, ent_coef=ent_coef, vf_coef=vf_coef)
        expected = m["policy_loss"] - ent_coef * m["entropy"] + vf_coef * m["value_loss"]
        torch.testing.assert_close(loss, expected, msg="the loss of record is pg_loss - "
                                   "ent_coef * entropy + vf_coef * v_loss (CleanRL, baselines)")


def test_the_training_loss_is_the_ppo_loss_of_record(instrumented):
    """Pins the published objective where training uses it: every call of the loss function
    main calls, on the real minibatches of a real update, against PPO's loss of record
    (reference_ppo_terms, written apart from the file). A fork that adds a term fails here with
    the size of its term, saying which of PPO's terms its metrics still match and what the
    coefficients would have to be (a changed coefficient is named as one); a fork that keeps PPO
    passes. Where the Agent's interface changed (a recurrent policy), the loss is checked
    against the file's own terms instead."""
    steps = optimizer_steps(instrumented)
    args = steps[0]["args"]
    if all("terms" in s for s in steps):
        expected = [s["terms"]["loss"] for s in steps]
        how = "recomputed from each optimizer step's minibatch"
    else:
        expected = [s["metrics"]["policy_loss"] - args.ent_coef * s["metrics"]["entropy"] +
                    args.vf_coef * s["metrics"]["value_loss"] for s in steps]
        how = "from its own policy_loss, entropy and value_loss"
    gaps = [min(abs(s["loss"] - e), abs(s["summed"] - e)) for s, e in zip(steps, expected)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    scale = abs(expected[worst]) or 1.0
    assert gaps[worst] <= 1e-5 * scale + 1e-6, (
        f"the loss training uses is not PPO's loss of record (clipped surrogate - ent_coef * "
        f"entropy + vf_coef * clipped value loss, CleanRL and baselines ppo2; {how}): it differs "
        f"by up to {gaps[worst]:.3g} ({gaps[worst] / scale:.2%} of PPO's {expected[worst]:.4g}) "
        f"over the {len(steps)} optimizer steps of two updates. " + which_part_differs(steps))


def which_part_differs(calls: list) -> str:
    """Where the training loss parts from PPO's (calls: optimizer steps): the advantages
    normalized over each loss call's rows instead of the step's; else the terms its metrics
    report against PPO's terms of record, then, with those matching, the coefficient that would
    explain the rest."""
    if not all("terms" in c for c in calls):
        return ""
    args = calls[0]["args"]
    split = [s for s in calls if len(s["calls"]) > 1]
    if split and args.norm_adv and all(
            abs(s["loss"] - sum(len(c["actions"]) * c["of_record"] for c in s["calls"]) /
                s["rows"]) <= 1e-5 * abs(s["loss"]) + 1e-6 for s in split):
        call_rows = sorted({len(c["actions"]) for s in split for c in s["calls"]})
        return (f"Advantage normalization: over each loss call's rows ({call_rows}), not over "
                f"the {split[0]['rows']} rows of the minibatch an optimizer step learns from "
                f"(normalize the minibatch's advantages before splitting it).")
    names = ["policy_loss", "value_loss", "entropy"]
    gap = {n: max(abs(c["metrics"].get(n, float("nan")) - c["terms"][n]) for c in calls)
           for n in names}
    differ = [n for n in names if not gap[n] <= 1e-5 * max(abs(c["terms"][n]) for c in calls)
              + 1e-6]
    if differ:
        return "Its metrics differ from PPO's terms: " + ", ".join(
            f"{n} by up to {gap[n]:.3g}" if gap[n] == gap[n] else f"{n} not reported"
            for n in differ) + "."
    pg, v, e = ([c["terms"][n] for c in calls] for n in names)
    loss = [c["loss"] for c in calls]
    ent = [(p + args.vf_coef * vv - l) / ee for p, vv, ee, l in zip(pg, v, e, loss)]
    vf = [(l - p + args.ent_coef * ee) / vv for p, vv, ee, l in zip(pg, v, e, loss)]
    constant = {name: max(xs) - min(xs) <= 1e-4 * max(map(abs, xs))
                for name, xs in (("entropy", ent), ("value", vf))}
    head = "Its policy_loss, value_loss and entropy match PPO's terms; what differs is how " \
        "they are combined: "
    if constant["entropy"] != constant["value"]:
        name, xs, published = ("entropy", ent, args.ent_coef) if constant["entropy"] else \
            ("value", vf, args.vf_coef)
        return head + f"the {name} coefficient is {xs[0]:.4g}, not the published {published}."
    return head + (f"no one coefficient explains it: an added term, or a coefficient that "
                   f"changes across minibatches (the entropy coefficient would run from "
                   f"{min(ent):.4g} to {max(ent):.4g}, published {args.ent_coef}; the value "
                   f"coefficient from {min(vf):.4g} to {max(vf):.4g}, published {args.vf_coef}).")


def test_the_entropy_term_pushes_towards_more_entropy():
    need("ppo_loss")
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5]], requires_grad=True)
    logp_all = torch.log_softmax(logits, -1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros(1)
    loss, _ = P.ppo_loss(logp_all[:, 0], entropy, zero, logp_all[:, 0].detach(), zero, zero,
                         zero, 0.1, norm_adv=False, ent_coef=0.01)
    loss.backward()
    with torch.no_grad():  # a small step against the gradient must raise the entropy
        stepped = torch.log_softmax(logits - 0.1 * logits.grad, -1)
    after = -(stepped.exp() * stepped).sum()
    assert after > entropy.detach().sum(), (
        f"the entropy bonus (- ent_coef * entropy in the loss) raises the entropy; a step "
        f"against this copy's gradient moved it from {entropy.item():.6f} to {after.item():.6f}")


def test_entropy_is_that_of_the_categorical_policy():
    need("Agent.get_action_and_value")
    agent = P.Agent(OBS, 4)
    with torch.no_grad():  # a uniform policy: entropy log 4, whatever the network
        for p in agent.parameters():
            p.zero_()
    obs = torch.randint(0, 255, (8, *OBS), dtype=torch.uint8)
    _, logprob, entropy, _ = agent.get_action_and_value(obs, torch.zeros(8, dtype=torch.long))[:4]
    expect((torch.allclose(entropy, torch.full((8,), math.log(4))), f"the policy of record is a "
            f"categorical over the actions (uniform here): entropy log 4 = {math.log(4):.4f}; "
            f"this copy's {entropy[0].item():.4f}"),
           (torch.allclose(logprob, torch.full((8,), -math.log(4))), f"a uniform categorical's "
            f"log-probability: -log 4 = {-math.log(4):.4f}; this copy's {logprob[0].item():.4f}"))


def test_policy_gradient_flows_through_the_ratio():
    need("ppo_loss")
    b = batch(8)
    newlogprob = b.pop("newlogprob").clone().requires_grad_(True)
    b["newlogprob"] = newlogprob
    loss, _ = P.ppo_loss(**b, clip_coef=10.0, ent_coef=0.0, vf_coef=0.0)  # nothing clipped
    loss.backward()
    adv = b["advantages"]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = (newlogprob - b["logprob"]).exp().detach()
    torch.testing.assert_close(newlogprob.grad, -adv * ratio / 8, msg=lambda m: (
        "the policy gradient flows through the ratio: d pg_loss / d logp = -A * ratio / B "
        f"(normalized advantages, nothing clipped); this copy's differs: {m}"))


def test_advantage_normalization_is_per_minibatch_and_affine_invariant():
    need("ppo_loss")
    b = batch()
    _, base = P.ppo_loss(**b, clip_coef=0.1)
    b["advantages"] = b["advantages"] * 7.0 + 5.0
    _, moved = P.ppo_loss(**b, clip_coef=0.1)
    _, raw = P.ppo_loss(**b, clip_coef=0.1, norm_adv=False)
    expect((torch.isclose(base["policy_loss"], moved["policy_loss"]), f"advantages normalized "
            f"per minibatch (mean and scale removed): 7 A + 5 gives A's pg_loss "
            f"{base['policy_loss']:.5f}; this copy's {moved['policy_loss']:.5f}"),
           (not torch.isclose(raw["policy_loss"], base["policy_loss"]), "--no-norm-adv uses the "
            "advantages as they are; this copy's pg_loss is the normalized one"))


def test_value_loss_is_half_the_clipped_squared_error():
    need("ppo_loss")
    zero = torch.zeros(2)
    values, returns = torch.tensor([0.0, 0.0]), torch.tensor([1.0, -2.0])
    newvalue = torch.tensor([0.5, 0.05])  # the first moved more than clip 0.2: clipped to 0.2
    _, m = P.ppo_loss(zero, zero, newvalue, zero, zero, returns, values, 0.2)
    expected = 0.5 * (max((0.5 - 1) ** 2, (0.2 - 1) ** 2) + max(2.05 ** 2, 2.05 ** 2)) / 2
    _, plain = P.ppo_loss(zero, zero, newvalue, zero, zero, returns, values, 0.2,
                          clip_vloss=False)
    unclipped = 0.5 * ((0.5 - 1) ** 2 + 2.05 ** 2) / 2
    expect((math.isclose(m["value_loss"].item(), expected, rel_tol=1e-6), f"value loss of record "
            f"(baselines ppo2): 0.5 * mean(max(unclipped, clipped squared error)) = "
            f"{expected:.5f}; this copy's {m['value_loss'].item():.5f}"),
           (math.isclose(plain["value_loss"].item(), unclipped, rel_tol=1e-6), f"--no-clip-vloss: "
            f"0.5 * mean squared error = {unclipped:.5f}; this copy's "
            f"{plain['value_loss'].item():.5f}"))


def singular_values(layer):
    return torch.linalg.svdvals(layer.weight.detach().reshape(layer.weight.shape[0], -1))


def trunks(agent) -> dict:
    """Each head's own trunk: the Conv2d and Linear layers its input depends on, found by autograd
    from one pass of get_action_and_value, in module order (a shared trunk is both heads', a
    separate one each head's own). Where that interface or the heads changed (a recurrent policy),
    Agent.network stands for both."""
    layers = [m for m in agent.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    if seam_problem("Agent.get_action_and_value") or seam_problem("Agent heads"):
        trunk = getattr(agent, "network", None)
        shared = [m for m in trunk.modules() if m in layers] if isinstance(trunk, nn.Module) else []
        return {"actor": shared, "critic": shared}
    inputs, hooks = {}, [getattr(agent, head).register_forward_pre_hook(
        lambda m, i, head=head: inputs.setdefault(head, i[0])) for head in ("actor", "critic")]
    agent.get_action_and_value(torch.randint(0, 256, (5, *OBS), dtype=torch.uint8))
    for hook in hooks:
        hook.remove()
    found = {}
    for head, features in inputs.items():
        grads = torch.autograd.grad(features.sum(), [m.weight for m in layers], allow_unused=True,
                                    retain_graph=True) \
            if features.requires_grad else [None] * len(layers)
        found[head] = [m for m, g in zip(layers, grads) if g is not None]
    return found


def hidden_layers(agent) -> list:
    """Every trunk layer of the actor's and the critic's, in module order."""
    found = trunks(agent)
    return [m for m in agent.modules() if any(m in layers for layers in found.values())]


def test_the_trunk_is_the_nature_cnn():
    """NatureCNN of record (Mnih et al. 2015, CleanRL): 3 conv layers, then a Linear(., 512), one
    trunk shared by the heads (a fork with separate actor and critic trunks: each is checked)."""
    found = trunks(P.Agent(OBS, 6))
    separate = found["actor"] != found["critic"]
    common = [m for m in found["actor"] if m in found["critic"]]
    checks = [(not separate, f"one trunk shared by the actor and the critic (published: CleanRL, "
               f"baselines ppo2); this copy's actor reads {len(found['actor'])} layers and its "
               f"critic {len(found['critic'])}, {len(common)} of them shared")]
    for head, hidden in (found.items() if separate else [("Agent", found["actor"])]):
        kinds = [type(m).__name__ for m in hidden]
        where = f"the {head}'s trunk" if separate else "the trunk the heads share"
        checks.append((kinds == ["Conv2d"] * 3 + ["Linear"] and hidden[-1].out_features == 512,
                       f"NatureCNN of record: 3 conv layers and a Linear(., 512) in {where}; "
                       f"this copy's has {len(hidden)} such layers ({', '.join(kinds) or 'none'})"))
    expect(*checks)


def test_the_heads_read_the_trunks_features_directly():
    """NatureCNN of record: the actor and the critic each read their trunk's features (the ReLU of
    its Linear(., 512)), nothing in between; modules beside them (an auxiliary or intrinsic value
    head) are the fork's own. Where the Agent's interface changed (a recurrent policy), its
    parameters tell instead."""
    need("Agent heads")
    agent = P.Agent(OBS, 6)
    if seam_problem("Agent.get_action_and_value"):
        others = sorted({name.split(".")[0] for name, _ in agent.named_parameters()} -
                        {"network", "actor", "critic"})
        assert not others, ("NatureCNN of record: the heads read the trunk's 512 features "
                            f"directly; this copy's Agent also has parameters in "
                            f"{', '.join(others)}")
        return
    found, seen = trunks(agent), {}
    for head in ("actor", "critic"):
        if found[head]:
            found[head][-1].register_forward_hook(
                lambda m, i, out, head=head: seen.setdefault(f"{head} trunk", torch.relu(out)))
        getattr(agent, head).register_forward_pre_hook(
            lambda m, i, head=head: seen.setdefault(head, i[0]))
    with torch.no_grad():
        agent.get_action_and_value(torch.randint(0, 256, (5, *OBS), dtype=torch.uint8))
    checks = []
    for head in ("actor", "critic"):
        trunk, read = seen.get(f"{head} trunk"), seen.get(head)
        checks.append((trunk is not None and read is not None and read.shape == trunk.shape and
                       torch.equal(read, trunk), f"NatureCNN of record: the {head} reads its "
                       f"trunk's 512 features directly; this copy's {head} reads "
                       f"{tuple(read.shape) if read is not None else 'nothing'} that are not "
                       f"its trunk's output"))
    expect(*checks)


@pytest.mark.parametrize("part,gain", [("hidden", math.sqrt(2)), ("actor", 0.01),
                                       ("critic", 1.0)])
def test_orthogonal_init_gain(part, gain):
    """Orthogonal init (CleanRL, baselines): every singular value of a layer's weight is its
    gain: sqrt 2 for the trunk's layers, 0.01 for the actor head, 1 for the critic head."""
    agent = P.Agent(OBS, 6)
    layers = hidden_layers(agent) if part == "hidden" else [getattr(agent, part, None)]
    if part != "hidden":
        need("Agent heads")
    checks = []
    for layer in layers:
        values = singular_values(layer)
        checks.append((torch.allclose(values, torch.full_like(values, gain), rtol=1e-4, atol=1e-6),
                       f"{part} layers: orthogonal init with gain {gain:.4g} (published); this "
                       f"copy's {type(layer).__name__} has singular values "
                       f"{values.min():.4g}..{values.max():.4g}"))
    expect(*checks)


def test_biases_start_at_zero():
    need("Agent heads")
    agent = P.Agent(OBS, 6)
    expect(*[(torch.count_nonzero(layer.bias) == 0, f"biases start at zero (published); this "
              f"copy's {name} {type(layer).__name__} has {int(torch.count_nonzero(layer.bias))} "
              f"non-zero") for name, layer in [("hidden", m) for m in hidden_layers(agent)] + [
                  ("actor", agent.actor), ("critic", agent.critic)]])


def test_observations_are_scaled_to_unit_range():
    """What the network's first layers receive is the frames / 255: read at every convolution
    that takes the observation's channels (one per trunk: separate actor and critic trunks are
    each checked), else through Agent.network and the heads."""
    need("Agent.forward")
    agent = P.Agent(OBS, 4)
    obs = torch.randint(0, 256, (3, *OBS), dtype=torch.uint8)
    firsts = [m for m in agent.modules() if isinstance(m, nn.Conv2d) and m.in_channels == OBS[0]]
    if firsts:
        seen = []
        for layer in firsts:
            layer.register_forward_pre_hook(lambda m, i: seen.append(i[0].detach().float()))
        with torch.no_grad():
            agent(obs)
        scaled = [torch.allclose(s, obs.float() / 255.0, atol=1e-6) for s in seen]
        ranges = [f"[{float(s.min()):.3g}, {float(s.max()):.3g}]" for s in seen]
        assert seen and all(scaled), ("frames are scaled to [0, 1] (x / 255) before the trunk "
                                      f"(published); this copy's first layers receive {ranges}")
        return
    need("Agent heads")
    logits, value = agent(obs)
    hidden = agent.network(obs.float() / 255.0)
    expect((torch.allclose(value, agent.critic(hidden).squeeze(-1), atol=1e-6) and
            torch.allclose(logits, agent.actor(hidden), atol=1e-6), "frames are scaled to [0, 1] "
            "(x / 255) before the trunk (published); this copy's outputs differ from that"))


CLEANRL = "CleanRL ppo_atari.py"
PPO2 = "CleanRL ppo_atari.py; baselines ppo2's Atari defaults (Huang et al. 2022)"
# The published hyperparameters this file claims, each with its source, written here apart from
# the file: a test that read them from Args could not fail. Adam's eps is checked on the
# optimizer the training makes.
PUBLISHED = {
    "total_timesteps": (10_000_000, CLEANRL + " (the 10M-step scores README quotes)"),
    "learning_rate": (2.5e-4, PPO2), "anneal_lr": (True, PPO2),
    "num_envs": (8, PPO2), "num_steps": (128, PPO2),
    "gamma": (0.99, PPO2), "gae_lambda": (0.95, PPO2),
    "num_minibatches": (4, PPO2), "update_epochs": (4, PPO2),
    "norm_adv": (True, PPO2 + ": per-minibatch advantage normalization"),
    "clip_coef": (0.1, PPO2), "anneal_clip": (False, PPO2 + ": a constant clip range"),
    "clip_vloss": (True, PPO2 + ": the clipped value loss"),
    "ent_coef": (0.01, PPO2), "vf_coef": (0.5, PPO2), "max_grad_norm": (0.5, PPO2),
    "target_kl": (None, CLEANRL + ": no early stop"),
}


def test_args_defaults_are_the_published_hyperparameters(instrumented):
    """One line per field whose default differs from the published value, so a fork that
    changes a default on purpose reads exactly what it changed (and that its scores are no
    longer those README quotes)."""
    need("main")
    defaults = {f.name: f.default for f in dataclasses.fields(P.Args)}
    lines = [f"--{name.replace('_', '-')}: published {value!r} ({source}); this copy's "
             f"default {defaults.get(name, 'absent')!r}"
             for name, (value, source) in PUBLISHED.items()
             if name not in defaults or defaults[name] != value
             or type(defaults[name]) is not type(value)]
    eps = [kw.get("eps") for kw in instrumented["adam"]]
    if eps != [1e-5]:
        lines.append(f"Adam eps: published 1e-05 ({PPO2}); this copy's optimizers' {eps}")
    assert not lines, "defaults that are not the published hyperparameters:\n" + "\n".join(lines)


def test_adam_eps_and_learning_rate(instrumented):
    adams = instrumented["adam"]
    assert len(adams) == 1, f"one Adam optimizer (published); this copy's made {len(adams)}"
    kw = adams[0]
    expect((kw.get("eps") == 1e-5, f"Adam eps of record: 1e-5; this copy's: {kw.get('eps')}"),
           (kw.get("lr") == 2.5e-4, f"Adam lr of record: 2.5e-4; this copy's: {kw.get('lr')}"))


def test_gradient_norm_clipped_at_every_minibatch_step(instrumented):
    clips, steps = instrumented["clip"], 2 * 3 * 4
    assert clips == [0.5] * steps, (f"gradient norm clipped to 0.5 at each of the {steps} "
                                    f"minibatch steps (published); this copy's: {clips}")


def test_epochs_and_shuffled_minibatches(instrumented):
    calls = optimizer_steps(instrumented)  # what each optimizer step learned from
    assert len(calls) == 2 * 3 * 4, (f"optimizer steps of 2 iterations x 3 epochs x 4 "
                                     f"minibatches: 24; this copy's {len(calls)}")
    rows = [c["rows"] for c in calls]
    epochs = [torch.cat([c["actions"] for c in calls[e * 4:(e + 1) * 4]]) for e in range(3)]
    expect((rows == [16] * 24, f"each optimizer step learns from one minibatch of 64 / 4 = 16 "
            f"rows; this copy's steps learned from {sorted(set(rows))} rows"),
           (len(epochs[0]) == 64, f"each epoch passes over the whole batch of 4 envs x 16 steps "
            f"(64); this copy's first epoch {len(epochs[0])}"),
           (not all(torch.equal(epochs[0], e) for e in epochs[1:]), "minibatches are reshuffled "
            "every epoch (published); this copy's epochs repeat one order"))


def test_learning_rate_and_clip_range_annealed_linearly(workdir, monkeypatch):
    """lr 2.5e-4 and (--anneal-clip) clip_coef 0.1 fall linearly to 0 over the run: 1, 3/4, 1/2
    and 1/4 of them in iterations 1-4 of 4, at every optimizer step (4 iterations: a cosine
    decay meets the line at iterations 1 and 2 of 2), in the stand-in game."""
    need("main")
    seen, clips, last, real_step, real_loss = [], [], [], torch.optim.Adam.step, P.minibatch_loss

    def step(self, *a, **kw):  # the rate and clip range of each optimizer step
        seen.append(self.param_groups[0]["lr"])
        clips.append(last[-1])
        return real_step(self, *a, **kw)

    def loss(*a, **kw):  # (a step may learn from several loss calls)
        last.append(round(float(bound(real_loss, a, kw)["clip_coef"]), 6))
        return real_loss(*a, **kw)

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    monkeypatch.setattr(P, "minibatch_loss", loss)
    monkeypatch.setattr(P, "make_envs", truncating_envs)
    monkeypatch.setattr(P, "check_env_id", lambda env_id: None)
    P.main(P.Args(env_id="Truncating", num_envs=2, num_steps=8, num_minibatches=1,
                  update_epochs=1, total_timesteps=4 * 16, anneal_clip=True, cuda=False,
                  run_name="schedules"))
    lrs = [round(lr, 12) for lr in seen]
    expect((lrs == [2.5e-4, 1.875e-4, 1.25e-4, 6.25e-5], f"learning rate annealed linearly: "
            f"2.5e-4, 1.875e-4, 1.25e-4, 6.25e-5 in iterations 1-4 of 4; this copy's {lrs}"),
           (clips == [0.1, 0.075, 0.05, 0.025], f"--anneal-clip: clip 0.1, 0.075, 0.05, 0.025 in "
            f"iterations 1-4 of 4 (linear to 0); this copy's {clips}"))


def test_the_first_minibatch_has_ratio_one_no_clipping_and_no_kl(instrumented):
    """Before the first optimizer step the policy is the rollout's: the stored log-probabilities
    are the rollout policy's, so the ratio is exactly 1, nothing is clipped, both KL estimates
    are 0, and the surrogate of normalized advantages (mean 0) is 0."""
    first = optimizer_steps(instrumented)[0]  # its calls' metrics, weighted by their rows
    m, gap = first["metrics"], first["ratio_gap"]
    checks = [(gap < 1e-5, f"the stored log-probabilities are the rollout policy's (ratio 1 "
               f"before the first step); this copy's differ by {gap:.3g}")]
    for name, bound in [("old_approx_kl", 1e-6), ("approx_kl", 1e-6), ("clipfrac", 0.0),
                        ("value_clipfrac", 0.0), ("policy_loss", 1e-5)]:
        hint = " (advantages normalized per minibatch?)" if name == "policy_loss" else ""
        checks.append((abs(m[name]) <= bound, f"{name} of the first minibatch (ratio 1; "
                       f"advantages normalized to mean 0): 0 published, this copy's "
                       f"{m[name]:.3g}{hint}"))
    expect(*checks, (0 < m["entropy"] <= math.log(4) + 1e-6, f"entropy of 4 actions: in "
                     f"(0, log 4]; this copy's {m['entropy']:.4g}"))


def test_every_metric_of_the_training_loss_is_logged(instrumented):
    """A metric is one entry in the loss's dict: logged as losses/<name>, the mean over the
    iteration's minibatches; grad_norm, the norm before clipping, is logged by default."""
    calls, logged = optimizer_steps(instrumented), instrumented["logged"]
    checks = []
    for name in calls[0]["metrics"]:
        per_iteration = [sum(c["metrics"][name] for c in calls[i * 12:(i + 1) * 12]) / 12
                         for i in range(2)]
        got = [v for _, v in logged.get(f"losses/{name}", [])]
        checks.append((got == pytest.approx(per_iteration, rel=1e-5), f"losses/{name}: the mean "
                       f"of the metric over each iteration's 12 optimizer steps, "
                       f"{[f'{v:.6g}' for v in per_iteration]}; this copy logged "
                       f"{[f'{v:.6g}' for v in got]}"))
    grad_norms = [v for _, v in logged.get("losses/grad_norm", [])]
    expect(*checks, (len(grad_norms) == 2 and all(v > 0 for v in grad_norms), f"losses/grad_norm "
                     f"(the norm before clipping) logged at each iteration; this copy's "
                     f"{grad_norms}"))


def test_truncation_is_a_done_and_gae_bootstraps_from_the_next_value(instrumented):
    need("compute_gae")
    first = gae_calls(instrumented)[0]
    dones, next_value = first["dones"], first["next_value"]
    expected = torch.tensor([float((t + 1) % 5 == 0) for t in range(16)])
    expect((dones.shape == (16, 4) and torch.equal(dones[:, 0], expected), f"a truncation "
            f"(every 5 steps here) is a done at the step that ended it: {expected.tolist()}; "
            f"this copy's GAE got {dones[:, 0].tolist() if dones.dim() == 2 else dones.shape}"),
           (bool(torch.all(next_value != 0)), "GAE bootstraps from the value of the observation "
            "after the rollout's last step; this copy's next_value is 0"))


def gae_of_record(rewards, values, dones, next_value, gamma, lam):
    """GAE (Schulman et al. 2016) as CleanRL and baselines ppo2 compute it, written here apart
    from the file: dones[t] = 1 when step t's action ended the episode; the last step bootstraps
    from the next observation's value. Returns (advantages, returns = advantages + values)."""
    advantages, running = torch.zeros_like(rewards), torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        following = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        delta = rewards[t] + gamma * following * (1 - dones[t]) - values[t]
        running = delta + gamma * lam * (1 - dones[t]) * running
        advantages[t] = running
    return advantages, advantages + values


def test_the_loss_receives_gae_of_the_rollout(instrumented):
    """What reaches the loss: the advantages and returns (value targets) in every minibatch the
    training loss receives equal GAE of that iteration's rollout (its rewards, values and
    dones, bootstrapped from the value of the next observation), whatever the copy computes
    them with. Rows are matched through their rollout value (mb["values"])."""
    steps, rollouts = optimizer_steps(instrumented), instrumented["rollouts"]
    need(what="make_batch(agent, storage, next_obs, ...) with storage's rewards, values and "
         "dones (T, N), and Agent.get_action_and_value(next_obs) for the bootstrap value",
         problem=None if rollouts and "rewards" in rollouts[0] else "this copy has not")
    args = steps[0]["args"]
    per_iteration = len(steps) // len(rollouts)
    gaps, rows, hints = {"advantages": [], "returns": []}, 0, set()
    for i, rollout in enumerate(rollouts):
        advantages, returns = gae_of_record(rollout["rewards"], rollout["values"],
                                            rollout["dones"], rollout["next_value"],
                                            args.gamma, args.gae_lambda)
        expected = {"advantages": advantages.flatten(), "returns": returns.flatten()}
        where = {round(float(v), 9): j for j, v in enumerate(rollout["values"].flatten())}
        assert len(where) == rollout["values"].numel(), "rollout values repeat: rows unmatched"
        everything = expected["advantages"]
        for step in steps[i * per_iteration:(i + 1) * per_iteration]:
            need(what="minibatch_loss's mb with 'values', 'advantages' and 'returns'",
                 problem=None if all(len(c["targets"]) == 3 for c in step["calls"]) else
                 f"this copy's mb has {sorted(step['calls'][0]['targets'])}")
            got = {k: torch.cat([c["targets"][k] for c in step["calls"]])
                   for k in ("values", "advantages", "returns")}
            index = torch.tensor([where.get(round(float(v), 9), -1) for v in got["values"]])
            assert (index >= 0).all(), "the minibatch's values are not the rollout's"
            rows += len(index)
            gaps["returns"].append((got["returns"] - expected["returns"][index]).abs())
            gae = expected["advantages"][index]  # GAE, or GAE normalized over the minibatch the
            normalized = (gae - gae.mean()) / (gae.std() + 1e-8)  # step learns from (before a
            gaps["advantages"].append(min((got["advantages"] - gae).abs(),  # split into calls)
                                          (got["advantages"] - normalized).abs(),
                                          key=lambda g: float(g.max())))
            if float(gaps["advantages"][-1].max()) > 1e-4 and args.norm_adv:
                over_batch = (gae - everything.mean()) / (everything.std() + 1e-8)
                if float((got["advantages"] - over_batch).abs().max()) <= 1e-4:
                    hints.add("normalized over the whole batch, not per minibatch")
                elif len(step["calls"]) > 1:
                    hints.add("normalized over each loss call's rows, not over the minibatch")
    lines = []
    for key, parts in gaps.items():
        gap = torch.cat(parts)
        if gap.max() > 1e-4:
            what = "returns (the value targets)" if key == "returns" else key
            lines.append(f"{what}: differ from GAE(gamma {args.gamma}, lambda {args.gae_lambda}) "
                         f"of the rollout by up to {gap.max():.4g} (mean {gap.mean():.4g}; "
                         f"{int((gap > 1e-4).sum())} of {rows} minibatch rows)" + (
                             f"; advantage normalization: {', '.join(sorted(hints))}"
                             if key == "advantages" and hints else ""))
    assert not lines, ("what the training loss receives is not GAE of record (CleanRL, "
                       "baselines ppo2):\n" + "\n".join(lines))


def test_the_loss_of_record_far_from_ratio_one(instrumented):
    """The training loss on a crafted minibatch of the real agent: ratios from e^-3 to e^3 (far
    outside the clip range on both sides), advantages of both signs, values far from their
    targets, against PPO's loss of record term by term (a dual clip, another value loss or a
    bounded surrogate shows up here, where real minibatches, near ratio 1, do not reach; a term
    added to the total is test_the_training_loss_is_the_ppo_loss_of_record's). A fork's own
    minibatch rows (an intrinsic return) come from a real minibatch."""
    call = loss_calls(instrumented)[-1]
    need("Agent.get_action_and_value")
    args, agent = call["args"], instrumented["agent"]
    n, g = 48, torch.Generator().manual_seed(0)
    obs = torch.randint(0, 256, (n, *OBS), dtype=torch.uint8, generator=g)
    actions = torch.randint(0, 4, (n,), generator=g)
    with torch.no_grad():
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs, actions)[:4]
    shift = torch.linspace(-3, 3, n)  # log-ratio: newlogprob - logprob
    signs = torch.tensor([1.0, -1.0]).repeat(n // 2)
    mb = {"obs": obs, "actions": actions, "logprobs": newlogprob - shift,
          "advantages": signs * (torch.rand(n, generator=g) * 4 + 0.5),
          "values": newvalue + torch.randn(n, generator=g) * 3,
          "returns": newvalue + torch.randn(n, generator=g) * 10}
    mb |= {k: v[torch.arange(n) % len(v)] for k, v in call.get("own_rows", {}).items()}
    clip = 0.1
    carry = copy.deepcopy(instrumented["carry"])  # a stateful fork's coefficient, say
    _, metrics = P.minibatch_loss(agent, mb, torch.tensor(clip), args, carry)
    ratio = torch.exp(newlogprob - mb["logprobs"])
    adv = mb["advantages"]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8) if args.norm_adv else adv
    pg = -torch.min(adv * ratio, adv * ratio.clamp(1 - clip, 1 + clip)).mean()
    error = (newvalue - mb["returns"]) ** 2
    moved = mb["values"] + (newvalue - mb["values"]).clamp(-clip, clip)
    v = 0.5 * (torch.maximum(error, (moved - mb["returns"]) ** 2) if args.clip_vloss else
               error).mean()
    of_record = {"policy_loss": pg, "value_loss": v, "entropy": entropy.mean()}
    need(what="minibatch_loss's metrics policy_loss, value_loss and entropy", problem=None if
         of_record.keys() <= metrics.keys() else f"this copy's metrics are {sorted(metrics)}")
    got = {k: float(metrics[k]) for k in of_record}  # the total is the training-loss test's
    expect(*[(abs(got[k] - float(e)) <= 1e-4 * max(1.0, abs(float(e))), f"{k} at ratios e^-3.."
              f"e^3, advantages of both signs, values far from their targets: PPO's "
              f"{float(e):.6g}; this copy's {got[k]:.6g}") for k, e in of_record.items()])


def test_explained_variance_is_one_minus_the_residual_variance_share(instrumented):
    """losses/explained_variance = 1 - Var[returns - values] / Var[returns] over the iteration's
    batch (the rollout's values against GAE's returns), as CleanRL and baselines log it."""
    batches = instrumented["batch"]
    need(what="make_batch(...) returning the batch dict with its values and returns",
         problem=None if batches else "this copy's make_batch returned no such dict")
    logged = instrumented["logged"]["losses/explained_variance"]
    assert len(logged) == len(batches) == 2, (f"one explained variance per iteration (2); this "
                                              f"copy logged {len(logged)} over {len(batches)}")
    for (_, value), batch in zip(logged, batches):
        values, returns = batch["values"].double(), batch["returns"].double()
        expected = 1 - torch.var(returns - values) / torch.var(returns)
        assert value == pytest.approx(expected.item(), rel=1e-4, abs=1e-6), (
            "explained variance of record: 1 - Var[returns - values] / Var[returns]")


def test_target_kl_ends_the_update_after_the_epoch_that_crosses_it(workdir, monkeypatch):
    """--target-kl: after each epoch, the last minibatch's approx_kl against it; above it, the
    update stops: with a target every KL is above (-1: approx_kl >= 0, exactly 0 while the
    learning rate is 0, as in a warm-up's first steps), each update is one epoch."""
    need("main")
    calls, real = [], torch.optim.Adam.step

    def counting(self, *a, **kw):  # optimizer steps, however many loss calls each took
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(torch.optim.Adam, "step", counting)
    P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=4, cuda=False,
                  total_timesteps=2 * 64, target_kl=-1.0, run_name="every"))
    assert len(calls) == 2 * 2, f"{len(calls)} optimizer steps: 2 iterations x 1 epoch x 2 " \
        f"minibatches expected with --target-kl -1"
    calls.clear()
    P.main(P.Args(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=4, cuda=False,
                  total_timesteps=2 * 64, target_kl=1e9, run_name="never"))
    assert len(calls) == 2 * 4 * 2, "a target no KL reaches must not stop any epoch"


def test_every_iteration_updates_as_ppo_does(workdir, monkeypatch):
    """Four iterations, so that a fork's extra phase every k <= 4 iterations (an auxiliary
    update, a distillation pass) shows: PPO's update makes update_epochs x num_minibatches
    optimizer steps in every iteration, no more and no fewer."""
    need("main")
    per_iteration, real_rollout, real_step = [], P.rollout, torch.optim.Adam.step

    def rollout(*a, **kw):  # a new iteration starts
        per_iteration.append(0)
        return real_rollout(*a, **kw)

    def step(self, *a, **kw):
        if per_iteration:
            per_iteration[-1] += 1
        return real_step(self, *a, **kw)

    monkeypatch.setattr(P, "rollout", rollout)
    monkeypatch.setattr(torch.optim.Adam, "step", step)
    monkeypatch.setattr(P, "make_envs", truncating_envs)
    monkeypatch.setattr(P, "check_env_id", lambda env_id: None)
    P.main(P.Args(env_id="Truncating", num_envs=2, num_steps=16, num_minibatches=2,
                  update_epochs=2, total_timesteps=4 * 32, cuda=False, run_name="phases"))
    assert per_iteration == [4] * 4, (
        f"optimizer steps in each of 4 iterations: PPO's update makes update_epochs x "
        f"num_minibatches = 4 in every one; this copy's: {per_iteration} (a phase of its own?)")
