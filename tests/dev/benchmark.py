"""Speed benchmark (not collected by pytest): python tests/dev/benchmark.py [--rounds 2]
    python tests/dev/benchmark.py --configs async --compare old_ppo_atari.py   # old vs new file
    python tests/dev/benchmark.py --cuda --num-envs 64     # on a GPU, with host syncs per step
    python tests/dev/benchmark.py --worker-memory          # each async env worker's memory
    python tests/dev/benchmark.py --stop-latency 3         # SIGTERM to checkpoint, worst case

For default hyperparameters (8 envs x 128 steps, 4 epochs x 4 minibatches) on Breakout it prints,
per configuration: steady-state SPS (iterations after the first), rollout and update seconds per
iteration, the peak resident memory of the training process, and the compute-only bound (the same
inference and update on random uint8 data, no env) with SPS as a fraction of it, and the env-only
SPS (the backend stepped with random actions, no network). When the envs and the network take
turns on the same cores, 1 / (1 / compute-only + 1 / env-only) is the most a configuration can
reach; the last column shows SPS as a fraction of that turn-taking ceiling.

`plain` is what a straightforward port does: sync envs, fp32, NCHW convolutions, a float32
observation buffer, torch.distributions.Categorical. The other rows run ppo_atari.py itself in a
subprocess and read its TensorBoard timings; `--compare FILE` adds a row running FILE with the
first configuration's flags, and `--script FILE` benchmarks that copy instead of the
repository's. All rows run in one
invocation: `--rounds` passes over the configurations in turn, every other pass in reverse order,
so that neither a slow spell of a noisy machine nor going first favours a row; each figure is the
median over rounds, and every round's SPS is printed.
With --cuda it also counts the host syncs of one rollout (torch.cuda.set_sync_debug_mode).
"""
import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.abspath(sys.argv[sys.argv.index("--script") + 1]) if "--script" in sys.argv \
    else os.path.join(ROOT, "ppo_atari.py")
_spec = importlib.util.spec_from_file_location("ppo_atari", SCRIPT)
P = importlib.util.module_from_spec(_spec)
sys.modules["ppo_atari"] = P
_spec.loader.exec_module(P)
OBS = P.make_env("BreakoutNoFrameskip-v4", 0)().observation_space.shape

CONFIGS = {  # name: ppo_atari.py flags (plain is the hand port below)
    "plain": None,
    "default": [],  # --env-backend auto: sync on a CPU, async on CUDA with 4+ cores
    "sync": ["--env-backend", "sync"],
    "async": ["--env-backend", "async"],
    "sync+bf16": ["--env-backend", "sync", "--precision", "bf16"],
    "async+bf16": ["--env-backend", "async", "--precision", "bf16"],
    "sync+compile": ["--env-backend", "sync", "--compile"],
    "sync+bf16+compile": ["--env-backend", "sync", "--precision", "bf16", "--compile"],
}


class PlainAgent(P.Agent):
    def forward(self, obs):  # obs float32 in [0, 255], NCHW
        hidden = self.network(obs / 255.0)
        return self.actor(hidden), self.critic(hidden).squeeze(-1)


def plain_worker(iterations, num_envs, device, out):
    """A straightforward port: float32 storage, NCHW, Categorical, sync envs."""
    args = P.Args(env_backend="sync", num_envs=num_envs)
    envs = P.make_envs(args, seed=1)
    agent = PlainAgent(OBS, envs.single_action_space.n).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    T, N = args.num_steps, args.num_envs
    obs = torch.zeros((T, N, *OBS), device=device)  # float32: 4x the bytes of uint8
    actions, logprobs, rewards, dones, values = (torch.zeros((T, N), device=device)
                                                 for _ in range(5))
    next_obs = torch.Tensor(envs.reset(seed=1)[0]).to(device)
    times = []
    for _ in range(iterations):
        t0 = time.time()
        for step in range(T):
            obs[step] = next_obs
            with torch.no_grad():
                logits, value = agent(next_obs)
            dist = torch.distributions.Categorical(logits=logits)
            action = dist.sample()
            actions[step], logprobs[step], values[step] = action, dist.log_prob(action), value
            o, r, te, tr, _ = envs.step(action.cpu().numpy())
            rewards[step], dones[step] = torch.tensor(r), torch.Tensor(te | tr)
            next_obs = torch.Tensor(o).to(device)
        t1 = time.time()
        with torch.no_grad():
            next_value = agent(next_obs)[1]
        adv, ret = P.compute_gae(rewards, values, dones, next_value, args.gamma, args.gae_lambda)
        b = [x.reshape(-1, *x.shape[2:]) for x in (obs, actions, logprobs, adv, ret, values)]
        mb_size = T * N // args.num_minibatches
        for _ in range(args.update_epochs):
            perm = np.random.permutation(T * N)
            for start in range(0, T * N, mb_size):
                mb = perm[start:start + mb_size]
                logits, newvalue = agent(b[0][mb])
                dist = torch.distributions.Categorical(logits=logits)
                newlogprob = dist.log_prob(b[1][mb].long())
                loss, m = P.ppo_loss(newlogprob, dist.entropy(), newvalue, b[2][mb], b[3][mb],
                                     b[4][mb], b[5][mb], args.clip_coef)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
                [v.item() for v in m.values()]  # a port reads each minibatch's metrics
        times.append((t1 - t0, time.time() - t1))
    json.dump({"times": times}, open(out, "w"))


