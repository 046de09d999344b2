"""Each Atari wrapper on the real ALE (Breakout, Pong, SpaceInvaders with their bundled ROMs),
checked against stepping the raw emulator by hand."""
import cv2
import gymnasium as gym
import numpy as np
import pytest

import ppo_atari as P
from conftest import expect, need, obs_shape

pytestmark = pytest.mark.details  # the published details: `pytest tests -m details`

OBS = obs_shape()


def stack_depth() -> int:
    """The number of frames make_env stacks (its FrameStackObservation)."""
    need("frame stack")
    env = P.make_env("BreakoutNoFrameskip-v4", seed=0)()
    while not isinstance(env, gym.wrappers.FrameStackObservation):
        env = env.env
    return env.stack_size


def split_frames(obs, depth):
    """A stacked observation (..., C, H, W) as its depth frames (..., C / depth, H, W) each."""
    return np.split(obs, depth, axis=-3)


class ActionLog(gym.Wrapper):
    """Test probe, innermost: records every action the emulator receives and every reset."""

    def __init__(self, env):
        super().__init__(env)
        self.log = []

    def reset(self, **kwargs):
        self.log.append("reset")
        return self.env.reset(**kwargs)

    def step(self, action):
        self.log.append(int(action))
        return self.env.step(action)


def raw(env_id="BreakoutNoFrameskip-v4"):
    return gym.make(env_id, frameskip=1)


EMULATOR_OF_RECORD = {  # a NoFrameskip-v4 id as the published runs made it (ALE-NOTES.md)
    "sticky actions (repeat_action_probability)": 0.0,
    "the emulator's frame skip (the wrappers skip)": 1,
    "the action set (minimal: the game's own actions)": "minimal",
    "the emulator's episode limit in frames (max_num_frames_per_episode)": 108_000,
    "the observation type the wrappers receive": "rgb",
}


def emulator_settings(env) -> dict:
    """What an env's emulator was given, read back from the ALE itself."""
    atari = env.unwrapped
    ale = atari.ale
    minimal = [a.value for a in ale.getMinimalActionSet()]
    return dict(zip(EMULATOR_OF_RECORD, [
        round(ale.getFloat("repeat_action_probability"), 6),
        max(ale.getInt("frame_skip"), int(getattr(atari, "_frameskip", 1))),
        "minimal" if [a.value for a in atari._action_set] == minimal else
        f"{len(atari._action_set)} actions, not the game's minimal {len(minimal)}",
        ale.getInt("max_num_frames_per_episode"),
        getattr(atari, "_obs_type", "?")]))


def test_the_emulator_settings_of_record_in_the_copys_own_training_env():
    """The env this copy's make_envs builds for training (not one this test makes) gives the
    emulator the settings of record for a v4 id: no sticky actions, frame skip left to the
    wrappers, the minimal action set, ALE's 108,000-frame limit, RGB frames in. Each changed one
    is named with its value of record and this copy's."""
    need("vector env")
    envs = P.make_envs(P.Args(env_id="BreakoutNoFrameskip-v4", num_envs=1, env_backend="sync"),
                       seed=0)
    try:
        mine = emulator_settings(envs.envs[0])
    finally:
        envs.close()
    expect(*[(mine[name] == value, f"emulator setting {name}: of record {value!r}; this "
                                   f"copy's {mine[name]!r}")
             for name, value in EMULATOR_OF_RECORD.items()])


def test_max_and_skip_matches_stepping_the_raw_env_by_hand():
    need("wrappers")
    wrapped, reference = P.MaxAndSkip(raw("PongNoFrameskip-v4"), skip=4), raw("PongNoFrameskip-v4")
    wrapped.reset(seed=3)
    reference.reset(seed=3)
    actions = np.random.default_rng(0).integers(0, 6, size=300)
    total_reward, max_differs_from_last, bad_sums, bad_frames = 0.0, 0, [], 0
    for a in actions:
        obs, reward, terminated, truncated, _ = wrapped.step(a)
        frames, expected_reward = [], 0.0
        for _ in range(4):
            frame, r, term, trunc, _ = reference.step(a)
            frames.append(frame)
            expected_reward += r
        if reward != expected_reward:
            bad_sums.append((reward, expected_reward))
        bad_frames += not np.array_equal(obs, np.maximum(frames[-2], frames[-1]))
        max_differs_from_last += not np.array_equal(obs, frames[-1])
        total_reward += abs(reward)
    expect((not bad_sums, f"frame skip 4 sums the 4 frames' rewards (published); this copy's "
            f"(reward, sum) differ at {len(bad_sums)} steps, first {bad_sums[:1]}"),
           (not bad_frames, f"the observation is the pixel-wise max of the last 2 of the 4 frames "
            f"(published); this copy's differs at {bad_frames} of {len(actions)} steps"),
           (total_reward > 0, "no reward seen: the reward sum was not exercised"),
           (max_differs_from_last > 0, "the max of two frames never differed from the last"))


