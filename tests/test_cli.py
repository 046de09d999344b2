"""The command line: --help is clean, bad input fails with one line, exit 2, and nothing on disk."""
import contextlib
import importlib.util
import os
import py_compile
import re
import shutil
import signal
import subprocess
import sys

import pytest
import tyro

import ppo_atari as P
from conftest import SCRIPT, is_repository_file, need

FORKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forks")


def test_help_is_clean_with_user_warnings_as_errors(tmp_path):
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", SCRIPT, "--help"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--env-id", "--total-timesteps", "--anneal-clip", "--no-anneal-clip",
                 "--target-kl", "--resume", "--eval-checkpoint", "--precision", "--stop-at-step",
                 "--threads"):
        assert flag in out.stdout
    assert "--batch-size" not in out.stdout and "--num-iterations" not in out.stdout
    assert not os.path.exists(tmp_path / "runs")


def test_the_resume_help_names_what_a_resume_may_change():
    """--resume's help line lists the options a resume may change: the ones the resume checks
    let through (RESUME_OVERRIDABLE), no more and no fewer."""
    field = "    resume: str | None = None\n"
    need(what="Args' line `resume: str | None = None` and its docstring", problem=None if (
        open(SCRIPT).read().count(field) == 1 and hasattr(P, "RESUME_OVERRIDABLE")) else
        "this copy has another")
    doc = open(SCRIPT).read().split(field, 1)[1].split('"""')[1]
    named = set(re.findall(r"--([a-z-]+)", doc))
    assert named == {n.replace("_", "-") for n in P.RESUME_OVERRIDABLE - {"resume"}}, named


