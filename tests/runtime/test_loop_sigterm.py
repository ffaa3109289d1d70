"""A second SIGTERM during training (mpgen/runtime/loop.py's run): it ends
train_<name>.py at once, but not a rank of pp_<name>.py, whose SIGTERMs come
from torchrun's agent (one to every worker when one ends, another as the
agent shuts down; NOTE [A lost rank]): that rank still finishes its step,
saves and stops, or names the lost ranks. The loop runs in a child, which
sends itself the two signals inside its first step."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import signal, sys
sys.path.insert(0, {tests!r})
from mpgen.runtime import loop
from tiny import TRAINING

loop.Single.agent_sigterm = {agent}
step = loop.Single.step

def twice(self, stream):
    if not self.signals:  # the first step: two SIGTERMs, each handled before the next
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
    return step(self, stream)

loop.Single.step = twice
loop.train(TRAINING, ["--steps", "5", "--checkpoint", {folder!r}])
"""


def _run(tmp_path: Path, agent: bool) -> subprocess.CompletedProcess:
    code = CHILD.format(tests=str(Path(__file__).parent), agent=agent, folder=str(tmp_path))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_a_second_sigterm_from_torchruns_agent_lets_the_step_finish_and_save(tmp_path):
    done = _run(tmp_path, agent=True)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().endswith(f"interrupted after step 1; saved {tmp_path}/last.pt")
    assert (tmp_path / "last.pt").is_file()


@pytest.mark.slow
def test_a_second_sigterm_ends_the_single_process_script_at_once(tmp_path):
    done = _run(tmp_path, agent=False)
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]
    assert not (tmp_path / "last.pt").exists()
