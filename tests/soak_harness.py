"""The reliability soak's core (issue 32): commands run with a fault drawn at random, each run
classified as identical, clean failure or dirty.

A *point* is one seeded draw: a command (consolidate to .safetensors / Hub shards / .pt,
reshard, export, import, consolidate --merge-adapter, push to the loopback Hub), a store
(local, or s3:// on moto through `fault_proxy.FaultProxy` as source, destination or both) and
a fault: SIGKILL or SIGTERM at a random time, the disk full at a random byte (a tmpfs of
random size under the destination, or under TMPDIR where the output is staged or exported), S3
faults at a random rate and mix, or one torchrun rank SIGKILLed at a random time. After each
run:

- **identical**: exit 0 and the output byte-identical to the fault-free run's, nothing else left;
- **clean failure**: exit != 0 with one line on stderr, nothing at the destination (no file, no
  temporary, no object, no unfinished multipart upload, no new Hub commit); after SIGKILL, only
  what the next run removes (a temporary, an upload beside its marker key);
- and in both cases the source is untouched (hashed before and after) and the next fault-free
  run succeeds, byte-identical, with nothing left over;
- **dirty**: anything else, printed with its seed to replay (`benchmarks/soak.py --seed S --only N`).

Runs are real processes of ckpttool's CLI, forked from a process that has imported it once
(`Zygote`: 0.2 s a run instead of 2 s of interpreter start and imports); torchrun points run
`python -m torch.distributed.run ... -m ckpttool`. One moto server and one proxy serve the soak.

Example:
    >>> with Soak(work, seed=1) as soak:
    ...     results = [soak.run_point(n) for n in range(50)]
    >>> print(table(results))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIXTURES = ROOT / "fixtures"
BUCKET = "soak"
TOKEN = "hf_soak_token"
TEMP_MARK = ".ckpttool-"
PART_SIZE = 65536  # multipart parts of the soak's uploads (CKPTTOOL_PART_SIZE): several per output
READ_TIMEOUT = 1.5  # the children's S3 read timeout (config_kwargs); the proxy's stalls are longer
STALL = 2.0
RUN_TIMEOUT = 90.0  # a run still going after this is dirty (hung)

STORES = ("local", "s3-src", "s3-dst", "s3")  # where the source and the destination are
# Known, not fixed: SIGKILL while a multi-file S3 output is being committed (its uploads completed one by one,
# the index or .metadata put last) leaves the files completed so far visible, without the index: no reader takes
# it for a checkpoint, and the next run needs --force to replace it. S3 has no atomic commit of several keys.
PARTIAL = "partial commit"
VERDICTS = ("identical", "clean failure", PARTIAL, "dirty")
FAULT_KINDS = ("sigkill", "sigterm", "disk-full", "s3", "torchrun-kill")


@dataclass(frozen=True)
class Command:
    name: str
    source: str  # a key of Soak.sources
    output: str  # the destination's name
    args: tuple[str, ...]  # after SRC OUT
    verb: str = "consolidate"
    stores: tuple[str, ...] = STORES
    torchrun: bool = False


COMMANDS = (
    Command("safetensors", "dcp", "model.safetensors", (), torchrun=True),
    Command("shards", "dcp", "hub", ("--max-shard-size", "64KB"), torchrun=True),
    Command("pt", "dcp", "model.pt", ()),
    Command("reshard", "dcp", "world3", ("--world", "3"), verb="reshard", torchrun=True),
    Command("export", "llama", "hf", ("--assets", str(FIXTURES / "llama_world2" / "config")), verb="export"),
    Command("import", "hub", "dcp", ("--world", "2"), verb="import"),
    Command("merge-adapter", "peft", "merged.safetensors", ("--merge-adapter", "--lora-alpha", "16"),
            stores=("local", "s3-src")),  # --merge-adapter writes local outputs only
    Command("push", "dcp", "tester/soak", (), verb="push", stores=("local",)),
)
BY_NAME = {command.name: command for command in COMMANDS}


@dataclass(frozen=True)
class Point:
    """One draw: what runs, where, and which fault (with its parameters)."""

    index: int
    seed: int
    command: str
    store: str
    fault: str
    delay: float = 0.0  # seconds after start (sigkill, sigterm, torchrun-kill), as a fraction of the fault-free run
    disk: float = 0.0  # the tmpfs's size as a fraction of what the fault-free run wrote
    rate: float = 0.0
    faults: tuple[str, ...] = ()
    requests: tuple[str, ...] = ()

    def describe(self) -> str:
        detail = {"sigkill": f"at {self.delay:.2f}", "sigterm": f"at {self.delay:.2f}",
                  "torchrun-kill": f"at {self.delay:.2f}", "disk-full": f"tmpfs {self.disk:.2f}",
                  "s3": f"rate {self.rate:.2f} {'+'.join(self.faults)} on {'+'.join(self.requests)}"}[self.fault]
        return f"#{self.index} {self.command} {self.store} {self.fault} ({detail})"


def draw(seed: int, index: int, mount_ok: bool, torchrun_share: float = 0.02,
         kinds: tuple[str, ...] = ("sigkill", "sigterm", "s3", "disk-full")) -> Point:
    """Point `index` of the soak seeded `seed` (the same point for the same numbers), its fault
    one of `kinds` (disk-full only when `mount_ok`), or torchrun-kill at `torchrun_share`."""
    from fault_proxy import FAULTS, REQUEST_TYPES

    rng = random.Random(f"soak:{seed}:{index}")
    kinds = tuple(kind for kind in kinds if kind != "disk-full" or mount_ok)
    fault = "torchrun-kill" if rng.random() < torchrun_share else rng.choice(kinds)
    commands = [c for c in COMMANDS if (c.torchrun or fault != "torchrun-kill")]
    if fault == "s3":
        commands = [c for c in commands if c.stores != ("local",)]
    command = rng.choice(commands)
    stores = [s for s in command.stores if (s != "local" if fault == "s3" else True)]
    if fault == "torchrun-kill":
        stores = [s for s in stores if s in ("local", "s3-dst")]
    store = rng.choice(stores)
    point = Point(index, seed, command.name, store, fault)
    if fault in ("sigkill", "sigterm", "torchrun-kill"):
        return Point(**{**point.__dict__, "delay": rng.uniform(0.0, 1.2)})
    if fault == "disk-full":
        return Point(**{**point.__dict__, "disk": rng.uniform(0.0, 1.0)})
    requests = tuple(sorted(rng.sample(REQUEST_TYPES, rng.randint(1, len(REQUEST_TYPES)))))
    if rng.random() < 0.3:
        requests = REQUEST_TYPES
    return Point(**{**point.__dict__, "rate": rng.choice((0.02, 0.05, 0.1, 0.2, 0.3)),
                    "faults": tuple(sorted(rng.sample(FAULTS, rng.randint(1, len(FAULTS))))), "requests": requests})


@dataclass
class Outcome:
    point: Point
    verdict: str  # identical, clean failure, dirty
    reasons: list[str] = field(default_factory=list)
    code: int | None = None
    seconds: float = 0.0
    stderr: str = ""
    injected: int = 0
    leftovers_after_kill: int = 0  # SIGKILL leftovers the next run removed


# ---------------------------------------------------------------------------------------------
# Runs: forked from a process that imported ckpttool once


_ZYGOTE_IMPORTS = ("ckpttool.cli", "ckpttool.commands.consolidate", "ckpttool.commands.reshard",
                   "ckpttool.commands.export", "ckpttool.commands.import_", "ckpttool.commands.push",
                   "ckpttool.storage", "ckpttool.s3", "ckpttool.outputs.remote", "s3fs", "aiobotocore.session",
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
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import soak_harness; "
                                   "soak_harness.zygote_main()"],
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
               timeout: float = RUN_TIMEOUT) -> Run:
    """Run ckpttool with `args`; with `kill=(seconds, signal)`, send it that signal then."""
    out, err = logs / "stdout", logs / "stderr"
    out.write_bytes(b"")  # a run SIGKILLed before it opened them still has them
    err.write_bytes(b"")
    start = time.monotonic()
    pid = zygote.spawn(args, env, out, err)
    code = None
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


# ---------------------------------------------------------------------------------------------
# Looking at what a run left


def tree_hashes(path: Path) -> dict[str, str]:
    """relative name -> sha256 of every file under `path` (or of `path` itself: key "")."""
    if path.is_file():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    if not path.is_dir():
        return {}
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def one_line_error(stderr: str) -> bool:
    """A failed run said what went wrong in one line (a traceback is a bug)."""
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("ckpttool-test:")]
    if "Traceback" in stderr:
        return False
    return len([line for line in lines if line.startswith("error:") or "nothing was left half-written" in line]) == 1


def mount_available() -> bool:
    """True when tmpfs can be mounted here (root, `mount` on PATH, and the kernel allows it)."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    probe = Path(f"/tmp/ckpttool-soak-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=True)
        return ok
    finally:
        probe.rmdir()


