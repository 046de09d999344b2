"""Do two copies of ppo_atari.py train identically? (not collected by pytest)

    python tests/dev/compare_scalars.py OLD.py NEW.py [-- extra flags]
    python tests/dev/compare_scalars.py old.py ppo_atari.py --iterations 2 --config default
    python tests/dev/compare_scalars.py old.py ppo_atari.py --new-tag losses/grad_norm
    python tests/dev/compare_scalars.py ppo_atari.py ppo_atari.py --new-python ~/torch-next/bin/python

Runs both files in subprocesses on the CPU, same seed and flags, one after the other, and
compares every TensorBoard scalar except the timing ones (charts/SPS, charts/rollout_time,
charts/update_time) value for value. Prints each tag with its verdict; exit code 1 unless all
are bit-identical (--new-tag: a tag the new file adds on purpose, allowed). This is how a
refactor that should not change the numbers is checked; --new-python runs the new file with
another interpreter (another torch release's venv), and for a differing tag prints the largest
difference and the first iteration that differs.
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from events import scalars  # noqa: E402  (the tools' events reader)

TIMING = {"charts/SPS", "charts/rollout_time", "charts/update_time"}
CONFIGS = {  # name: (flags, steps per iteration)
    "tiny": (["--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2",
              "--update-epochs", "2"], 64),
    "default": ([], 1024),
}


def run(python, script, flags, cwd):
    out = subprocess.run([python, os.path.abspath(script), *flags, "--no-cuda",
                          "--run-name", "compare"], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{script} failed:\n{out.stderr[-3000:]}")
    return scalars(os.path.join(cwd, "runs", "compare"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--config", choices=list(CONFIGS), default="tiny")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--new-tag", action="append", default=[],
                        help="a tag only the new file logs, on purpose (repeatable)")
    parser.add_argument("--new-python", default=sys.executable,
                        help="the interpreter for the new file (default: this one)")
    parser.add_argument("extra", nargs="*", help="more flags for both runs (after --)")
    a, unknown = parser.parse_known_args()  # flags after -- or unknown here go to both runs
    a.extra += [f for f in unknown if f != "--"]
    flags, per_iteration = CONFIGS[a.config]
    flags = [*flags, "--total-timesteps", str(a.iterations * per_iteration), "--seed",
             str(a.seed), *a.extra]
    with tempfile.TemporaryDirectory() as tmp:
        logged = []
        for name, python, script in (("old", sys.executable, a.old),
                                     ("new", a.new_python, a.new)):
            os.mkdir(os.path.join(tmp, name))
            logged.append(run(python, script, flags, os.path.join(tmp, name)))
    old, new = logged
    same = True
    for tag in sorted(set(old) | set(new)):
        if tag in TIMING:
            continue
        a_, b_ = old.get(tag), new.get(tag)
        if a_ is None and tag in a.new_tag:
            verdict = f"new in {a.new} ({len(b_)} values), allowed"
        elif a_ is None or b_ is None:
            verdict, same = f"only in {'new' if a_ is None else 'old'}", False
        elif a_ == b_ or (len(a_) == len(b_) and all(
                s == t and (v == w or (math.isnan(v) and math.isnan(w)))
                for (s, v), (t, w) in zip(a_, b_))):
            verdict = f"identical ({len(a_)} values)"
        elif len(a_) != len(b_) or any(s != t for (s, _), (t, _) in zip(a_, b_)):
            verdict, same = f"DIFFERENT steps ({len(a_)} and {len(b_)} values)", False
        else:
            gaps = [abs(v - w) for (_, v), (_, w) in zip(a_, b_)]
            first = next(i for i, g in enumerate(gaps) if g > 0 or math.isnan(g))
            scale = max(abs(v) for _, v in a_) or 1.0
            verdict, same = (f"DIFFERENT: largest difference {max(gaps):.3g} ({max(gaps) / scale:.2g}"
                             f" of the largest value), first at step {a_[first][0]}"), False
        print(f"{tag:35} {verdict}")
    print("all scalars identical" if same else "scalars differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
