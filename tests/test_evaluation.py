"""--eval-checkpoint: full games played through act() and logged, another id of the game
under sticky actions, and a checkpoint of another game, action set or network refused in one line."""
import os

import pytest
import torch

import ppo_atari as P
from conftest import TINY, need, run_dirs, run_in_process, scalars


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny finished run, shared by the checks below."""
    cwd = tmp_path_factory.mktemp("trained")
    out = run_in_process([*TINY, "--total-timesteps", "128"], cwd=cwd)
    assert out.returncode == 0, out.stderr
    return cwd, run_dirs(cwd)[0]


def test_corrupt_other_game_and_other_action_set_are_refused(trained, tmp_path):
    need("Agent heads")
    cwd, run = trained
    data = open(os.path.join(run, "checkpoint.pt"), "rb").read()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    state = P.load_checkpoint(run)
    weight = state["model"]["actor.weight"]
    state["model"]["actor.weight"] = torch.zeros(6, weight.shape[1])
    state["model"]["actor.bias"] = torch.zeros(6)
    torch.save(state, tmp_path / "six_actions.pt")
    shape = f"actor.weight is (6, {weight.shape[1]}) in the checkpoint (BreakoutNoFrameskip-v4) " \
            f"and (4, {weight.shape[1]}) here"
    cases = [(["--resume", "truncated.pt"], "cannot load truncated.pt as a safe checkpoint"),
             (["--eval-checkpoint", "six_actions.pt"], shape),
             (["--resume", "six_actions.pt", "--total-timesteps", "256"], shape),
             (["--resume", os.path.join(run, "agent.pt")], "is a saved agent, not a checkpoint"),
             (["--eval-checkpoint", run, "--env-id", "PongNoFrameskip-v4"],
              "was trained on BreakoutNoFrameskip-v4, not PongNoFrameskip-v4")]
    for args, message in cases:
        out = run_in_process([*args, "--no-cuda"], tmp_path)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    assert sorted(os.listdir(tmp_path)) == ["six_actions.pt", "truncated.pt"]


def test_another_network_is_one_line_naming_both_shapes(trained, tmp_path):
    """A checkpoint of another network (a fork's, or the file's before a fork changed a layer)
    meets this one: one line naming the tensor and both shapes, no traceback."""
    cwd, run = trained
    state = P.load_checkpoint(run)
    name, tensor = next(iter(state["model"].items()))  # the network's first tensor, whatever it is
    state["model"][name] = torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:])
    torch.save(state, tmp_path / "other_network.pt")
    for flags in (["--resume", "other_network.pt", "--total-timesteps", "256"],
                  ["--eval-checkpoint", "other_network.pt"]):
        out = run_in_process([*flags, "--no-cuda"], tmp_path)
        assert out.returncode == 2, out.stderr[-2000:]
        (message,) = out.stderr.splitlines()
        theirs, mine = (tensor.shape[0] + 1, *tensor.shape[1:]), tuple(tensor.shape)
        assert f"does not fit this network: {name} is {theirs} in the checkpoint" in message
        assert f"and {mine} here" in message


def test_evaluation_plays_full_games_and_logs_them(trained):
    cwd, run = trained
    command = ["--eval-checkpoint", os.path.join(run, "agent.pt"), "--eval-episodes", "2",
               "--no-cuda", "--capture-video"]
    out = run_in_process(command, cwd=cwd)
    assert out.returncode == 0, out.stderr
    games = [line for line in out.stdout.splitlines() if line.startswith("game ")]
    assert len(games) == 2
    assert "BreakoutNoFrameskip-v4: " in out.stdout and " ± " in out.stdout
    assert "over 2 games (agent at step 128)" in out.stdout
    assert "device: cpu (--no-cuda)" in out.stdout and "training" not in out.stdout
    assert "evaluation events: " in out.stdout and "; videos: " in out.stdout
    (folder,) = os.listdir(os.path.join(run, "eval"))  # each evaluation: a TensorBoard run
    assert folder.startswith("step128-seed1-")
    logged = scalars(os.path.join(run, "eval", folder))
    assert [s for s, _ in logged["eval/episodic_return"]] == [1, 2]
    scores = [float(line.split("score ")[1].split(",")[0]) for line in games]
    assert [v for _, v in logged["eval/episodic_return"]] == scores
    assert logged["eval/mean_episodic_return"] == [(128, sum(scores) / 2)]
    # full games only: the game the autoreset began after the last one leaves no video
    videos = sorted(os.listdir(os.path.join(run, "eval-videos", folder)))  # its own folder
    assert videos == ["game-0.mp4", "game-1.mp4"]
    assert os.path.getsize(os.path.join(run, "eval-videos", folder, "game-0.mp4")) > 1000
    # seeded: the same command plays the same games, and logs them apart
    again = run_in_process(command[:4] + ["--no-cuda"], cwd=cwd)
    assert [ln for ln in again.stdout.splitlines() if ln.startswith("game ")] == games
    assert len(os.listdir(os.path.join(run, "eval"))) == 2


def test_evaluation_chooses_its_actions_through_act(trained, monkeypatch):
    """evaluate() plays the policy through the core's act(agent, obs, memory), so a recurrent
    fork edits act above the fence: memory["starts"] is all ones at the first step, then 1.0
    exactly where the previous step ended an episode (a lost life included)."""
    need(what="act(agent, obs, memory), which evaluation calls", problem=None if hasattr(
        P, "act") else "this copy has none")
    cwd, run = trained
    starts, real = [], P.act

    def act(agent, obs, memory):
        starts.append(memory["starts"].clone())
        return real(agent, obs, memory)

    monkeypatch.setattr(P, "act", act)
    out = run_in_process(["--eval-checkpoint", os.path.join(run, "agent.pt"), "--eval-episodes",
                          "1", "--no-cuda"], cwd=cwd)
    assert out.returncode == 0, out.stderr
    assert starts and torch.equal(starts[0], torch.ones(1)), starts[:1]
    later = sum(float(s) for s in starts[1:])
    assert later >= 4, f"Breakout's 5 lives: 4 or more episode starts after the first; {later}"


def test_an_agent_is_scored_on_another_id_of_its_game_under_sticky_actions(trained):
    """ALE/Breakout-v5 plays a BreakoutNoFrameskip-v4 agent with sticky actions 0.25 (Machado et
    al. 2018's protocol) and the same 4-frame skip, and its evaluation is logged apart."""
    need("env thunk")
    cwd, run = trained
    env = P.make_env("ALE/Breakout-v5", 1)()
    env.reset(seed=1)
    ale = env.unwrapped.ale
    frames = ale.getEpisodeFrameNumber()
    env.step(0)
    assert ale.getFloat("repeat_action_probability") == 0.25
    assert ale.getEpisodeFrameNumber() - frames == 4, "v5's own frame skip must be off"
    env.close()
    out = run_in_process(["--eval-checkpoint", os.path.join(run, "agent.pt"), "--env-id",
                          "ALE/Breakout-v5", "--eval-episodes", "1", "--no-cuda"], cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ALE/Breakout-v5: " in out.stdout and "over 1 game (agent at step 128)" in out.stdout
    (folder,) = [f for f in os.listdir(os.path.join(run, "eval")) if "v5" in f]
    assert folder.startswith("ALE-Breakout-v5-step128-seed1-")
    logged = scalars(os.path.join(run, "eval", folder))
    assert [s for s, _ in logged["eval/episodic_return"]] == [1]
