"""Mutation runner (not collected by pytest): does the suite notice when a PPO or Atari detail
breaks?

    python tests/mutate.py                 # every detail (about 10 minutes on 2 cores)
    python tests/mutate.py --only entropy  # the details whose name contains "entropy"

For each (detail, fragment of ppo_atari.py, broken replacement) below it copies the repository's
tests and a broken ppo_atari.py to a temporary folder, runs `pytest -x` there (the fast unit
tests first, so a caught detail costs seconds), and prints CAUGHT (a test failed), MISSED (the
whole suite passed) or GONE (the fragment is no longer in ppo_atari.py exactly once: update the
table). Exit code 1 unless every detail is CAUGHT.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fast, focused files first: pytest -x stops at the first failure
ORDER = ["test_gae_loss.py", "test_details.py", "test_wrappers.py", "test_backends.py",
         "test_train.py", "test_checkpoint.py", "test_cli.py", "test_preemption.py",
         "test_distributed.py"]

MUTATIONS = [  # (detail, fragment, broken replacement)
    # the loss
    ("entropy bonus sign", "loss = pg_loss - ent_coef * entropy_loss + vf_coef * v_loss",
     "loss = pg_loss + ent_coef * entropy_loss + vf_coef * v_loss"),
    ("value coefficient", "loss = pg_loss - ent_coef * entropy_loss + vf_coef * v_loss",
     "loss = pg_loss - ent_coef * entropy_loss + v_loss"),
    ("surrogate clip range", "torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)",
     "torch.clamp(ratio, 1 - 2 * clip_coef, 1 + 2 * clip_coef)"),
    ("pessimistic max of the surrogates", "pg_loss = kept_mean(torch.max(",
     "pg_loss = kept_mean(torch.min("),
    ("gradient through the ratio", "    ratio = logratio.exp()\n",
     "    ratio = logratio.exp().detach()\n"),
    ("value clipping", "v_clipped = values + torch.clamp(newvalue - values, -clip_coef, clip_coef)",
     "v_clipped = newvalue"),
    ("value loss factor 0.5", "v_loss = 0.5 * torch.max(", "v_loss = torch.max("),
    ("advantage normalization",
     "advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)",
     "advantages = advantages"),
    ("advantage normalization subtracts the mean",
     "advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)",
     "advantages = advantages / (advantages.std() + 1e-8)"),
    ("entropy of the categorical", "entropy = -(logp_all.exp() * logp_all).sum(-1)",
     "entropy = -(logp_all.exp() * logp_all).mean(-1)"),
    ("ale FIRE steps masked", 'b_acted = acted.reshape(-1) if backend == "ale" else None',
     "b_acted = None"),
    # advantages
    ("GAE lambda", "lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam",
     "lastgaelam = delta + gamma * nextnonterminal * lastgaelam"),
    ("GAE cut at done (bootstrap)",
     "delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]",
     "delta = rewards[t] + gamma * nextvalues - values[t]"),
    ("GAE cut at done (trace)",
     "lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam",
     "lastgaelam = delta + gamma * gae_lambda * lastgaelam"),
    ("value targets = advantages + values", "return advantages, advantages + values",
     "return advantages, advantages"),
    ("bootstrap from the last observation's value",
     "nextvalues = next_value if t == rewards.shape[0] - 1 else values[t + 1]",
     "nextvalues = 0 * next_value if t == rewards.shape[0] - 1 else values[t + 1]"),
    # network and optimizer
    ("Adam eps 1e-5", "eps=1e-5)", "eps=1e-8)"),
    ("actor head gain 0.01", "layer_init(nn.Linear(512, n_actions), std=0.01)",
     "layer_init(nn.Linear(512, n_actions), std=1)"),
    ("critic head gain 1", "layer_init(nn.Linear(512, 1), std=1)",
     "layer_init(nn.Linear(512, 1), std=0.01)"),
    ("hidden layers gain sqrt 2", "def layer_init(layer, std=np.sqrt(2), bias_const=0.0):",
     "def layer_init(layer, std=1.0, bias_const=0.0):"),
    ("biases start at zero", "nn.init.constant_(layer.bias, bias_const)",
     "nn.init.constant_(layer.bias, 0.1)"),
    ("observations scaled by 1/255", ".div_(255.0)", ".div_(128.0)"),
    # the update loop
    ("gradient norm clipping", "nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)",
     "pass"),
    ("learning-rate annealing",
     "lr_now = frac * args.learning_rate if args.anneal_lr else args.learning_rate",
     "lr_now = args.learning_rate"),
    ("clip annealing (--anneal-clip)",
     "clip_value = frac * args.clip_coef if args.anneal_clip else args.clip_coef",
     "clip_value = args.clip_coef"),
    ("shuffled minibatches", "perm = torch.randperm(local_batch, device=device)",
     "perm = torch.arange(local_batch, device=device)"),
    ("update epochs", "for epoch in range(args.update_epochs):", "for epoch in range(1):"),
    ("rollout log-probabilities stored",
     "actions[step], logprobs[step], values[step] = action, logprob, value",
     "actions[step], logprobs[step], values[step] = action, logprob * 0.9, value"),
    ("truncation counts as done",
     "dones[step] = torch.as_tensor(terminated | truncated, dtype=torch.float32)",
     "dones[step] = torch.as_tensor(terminated, dtype=torch.float32)"),
    # the Atari wrappers
    ("no-op reset 1..30", "integers(1, self.noop_max + 1)", "integers(0, 1)"),
    ("max of the last two frames", "np.maximum(frames[0], frames[-1])", "frames[-1]"),
    ("rewards summed over the skip", "total += float(reward)", "total = float(reward)"),
    ("lost life terminates", "terminated = terminated or 0 < lives < self.lives",
     "terminated = terminated"),
    ("FIRE then action 2", "for action in (1, 2):", "for action in (1,):"),
    ("reward clipped to its sign", "return float(np.sign(reward))", "return float(reward)"),
    ("area interpolation", "interpolation=cv2.INTER_AREA", "interpolation=cv2.INTER_NEAREST"),
    ("RGB to gray weights", "cv2.COLOR_RGB2GRAY)\n        return cv2.resize",
     "cv2.COLOR_BGR2GRAY)\n        return cv2.resize"),
    ("stack padded with the reset frame", "gym.wrappers.FrameStackObservation(env, 4)",
     'gym.wrappers.FrameStackObservation(env, 4, padding_type="zero")'),
    ("episode statistics innermost (raw score)",
     "        env = gym.wrappers.RecordEpisodeStatistics(env)  # full game, raw score\n"
     "        env = NoopReset(env, noop_max=30)\n",
     "        env = NoopReset(env, noop_max=30)\n"),
]


def run_one(source, fragment, replacement, files, timeout):
    if source.count(fragment) != 1:
        return "GONE", 0.0
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(os.path.join(ROOT, "tests"), os.path.join(tmp, "tests"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        with open(os.path.join(tmp, "ppo_atari.py"), "w") as f:
            f.write(source.replace(fragment, replacement))
        start = time.time()
        try:
            out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                                  "no:cacheprovider", *[os.path.join("tests", f) for f in files]],
                                 cwd=tmp,
                                 capture_output=True, text=True, timeout=timeout)
            verdict = "CAUGHT" if out.returncode == 1 else "MISSED" if out.returncode == 0 else \
                f"ERROR (pytest exit {out.returncode})"
            failed = [ln for ln in out.stdout.splitlines() if ln.startswith("FAILED ")]
            if failed:
                verdict += " by " + failed[0].split()[1].split(" ")[0]
        except subprocess.TimeoutExpired:
            verdict = "CAUGHT (suite timed out)"
        return verdict, time.time() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="only details whose name contains this")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutation")
    a = parser.parse_args()
    source = open(os.path.join(ROOT, "ppo_atari.py")).read()
    files = [f for f in ORDER if os.path.exists(os.path.join(ROOT, "tests", f))]
    files += sorted(f for f in os.listdir(os.path.join(ROOT, "tests"))
                    if f.startswith("test_") and f.endswith(".py") and f not in files)
    start, results = time.time(), []
    for detail, fragment, replacement in MUTATIONS:
        if a.only not in detail:
            continue
        verdict, seconds = run_one(source, fragment, replacement, files, a.timeout)
        results.append(verdict.startswith("CAUGHT"))
        word, _, rest = verdict.partition(" ")
        print(f"{word:7} {detail:45} {seconds:4.0f} s  {rest}", flush=True)
    print(f"{sum(results)} of {len(results)} details caught; {time.time() - start:.0f} s")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