def play_until(env, stop, rng, max_steps=5000):
    for _ in range(max_steps):
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(0, 4)))
        if stop(terminated, truncated):
            return terminated, truncated
    raise AssertionError("the condition never happened")


def test_life_loss_terminates_without_resetting_the_game():
    need("wrappers")
    env = P.EpisodicLife(P.MaxAndSkip(ActionLog(raw())))
    ale = env.unwrapped.ale
    env.reset(seed=1)
    rng = np.random.default_rng(1)
    terminated, _ = play_until(env, lambda te, tr: te or tr, rng)
    assert terminated and ale.lives() == 4, (
        f"a lost life ends the episode as terminated (published); this copy's episode ended "
        f"with terminated={terminated} at {ale.lives()} lives of Breakout's 5")
    frame_before, log = ale.getEpisodeFrameNumber(), env.env.env.log
    log.clear()
    env.reset()
    # the pseudo-reset is one no-op agent step (4 frames), not a new game
    expect((log == [0, 0, 0, 0], f"the reset after a lost life is one no-op agent step (4 "
            f"emulator no-ops, published); this copy's emulator got {log[:12]}"),
           (ale.lives() == 4 and ale.getEpisodeFrameNumber() == frame_before + 4,
            f"the game goes on after a lost life: 4 lives, frame {frame_before + 4}; this "
            f"copy's {ale.lives()} lives, frame {ale.getEpisodeFrameNumber()}"))
    lives_seen = []  # after the last life the game really resets
    for lives_left in (3, 2, 1, 0):
        play_until(env, lambda te, tr: te or tr, rng)
        lives_seen.append(ale.lives())
        if lives_left:
            env.reset()
    env.reset()
    expect((lives_seen == [3, 2, 1, 0], f"each episode ends with one life lost: 3, 2, 1, 0 left; "
            f"this copy's {lives_seen}"),
           (ale.lives() == 5 and ale.getEpisodeFrameNumber() == 0 and log[-1] == "reset",
            f"after the last life, a real reset (5 lives, frame 0); this copy's {ale.lives()} "
            f"lives at frame {ale.getEpisodeFrameNumber()}, last emulator call {log[-1]!r}"))


def test_fire_is_pressed_after_every_reset_including_lost_lives():
    need("wrappers")
    probe = ActionLog(raw())
    env = P.FireReset(P.EpisodicLife(P.MaxAndSkip(probe)))
    env.reset(seed=2)
    first = list(probe.log)
    play_until(env, lambda te, tr: te or tr, np.random.default_rng(2))
    probe.log.clear()
    env.reset()
    expect((first == ["reset"] + [1] * 4 + [2] * 4, f"a game starts with FIRE, then action 2 "
            f"(one agent step each, published); this copy's emulator got {first[:14]}"),
           (probe.log == [0] * 4 + [1] * 4 + [2] * 4, f"after a lost life: the no-op, FIRE, "
            f"then action 2 (published); this copy's emulator got {probe.log[:14]}"))


def test_noop_reset_takes_1_to_30_noops_from_the_seeded_rng():
    need("wrappers")
    counts, others = [], []
    for seed in range(12):
        probe = ActionLog(raw())
        env = P.NoopReset(probe, noop_max=30)
        env.reset(seed=seed)
        others += [a for a in probe.log[1:] if a != 0] + probe.log[:1] * (probe.log[0] != "reset")
        counts.append(len(probe.log) - 1)
    probe = ActionLog(raw())
    P.NoopReset(probe).reset(seed=5)
    expect((not others, f"a reset, then no-ops (action 0) only; this copy's also sent "
            f"{others[:5]}"),
           (all(1 <= c <= 30 for c in counts), f"1 to 30 no-ops after a reset (published); "
            f"this copy's counts over 12 seeds: {counts}"),
           (len(set(counts)) > 3, f"no-op counts vary with the seed; this copy's: {counts}"),
           (len(probe.log) - 1 == counts[5], f"the same seed gives the same no-op count: "
            f"{counts[5]}; this copy's {len(probe.log) - 1}"))