@contextlib.contextmanager
def tmpfs(path: Path, size: int):
    """A tmpfs of `size` bytes (rounded up to pages) mounted at `path` (created empty)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={max(size, 4096)}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        for _ in range(50):
            if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# The soak


@dataclass
class Reference:
    hashes: dict[str, str]
    seconds: float
    size: int


class Soak:
    """One moto server, one fault proxy, one Hub stand-in and one zygote for a whole soak;
    `run_point(n)` runs point n and returns its Outcome. `work` holds the sources (written once
    by torch's dcp.save), the destinations and the logs."""

    def __init__(self, work: Path, seed: int, torchrun_share: float = 0.02, jobs: int = 1,
                 kinds: tuple[str, ...] = ("sigkill", "sigterm", "s3", "disk-full")):
        self.work, self.seed, self.torchrun_share, self.jobs = Path(work), seed, torchrun_share, jobs
        self.kinds = kinds
        self._slots: dict[tuple[str, str], threading.Lock] = {}  # one point at a time per command and store
        self._slots_lock = threading.Lock()
        self.mount_ok = mount_available()
        self.references: dict[tuple[str, str], Reference] = {}
        self._stack = contextlib.ExitStack()

    # -- setup --------------------------------------------------------------------------------

    def __enter__(self) -> "Soak":
        import logging
        import urllib.request

        import moto.s3.models
        from moto.server import ThreadedMotoServer

        from fault_proxy import FaultProxy
        from hub_server import HubServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        smallest = moto.s3.models.S3_UPLOAD_PART_MIN_SIZE
        moto.s3.models.S3_UPLOAD_PART_MIN_SIZE = 1000  # parts of PART_SIZE bytes (this process serves moto)
        self._stack.callback(setattr, moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", smallest)
        self.work.mkdir(parents=True, exist_ok=True)
        self.sources = self._local_sources()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        self._stack.callback(server.stop)
        host, port = server.get_host_and_port()
        self.moto = f"http://{host}:{port}"
        urllib.request.urlopen(urllib.request.Request(f"{self.moto}/moto-api/reset", method="POST")).close()
        import s3fs

        self.fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=self.moto, skip_instance_cache=True,
                                    client_kwargs={"region_name": "us-east-1"})
        self.fs.call_s3("create_bucket", Bucket=BUCKET)
        for name, folder in self.sources.items():
            for path in sorted(folder.rglob("*")):
                if path.is_file():
                    self.fs.put_file(str(path), f"{BUCKET}/src/{name}/{path.relative_to(folder).as_posix()}")
        self.proxies = [self._stack.enter_context(FaultProxy(self.moto, stall=STALL, slow=READ_TIMEOUT / 2))
                        for _ in range(self.jobs)]
        self.hub = self._stack.enter_context(HubServer(token=TOKEN))
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "CKPTTOOL_"))},
                    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.proxies[0].endpoint,
                    "HF_ENDPOINT": self.hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(self.work / "hf-home"),
                    "HF_HUB_DISABLE_TELEMETRY": "1", "CKPTTOOL_PART_SIZE": str(PART_SIZE)}
        self.zygote = Zygote(self.env)
        self._stack.callback(self.zygote.close)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _local_sources(self) -> dict[str, Path]:
        """name -> local folder: a DCP checkpoint by torch's dcp.save (2 ranks, 8 fp32 128x64
        tensors: 256 KB, so a disk fills at many points), a Hub folder made from it, and the
        bundled Llama and PEFT fixtures."""
        import dcp_world

        sources = self.work / "sources"
        dcp = sources / "dcp"
        if not (dcp / ".metadata").exists():
            shutil.rmtree(dcp, ignore_errors=True)
            dcp.parent.mkdir(parents=True, exist_ok=True)
            dcp_world.write(dcp, world=2, tensors=8, rows=128, columns=64)
        hub = sources / "hub"
        if not (hub / "model.safetensors.index.json").exists():
            shutil.rmtree(hub, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "ckpttool", "consolidate", str(dcp), str(hub), "--max-shard-size",
                            "64KB", "-q"], check=True, capture_output=True)
        return {"dcp": dcp, "hub": hub, "llama": FIXTURES / "llama_world2" / "checkpoint",
                "peft": FIXTURES / "peft" / "attention" / "checkpoint"}

    # -- where a point reads and writes -------------------------------------------------------

    def _slot(self, command: Command, store: str) -> str:
        return f"{command.name}-{store}"

    def _destination(self, command: Command, store: str) -> str:
        if command.verb == "push":
            return command.output
        if store in ("s3-dst", "s3"):
            return f"s3://{BUCKET}/out/{self._slot(command, store)}/{command.output}"
        return str(self.work / "out" / self._slot(command, store) / command.output)

    def _args(self, command: Command, store: str, force: bool = False) -> list[str]:
        source = (f"s3://{BUCKET}/src/{command.source}" if store in ("s3-src", "s3")
                  else str(self.sources[command.source]))
        args = [command.verb, source, self._destination(command, store), *command.args, "-q"]
        if store != "local":
            timeouts = {"read_timeout": READ_TIMEOUT, "connect_timeout": READ_TIMEOUT}
            args += ["--storage-option", "config_kwargs=" + json.dumps(timeouts, separators=(",", ":"))]
        if force and command.verb != "push":
            args.append("--force")
        return args

    def _tmpdir(self, command: Command, store: str) -> Path:
        return self.work / "tmp" / self._slot(command, store)

    def _run_env(self, command: Command, store: str, proxy: Any) -> dict[str, str]:
        tmpdir = self._tmpdir(command, store)
        tmpdir.mkdir(parents=True, exist_ok=True)
        return {**self.env, "TMPDIR": str(tmpdir), "AWS_ENDPOINT_URL": proxy.endpoint}

    # -- what is at the destination ----------------------------------------------------------

    def state(self, command: Command, store: str) -> dict[str, Any]:
        """{"output": hashes (None: absent), "temps": [...], "stray": [...], "uploads": [...], "tmpdir": [...]}."""
        tmp_left = sorted(p.name for p in self._tmpdir(command, store).iterdir()) \
            if self._tmpdir(command, store).is_dir() else []
        if command.verb == "push":
            with self.hub.lock:
                repo = self.hub.repos.get(command.output)
                tree = dict(repo.trees[repo.branches["main"]]) if repo else {}
            hashes = {name: hashlib.sha256(data).hexdigest() for name, data in sorted(tree.items())}
            return {"output": hashes or None, "temps": [], "stray": [], "uploads": [], "tmpdir": tmp_left}
        destination = self._destination(command, store)
        if destination.startswith("s3://"):
            return self._remote_state(destination, tmp_left)
        path = Path(destination)
        entries = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else []
        temps = [name for name in entries if name.startswith(TEMP_MARK)]
        inner = [p.name for p in path.rglob(TEMP_MARK + "*")] if path.is_dir() else []
        stray = [name for name in entries if name != path.name and name not in temps and name != "lost+found"]
        return {"output": tree_hashes(path) if path.exists() else None, "temps": temps + inner, "stray": stray,
                "uploads": [], "tmpdir": tmp_left}

    def _remote_state(self, destination: str, tmp_left: list[str]) -> dict[str, Any]:
        key = destination[len("s3://"):]
        parent = key.rsplit("/", 1)[0]
        self.fs.invalidate_cache()
        keys = sorted(self.fs.find(parent))
        temps = [k for k in keys if "/" + TEMP_MARK in k]
        mine = [k for k in keys if (k == key or k.startswith(key + "/")) and k not in temps]
        stray = [k for k in keys if k not in temps and k not in mine]
        listing = self.fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=parent[len(BUCKET) + 1:] + "/")
        uploads = [upload["Key"] for upload in listing.get("Uploads", [])]
        output = None
        if mine:
            output = {("" if k == key else k[len(key) + 1:]): hashlib.sha256(self.fs.cat_file(k)).hexdigest()
                      for k in mine}
        return {"output": output, "temps": temps, "stray": stray, "uploads": uploads, "tmpdir": tmp_left}

    def source_hashes(self, command: Command, store: str) -> dict[str, str]:
        if store in ("s3-src", "s3"):
            self.fs.invalidate_cache()
            prefix = f"{BUCKET}/src/{command.source}"
            return {k: hashlib.sha256(self.fs.cat_file(k)).hexdigest() for k in sorted(self.fs.find(prefix))}
        return tree_hashes(self.sources[command.source])

    def clear(self, command: Command, store: str) -> None:
        """Remove the destination, what is beside it and the run's TMPDIR (after a point)."""
        shutil.rmtree(self._tmpdir(command, store), ignore_errors=True)
        if command.verb == "push":
            with self.hub.lock:
                self.hub.repos.pop(command.output, None)
            return
        destination = self._destination(command, store)
        if destination.startswith("s3://"):
            parent = destination[len("s3://"):].rsplit("/", 1)[0]
            listing = self.fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=parent[len(BUCKET) + 1:] + "/")
            for upload in listing.get("Uploads", []):
                self.fs.call_s3("abort_multipart_upload", Bucket=BUCKET, Key=upload["Key"], UploadId=upload["UploadId"])
            self.fs.invalidate_cache()
            if self.fs.find(parent):
                self.fs.rm(parent, recursive=True)
            self.fs.invalidate_cache()
        else:
            parent = Path(destination).parent
            if parent.is_dir():
                for entry in parent.iterdir():
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            parent.mkdir(parents=True, exist_ok=True)

    # -- points -------------------------------------------------------------------------------

    def reference(self, command: Command, store: str, proxy: Any) -> Reference:
        """The fault-free run's output (hashes), time and size, made once per command and store."""
        slot = (command.name, store)
        if slot not in self.references:
            self.clear(command, store)
            proxy.configure(seed=0, rate=0.0)
            logs = self._logs(f"reference-{self._slot(command, store)}")
            run = run_forked(self.zygote, self._args(command, store), self._run_env(command, store, proxy), logs)
            state = self.state(command, store)
            if run.code != 0 or not state["output"]:
                raise RuntimeError(f"the fault-free run of {command.name} on {store} failed ({run.code}): {run.stderr}")
            size = self._output_size(command, store)
            self.references[slot] = Reference(state["output"], run.seconds, size)
            self.clear(command, store)
        return self.references[slot]

    def _output_size(self, command: Command, store: str) -> int:
        """Bytes the output holds (for push: its export, staged under TMPDIR, about the source's size)."""
        if command.verb == "push":
            return sum(p.stat().st_size for p in self.sources[command.source].rglob("*") if p.is_file())
        destination = self._destination(command, store)
        if destination.startswith("s3://"):
            self.fs.invalidate_cache()
            return int(self.fs.du(destination[len("s3://"):]))
        path = Path(destination)
        return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    def _logs(self, name: str) -> Path:
        logs = self.work / "logs" / name
        logs.mkdir(parents=True, exist_ok=True)
        return logs

    def run_point(self, index: int, worker: int = 0) -> Outcome:
        """Point `index`, its S3 requests through proxy `worker` (one per concurrent caller)."""
        point = draw(self.seed, index, self.mount_ok, self.torchrun_share, self.kinds)
        with self._slots_lock:
            slot = self._slots.setdefault((point.command, point.store), threading.Lock())
        with slot:
            return self._run_point(point, self.proxies[worker])

    def _run_point(self, point: Point, proxy: Any) -> Outcome:
        command = BY_NAME[point.command]
        reference = self.reference(command, point.store, proxy)
        self.clear(command, point.store)
        before = self.source_hashes(command, point.store)
        initial = self.state(command, point.store)
        run, mounted = self._faulted_run(point, command, reference, proxy)
        injected = len(proxy.injected)
        proxy.configure(seed=0, rate=0.0)
        outcome = Outcome(point, "", code=run.code, seconds=run.seconds, stderr=run.stderr.strip()[-2000:],
                          injected=injected)
        state = mounted if mounted is not None else self.state(command, point.store)
        self._classify(outcome, command, reference, state, initial)
        if self.source_hashes(command, point.store) != before:
            outcome.reasons.append("the source changed")
        self._recover(outcome, command, reference, proxy)
        outcome.verdict = "dirty" if outcome.reasons else outcome.verdict
        self.clear(command, point.store)
        return outcome

    def _faulted_run(self, point: Point, command: Command, reference: Reference, proxy: Any
                     ) -> tuple[Run, dict | None]:
        """Run the point's command with its fault; for disk-full, also the state seen before unmounting."""
        env = self._run_env(command, point.store, proxy)
        args = self._args(command, point.store)
        logs = self._logs(f"point-{point.index}")
        if point.fault == "s3":
            proxy.configure(seed=point.seed * 100_003 + point.index, rate=point.rate, faults=point.faults,
                                 requests=point.requests)
        if point.fault == "torchrun-kill":
            return run_torchrun(args, env, point.delay * reference.seconds + 0.5,
                                random.Random(f"{point.seed}:{point.index}")), None
        if point.fault in ("sigkill", "sigterm"):
            number = signal.SIGKILL if point.fault == "sigkill" else signal.SIGTERM
            return run_forked(self.zygote, args, env, logs, kill=(point.delay * reference.seconds, number)), None
        if point.fault == "disk-full":
            local_output = command.verb != "push" and point.store in ("local", "s3-src")
            where = Path(self._destination(command, point.store)).parent if local_output else self._tmpdir(command, point.store)
            shutil.rmtree(where, ignore_errors=True)
            with tmpfs(where, int(point.disk * reference.size)):
                run = run_forked(self.zygote, args, env, logs)
                return run, self.state(command, point.store)  # looked at on the tmpfs, before it goes
        return run_forked(self.zygote, args, env, logs), None

    def _classify(self, outcome: Outcome, command: Command, reference: Reference, state: dict, initial: dict) -> None:
        point, killed = outcome.point, outcome.point.fault in ("sigkill", "torchrun-kill")
        # SIGTERM before the CLI installed its handler (the first ~0.1 s) ends the process as SIGKILL would
        killed = killed or outcome.code == -signal.SIGTERM
        leftovers = state["temps"] + state["uploads"]
        if outcome.code is None:
            outcome.reasons.append(f"hung: still running after {RUN_TIMEOUT:.0f} s")
            return
        if state["stray"]:
            outcome.reasons.append(f"stray entries beside the output: {state['stray'][:4]}")
        if outcome.code == 0:
            outcome.verdict = "identical"
            if state["output"] != reference.hashes:
                outcome.reasons.append(f"exit 0 but the output differs: {_difference(state['output'], reference.hashes)}")
        else:
            outcome.verdict = "clean failure"
            signalled = killed or point.fault == "sigterm"
            if killed and point.store in ("s3-dst", "s3") and _partial_commit(state["output"], reference.hashes):
                outcome.verdict = PARTIAL  # known: see PARTIAL
            elif state["output"] not in (None, initial["output"]) and not (signalled and state["output"] == reference.hashes):
                outcome.reasons.append(f"exit {outcome.code} and something at the destination: "
                                       f"{_difference(state['output'], reference.hashes)}")
            if state["output"] == reference.hashes and signalled:
                outcome.verdict = "identical"  # stopped after the output was complete
            if not killed and not one_line_error(outcome.stderr):
                outcome.reasons.append("not a one-line error: " + outcome.stderr[-600:].replace("\n", " | "))
        if leftovers and not killed:
            outcome.reasons.append(f"temporaries or unfinished uploads left: {leftovers[:4]}")
        if state["tmpdir"] and not killed:
            outcome.reasons.append(f"left in TMPDIR: {state['tmpdir'][:4]}")
        outcome.leftovers_after_kill = len(leftovers) if killed else 0

    def _recover(self, outcome: Outcome, command: Command, reference: Reference, proxy: Any) -> None:
        """The next fault-free run succeeds with no clean-up by hand (with --force where the
        output is there), byte-identical, leaving nothing beside it."""
        store = outcome.point.store
        if outcome.point.fault == "disk-full":  # the tmpfs is gone: its leftovers were looked at
            shutil.rmtree(self._tmpdir(command, store), ignore_errors=True)
        shutil.rmtree(self._tmpdir(command, store) / "ckpttool-push-preview", ignore_errors=True)
        if outcome.point.fault in ("sigkill", "torchrun-kill") or outcome.code == -signal.SIGTERM:
            # TMPDIR leftovers of a killed run are not the destination's
            shutil.rmtree(self._tmpdir(command, store), ignore_errors=True)
        present = self.state(command, store)["output"] is not None and command.verb != "push"
        run = run_forked(self.zygote, self._args(command, store, force=present), self._run_env(command, store, proxy),
                         self._logs(f"point-{outcome.point.index}-next"))
        after = self.state(command, store)
        if run.code != 0:
            outcome.reasons.append(f"the next fault-free run failed ({run.code}): {run.stderr.strip()[-400:]}")
        elif after["output"] != reference.hashes:
            outcome.reasons.append(f"the next run's output differs: {_difference(after['output'], reference.hashes)}")
        left = after["temps"] + after["uploads"] + after["stray"] + after["tmpdir"]
        if left:
            outcome.reasons.append(f"left after the next run: {left[:4]}")


