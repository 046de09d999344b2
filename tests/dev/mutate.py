"""Mutation runner (not collected by pytest): does the suite notice when a PPO or Atari detail
breaks?

    python tests/dev/mutate.py                 # every detail (about 10 minutes on 2 cores)
    python tests/dev/mutate.py --only entropy  # the details whose name contains "entropy"
    python tests/dev/mutate.py --script ~/my-experiment/ppo_atari.py   # against a fork
    python tests/dev/mutate.py --control       # the unbroken file through the runner's own path
    python tests/dev/mutate.py --compare-runs  # tests/tools/compare_runs.py's details, by its own tests
(--only on the repository's file skips the control; a full run and a fork's run start with it)

For each (detail, fragment of the file, broken replacement) below it copies the repository (what
the suite reads: tests/, README.md, requirements.txt; not .git, .venv or runs/) with a broken
copy of the file (the repository's ppo_atari.py, or --script) to a temporary folder, runs
`pytest -x --script` on it there (the detail's own test first, then the fast files, so a caught
detail costs seconds), and prints CAUGHT (a test failed), MISSED (the whole suite passed) or
GONE (the fragment is not in the file exactly once: the fork rewrote it, or the table needs
updating). Only tests whose subject is the file's behaviour count: the README's figures and the
tooling's own tests (NOT_DETAILS) never run for a mutant. Every run starts with the control: the
unbroken copy through the same path (copy, files, order); on the repository's file it must
pass, or the run stops (exit 2); on a fork, the tests that already fail there (the published
settings the fork changed on purpose) are left out of every run, so that no mutant is counted
caught by a test that fails anyway. Exit code 1 unless every detail is CAUGHT.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# fast, focused files first: pytest -x stops at the first failure
NOT_DETAILS = ["test_readme.py", "test_plot_curves.py", "test_measuring.py",  # figures, tooling
               "test_compare_runs.py"]
ORDER = ["test_gae_loss.py", "test_details.py", "test_wrappers.py", "test_devices.py",
         "test_backends.py", "test_train.py", "test_checkpoint.py", "test_evaluation.py",
         "test_cli.py", "test_run_folders_and_locks.py", "test_stops.py", "test_crashes.py",
         "test_distributed.py"]

INSTANT = "test_crashes.py::test_a_kill_at_this_instant_leaves_a_run_the_same_command_finishes"
DEFAULTS = "test_details.py::test_args_defaults_are_the_published_hyperparameters"
RESUME = "test_checkpoint.py::test_a_resume_restores_the_weights_the_optimizer_and_the_rng"
GAMES = "test_checkpoint.py::test_a_resume_keeps_the_last_100_games"
STATISTICS = "test_checkpoint.py::test_env_wrapper_statistics_survive_a_resume"
WRAPPERS = "test_wrappers.py::test_the_wrappers_parameters_of_record_in_the_copys_own_training_env"
MUTATIONS = [  # (detail, fragment, broken replacement[, the test file to run first])
    # the loss
    ("entropy bonus sign", "loss = pg_loss - ent_coef * entropy_loss + vf_coef * v_loss",
     "loss = pg_loss + ent_coef * entropy_loss + vf_coef * v_loss"),
    ("value coefficient", "loss = pg_loss - ent_coef * entropy_loss + vf_coef * v_loss",
     "loss = pg_loss - ent_coef * entropy_loss + v_loss"),
    ("surrogate clip range", "torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)",
     "torch.clamp(ratio, 1 - 2 * clip_coef, 1 + 2 * clip_coef)"),
    ("pessimistic max of the surrogates", "pg_loss = torch.max(-advantages * ratio,",
     "pg_loss = torch.min(-advantages * ratio,"),
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
     "torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in agent.parameters()]))"),
    ("grad_norm logged", 'metrics = metrics | {"grad_norm": grad_norm}', "metrics = metrics"),
    ("approx_kl keeps its gradient", "approx_kl = ((ratio - 1) - logratio).mean()  #",
     "approx_kl = ((ratio - 1) - logratio).mean().detach()  #"),
    ("learning-rate annealing",
     "return (frac * args.learning_rate if args.anneal_lr else args.learning_rate,",
     "return (args.learning_rate,"),
    ("clip annealing (--anneal-clip)",
     "            frac * args.clip_coef if args.anneal_clip else args.clip_coef)",
     "            args.clip_coef)"),
    ("shuffled minibatches", 'perm = torch.randperm(local_batch, device=batch["obs"].device)',
     'perm = torch.arange(local_batch, device=batch["obs"].device)'),
    ("update epochs", "for epoch in range(args.update_epochs):", "for epoch in range(1):"),
    ("rollout log-probabilities stored",
     'storage["actions"][step], storage["logprobs"][step] = action, logprob\n',
     'storage["actions"][step], storage["logprobs"][step] = action, logprob * 0.9\n'),
    ("truncation counts as done",
     'storage["dones"][step] = torch.from_numpy(terminated | truncated)',
     'storage["dones"][step] = torch.from_numpy(terminated)'),
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
    # the hardening fixes: each is reverted, and a test must notice (4th: the file to run first)
    ("CUDA RNG restores the training device only",
     'torch.cuda.set_rng_state(state["cuda"], device)', 'torch.cuda.set_rng_state(state["cuda"])',
     "test_checkpoint.py"),
    ('rank 0 decides the resume',
     '        if rank == 0:\n            args, ckpt, lock = decide_run(',
     '        if True:\n            args, ckpt, lock = decide_run(',
     'test_distributed.py'),
    ("async workers forked from a server, not spawned", 'context="forkserver"',
     'context="spawn"', "test_backends.py"),
    ("the fork server imports torch before it forks",
     'set_forkserver_preload(["torch", "torch.utils.tensorboard", "gymnasium",\n',
     'set_forkserver_preload([  # "torch", "torch.utils.tensorboard", "gymnasium",\n',
     "test_backends.py"),
    ('an async worker sets itself up (deaf to stop signals)',
     '        if os.getpid() != trainer:\n',
     '        if False:\n',
     'test_stops.py::test_async_workers_ignore_signals_with_no_timer_and_die_with_the_trainer'),
    ("parameters without a gradient skip the all-reduce",
     "grads = [p.grad for p in agent.parameters() if p.grad is not None]",
     "grads = [p.grad for p in agent.parameters()]", "test_distributed.py"),
    ("Python callers' fields count as given",
     "    if explicit is None:\n", "    explicit = set() if explicit is None else explicit\n"
     "    if False:\n",
     "test_checkpoint.py"),
    ("workers ignore Ctrl-C and SIGTERM, no timer", "signal.signal(s, signal.SIG_IGN)",
     "signal.signal(s, lambda *_: signal.alarm(60))", "test_backends.py"),
    ("cores of the allocation", "return len(os.sched_getaffinity(0)) if hasattr(",
     "return os.cpu_count() if hasattr(", "test_backends.py"),
    ("threads: the cores split over torchrun's local processes",
     "max(1, usable_cores() // local_processes)", "max(1, usable_cores())", "test_backends.py"),
    ('agent.pt written atomically',
     'write_atomically(os.path.join(run.folder, "agent.pt"), state, run.saved_step)',
     'torch.save(state, os.path.join(run.folder, "agent.pt"))',
     'test_checkpoint.py::test_agent_pt_is_the_latest_weights_written_atomically_before_each_checkpoint'),
    ("non-finite stop closes the writer", "            close(envs, writer)\n            fail(",
     "            envs.close()\n            fail(", "test_checkpoint.py"),
    ("rewards stay on the host", '"rewards": torch.zeros((T, N)),',
     '"rewards": torch.zeros((T, N), device=device),', "test_devices.py"),
    ("heads in float32 under bf16", "with torch.autocast(x.device.type, enabled=False):",
     "with torch.autocast(x.device.type, enabled=torch.is_autocast_enabled(x.device.type)):",
     "test_devices.py"),
    ("cudnn.benchmark unless deterministic",
     "torch.backends.cudnn.benchmark = not args.torch_deterministic",
     "torch.backends.cudnn.benchmark = False", "test_devices.py"),
    ('a continued run keeps its wandb id',
     'name=name, id=name, resume="allow",',
     'name=name, resume="allow",',
     'test_devices.py'),
    ("a network mismatch is one line", "        if mine != theirs:", "        if False:",
     "test_checkpoint.py"),
    ("SPS from this process's first iteration",
     "clock, sps = (global_step, now), int(batch_steps / (now - t0))",
     "clock, sps = (global_step - batch_steps, t0), 0", "test_train.py"),
    ("--stop-at-step stops",
     "at_stop = args.stop_at_step is not None and global_step >= args.stop_at_step",
     "at_stop = False", "test_checkpoint.py"),
    ("a fork's carry is saved",
     '"env_statistics": env_state, "carry": to_saved(carry)}, run.saved_step)',
     '"env_statistics": env_state}, run.saved_step)',
     'test_checkpoint.py::test_a_forks_carry_survives_a_resume'),
    ("a fork's carry is restored",
     'carry.update(map_tensors(from_saved(ckpt.get("carry", {})), lambda t: t.to(device)))',
     "pass",
     "test_checkpoint.py::test_a_forks_carry_survives_a_resume"),
    ("observations must be (C, H, W)", "    if len(shape) != 3:", "    if False:",
     "test_train.py::test_observations_that_are_not_channels_first_are_refused_in_one_line"),
    ("explained variance formula",
     'explained_variance"] = 1 - torch.var(y_true - y_pred) / torch.var(y_true)',
     'explained_variance"] = 1 - torch.var(y_pred) / torch.var(y_true)', "test_details.py"),
    ("no-op count up to 30 inclusive", "integers(1, self.noop_max + 1)",
     "integers(1, self.noop_max)", "test_wrappers.py"),
    ("--target-kl stops the epochs", "            if kl.item() > args.target_kl:",
     "            if False:", "test_details.py"),
    ("--target-kl on the mean over ranks", "                kl /= world_size\n", "",
     "test_distributed.py::test_target_kl_is_decided_on_the_mean_over_ranks"),
    ("a resume restores Adam's state", '        optimizer.load_state_dict(ckpt["optimizer"])',
     "        pass", RESUME),
    ("a resume restores the RNG", '        set_rng_state(ckpt["rng"], device)', "        pass",
     "test_checkpoint.py::test_a_resume_restores_the_weights_the_optimizer_and_the_rng"),
    ("each rank's envs seeded apart", "env_seed = args.seed + rank * args.num_envs + 7919",
     "env_seed = args.seed + 7919",
     "test_distributed.py::test_ranks_play_apart_and_average_their_gradients"),
    ("gradients averaged over ranks",
     "flat = torch.cat([g.reshape(-1) for g in grads]) / world_size",
     "flat = torch.cat([g.reshape(-1) for g in grads])",
     "test_distributed.py::test_ranks_play_apart_and_average_their_gradients"),
    ('a partial first checkpoint starts again',
     'f != "agent.pt" and not re.fullmatch(r".+\\.pt\\..*tmp", f) for f in os.listdir(folder)):',
     'True for f in os.listdir(folder)):',
     'test_crashes.py::test_a_kill_at_this_instant_leaves_a_run_the_same_command_finishes'),
    ('agent.pt before checkpoint.pt',
     '    write_atomically(os.path.join(run.folder, "agent.pt"), state, run.saved_step)\n    write_atomically(os.path.join(run.folder, "checkpoint.pt"), state | {\n',
     '    write_atomically(os.path.join(run.folder, "checkpoint.pt"), state, run.saved_step) or write_atomically(os.path.join(run.folder, "agent.pt"), state, run.saved_step)\n    (state | {\n',
     'test_checkpoint.py::test_agent_pt_is_the_latest_weights_written_atomically_before_each_checkpoint'),
    ('signals caught from the first instant',
     '    release = catch_stop_signals(stops)\n',
     '    release = lambda: None  # noqa: E731\n',
     'test_crashes.py::test_a_kill_at_this_instant_leaves_a_run_the_same_command_finishes'),
    ('an ignored signal stays ignored',
     '        if handler != signal.SIG_IGN:\n',
     '        if True:\n',
     'test_stops.py::test_signals_ignored_at_start_stay_ignored_and_the_warning_signals_stop'),
    ("async workers born with Ctrl-C and SIGTERM blocked",
     "        signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))  # it unblocked INT and",
     "        pass  #", INSTANT),
    ("the resource tracker born with the warning signals blocked",
     "    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))",
     "    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set())",
     "test_stops.py::test_async_workers_survive_a_stop_signal_to_the_process_group"),
    ('a crash after a mid-run signal keeps its traceback',
     '        return train(args, ckpt, device, run, rank, world_size)\n    except OSError as e:',
     '        return train(args, ckpt, device, run, rank, world_size)\n    except RuntimeError:\n        if not stops:\n            raise\n        raise SystemExit(128 + stops[0])\n    except OSError as e:',
     'test_stops.py::test_a_crash_after_a_signal_mid_run_keeps_its_traceback'),
    ("evaluation on another id of the agent's game",
     '    env_id = args.env_id if "env_id" in explicit else trained\n',
     "    env_id = trained\n",
     "test_evaluation.py::test_an_agent_is_scored_on_another_id_of_its_game_under_sticky_actions"),
    # the published defaults (tests/test_details.py's PUBLISHED table)
    *[(f"default {name} {value}", f"    {name}: {kind} = {value}\n",
       f"    {name}: {kind} = {broken}\n", DEFAULTS) for name, kind, value, broken in [
        ("total_timesteps", "int", "10_000_000", "5_000_000"),
        ("learning_rate", "float", "2.5e-4", "3e-4"), ("anneal_lr", "bool", "True", "False"),
        ("num_envs", "int", "8", "16"), ("num_steps", "int", "128", "256"),
        ("gamma", "float", "0.99", "0.995"), ("gae_lambda", "float", "0.95", "0.9"),
        ("num_minibatches", "int", "4", "8"), ("update_epochs", "int", "4", "3"),
        ("norm_adv", "bool", "True", "False"), ("clip_coef", "float", "0.1", "0.2"),
        ("anneal_clip", "bool", "False", "True"), ("clip_vloss", "bool", "True", "False"),
        ("ent_coef", "float", "0.01", "0.001"), ("vf_coef", "float", "0.5", "1.0"),
        ("max_grad_norm", "float", "0.5", "1.0"),
        ("target_kl", "float | None", "None", "0.015")]],
    # a resume's state, piece by piece (Adam's state, the RNG and carry are above)
    ("a resume restores the weights",
     '        load_agent(agent, ckpt, ckpt["run_dir"], ckpt["args"]["env_id"])\n',
     "        pass\n", RESUME),
    ("a resume continues the iteration count",
     'iteration, global_step = (ckpt["iteration"], ckpt["global_step"]) if ckpt else (0, 0)',
     'iteration, global_step = (0, ckpt["global_step"]) if ckpt else (0, 0)',
     "test_checkpoint.py::test_a_resume_continues_exactly_where_the_checkpoint_left_off"),
    ("a resume continues the step count",
     'iteration, global_step = (ckpt["iteration"], ckpt["global_step"]) if ckpt else (0, 0)',
     'iteration, global_step = (ckpt["iteration"], 0) if ckpt else (0, 0)',
     "test_checkpoint.py::test_a_resume_continues_exactly_where_the_checkpoint_left_off"),
    ("the last 100 games are saved", '"recent_returns": list(recent),',
     '"recent_returns": [],', GAMES),
    ("the last 100 games are restored", '        recent.extend(ckpt["recent_returns"])\n',
     "        pass\n", GAMES),
    ("wrapper statistics are saved", '"env_statistics": env_state, "carry"',
     '"env_statistics": {}, "carry"', STATISTICS),
    ("wrapper statistics are restored",
     '        restore_wrapper_statistics(envs, ckpt.get("env_statistics", {}), rank)\n',
     "        pass\n", STATISTICS),
    # what reaches the loss, and this session's fixes of the GPU path
    ("the bootstrap is the next observation's value", "        _, next_value = agent(next_obs)\n",
     '        next_value = storage["values"][-1]\n',
     "test_details.py::test_the_loss_receives_gae_of_the_rollout"),
    ("rank 0 beats until every rank checked in",
     "        if rank == 0:  # beating until", "        if False:  # beating until",
     "test_distributed.py::test_a_rank_that_starts_late_joins_when_init_returns_at_once"),
    ('--no-cuda hides the GPUs before torch counts them',
     '        os.environ["CUDA_VISIBLE_DEVICES"] = ""\n',
     '        pass\n',
     'test_devices.py::test_no_cuda_hides_the_gpus_before_torch_counts_them'),
    ("videos numbered on after a resume's earlier ones",
     "states = [{key: saved[key][first + i] for key in now & kept if",
     "states = [{key: saved[key][first + i] for key in now & kept - {COUNT} if".replace(
         "COUNT", '"VideoRecorder.games_state"'),
     "test_checkpoint.py::test_a_resumed_run_keeps_the_videos_its_earlier_launches_wrote"),
    ("the exit hook before the workers start",
     "    atexit.register(kill_workers)\n    blocked = signal.pthread_sigmask(",
     "    blocked = signal.pthread_sigmask(",
     "test_backends.py::test_a_crashing_trainer_does_not_wait_for_its_async_workers"),
    ("numpy wrapper state saved as tensors",
     "lambda v: isinstance(v, (np.ndarray, np.generic)) and checkpointable(v))",
     "lambda v: False)", "test_wrapper_state.py"),
    ("each rank gets its own envs' wrapper state back",
     'kept, first = saved.keys() - {"numbers", "vector"}, rank * num_envs',
     'kept, first = saved.keys() - {"numbers", "vector"}, 0',
     'test_distributed.py::test_two_processes_train_in_step_stop_resume_and_evaluate'),
    ('a worker whose trainer is gone exits quietly',
     '            signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n',
     '',
     'test_stops.py::test_async_workers_ignore_signals_with_no_timer_and_die_with_the_trainer'),
    ('a second Ctrl-C kills the workers before exiting',
     '        kill_workers()  # before they find the trainer gone\n',
     '',
     'test_stops.py::test_a_second_ctrl_c_kills_async_workers_stuck_in_a_step'),
    ('a stop is recorded before its answer is written',
     '    stops.append(signum)\n    if len(stops) == 1 and not (dist.is_initialized() and dist.get_rank() > 0):\n        with contextlib.suppress(Exception):  # a closed pipe, a write this handler interrupted\n            print(stop_answer(run, signum), file=sys.stderr, flush=True)\n',
     '    if not stops and not (dist.is_initialized() and dist.get_rank() > 0):\n        print(stop_answer(run, signum), file=sys.stderr, flush=True)\n    stops.append(signum)\n',
     'test_stops.py::test_main_from_a_script_whose_stderr_is_closed_still_stops_on_sigterm'),
    ('the continue line repeats the launch-only options',
     'shlex.join([python] * (world_size == 1) + [sys.argv[0], "--resume", shown, *again])',
     'shlex.join([python] * (world_size == 1) + [sys.argv[0], "--resume", shown])',
     'test_cli.py::test_the_continue_line_keeps_the_launch_only_options_and_names_torchruns'),
    ("videos go on from env 0's finished games",
     "states[0][count], kept = saved[games][0] + 1, kept | {count}", "kept = kept",
     "test_checkpoint.py::test_videos_are_named_after_the_game_they_show_across_resumes"),
    ('--no-cuda says when torch counted the GPUs first',
     '        if torch.cuda.is_available():  # counted before this line: too late to hide them\n',
     '        if False:\n',
     'test_devices.py::test_no_cuda_hides_the_gpus_before_torch_counts_them'),
    ("no sticky actions in training (v4)", "env = gym.make(env_id, frameskip=1)",
     "env = gym.make(env_id, frameskip=1, repeat_action_probability=0.25)",
     "test_wrappers.py::test_the_emulator_settings_of_record_in_the_copys_own_training_env"),
    ("the emulator does not skip frames (v4)", "env = gym.make(env_id, frameskip=1)",
     "env = gym.make(env_id, frameskip=2)",
     "test_wrappers.py::test_the_emulator_settings_of_record_in_the_copys_own_training_env"),
    ("the minimal action set", "env = gym.make(env_id, frameskip=1)",
     "env = gym.make(env_id, frameskip=1, full_action_space=True)",
     "test_wrappers.py::test_the_emulator_settings_of_record_in_the_copys_own_training_env"),
    ("the emulator's episode frame limit", "env = gym.make(env_id, frameskip=1)",
     "env = gym.make(env_id, frameskip=1, max_num_frames_per_episode=10_000)",
     "test_wrappers.py::test_the_emulator_settings_of_record_in_the_copys_own_training_env"),
    ("the value loss trains the shared trunk",
     "return self.actor(hidden), self.critic(hidden).squeeze(-1)",
     "return self.actor(hidden), self.critic(hidden.detach()).squeeze(-1)", "test_details.py"),
    ('one exit hook per process, none per run',
     '    return make_async()\n',
     '    envs = make_async()\n    atexit.register(envs.close)\n    return envs\n',
     'test_backends.py::test_sync_and_async_step_identically'),
    # dependable wherever it is called (items 1-4 of the entry-points issue)
    ('numpy in carry saved loadable',
     '"env_statistics": env_state, "carry": to_saved(carry)}, run.saved_step)',
     '"env_statistics": env_state, "carry": carry}, run.saved_step)',
     'test_checkpoint.py::test_each_kind_a_fork_keeps_in_carry_comes_back_as_it_was'),
    ("an unsavable carry refused at the end of its iteration",
     "env_state = wrapper_statistics(envs, world_size, carry, gather=checkpoint)",
     "env_state = wrapper_statistics(envs, world_size, carry) if checkpoint else None",
     "test_checkpoint.py::test_what_carry_cannot_hold_is_refused_at_the_end_of_the_iteration_"
     "that_set_it"),
    ('agent.pt with every checkpoint',
     '    write_atomically(os.path.join(run.folder, "agent.pt"), state, run.saved_step)\n',
     '    if finished:\n        write_atomically(os.path.join(run.folder, "agent.pt"), state, run.saved_step)\n',
     'test_crashes.py::test_after_a_kill_9_readmes_evaluation_scores_the_latest_weights'),
    ('main() from a thread leaves signals to the caller',
     '    if threading.current_thread() is not threading.main_thread():\n        return lambda: None\n',
     '    if False:\n        return lambda: None\n',
     'test_stops.py::test_main_in_a_thread_trains_to_its_end_and_leaves_signals_to_the_caller'),
    ('a stop during evaluation ends it',
     '    while len(scores) < args.eval_episodes and not stops:',
     '    while len(scores) < args.eval_episodes:',
     'test_stops.py::test_a_stop_during_evaluation_prints_the_games_played_and_exits_quietly'),
    ("a torchrun restart continues its job's run",
     '            name, dated = store.get("ppo_atari/run_name").decode(), False\n',
     '            dated = True\n',
     'test_distributed.py::test_a_torchrun_restart_without_a_run_name_continues_its_run'),
    ("--resume under another --run-name refused",
     '    if "run_name" in explicit and name != (folder :=',
     '    if False and name != (folder :=',
     "test_run_folders_and_locks.py::test_resume_under_another_run_name_is_refused_and_damages_nothing"),
    ('the stop agreed over ranks',
     'stopped = stats["stop"] > 0',
     'stopped = bool(run.stops)',
     'test_stops.py::test_a_sigterm_to_one_rank_alone_stops_every_rank_in_the_same_iteration'),
    ("episode statistics innermost (raw score)",
     "        env = gym.wrappers.RecordEpisodeStatistics(env)  # full game, raw score\n"
     "        env = NoopReset(env, noop_max=30)\n",
     "        env = NoopReset(env, noop_max=30)\n"),
    # the wrappers' parameters as make_env passes them (read from the copy's training env)
    *[(f"make_env: {detail}", fragment, broken, WRAPPERS) for detail, fragment, broken in [
        ("no-op maximum 30", "env = NoopReset(env, noop_max=30)",
         "env = NoopReset(env, noop_max=20)"),
        ("frame skip 4", "env = MaxAndSkip(env, skip=4)", "env = MaxAndSkip(env, skip=3)"),
        ("FIRE after a reset", 'if "FIRE" in env.unwrapped.get_action_meanings():', "if False:"),
        ("a lost life is terminal", "        env = EpisodicLife(env)\n", "")]],
    ("make_env: frames of 84 x 84", "        env = GrayResize(env)\n",
     "        env = GrayResize(env, size=64)\n",
     "test_wrappers.py::test_the_published_observation_is_4_frames_of_84x84"),
    ("make_env: a stack of 4", "gym.wrappers.FrameStackObservation(env, 4)",
     "gym.wrappers.FrameStackObservation(env, 3)",
     "test_wrappers.py::test_the_published_observation_is_4_frames_of_84x84"),
    ("make_env: rewards clipped", "        env = ClipReward(env)\n", "",
     "test_wrappers.py::test_rewards_are_clipped_while_statistics_keep_the_raw_score"),
    ("a schedule's numpy floats are saved as floats",
     "map(float, schedule(iteration, num_iterations, args))",
     "schedule(iteration, num_iterations, args)",
     "test_checkpoint.py::test_a_resume_reports_the_learning_rate_the_forks_schedule_gives"),
    ("runs started in the same second get folders of their own",
     "            os.makedirs(os.path.join(parent, folder))\n",
     "            os.makedirs(os.path.join(parent, folder), exist_ok=True)\n",
     "test_run_folders_and_locks.py::test_new_runs_started_in_the_same_second_get_folders_of_their_own"),
    ("evaluations in the same second log apart", '-seed{args.seed}-{time.time():.3f}"',
     '-seed{args.seed}-{int(time.time())}"',
     "test_run_folders_and_locks.py::test_new_runs_started_in_the_same_second_get_folders_of_their_own"),
    ('a dated name is never taken for a run to continue',
     '    named = args.resume is None and not dated  #',
     '    named = args.resume is None  #',
     'test_run_folders_and_locks.py::test_new_runs_started_in_the_same_second_get_folders_of_their_own'),
    ('a run continues only with the file that trained it',
     '    if theirs != source and not args.allow_other_file:',
     '    if False:',
     'test_run_folders_and_locks.py::test_a_run_continues_only_with_the_file_that_trained_it'),
    ('the checkpoint records the file that wrote it',
     '"finished": finished, "source": run.source}',
     '"finished": finished}',
     'test_run_folders_and_locks.py::test_a_run_continues_only_with_the_file_that_trained_it'),
    ("a fork's vector wrapper keeps its statistics",
     '    return all_ranks_statistics(states, world_size) | {"vector": vector["state"]}',
     '    return all_ranks_statistics(states, world_size) | {"vector": {}}',
     'test_wrapper_state.py::test_a_forks_vector_wrapper_trains_stops_and_resumes_with_its_statistics'),
]


COMPARE_RUNS = [  # (detail, fragment of tests/tools/compare_runs.py, broken replacement)
    ("a 95% interval from the 2.5% and 97.5% percentiles",
     "    tail = 100 * (1 - confidence) / 2\n", "    tail = 25.0\n"),
    ("every resample counted (not 20)", "    draws = aggregates(resample(per_game, rng, reps), bounds)",
     "    draws = aggregates(resample(per_game, rng, 20), bounds)"),
    ("P's interval resamples the baseline too",
     "improvement(resample(xs, rng, reps), resample(ys, rng, reps))",
     "improvement(resample(xs, rng, reps), [g[None] for g in ys])"),
    ("unequal runs per game: games weigh equally in the IQM",
     "    if equal_counts(per_game):\n        cut = n // 4", "    if True:\n        cut = n // 4"),
    ("the game from any word of the name, not the first",
     '        named = games_named(re.sub(r"\\.csv$", "", part))',
     '        named = games_named(re.split(r"[-_.]", part)[0])'),
    ("rliable's IQM: trim_mean's floor(n / 4) cut", "        cut = n // 4\n",
     "        cut = round(n / 4)\n"),
    ("the exact p-value two-sided",
     "    far = np.abs(np.arange(len(total)) - centre) >= abs(observed - centre) - 1e-9",
     "    far = np.arange(len(total)) - centre >= abs(observed - centre) - 1e-9"),
    ("one budget across groups", "    common = min(last.values())", "    common = max(last.values())"),
    ("v4 and v5 refused together", "        if len(found) > 1:", "        if len(found) > 9:"),
    ("the sample standard deviation", '"std": float(raw[g].std(ddof=1))',
     '"std": float(raw[g].std(ddof=0))'),
]


FOLDERS = "test_run_folders_and_locks.py::"
MUTATIONS += [  # one run, one folder, one writer; the warning signals
    ("a run folder has one writer (an exclusive lock)",
     "        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)",
     "        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)",
     FOLDERS + "test_a_second_launch_of_a_run_in_use_is_refused_and_a_kill_9_frees_it"),
    ("temporary files named per process", '    temporary = f"{path}.{os.getpid()}.tmp"',
     '    temporary = path + ".tmp"',
     "test_checkpoint.py::test_crash_before_the_rename_keeps_the_previous_checkpoint"),
    ("a dead writer's temporary files removed under the lock",
     '        os.remove(stale)', '        pass',
     FOLDERS + "test_a_second_launch_of_a_run_in_use_is_refused_and_a_kill_9_frees_it"),
    ("every rank agrees on the run folder",
     "        if s is not None and (first is None or s > first):", "        if False:",
     FOLDERS + "test_node_local_runs_folders_that_disagree_stop_every_rank"),
    ("a torchrun job's new run gets a folder of its own",
     '        args = dataclasses.replace(args, run_name=own_folder(args.runs_dir, name))',
     '        args = dataclasses.replace(args, run_name=name if store else own_folder(args.runs_dir, name))',
     'test_run_folders_and_locks.py::test_two_torchrun_jobs_in_one_second_get_a_folder_each'),
    ("a checkpoint with fields this file lacks refused", "    if theirs - ours:",
     "    if False:", FOLDERS + "test_a_checkpoint_of_another_version_of_the_file"),
    ("an older snapshot never replaces a newer checkpoint",
     '        if step > ckpt["global_step"]:', "        if False:",
     FOLDERS + "test_an_older_snapshot_never_replaces_a_newer_checkpoint"),
    ('--runs-dir is where the run goes',
     '    folder = ckpt["run_dir"] if ckpt else os.path.join(args.runs_dir, args.run_name)',
     '    folder = ckpt["run_dir"] if ckpt else os.path.join("runs", args.run_name)',
     'test_run_folders_and_locks.py::test_runs_dir_pins_the_run_whatever_the_working_directory'),
    ("the warning signals are stops",
     "STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)",
     "STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)",
     "test_stops.py::test_async_workers_survive_a_stop_signal_to_the_process_group"),
    ("a refused pickle names its global, never advises an unsafe load",
     '        if "weights_only" in reason:', "        if False:",
     "test_checkpoint.py::test_malicious_pickle_never_runs"),
]
CRASHES = "test_crashes.py::"
MUTATIONS += [  # every stop a stop, every failure says what it cost, output never stops a run
    ('the first stop signal answered at once',
     '            print(stop_answer(run, signum), file=sys.stderr, flush=True)',
     '            pass',
     'test_stops.py::test_a_stop_gives_up_the_rollout_in_progress_and_the_first_ctrl_c_is_answered_at_once'),
    ('a stop gives up the rollout in progress',
     '        if stop:  # checked between env steps',
     '        if False:  # checked between env steps',
     'test_stops.py::test_a_stop_gives_up_the_rollout_in_progress_and_the_first_ctrl_c_is_answered_at_once'),
    ("a given-up rollout checkpoints its iteration's RNG as it began",
     '            set_rng_state(rng, device)\n',
     '',
     'test_checkpoint.py::test_a_resume_continues_exactly_where_the_checkpoint_left_off'),
    ('a given-up rollout checkpoints the iteration before it',
     'global_step, iteration - 1,\n',
     'global_step, iteration,\n',
     'test_checkpoint.py::test_a_resume_continues_exactly_where_the_checkpoint_left_off'),
    ("--checkpoint-minutes checkpoints on time", "    return due.item() > 0",
     "    return False", CRASHES + "test_checkpoint_minutes_bounds_what_a_kill_9_loses"),
    ("a failed write leaves no temporary file", "            os.remove(temporary)",
     "            pass", CRASHES + "test_a_full_disk_ends_the_run_in_one_line_keeps_its_"
     "checkpoint_and_leaves_no_temporary"),
    ('a failed checkpoint write is one line',
     '        cannot_write(path, storage_error(e), held)',
     '        raise',
     'test_crashes.py::test_a_full_disk_ends_the_run_in_one_line_keeps_its_checkpoint_and_leaves_no_temporary'),
    ("a failed events write is one line", "    except OSError as e:  # an events write",
     "    except ZeroDivisionError as e:  # an events write", CRASHES + "test_a_full_disk_ends"
     "_the_run_in_one_line_keeps_its_checkpoint_and_leaves_no_temporary"),
    ("a start needs room for two checkpoints", "    if room < need:", "    if False:",
     CRASHES + "test_a_full_disk_ends_the_run_in_one_line_keeps_its_checkpoint_and_leaves_no_"
     "temporary"),
    ("a read-only run folder is evaluated into runs/ here",
     "    if not os.access(run_dir, os.W_OK):", "    if False:",
     CRASHES + "test_a_read_only_run_folder_is_evaluated_with_its_events_under_runs_here"),
    ("closed output never stops a run",
     "    sys.stdout, sys.stderr = Unbroken(sys.stdout), Unbroken(sys.stderr)", "    pass",
     CRASHES + "test_closed_output_never_stops_a_run"),
    ("the launch and its run folder in the events", '    writer.add_text("launch", ',
     '    writer.add_text("started", ', CRASHES + "test_closed_output_never_stops_a_run"),
    ('under torchrun no rank gives its rollout up alone',
     'run.stops if world_size == 1 else ())',
     'run.stops)',
     'test_stops.py::test_a_sigterm_to_one_rank_alone_stops_every_rank_in_the_same_iteration'),
]


def compare_runs_details(timeout) -> list:
    """Each COMPARE_RUNS detail broken in a copy of the repository, test_compare_runs.py run."""
    tool = open(os.path.join(ROOT, "tests", "tools", "compare_runs.py")).read()
    results = []
    for detail, fragment, replacement in [("(control: unbroken)", "", "")] + COMPARE_RUNS:
        if fragment and tool.count(fragment) != 1:
            print(f"GONE    {detail}", flush=True)
            results.append(False)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            copy_repository(tmp, open(os.path.join(ROOT, "ppo_atari.py")).read())
            with open(os.path.join(tmp, "tests", "tools", "compare_runs.py"), "w") as f:
                f.write(tool.replace(fragment, replacement) if fragment else tool)
            start = time.time()
            out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                                  "no:cacheprovider", "tests/test_compare_runs.py"], cwd=tmp,
                                 capture_output=True, text=True, timeout=timeout)
        failed = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("FAILED ")]
        caught = out.returncode == 1 and bool(failed)
        word = ("PASSED" if out.returncode == 0 else "FAILED") if not fragment else \
            "CAUGHT" if caught else "MISSED"
        print(f"{word:7} {detail:55} {time.time() - start:4.0f} s  {' '.join(failed[:1])}",
              flush=True)
        results.append(out.returncode == 0 if not fragment else caught)
    return results


def copy_repository(tmp: str, source: str) -> str:
    """The repository as the suite reads it, in tmp, with source as its ppo_atari.py."""
    shutil.copytree(ROOT, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "__pycache__", ".pytest_cache", "wandb", "parity-runs"))
    script = os.path.join(tmp, "ppo_atari.py")
    with open(script, "w") as f:
        f.write(source)
    return script


def control(source, files, timeout):
    """The unbroken copy through the runner's own path, every file: the tests that fail."""
    with tempfile.TemporaryDirectory() as tmp:
        script = copy_repository(tmp, source)
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "--script", script, *[os.path.join("tests", f) for f in files]],
                             cwd=tmp, capture_output=True, text=True, timeout=timeout)
    failed = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith(("FAILED ",
                                                                                "ERROR "))]
    return failed + ([] if out.returncode in (0, 1) or failed else
                     [f"(pytest exit {out.returncode})"])


