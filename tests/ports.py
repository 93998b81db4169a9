"""Ports for the tests' listeners that the other pytest-xdist worker cannot take.

A port found by binding port 0 and closing the socket is a port in Linux's ephemeral range
(`ip_local_port_range`, 32768-60999 by default): between the probe and the listener's own bind
(seconds, when the listener is a torchrun or an emulator that imports its world first), any
process's outgoing connection may take it, and with two workers the other one makes thousands
(gloo meshes, HTTP to moto). So a probe here picks from a block below that range, one block per
xdist worker (`PYTEST_XDIST_WORKER`, inherited by every child the worker starts; a serial run
has its own block): only this worker's own listeners ever use it, and the bind check skips a
port still held or in TIME_WAIT.
"""

from __future__ import annotations

import os
import random
import socket

FIRST = 20000  # below the ephemeral range on Linux (32768) and on macOS (49152)
BLOCK = 2000  # ports per worker
BLOCKS = 6  # 20000-31999: the serial run, then gw0..gw4 (more workers share blocks, still bind-checked)

_random = random.SystemRandom()  # os.urandom: forked children do not share a sequence


def worker_block() -> range:
    """The ports of this pytest process (and of its children): its xdist worker's block."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    slot = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    start = FIRST + BLOCK * (slot % BLOCKS)
    return range(start, start + BLOCK)


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now, from this worker's block (for a listener started next:
    a gloo rendezvous, an emulator); also a port nothing listens on (connections refused)."""
    block = worker_block()
    for _ in range(200):
        port = _random.choice(block)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {block.start}-{block.stop - 1} after 200 tries")


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (connections are refused at once): from this
    worker's block, where no other process starts a listener."""
    return free_port()
