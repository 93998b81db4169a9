"""The first minutes of a new user: commands typed inside a checkpoint directory, and logs
without progress-bar fragments. Each runs the installed `ckpttool` as a real subprocess."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

from conftest import FIXTURES

CKPTTOOL = Path(sys.executable).with_name("ckpttool")
SOURCE = FIXTURES / "fsdp2_world3_uneven"


def test_reshard_typed_inside_a_checkpoint_directory_writes_name_world4_beside_it_and_says_so(tmp_path):
    checkpoint = tmp_path / "step-00000200"
    shutil.copytree(SOURCE, checkpoint)
    done = subprocess.run([CKPTTOOL, "reshard", "--world", "4", "-q"], cwd=checkpoint, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "no DST given: writing ../step-00000200-world4" in done.stderr
    assert (tmp_path / "step-00000200-world4" / ".metadata").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000200", "step-00000200-world4"]
    for command in (["inspect"], ["validate"]):
        done = subprocess.run([CKPTTOOL, *command], cwd=tmp_path / "step-00000200-world4", capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert "from ranks 0..3" in subprocess.run([CKPTTOOL, "inspect"], cwd=tmp_path / "step-00000200-world4",
                                               capture_output=True, text=True).stdout


def test_progress_bars_go_to_a_terminal_but_never_into_a_log_file(tmp_path):
    log = tmp_path / "stderr.log"
    with open(log, "w") as stderr:
        done = subprocess.run([CKPTTOOL, "consolidate", SOURCE, tmp_path / "a.safetensors"], stderr=stderr,
                              stdout=subprocess.PIPE)
    assert done.returncode == 0 and "%|" not in log.read_text()

    controller, terminal = pty.openpty()  # stderr a terminal, as when a person runs it
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 0 columns shows no bar
    try:
        process = subprocess.Popen([CKPTTOOL, "consolidate", SOURCE, tmp_path / "b.safetensors"], stderr=terminal,
                                   stdout=subprocess.DEVNULL)
        shown = b""
        while True:  # read while it runs: once it exits, Linux drops what the terminal held
            ready, _, _ = select.select([controller], [], [], 0.05)
            if ready:
                shown += os.read(controller, 65536)
            elif process.poll() is not None:
                break
    finally:
        os.close(terminal)
        os.close(controller)
    assert process.returncode == 0 and b"consolidate:" in shown