def run_one(source, fragment, replacement, files, timeout, first=None, deselect=()):
    if source.count(fragment) != 1:
        return "GONE", 0.0
    with tempfile.TemporaryDirectory() as tmp:
        script = copy_repository(tmp, source.replace(fragment, replacement))
        start = time.time()
        # a detail's own test (file::test) runs alone first: given beside its file, pytest
        # would run it in the file's order instead
        runs = [[first]] if first and "::" in first else []
        runs.append(([first] if first and "::" not in first else []) +
                    [f for f in files if f != first])
        try:
            for tests in runs:
                out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                                      "no:cacheprovider", "--script", script,
                                      *[f"--deselect={node}" for node in deselect],
                                      *[os.path.join("tests", f) for f in tests]],
                                     cwd=tmp, capture_output=True, text=True, timeout=timeout)
                if out.returncode != 0:
                    break
            verdict = "CAUGHT" if out.returncode == 1 else "MISSED" if out.returncode == 0 else \
                f"ERROR (pytest exit {out.returncode})"
            failed = [ln for ln in out.stdout.splitlines() if ln.startswith(("FAILED ",
                                                                              "ERROR "))]
            if failed:
                verdict += " by " + failed[0].split()[1].split(" ")[0]
        except subprocess.TimeoutExpired:  # no test failed: not a catch
            verdict = f"TIMEOUT (no test failed within {timeout} s)"
        return verdict, time.time() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="only details whose name contains this (or "
                        "one of these, comma-separated)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutation")
    parser.add_argument("--script", default=os.path.join(ROOT, "ppo_atari.py"),
                        help="the copy of ppo_atari.py to break (default: the repository's)")
    parser.add_argument("--control", action="store_true",
                        help="only the control: the unbroken copy through the runner's path")
    parser.add_argument("--compare-runs", action="store_true",
                        help="break tests/tools/compare_runs.py instead, detail by detail")
    a = parser.parse_args()
    if a.compare_runs:
        results = compare_runs_details(a.timeout)
        print(f"{sum(results[1:])} of {len(results) - 1} details caught")
        return 0 if all(results) else 1
    source = open(a.script).read()
    files = [f for f in ORDER if os.path.exists(os.path.join(ROOT, "tests", f))]
    files += sorted(f for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_")
                    and f.endswith(".py") and f not in files and f not in NOT_DETAILS)
    start, results, deselect = time.time(), [], []
    own = os.path.abspath(a.script) == os.path.join(ROOT, "ppo_atari.py")
    if a.control or not a.only or not own:  # (--only on the repository's file: no control)
        deselect = control(source, files, a.timeout * 4)
        print(f"control: the unbroken copy fails {len(deselect)} test(s) in "
              f"{time.time() - start:.0f} s{': ' + ', '.join(deselect) if deselect else ''}",
              flush=True)
        if a.control or (deselect and own):
            return 2 if deselect else 0  # the repository's file must pass its own suite
    for detail, fragment, replacement, *first in MUTATIONS:
        if not any(part in detail for part in a.only.split(",")):
            continue
        verdict, seconds = run_one(source, fragment, replacement, files, a.timeout, *first,
                                   deselect=deselect)
        results.append(verdict.startswith("CAUGHT"))
        word, _, rest = verdict.partition(" ")
        print(f"{word:7} {detail:45} {seconds:4.0f} s  {rest}", flush=True)
    print(f"{sum(results)} of {len(results)} details caught; {time.time() - start:.0f} s")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