def bound_worker(name, num_envs, device, out):
    """The compute alone: rollout inference and the update on random data, no env."""
    args = P.Args(num_envs=num_envs)
    flags = CONFIGS[name] or []
    bf16 = "bf16" in flags
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=bf16)
    T, N = args.num_steps, args.num_envs
    if name == "plain":
        agent = PlainAgent(OBS, 4).to(device)
        obs = torch.randint(0, 256, (T, N, *OBS), device=device).float()
    else:
        agent = P.Agent(OBS, 4).to(device, memory_format=torch.channels_last)
        obs = torch.randint(0, 256, (T, N, *OBS), dtype=torch.uint8, device=device)
    act, loss_fn = agent.get_action_and_value, P.minibatch_loss
    if "--compile" in flags:
        act, loss_fn = torch.compile(act), torch.compile(P.minibatch_loss)
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-4, eps=1e-5)
    clip = torch.tensor(0.1, device=device)
    times = []
    for _ in range(3):
        t0 = time.time()
        for step in range(T):
            with torch.inference_mode(), autocast:
                action = act(obs[step])[0]
            action.cpu()
        t1 = time.time()
        batch = dict(obs=obs.reshape(-1, *OBS),
                     actions=torch.randint(0, 4, (T * N,), device=device),
                     **{k: torch.randn(T * N, device=device)
                        for k in ("logprobs", "advantages", "returns", "values")})
        mb_size = T * N // args.num_minibatches
        for _ in range(args.update_epochs):
            perm = torch.randperm(T * N, device=device)
            for start in range(0, T * N, mb_size):
                mb = {k: v[perm[start:start + mb_size]] for k, v in batch.items()}
                with autocast:
                    loss, m = loss_fn(agent, mb, clip, args, {})
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
        torch.stack(list(m.values())).tolist()
        times.append((t1 - t0, time.time() - t1))
    json.dump({"times": times[1:]}, open(out, "w"))  # the first pass warms up (and compiles)


def sync_worker(num_envs, device):
    """Host syncs per rollout step on CUDA: one rollout of the file's own rollout() with
    torch.cuda.set_sync_debug_mode("warn"), counting the warnings (the actions' copy to the
    host is the one needed)."""
    args = P.Args(num_envs=num_envs, env_backend="sync")
    envs = P.make_envs(args, seed=1)
    agent = P.Agent(OBS, envs.single_action_space.n).to(device, memory_format=torch.channels_last)
    storage = P.make_storage(OBS, args.num_steps, num_envs, device)
    staging = torch.zeros((num_envs, *OBS), dtype=torch.uint8, pin_memory=True)
    next_obs = staging.copy_(torch.from_numpy(envs.reset(seed=1)[0])).to(device)
    off = torch.autocast("cuda", enabled=False)
    P.rollout(agent.get_action_and_value, envs, next_obs, storage, staging, off, 0, num_envs)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        P.rollout(agent.get_action_and_value, envs, next_obs, storage, staging, off, 0, num_envs)
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    print(f"# host syncs in one rollout: {len(syncs)} in {args.num_steps} steps "
          f"({len(syncs) / args.num_steps:.2f} per step)")
    envs.close()


def env_worker(name, num_envs, out):
    """The env alone: the configuration's backend stepped with random actions, no network."""
    flags = CONFIGS[name] if CONFIGS[name] is not None else ["--env-backend", "sync"]
    backend = flags[flags.index("--env-backend") + 1] if flags else P.choose_backend(
        P.Args(), torch.cuda.is_available(), 1)
    envs = P.make_envs(P.Args(env_backend=backend, num_envs=num_envs), seed=1)
    envs.reset(seed=1)
    rng, times = np.random.default_rng(1), []
    for _ in range(3):
        t0 = time.time()
        for _ in range(128):
            envs.step(rng.integers(0, envs.single_action_space.n, num_envs))
        times.append(time.time() - t0)
    envs.close()
    json.dump({"times": times[1:]}, open(out, "w"))