BAD = {
    "minibatches": (["--num-minibatches", "3"], "--num-minibatches 3 does not divide"),
    "num_envs": (["--num-envs", "0"], "--num-envs must be a positive integer"),
    "num_steps": (["--num-steps", "-5"], "--num-steps must be a positive integer"),
    "negative_lr": (["--learning-rate", "-0.001"], "--learning-rate must be positive"),
    "zero_lr": (["--learning-rate", "0"], "--learning-rate must be positive"),
    "unknown_env": (["--env-id", "BreakoutNoFrameskip-v5"], "provides versioned environments: "
                    "[ `v0`, `v4` ]"),
    "non_atari": (["--env-id", "CartPole-v1"], "--env-id CartPole-v1 is not an Atari game"),
    "frameskip_v4": (["--env-id", "Breakout-v4"], "skip frames at random or repeat actions); use "
                     "BreakoutNoFrameskip-v4 (the published setting) or ALE/Breakout-v5"),
    "sticky_v0": (["--env-id", "PongNoFrameskip-v0"], "not an Atari image id of record (the "
                  "other v4 ids and v0 skip frames at random or repeat actions); use "
                  "PongNoFrameskip-v4"),
    # unknown ids: gymnasium's own guess (within the namespace asked for), then the file's hint
    "typo": (["--env-id", "Breakot-v4"], "Did you mean: `Breakout`?"),
    "game_name_only": (["--env-id", "breakout"], "Did you mean: `Breakout`?"),
    "deterministic_id": (["--env-id", "PongDeterministic-v4"], "`PongDeterministic` doesn't "
                         "exist. (ids of record look like BreakoutNoFrameskip-v4 or ALE/"),
    "typo_keeps_the_game": (["--env-id", "PongNoFrameskp-v4"], "Did you mean: `PongNoFrameskip`?"),
    "typo_keeps_the_family": (["--env-id", "ALE/Breakuot-v5"], "in namespace ALE. Did you mean: "
                              "`Breakout`?"),
    "game_keeps_the_family": (["--env-id", "ALE/Pong-v4"], "Please use `ALE/Pong-v5` instead"),
    "zero_threads": (["--threads", "0"], "--threads must be a positive integer"),
    "zero_stop": (["--stop-at-step", "0"], "--stop-at-step must be a positive integer"),
    "tiny_budget": (["--total-timesteps", "10"], "--total-timesteps 10 is less than one batch"),
    "missing_resume": (["--resume", "no/such/run"], "no checkpoint at no/such/run"),
    "missing_eval": (["--eval-checkpoint", "nothing.pt"], "no checkpoint at nothing.pt"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_fails_with_one_clear_line(name, workdir, capsys):
    """In process (the command line's own path: tyro, then main): one line on stderr naming
    the field, exit 2, nothing written."""
    need("main")
    argv = [*BAD[name][0], "--no-cuda"]
    (workdir / "keep.txt").write_text("precious")
    with pytest.raises(SystemExit) as exit_:
        P.main(tyro.cli(P.Args, args=argv), P.explicit_fields(argv))
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert BAD[name][1] in lines[0]
    assert sorted(os.listdir(workdir)) == ["keep.txt"] and (workdir / "keep.txt").read_text() == \
        "precious"


def test_bad_input_from_the_shell_is_one_line_without_a_traceback(tmp_path):
    """The same as a user sees it: no ALE banner, no warning, no traceback, exit 2, for an error
    of main's and for one of tyro's."""
    for args, message in [(["--num-minibatches", "3"], "error: --num-minibatches 3 does not"),
                          (["--env-backend", "ale"], "invalid choice 'ale'")]:
        out = subprocess.run([sys.executable, SCRIPT, *args, "--no-cuda"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr + out.stdout
        if message.startswith("error: "):
            assert out.stderr.splitlines() == [out.stderr.strip()], out.stderr
    assert not os.listdir(tmp_path)


EXAMPLE_FORKS = sorted(f for f in os.listdir(FORKS) if f.endswith(".diff"))


def applied(fork, folder):
    """The repository's file with the example fork's diff applied, in folder."""
    if not is_repository_file():
        pytest.skip("the example forks are diffs of the repository's ppo_atari.py, not of a copy")
    shutil.copy(SCRIPT, folder / "ppo_atari.py")
    out = subprocess.run(["git", "apply", "-p0", os.path.join(FORKS, fork)], cwd=folder,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{fork} no longer applies: {out.stderr}"
    assert open(folder / "ppo_atari.py").read() != open(SCRIPT).read()
    py_compile.compile(str(folder / "ppo_atari.py"), doraise=True)
    return folder / "ppo_atari.py"


@pytest.mark.parametrize("fork", EXAMPLE_FORKS)
def test_each_example_fork_still_applies_to_the_file(fork, tmp_path):
    """README's fork table links these diffs (`patch ppo_atari.py tests/forks/lstm.diff`): each
    applies to the file as it is now, and the copy it makes compiles."""
    applied(fork, tmp_path)


def test_the_lstm_forks_act_takes_a_state_of_one_tensor_or_a_tuple(tmp_path):
    """The recurrent fork's act() (what evaluation plays) keeps whatever state the policy
    returns between steps: a tuple (an LSTM's) or one tensor (a GRU's, whose truth value torch
    refuses), starting from initial_state when there is none."""
    spec = importlib.util.spec_from_file_location("lstm_fork", applied("lstm.diff", tmp_path))
    F = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(F)
    import torch

    class Recurrent:  # stands for a policy whose state is `make(n)`, counted up each step
        def __init__(self, make):
            self.make = make

        def initial_state(self, num_envs, device):
            return self.make(num_envs)

        def get_action_and_value(self, obs, state, starts):
            moved = tuple(s + 1 for s in state) if isinstance(state, tuple) else state + 1
            return torch.zeros(obs.shape[0], dtype=torch.long), None, None, None, moved

    for make in (lambda n: torch.zeros(1, n, 8), lambda n: (torch.zeros(1, n, 8),) * 2):
        memory = {"starts": torch.ones(2)}
        for _ in range(3):
            F.act(Recurrent(make), torch.zeros(2, 4, 84, 84), memory)
        state = memory["state"] if isinstance(memory["state"], tuple) else (memory["state"],)
        assert all(torch.equal(s, torch.full((1, 2, 8), 3.0)) for s in state), memory


@pytest.mark.forks
@pytest.mark.parametrize("fork", EXAMPLE_FORKS)
def test_each_example_fork_trains_stops_resumes_and_evaluates(fork, tmp_path, monkeypatch):
    """The copy each example fork makes trains, stops at --stop-at-step, continues with the same
    command to its end, and scores its agent in a full game (`pytest tests -m forks`)."""
    spec = importlib.util.spec_from_file_location(fork[:-5], applied(fork, tmp_path))
    F = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(F)
    monkeypatch.chdir(tmp_path)
    tiny = dict(num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, cuda=False,
                total_timesteps=128, run_name="fork")
    F.main(F.Args(**tiny, stop_at_step=64))
    assert F.load_checkpoint("runs/fork")["global_step"] == 64
    F.main(F.Args(**tiny))  # the same command, continued
    assert F.load_checkpoint("runs/fork")["global_step"] == 128
    F.main(F.Args(eval_checkpoint="runs/fork/agent.pt", eval_episodes=1, cuda=False))
    (events,) = os.listdir(tmp_path / "runs" / "fork" / "eval")
    assert events.startswith("step128-"), events


def continue_line(capsys, args, step, stopped, stopped_early, world_size=1):
    """The last line end_run prints for a run in runs/x stopped by SIGTERM (or --stop-at-step)."""
    run = P.Run("runs/x", [signal.SIGTERM] if stopped else [], {})
    with contextlib.suppress(SystemExit):
        P.end_run(run, args, step, stopped, stopped_early, 0, world_size)
    return capsys.readouterr().out.splitlines()[-1]


def test_the_continue_line_is_the_same_command(capsys, monkeypatch):
    """A stopped run prints the line that continues it: `python ppo_atari.py ...` when that
    `python` (on PATH) is this interpreter, as README promises; the full path when it is not."""
    need("main")
    monkeypatch.setattr(sys, "argv", ["ppo_atari.py"])
    for on_path, expected in ((sys.executable, "python"), (None, sys.executable)):
        monkeypatch.setattr(P.shutil, "which", lambda name: on_path if name == "python" else None)
        line = continue_line(capsys, P.Args(), 64, True, False)
        assert line.endswith(f"continue with: {expected} ppo_atari.py --resume runs/x"), line


def test_the_continue_line_keeps_the_launch_only_options_and_names_torchruns(capsys, monkeypatch):
    """--no-cuda, --threads and a planned --stop-at-step are not saved in the checkpoint, so the
    line repeats them (a CPU run on a GPU machine resumes on the CPU); under torchrun the line
    asks for the same launcher and options (the file does not read them) before the script's."""
    need("main")
    monkeypatch.setattr(sys, "argv", ["ppo_atari.py"])
    monkeypatch.setattr(P.shutil, "which", lambda name: sys.executable)
    args = P.Args(cuda=False, threads=3, stop_at_step=5000)
    line = continue_line(capsys, args, 64, True, False)
    assert line.endswith("continue with: python ppo_atari.py --resume runs/x --no-cuda --threads 3 "
                         "--stop-at-step 5000"), line
    line = continue_line(capsys, args, 5120, False, True)  # the stop reached: dropped
    assert line.endswith("python ppo_atari.py --resume runs/x --no-cuda --threads 3"), line
    line = continue_line(capsys, P.Args(), 64, True, False, world_size=2)
    assert line.endswith("continue with: the same torchrun launcher and options, then: "
                         "ppo_atari.py --resume runs/x"), line
