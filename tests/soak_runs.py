"""How the reliability soak (`soak_harness`) runs ckpttool: processes forked from a zygote that
imported ckpttool once (0.2 s a run instead of 2 s of interpreter start and imports), torchrun
jobs with one rank killed, and the moto server the runs' S3 requests go to, in a process of its
own.

Example:
    >>> zygote = Zygote(env)
    >>> run = run_forked(zygote, ["consolidate", "ckpt", "out.safetensors", "-q"], env, logs, kill=(0.5, signal.SIGKILL))
    >>> run.code
    -9
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUN_TIMEOUT = 90.0  # a run still going after this is dirty (hung)


_ZYGOTE_IMPORTS = ("ckpttool.cli", "ckpttool.commands.consolidate", "ckpttool.commands.reshard",
                   "ckpttool.commands.export", "ckpttool.commands.import_", "ckpttool.commands.push",
                   "ckpttool.store.storage", "ckpttool.store.s3", "ckpttool.outputs.remote", "s3fs", "aiobotocore.session",
                   "botocore.session", "huggingface_hub", "numpy", "torch")


def zygote_main() -> None:
    """The zygote's loop (single-threaded, so forking it is safe): a JSON line on stdin forks a
    run (`args`, `env`, `cwd`, `stdout`, `stderr` paths) and answers `{"pid"}`; each run's end is
    told as `{"exit": pid, "code": returncode}` (-N: killed by signal N)."""
    import importlib
    import select

    for name in _ZYGOTE_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    print(json.dumps({"ready": True}), file=out)
    buffer = b""
    running: set[int] = set()
    parent = os.getppid()
    while os.getppid() == parent:  # the soak gone (killed): so is its zygote
        ready, _, _ = select.select([0], [], [], 0.01)
        if ready:
            data = os.read(0, 65536)
            if not data:
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                pid = _fork_run(json.loads(line))
                running.add(pid)
                print(json.dumps({"pid": pid}), file=out)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                print(json.dumps({"exit": pid, "code": code}), file=out)


def _fork_run(request: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(number, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import tempfile

        tempfile.tempdir = None  # TMPDIR is read again
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        random.seed()
        sys.argv = ["ckpttool", *request["args"]]
        from ckpttool.cli import main

        try:
            main(args=request["args"], prog_name="ckpttool")
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


class Zygote:
    """The process runs are forked from (`run`); `start` it with the environment every run shares."""

    def __init__(self, env: dict[str, str]):
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import soak_runs; "
                                   "soak_runs.zygote_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=str(ROOT), text=True, bufsize=1)
        assert self.process.stdout is not None
        first = self.process.stdout.readline()
        if not first.strip():
            raise RuntimeError("the soak's zygote did not start")
        self._pids: list[int] = []
        self._spawning = threading.Lock()  # one request and its pid at a time
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self._changed:
                if "pid" in message:
                    self._pids.append(message["pid"])
                else:
                    self._exits[message["exit"]] = message["code"]
                self._changed.notify_all()

    def spawn(self, args: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> int:
        assert self.process.stdin is not None
        with self._spawning, self._changed:
            self.process.stdin.write(json.dumps({"args": args, "env": env, "cwd": str(ROOT), "stdout": str(stdout),
                                                 "stderr": str(stderr)}) + "\n")
            self.process.stdin.flush()
            self._changed.wait_for(lambda: self._pids, timeout=30)
            return self._pids.pop(0)

    def wait(self, pid: int, timeout: float) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.pop(pid, None)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


@dataclass
class Run:
    code: int | None  # None: hung (killed by the harness)
    stdout: str
    stderr: str
    seconds: float


def run_forked(zygote: Zygote, args: list[str], env: dict[str, str], logs: Path, kill: tuple[float, int] | None = None,
               timeout: float = RUN_TIMEOUT, kill_at: str | None = None) -> Run:
    """Run ckpttool with `args`; with `kill=(seconds, signal)`, send it that signal then; with
    `kill_at`, SIGKILL it as soon as it prints that line on stderr (a `testpoints.pause`)."""
    out, err = logs / "stdout", logs / "stderr"
    out.write_bytes(b"")  # a run SIGKILLed before it opened them still has them
    err.write_bytes(b"")
    start = time.monotonic()
    pid = zygote.spawn(args, env, out, err)
    code = None
    while kill_at is not None and code is None and time.monotonic() - start < timeout:
        if kill_at in err.read_text(errors="replace").splitlines():
            os.kill(pid, signal.SIGKILL)
            break
        code = zygote.wait(pid, 0.02)
    if kill is not None:
        code = zygote.wait(pid, kill[0])
        if code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, kill[1])
    if code is None:
        code = zygote.wait(pid, timeout)
    if code is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        zygote.wait(pid, 10)
    seconds = time.monotonic() - start
    return Run(code, out.read_text(errors="replace"), err.read_text(errors="replace"), seconds)


def run_torchrun(args: list[str], env: dict[str, str], kill_after: float | None, rng: random.Random,
                 timeout: float = 180.0) -> Run:
    """`torchrun --standalone --nproc-per-node 2 -m ckpttool ARGS` (docs/distributed.md); with
    `kill_after`, one rank (drawn by `rng`) SIGKILLed that many seconds after both ranks started."""
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                "-m", "ckpttool", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**env, "OMP_NUM_THREADS": "1"}, cwd=str(ROOT))
    if kill_after is not None:
        threading.Thread(target=_kill_a_rank, args=(process, kill_after, rng.randrange(2)), daemon=True).start()
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        _kill_tree(process.pid)
        stdout, stderr = process.communicate()
        code = None
    return Run(code, stdout, stderr, time.monotonic() - start)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append(int(entry.name))
    return sorted(found)


def _kill_a_rank(process: subprocess.Popen, delay: float, which: int) -> None:
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        ranks = _children(process.pid)
        if len(ranks) >= 2:
            time.sleep(delay)
            with contextlib.suppress(ProcessLookupError):
                os.kill(ranks[which], signal.SIGKILL)
            return
        time.sleep(0.02)


def _kill_tree(pid: int) -> None:
    for child in _children(pid):
        _kill_tree(child)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


_MOTO = """
import logging, sys
import moto.s3.models
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
moto.s3.models.S3_UPLOAD_PART_MIN_SIZE = 1000  # parts of PART_SIZE bytes
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("http://%s:%d" % server.get_host_and_port(), flush=True)
sys.stdin.read()  # until the soak closes it, or is gone
server.stop()
"""


@contextlib.contextmanager
def moto_process(log: Path):
    """Yield the endpoint of a moto server in a process of its own (S3_UPLOAD_PART_MIN_SIZE
    lowered there), so that serving the runs' requests does not share one GIL with the
    harness's own looking and the fault proxies of concurrent points. Its log goes to `log`
    (moto answers 500 now and then to a LIST racing a DELETE: the clients retry, as for the
    proxy's)."""
    with open(log, "ab") as errors:
        process = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=errors, text=True)
    try:
        assert process.stdout is not None
        endpoint = process.stdout.readline().strip()
        if not endpoint.startswith("http://"):
            raise RuntimeError("the soak's moto server did not start")
        yield endpoint
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