def _partial_commit(found: dict[str, str] | None, expected: dict[str, str]) -> bool:
    """Some of the output's data files, complete and right, without its index or .metadata."""
    return bool(found) and found != expected and all(expected.get(name) == digest for name, digest in found.items()) \
        and not any(name.endswith((".index.json", ".metadata")) for name in found)


def _difference(found: dict[str, str] | None, expected: dict[str, str]) -> str:
    if found is None:
        return "nothing"
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    changed = sorted(name for name in set(found) & set(expected) if found[name] != expected[name])
    return f"missing {missing[:3]}, extra {extra[:3]}, changed {changed[:3]}"


def table(outcomes: list[Outcome], key=lambda point: (point.fault, point.command, point.store),
          names: tuple[str, ...] = ("fault", "command", "store")) -> str:
    """Faults by kind x command x store: identical / clean failure / partial commit / dirty (markdown)."""
    rows: dict[tuple, list[int]] = {}
    for outcome in outcomes:
        rows.setdefault(key(outcome.point), [0] * len(VERDICTS))[VERDICTS.index(outcome.verdict)] += 1
    lines = ["| " + " | ".join(names + VERDICTS) + " |", "|" + "---|" * len(names) + "---:|" * len(VERDICTS)]
    for row, counts in sorted(rows.items()):
        lines.append("| " + " | ".join(list(row) + [str(n) for n in counts]) + " |")
    totals = [str(sum(counts[i] for counts in rows.values())) for i in range(len(VERDICTS))]
    lines.append("| **all** |" + " |" * (len(names) - 1) + " " + " | ".join(totals) + " |")
    return "\n".join(lines)


def by_fault(outcomes: list[Outcome]) -> str:
    """The totals per fault kind (markdown)."""
    return table(outcomes, key=lambda point: (point.fault,), names=("fault",))