class FixedDraw:
    """Stands in for the env's seeded RNG: records each integers() call and returns `drawn`."""

    def __init__(self, drawn):
        self.drawn, self.calls = drawn, []

    def integers(self, low, high=None, size=None, dtype=np.int64, endpoint=False):
        self.calls.append(range(low, high + 1 if endpoint else high))
        return self.drawn


def test_noop_count_is_drawn_from_1_to_30_inclusive_by_the_envs_rng():
    need("wrappers")
    for drawn in (1, 17, 30):
        rng = FixedDraw(drawn)

        class Probe(ActionLog):  # the seeded reset, then the stand-in RNG
            def reset(self, **kwargs):
                out = super().reset(**kwargs)
                self.unwrapped._np_random = rng
                return out

        probe = Probe(raw())
        P.NoopReset(probe, noop_max=30).reset(seed=0)
        assert rng.calls == [range(1, 31)], ("no-op starts of record: a count from 1 to 30 "
                                            f"inclusive, from the env's RNG; this copy draws "
                                            f"from {rng.calls}")
        assert probe.log[1:] == [0] * drawn, (f"the drawn count of no-ops is taken: {drawn}; "
                                              f"this copy's emulator got {probe.log[1:]}")


def probed_training_env(draw):
    """The copy's own training env (make_env's thunk, whatever it passes its wrappers), its
    emulator probed: the log of the actions it gets ("reset" for a reset), `frames` returned
    instead of the emulator's while any are left, and `draw` as the env's RNG after a reset."""
    need("env thunk")
    env = P.make_env("BreakoutNoFrameskip-v4", seed=0)()
    atari, log, frames = env.unwrapped, [], []
    real_step, real_reset = atari.step, atari.reset

    def step(action):
        log.append(int(action))
        out = real_step(action)
        return (frames.pop(0), *out[1:]) if frames else out

    def reset(**kwargs):
        log.append("reset")
        out = real_reset(**kwargs)
        atari._np_random = draw  # seeded by the reset: what the no-op count is drawn from
        return out

    atari.step, atari.reset = step, reset
    return env, log, frames


def test_the_wrappers_parameters_of_record_in_the_copys_own_training_env():
    """What make_env passes its wrappers, read from the env it builds for training (the other
    wrapper tests build each class with its defaults): after a reset, a no-op count drawn from
    1..30 and taken, then FIRE and action 2 (one agent step each); an agent step of 4 emulator
    frames observing the max of the last 2; a lost life terminal. A fork passing another value
    is named with the value of record and the copy's."""
    draw = FixedDraw(30)
    env, log, frames = probed_training_env(draw)
    depth = stack_depth()
    env.reset(seed=0)
    noops = next((i for i, a in enumerate(log[1:]) if a != 0), len(log) - 1)
    ranges = [f"{r.start}..{r.stop - 1}" for r in draw.calls]
    after = log[1 + noops:]
    fire = [a for i, a in enumerate(after) if i == 0 or a != after[i - 1]]
    log.clear()
    shades = [90, 10, 60, 20, 30, 40, 50, 70]  # uniform frames: the max of 2 shows which 2
    frames += [np.full((210, 160, 3), v, np.uint8) for v in shades]
    obs, *_ = env.step(3)
    skip, newest = len(log), split_frames(obs, depth)[-1]
    frames.clear()
    seen = [int(v) for v in np.unique(newest)]
    atari, rng = env.unwrapped, np.random.default_rng(0)
    lives, terminated = atari.ale.lives(), False
    for _ in range(5000):
        _, _, terminated, truncated, _ = env.step(int(rng.integers(0, 4)))
        if atari.ale.lives() < lives or terminated or truncated:
            break
    lost = atari.ale.lives() < lives
    env.close()
    expect((ranges == ["1..30"], f"no-op maximum: of record 30 (a count drawn from 1..30 after "
            f"each reset); this copy's draws {ranges or 'none from the env RNG'}"),
           (noops == 30, f"the drawn no-op count is taken: 30 no-ops for a draw of 30; this "
            f"copy's emulator got {noops}"),
           (fire == [1, 2] and len(after) == 2 * skip, f"after a reset: FIRE, then action 2, one "
            f"agent step each (of record); this copy's emulator got {after[:16]}"),
           (skip == 4, f"frame skip: of record 4 emulator frames per agent step; this copy's "
            f"{skip}"),
           (seen == [max(shades[:skip][-2:])], f"the observation: the pixel-wise max of the last "
            f"2 frames of the step (of record: {max(shades[:skip][-2:])} from frames "
            f"{shades[:skip]}); this copy's newest frame holds {seen}"),
           (lost and terminated, f"a lost life is terminal (of record); this copy's step that "
            f"lost a life returned terminated={terminated}" if lost else "no life was lost in "
            "5000 random steps"))


