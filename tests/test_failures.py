"""Failures say what they cost: a full disk, a read-only folder, closed output. Real processes on
a filesystem of their own: a small tmpfs mounted in a private mount namespace (`unshare -m`,
which needs root or user namespaces; the tests skip with the reason where it is refused)."""
import functools
import glob
import os
import pty
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ppo_atari as P
from conftest import SCRIPT, TINY, need


@functools.cache
def private_tmpfs_refused() -> str | None:
    """Why this machine cannot mount a private tmpfs (None: it can)."""
    try:
        done = subprocess.run(["unshare", "-m", "sh", "-c", 'd=$(mktemp -d) && mount -t tmpfs '
                               '-o size=1m none "$d" && umount "$d" && rmdir "$d"'],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare: {e}"
    return None if done.returncode == 0 else f"unshare -m: {done.stderr.strip()[:120]}"


def in_small_filesystem(script: str, cwd, megabytes: int) -> subprocess.CompletedProcess:
    """script (sh) run with $D a tmpfs of that size, seen by it alone, and $RUN `python
    SCRIPT` with the tiny configuration; the files it leaves in cwd stay."""
    if private_tmpfs_refused():
        pytest.skip(private_tmpfs_refused())
    env = dict(os.environ, RUN=f"{sys.executable} {SCRIPT} {' '.join(TINY)}",
               PYTHONWARNINGS="ignore")
    body = f'set -u; D=$(mktemp -d); mount -t tmpfs -o size={megabytes}m none "$D"; {script}'
    return subprocess.run(["unshare", "-m", "sh", "-c", body], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_a_full_disk_ends_the_run_in_one_line_keeps_its_checkpoint_and_leaves_no_temporary(
        tmp_path):
    """A run checkpointing every iteration; once its first is done the disk is filled to 1 MiB
    (the events fit, a checkpoint does not): exit 1, one line naming the file, the cause and
    the step the checkpoint holds, which loads; no .tmp left. The same command then finds no
    room for two checkpoints and says so in one line, touching nothing; a new run there is
    refused alike, and leaves no folder. A run that checkpoints rarely, its disk filled to the
    last byte: the events' write fails, in one line too."""
    need("main")
    done = in_small_filesystem('''
        E=$(mktemp -d); mount -t tmpfs -o size=64m none "$E"
        $RUN --total-timesteps 100000 --checkpoint-interval 1 --runs-dir "$D" --run-name r \
            > out1 2> err1 &
        first=$!
        $RUN --total-timesteps 100000 --checkpoint-interval 1000 --runs-dir "$E" --run-name r \
            > out4 2> err4 &
        while ! grep -q "^step " out1 && kill -0 $first 2>/dev/null; do sleep 0.05; done
        free=$(df --output=avail -k "$D" | tail -1)
        dd if=/dev/zero of="$D/filler" bs=1k count=$((free - 1024)) 2>/dev/null
        while ! grep -q "^step " out4 && kill -0 $! 2>/dev/null; do sleep 0.05; done
        cat /dev/zero > "$E/filler" 2>/dev/null
        wait $first; echo $? > rc1
        ls -a "$D/r" > listing; cp "$D/r/checkpoint.pt" held.pt
        $RUN --total-timesteps 100000 --checkpoint-interval 1 --runs-dir "$D" --run-name r \
            > out2 2> err2; echo $? > rc2; ls -a "$D/r" > listing2
        $RUN --total-timesteps 64 --runs-dir "$D" --run-name new > out3 2> err3; echo $? > rc3
        ls -a "$D" > listing3
        wait $!; echo $? > rc4; ls -a "$E/r" > listing4
        ''', tmp_path, 64)
    assert done.returncode == 0, done.stderr
    read = lambda name: (tmp_path / name).read_text()  # noqa: E731
    assert read("rc1").strip() == "1", read("err1")
    line, held = one_error_line(read("err1")), P.load_checkpoint(str(tmp_path / "held.pt"))
    assert "cannot write" in line and ".pt" in line and "the disk is full" in line, line
    assert f"holds step {held['global_step']:,}" in line and held["global_step"] >= 64, line
    assert not [f for f in read("listing").split() if "tmp" in f], read("listing")
    assert read("rc2").strip() == "1" and read("listing2") == read("listing"), read("err2")
    line = one_error_line(read("err2"))
    assert "has room for" in line and "two checkpoints" in line and "free some space" in line
    assert read("rc3").strip() == "1" and "new" not in read("listing3").split(), read("err3")
    assert "or pass --runs-dir on another disk" in one_error_line(read("err3"))
    assert read("rc4").strip() == "1" and "tmp" not in read("listing4"), read("err4")
    line = one_error_line(read("err4"))
    assert line.startswith("error: cannot write the events in ") and "the disk is full" in \
        line and "holds step " in line, line


def test_a_read_only_run_folder_is_evaluated_with_its_events_under_runs_here(tmp_path):
    """A run trained on a filesystem then made read-only: its agent plays, and the evaluation's
    events go to runs/NAME/eval of the working directory, which it says."""
    need("main")
    done = in_small_filesystem('''
        $RUN --total-timesteps 64 --runs-dir "$D" --run-name r > out1 2> err1 || exit 3
        mount -o remount,ro "$D"
        $RUN --eval-checkpoint "$D/r/agent.pt" --eval-episodes 1 > out2 2> err2; echo $? > rc2
        ''', tmp_path, 64)
    assert done.returncode == 0, done.stderr + (tmp_path / "err1").read_text()
    out, err = ((tmp_path / f).read_text() for f in ("out2", "err2"))
    assert (tmp_path / "rc2").read_text().strip() == "0", err
    assert "is read-only: the evaluation writes to runs/r instead" in out, out
    (events,) = glob.glob(str(tmp_path / "runs" / "r" / "eval" / "*"))
    acc = EventAccumulator(events)
    acc.Reload()
    assert len(acc.Scalars("eval/episodic_return")) == 1


def test_closed_output_never_stops_a_run(tmp_path):
    """stdout and stderr are pipes closed after the first line (`| head -1`, a dropped `| tee`):
    the run goes on to its end, exit 0, every iteration logged; its events name the run
    folder. A terminal that hangs up (a pty whose master closes: EIO) likewise."""
    need("main")
    command = [sys.executable, SCRIPT, *TINY, "--total-timesteps", str(3 * 64)]
    piped = subprocess.Popen([*command, "--run-name", "piped"], cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    master, slave = pty.openpty()
    hung_up = subprocess.Popen([*command, "--run-name", "hung-up"], cwd=tmp_path, stdout=slave,
                               stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    assert piped.stdout.readline() and os.read(master, 100)
    for closed in (piped.stdout, piped.stderr):
        closed.close()
    os.close(master)
    assert piped.wait(timeout=200) == 0 and hung_up.wait(timeout=200) == 0
    for name in ("piped", "hung-up"):
        run = tmp_path / "runs" / name
        assert P.load_checkpoint(str(run))["global_step"] == 3 * 64, name
        acc = EventAccumulator(str(run), size_guidance={"tensors": 0})
        acc.Reload()
        assert [e.step for e in acc.Scalars("charts/SPS")] == [64, 128, 192], name
        (launch,) = acc.Tensors("launch/text_summary")
        assert str(run) in launch.tensor_proto.string_val[0].decode(), name
