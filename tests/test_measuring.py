"""tests/dev/phases.py, the phase table of where an iteration's time goes, at a tiny budget on the
CPU (its figures are measurements, not checked here; what is checked is that every phase is
measured for both backends and that the table adds up)."""
import os
import subprocess
import sys

from conftest import ROOT, SCRIPT

PHASES = os.path.join(ROOT, "tests", "dev", "phases.py")


def table(*flags) -> dict[str, list[float]]:
    out = subprocess.run([sys.executable, PHASES, "--script", SCRIPT, "--threads", "1",
                          "--num-envs", "2", "--num-steps", "8", "--iterations", "2", *flags],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| phase")]
    return {r[0]: [float(x) for x in r[1:]] for r in rows}


def test_the_phase_table_measures_every_phase_of_sync_and_async_and_adds_up():
    rows = table("--backends", "sync,async")
    phases = ["forward", "action to host", "env step", "obs to device", "storage writes"]
    for name in [*phases, "rollout per step (as trained)", "update per iteration",
                 "steps/s (rollout as trained + update)", "instrumented per step"]:
        assert len(rows[name]) == 2 and all(v > 0 for v in rows[name]), (name, rows)
    for backend in (0, 1):  # unexplained: the rollout's time per step less the phases' sum
        left = rows["rollout per step (as trained)"][backend] - sum(
            rows[p][backend] for p in phases)
        assert abs(rows["unexplained"][backend] - left) < 0.01, (backend, rows)


def test_the_loop_cost_is_measured_without_emulator_or_network():
    rows = table("--loop-cost", "--backends", "sync")
    (name,) = rows
    assert "no-op envs" in name and rows[name][0] > 0