def test_rewards_are_clipped_while_statistics_keep_the_raw_score():
    need("env thunk")
    env = P.make_env("SpaceInvadersNoFrameskip-v4", seed=0)()
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    clipped = []
    for _ in range(20_000):
        _, reward, terminated, truncated, info = env.step(int(rng.integers(0, 6)))
        clipped.append(reward)
        if "episode" in info:
            break
    assert "episode" in info, "the game did not end: no full-game statistics in info"
    signs, hits = sorted(set(clipped)), sum(abs(r) for r in clipped)
    # every alien is worth 5 to 30 points: the raw score is far above the count of rewards;
    # the statistics count the whole game (all lives; the 5 pseudo-resets add steps inside)
    expect((set(signs) <= {-1.0, 0.0, 1.0} and hits > 0,
            f"rewards clipped to their sign (published: -1, 0, 1); this copy's rewards take "
            f"{len(signs)} values from {min(signs):.3g} to {max(signs):.3g}"),
           (info["episode"]["r"] >= 5 * hits, f"the logged score is the raw game score (at "
            f"least 5 per alien, {5 * hits:.0f} here); this copy's {info['episode']['r']}"),
           (info["episode"]["l"] > len(clipped) - 1 - 5, f"the logged length is the whole game's "
            f"(over {len(clipped) - 6} steps); this copy's {info['episode']['l']}"))


def test_the_published_observation_is_4_frames_of_84x84():
    """Pins the published observation size: a stack of 4 frames of 84x84 (Mnih et al. 2015,
    baselines, CleanRL). The other tests take the shape from the file under test."""
    need("env thunk")
    env = P.make_env("BreakoutNoFrameskip-v4", seed=0)()
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4, 84, 84), f"published frames: 4 x 84 x 84, this file: {obs.shape}"


def test_stack_is_newest_last_and_padded_with_the_reset_frame():
    depth = stack_depth()
    env = P.make_env("BreakoutNoFrameskip-v4", seed=0)()
    obs, _ = env.reset(seed=0)
    first, dtype, shifted = split_frames(obs, depth), obs.dtype, 0
    rng = np.random.default_rng(0)
    for _ in range(20):
        new, *_ = env.step(int(rng.integers(0, 4)))
        shifted += all(np.array_equal(a, b) for a, b in zip(split_frames(new, depth)[:-1],
                                                            split_frames(obs, depth)[1:]))
        obs = new
    expect((dtype == np.uint8, f"observations are uint8 frames; this copy's {dtype}"),
           (all(np.array_equal(first[0], f) for f in first), "a reset pads the stack with its "
            "own frame (published); this copy's first stack holds different frames"),
           (shifted == 20, f"each step shifts the stack towards index 0, the newest frame last "
            f"(published); this copy's did at {shifted} of 20 steps"),
           (not np.array_equal(split_frames(obs, depth)[-1], first[0]), "the frames never "
            "changed over 20 steps"))