def worker_memory(num_envs):
    """The async envs' start (make_envs and the first reset, wall time) and each worker's
    resident (RSS) and proportional (PSS: shared pages split between the processes) memory after
    100 steps, with any other process this one started (a fork server) and the trainer's own."""
    def mib(pid, name, key):
        line = next(x for x in open(f"/proc/{pid}/{name}") if x.startswith(key))
        return int(line.split()[1]) / 1024

    def children():
        return {int(c) for t in os.listdir("/proc/self/task")
                for c in open(f"/proc/self/task/{t}/children").read().split()}
    before, t0 = children(), time.time()
    envs = P.make_envs(P.Args(num_envs=num_envs, env_backend="async"), seed=1)
    envs.reset(seed=1)
    start = time.time() - t0
    for _ in range(100):
        envs.step(np.zeros(num_envs, dtype=np.int64))
    print(f"# torch {torch.__version__}, {num_envs} async workers, {os.cpu_count()} cores")
    print(f"start (make_envs + first reset): {start:.2f} s")
    workers, total = [p.pid for p in envs.processes], 0.0
    for pid in workers:
        total += (pss := mib(pid, "smaps_rollup", "Pss:"))
        print(f"worker {pid}: RSS {mib(pid, 'status', 'VmRSS:'):.0f} MiB, PSS {pss:.0f} MiB")
    for pid in sorted(children() - before - set(workers)):  # the resource tracker, a fork server
        total += (pss := mib(pid, "smaps_rollup", "Pss:"))
        name = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:60]
        print(f"other process {pid} ({name}...): PSS {pss:.0f} MiB")
    print(f"the workers and other processes: PSS {total:.0f} MiB in all; trainer (no network "
          f"yet): RSS {mib(os.getpid(), 'status', 'VmRSS:'):.0f} MiB")
    envs.close()


STOPPER = """
import importlib.util, os, signal, sys, threading, time
import tyro
spec = importlib.util.spec_from_file_location("ppo_atari", os.environ["STOP_SCRIPT"])
P = importlib.util.module_from_spec(spec)
sys.modules["ppo_atari"] = P
spec.loader.exec_module(P)
starts, took, real_rollout, real_batch = [], [], P.rollout, P.make_batch


def signal_now():
    with open("sent", "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGTERM)


def rollout(*a, **kw):  # iteration 2: a timer signals half-way through its rollout
    starts.append(time.perf_counter())
    if len(starts) == 2 and os.environ["STOP_WHEN"] == "rollout":
        threading.Timer(took[0] / 2, signal_now).start()
    out = real_rollout(*a, **kw)
    took.append(time.perf_counter() - starts[-1])
    return out


def make_batch(*a, **kw):  # iteration 2: the signal as its rollout ends (the update must run)
    if len(starts) == 2 and os.environ["STOP_WHEN"] == "update":
        signal_now()
    return real_batch(*a, **kw)


P.rollout, P.make_batch = rollout, make_batch
if __name__ == "__main__":
    P.main(tyro.cli(P.Args), P.explicit_fields(sys.argv[1:]))
"""