def test_frames_are_gray_and_area_resized():
    """Pins the published frame: the max of the last two raw frames, grayscale, area-resized."""
    depth = stack_depth()
    env = P.make_env("BreakoutNoFrameskip-v4", seed=0)()
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(20):
        obs, *_ = env.step(int(rng.integers(0, 4)))
    newest = split_frames(obs, depth)[-1]
    assert newest.shape[0] == 1, ("published frames are grayscale (one channel each); this "
                                  f"copy's frames have {newest.shape[0]} channels")
    rgb = env.unwrapped.ale.getScreenRGB()
    # the newest frame is the max of the last two raw frames, grayed and area-resized; the
    # current screen alone differs from that max only where sprites moved
    last = cv2.resize(cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY), newest.shape[:0:-1],
                      interpolation=cv2.INTER_AREA)
    assert np.mean(newest[0] == last) > 0.95, "frames: RGB to gray, then cv2.INTER_AREA resize"


def test_finished_games_reports_every_game_ending_in_one_step():
    def thunk():
        return gym.wrappers.RecordEpisodeStatistics(gym.make("BreakoutNoFrameskip-v4",
                                                             max_episode_steps=30))
    envs = gym.vector.SyncVectorEnv([thunk, thunk, thunk],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    envs.reset(seed=0)
    for step in range(30):
        *_, infos = envs.step(np.zeros(3, dtype=np.int64))
        games = P.finished_games(infos)
        assert len(games) == (3 if step == 29 else 0), (
            f"games reported at step {step + 1}: {3 if step == 29 else 0} (all 3 end at step "
            f"30); this copy's finished_games reports {len(games)}")
    assert games == [(0.0, 30)] * 3, f"(score, length) of each: (0.0, 30); this copy's {games}"
    envs.close()


def test_games_lives_fire_and_stacks_in_the_vector_env():
    depth = stack_depth()
    need("vector env")
    args = P.Args(num_envs=2, env_backend="sync")
    envs = P.make_envs(args, seed=0)
    obs, _ = envs.reset(seed=0)

    def fresh_stack(obs):  # (N,): the stack is one frame repeated
        f = split_frames(obs, depth)
        return np.all([(f[0] == g).all(axis=(1, 2, 3)) for g in f[1:]], axis=0)

    assert fresh_stack(obs).all() and obs.max() > 0, ("a game starts with its frame repeated "
                                                      "(published); this copy's does not")
    rng = np.random.default_rng(0)
    terminations, steps = np.zeros(2, dtype=int), np.zeros(2, dtype=int)
    games, pending = [], np.zeros(2, dtype=bool)
    for _ in range(3000):
        # never FIRE: the backend must relaunch the ball after a lost life, or Breakout stalls
        obs, reward, terminated, truncated, infos = envs.step(rng.choice([0, 2, 3], size=2))
        assert obs.shape == (2, *OBS) and obs.dtype == np.uint8, (
            f"the vector env's observations: (2, *{OBS}) uint8; this copy's {obs.shape} "
            f"{obs.dtype}")
        terminations += terminated
        # a lost life or a game over restarts the stack from one frame x4 in the same step
        # (the pseudo-reset)
        fresh = fresh_stack(obs)
        assert fresh[pending].all(), ("a lost life or game over restarts the stack from one "
                                      "frame (published); this copy's stack went on")
        pending = terminated & ~fresh
        steps += 1
        if "episode" in infos.get("final_info", {}):
            ended = infos["final_info"]["_episode"]
            games += [(s, n, k) for (s, n), k in zip(P.finished_games(infos), steps[ended])]
            steps[ended] = 0
        if len(games) >= 2:
            break
    envs.close()
    assert len(games) >= 2, "games stalled: no FIRE after a lost life?"
    # Breakout has 5 lives: one finished game takes 5 terminations (4 lives lost, 1 game over);
    # lengths count emulator frames: 4 per agent step, plus the frames the no-op start and
    # the FIRE presses add (at most 30 + 2 * 4 per life)
    n = terminations.sum()
    expect((5 * len(games) <= n < 5 * (len(games) + 2), f"each lost life is a termination: 5 "
            f"per game of Breakout, {len(games)} games; this copy's terminations: {n}"),
           *[(score >= 0 and 4 * steps - 3 <= frames <= 4 * steps + 30 + 5 * 12,
              f"a game's length counts emulator frames (4 per agent step, {steps} steps); this "
              f"copy's game logged {frames} frames, score {score}")
             for score, frames, steps in games])