def stop_latency(trials, num_envs, num_steps, cuda, script):
    """Seconds from a SIGTERM to the checkpoint it asks for, and to the process's exit: each
    trial is a run that signals itself in its second iteration, half-way through the rollout
    (given up: iteration 1 is checkpointed) or as the update begins (the worst case: the update
    runs to its end). torchrun and SLURM SIGKILL 30 s after their SIGTERM."""
    flags = ["--num-envs", str(num_envs), "--num-steps", str(num_steps)] + ["--no-cuda"] * (
        not cuda)
    seen = {"rollout": [], "update": []}
    for k in range(trials):
        for when in seen:
            with tempfile.TemporaryDirectory() as cwd:
                with open(os.path.join(cwd, "stopper.py"), "w") as f:
                    f.write(STOPPER)
                proc = subprocess.run([sys.executable, "stopper.py", *flags, "--run-name", "t"],
                                      cwd=cwd, capture_output=True, text=True, env=dict(
                                          os.environ, STOP_SCRIPT=script, STOP_WHEN=when))
                ended = time.time()
                if proc.returncode != 143:
                    sys.exit(f"the trial exited {proc.returncode}: {proc.stderr[-1500:]}")
                sent = float(open(os.path.join(cwd, "sent")).read())
                checkpoint = os.path.join(cwd, "runs", "t", "checkpoint.pt")
                step = torch.load(checkpoint, weights_only=True)["global_step"]
                seen[when].append((os.path.getmtime(checkpoint) - sent, ended - sent))
            what = "mid-rollout" if when == "rollout" else "as the update begins"
            print(f"trial {k + 1}, SIGTERM {what}: checkpoint (step {step:,}) "
                  f"{seen[when][-1][0]:.2f} s after it, exit {seen[when][-1][1]:.2f} s after",
                  flush=True)
    print(f"# {trials} trials each, {num_envs} envs x {num_steps} steps, "
          f"{'CUDA' if cuda else 'CPU'}, {os.cpu_count()} cores: checkpoint at most "
          f"{max(s[0] for s in seen['rollout']):.2f} s after a signal mid-rollout, "
          f"{max(s[0] for s in seen['update']):.2f} s after one as the update begins (the worst); "
          f"exit at most {max(s[1] for v in seen.values() for s in v):.2f} s after")


def flops_and_peak(num_envs, device):
    """FLOPs of one iteration (torch's flop counter: the update's 16 minibatch forward+backward
    passes, the rollout's 128 batched forward passes) and the device's dense matmul rate, the
    most any convolution network can get out of it, in fp32 and bf16."""
    from torch.utils.flop_counter import FlopCounterMode
    args = P.Args(num_envs=num_envs)
    batch, mb = num_envs * args.num_steps, num_envs * args.num_steps // args.num_minibatches
    agent = P.Agent(OBS, 4).to(device, memory_format=torch.channels_last)
    obs = torch.randint(0, 256, (mb, *OBS), dtype=torch.uint8, device=device)
    zeros = torch.zeros(mb, device=device)
    minibatch = dict(obs=obs, actions=zeros.long(), logprobs=zeros, advantages=zeros + 1,
                     returns=zeros, values=zeros)
    with FlopCounterMode(display=False) as counter:
        loss, _ = P.minibatch_loss(agent, minibatch, 0.1, args, {})
        loss.backward()
    update = counter.get_total_flops() * args.update_epochs * batch // mb
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        agent.get_action_and_value(obs[:num_envs])
    rollout = counter.get_total_flops() * args.num_steps
    peak = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2048, 2048, device=device, dtype=dtype)
        (x @ x).sum().item()  # warm-up; .item() waits for the GPU to finish
        t0, n = time.time(), 0
        while time.time() - t0 < 2:
            (x @ x).sum().item()
            n += 1
        peak[dtype] = 2 * 2048 ** 3 * n / (time.time() - t0)
    return update, rollout, peak[torch.float32], peak[torch.bfloat16]


def run_child(cmd, cwd):
    """Runs a command; returns its peak RSS in MiB (that process alone)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd} failed:\n{err[-2000:]}")
    return usage.ru_maxrss / 1024


def trainer_times(run_dir):
    sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))
    from events import scalars
    logged = scalars(run_dir)
    return list(zip([v for _, v in logged["charts/rollout_time"]],
                    [v for _, v in logged["charts/update_time"]]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6, help="iterations per configuration")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the configurations")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--cuda", action="store_true", help="benchmark on CUDA")
    parser.add_argument("--num-envs", type=int, default=8, help="envs (8 is the default)")
    parser.add_argument("--script", default=SCRIPT, help="the copy of ppo_atari.py to benchmark")
    parser.add_argument("--compare", help="another copy, a row with the first config's flags")
    parser.add_argument("--no-bounds", action="store_true",
                        help="skip the compute-only and env-only runs (one process per row)")
    parser.add_argument("--worker-memory", action="store_true",
                        help="print the resident memory of each async env worker, then exit")
    parser.add_argument("--stop-latency", type=int, metavar="TRIALS",
                        help="seconds from SIGTERM to the checkpoint over TRIALS runs, then exit")
    parser.add_argument("--num-steps", type=int, default=128, help="--stop-latency's rollouts")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    a = parser.parse_args()
    device = torch.device("cuda" if a.cuda else "cpu")
    if a.worker == "plain":
        return plain_worker(a.iterations, a.num_envs, device, a.out)
    if a.worker and a.worker.startswith("env:"):
        return env_worker(a.worker[4:], a.num_envs, a.out)
    if a.worker:
        return bound_worker(a.worker, a.num_envs, device, a.out)
    if a.worker_memory:
        return worker_memory(a.num_envs)
    if a.stop_latency:
        return stop_latency(a.stop_latency, a.num_envs, a.num_steps, a.cuda, a.script)

    batch = a.num_envs * 128
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"# {cpu}, {os.cpu_count()} cores; "
          f"{torch.cuda.get_device_name() if a.cuda else 'CPU only'}; torch {torch.__version__}; "
          f"{a.num_envs} envs x 128 steps, 4 epochs x 4 minibatches, {a.iterations} iterations")
    update, rollout, fp32, bf16 = flops_and_peak(a.num_envs, device)
    print(f"# per iteration: update {update / 1e9:.0f} GFLOP, rollout inference "
          f"{rollout / 1e9:.0f} GFLOP; 2048x2048 matmul: fp32 {fp32 / 1e9:.0f} GFLOP/s, bf16 "
          f"{bf16 / 1e9:.0f} GFLOP/s; at those rates the compute alone would take "
          f"{(update + rollout) / fp32:.2f} s (fp32), {(update + rollout) / bf16:.2f} s (bf16)")
    if a.cuda:
        sync_worker(a.num_envs, device)
    if a.compare:
        first = a.configs.split(",")[0]
        CONFIGS[f"{first} ({os.path.basename(a.compare)})"] = ["--script", a.compare,
                                                              *(CONFIGS[first] or [])]
        a.configs += f",{first} ({os.path.basename(a.compare)})"
    print(f"{a.rounds} rounds; each figure is the median over rounds; file: {SCRIPT}")
    print("| config | SPS | x plain | rollout s/iter | update s/iter | peak RSS MiB | "
          "compute-only SPS | SPS / bound | env-only SPS | SPS / ceiling | SPS per round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    names = a.configs.split(",")
    rows = {name: [] for name in names}  # name: [(sps, rollout, update, rss, bound, env)]
    for r in range(a.rounds):  # every other round in reverse order: no row always goes first
        for name in names if r % 2 == 0 else names[::-1]:
            rows[name].append(measure(name, a, batch))
            print(f"# round {r + 1}, {name}: {rows[name][-1][0]:.0f} SPS", flush=True)
    base = None
    for name in names:
        sps, rollout, update, rss, bound_sps, env_sps = np.median(rows[name], axis=0)
        base = base or sps
        ceiling = 1 / (1 / bound_sps + 1 / env_sps)
        per_round = ", ".join(f"{r[0]:.0f}" for r in rows[name])
        print(f"| {name} | {sps:.0f} | {sps / base:.2f} | {rollout:.2f} | {update:.2f} | "
              f"{rss:.0f} | {bound_sps:.0f} | {sps / bound_sps:.0%} | {env_sps:.0f} | "
              f"{sps / ceiling:.0%} | {per_round} |", flush=True)


def measure(name, a, batch):
    """One configuration once: its training run, its compute-only bound, its env alone."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        me = [sys.executable, os.path.abspath(__file__), "--script", a.script,
              "--iterations", str(a.iterations),
              "--num-envs", str(a.num_envs), "--out", out] + (["--cuda"] if a.cuda else [])
        if name == "plain":
            rss = run_child(me + ["--worker", "plain"], tmp)
            times = json.load(open(out))["times"]
        else:
            flags, script = CONFIGS[name], a.script
            if flags[:1] == ["--script"]:  # --compare: another file, the first config's flags
                flags, script = flags[2:], os.path.abspath(flags[1])
            rss = run_child([sys.executable, script, *flags, "--num-envs", str(a.num_envs),
                             "--total-timesteps", str(batch * a.iterations)]
                            + ([] if a.cuda else ["--no-cuda"]), tmp)
            times = trainer_times(glob.glob(os.path.join(tmp, "runs", "*"))[0])
        bound_name, bound_sps, env_sps = name.split(" (")[0], np.nan, np.nan
        if not a.no_bounds:
            run_child(me + ["--worker", bound_name], tmp)
            bound_sps = batch / np.median([sum(t) for t in json.load(open(out))["times"]])
            run_child(me + ["--worker", "env:" + bound_name], tmp)
            env_sps = batch / np.median(json.load(open(out))["times"])
    rollout, update = np.median([t[0] for t in times[1:]]), np.median([t[1] for t in times[1:]])
    return batch / (rollout + update), rollout, update, rss, bound_sps, env_sps


if __name__ == "__main__":
    main()
