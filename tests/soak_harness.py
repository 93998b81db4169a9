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
  what the next run removes (a temporary, an upload beside its marker key, and, killed while a
  multi-file S3 output was committed key by key, the data files committed so far, without their
  index or `.metadata`, each listed in the run's commit record: `undone`, and the next run
  then goes without --force);
- and in both cases the source is untouched (hashed before and after) and the next fault-free
  run succeeds, byte-identical, with nothing left over;
- an S3 point within the retry budget (no one request, method and path, met RETRY_BUDGET faults)
  must be **identical**: a clean failure there is a retry that did not happen, so it is dirty;
- **dirty**: anything else, printed with its seed to replay (`benchmarks/soak.py --seed S --only N`).

Runs are real processes of ckpttool's CLI, forked from a process that has imported it once
(`soak_runs.Zygote`: 0.2 s a run instead of 2 s of interpreter start and imports); torchrun
points run `python -m torch.distributed.run ... -m ckpttool`. One moto server (in a process of
its own) and one fault proxy per concurrent point serve the soak.

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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soak_runs import RUN_TIMEOUT, Run, Zygote, moto_process, run_forked, run_torchrun

from ckpttool.store.s3 import ATTEMPTS
from ckpttool.store.storage import S3_ATTEMPTS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIXTURES = ROOT / "fixtures"
BUCKET = "soak"
TOKEN = "hf_soak_token"
TEMP_MARK = ".ckpttool-"
PART_SIZE = 65536  # multipart parts of the soak's uploads (CKPTTOOL_PART_SIZE): several per output
READ_TIMEOUT = 1.5  # the children's S3 read timeout (config_kwargs); the proxy's stalls are longer
STALL = 2.0

STORES = ("local", "s3-src", "s3-dst", "s3")  # where the source and the destination are
RECORD_MARK = "/.ckpttool-commit-"  # a run's commit record beside its S3 output (ckpttool/outputs/remote.py)
VERDICTS = ("identical", "clean failure", "dirty")
# tries of one S3 request: ckpttool's own client (store/s3.py) and botocore's standard mode (store/storage.py);
# a run none of whose requests met this many faults must succeed
RETRY_BUDGET = min(ATTEMPTS, S3_ATTEMPTS)
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
    most_faults_on_one_request: int = 0  # the most faults injected into one method and path (its retries)
    leftovers_after_kill: int = 0  # SIGKILL leftovers the next run removed
    undone: int = 0  # keys a run SIGKILLed mid-commit had made visible, listed in its commit record
    phases: dict[str, float] = field(default_factory=dict)  # seconds the harness spent per step of the point


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
        self._clean: set[tuple[str, str]] = set()  # (command, store) slots cleared after their last point
        self._stack = contextlib.ExitStack()

    # -- setup --------------------------------------------------------------------------------

    def __enter__(self) -> "Soak":
        import urllib.request

        from fault_proxy import FaultProxy
        from hub_server import HubServer

        self.work.mkdir(parents=True, exist_ok=True)
        self.sources = self._local_sources()
        self.moto = self._stack.enter_context(moto_process(self.work / "moto.log"))
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
            return {"output": hashes or None, "temps": [], "stray": [], "uploads": [], "tmpdir": tmp_left,
                    "listed": set()}
        destination = self._destination(command, store)
        if destination.startswith("s3://"):
            return self._remote_state(destination, tmp_left)
        path = Path(destination)
        entries = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else []
        temps = [name for name in entries if name.startswith(TEMP_MARK)]
        inner = [p.name for p in path.rglob(TEMP_MARK + "*")] if path.is_dir() else []
        stray = [name for name in entries if name != path.name and name not in temps and name != "lost+found"]
        return {"output": tree_hashes(path) if path.exists() else None, "temps": temps + inner, "stray": stray,
                "uploads": [], "tmpdir": tmp_left, "listed": set()}

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
        listed = set()  # the output's names the commit records beside it list
        for record in (k for k in temps if RECORD_MARK in k):
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                listed |= {("" if k == key else k[len(key) + 1:]) for k in json.loads(self.fs.cat_file(record))["keys"]
                           if k == key or k.startswith(key + "/")}
        return {"output": output, "temps": temps, "stray": stray, "uploads": uploads, "tmpdir": tmp_left,
                "listed": listed}

    def source_hashes(self, command: Command, store: str) -> dict[str, Any]:
        """What tells the source changed: each local file's SHA-256; each S3 key's size, ETag
        (the MD5 of its bytes, or of its parts') and LastModified, from one listing (a run that
        wrote any source key, even with the same bytes, changes its LastModified)."""
        if store in ("s3-src", "s3"):
            self.fs.invalidate_cache()
            found = self.fs.find(f"{BUCKET}/src/{command.source}", detail=True)
            return {key: (info["size"], info.get("ETag"), str(info.get("LastModified"))) for key, info in sorted(found.items())}
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
            self._clean.add(slot)
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

    def run_point(self, index: int, worker: int = 0, kinds: tuple[str, ...] | None = None) -> Outcome:
        """Point `index`, its S3 requests through proxy `worker` (one per concurrent caller), its
        fault drawn from `kinds` (default: the soak's)."""
        point = draw(self.seed, index, self.mount_ok, self.torchrun_share, kinds or self.kinds)
        with self._slots_lock:
            slot = self._slots.setdefault((point.command, point.store), threading.Lock())
        with slot:
            return self._run_point(point, self.proxies[worker])

    def _run_point(self, point: Point, proxy: Any) -> Outcome:
        command = BY_NAME[point.command]
        phases: dict[str, float] = {}
        with _timed(phases, "reference"):
            reference = self.reference(command, point.store, proxy)
        with _timed(phases, "look"):
            if (command.name, point.store) not in self._clean:
                self.clear(command, point.store)
            self._clean.discard((command.name, point.store))
            before = self.source_hashes(command, point.store)
            initial = self.state(command, point.store)
        with _timed(phases, "faulted run"):
            run, mounted = self._faulted_run(point, command, reference, proxy)
        injected = len(proxy.injected)
        # ranged GETs of one key share a path: counted together, a request's retries are overestimated,
        # so a point is never held to "identical" beyond its budget
        most = max(Counter(path for _, _, path in proxy.injected).values(), default=0)
        proxy.configure(seed=0, rate=0.0)
        outcome = Outcome(point, "", code=run.code, seconds=run.seconds, stderr=run.stderr.strip()[-2000:],
                          injected=injected, most_faults_on_one_request=most, phases=phases)
        with _timed(phases, "look"):
            state = mounted if mounted is not None else self.state(command, point.store)
            self._classify(outcome, command, reference, state, initial)
            if point.fault == "s3" and outcome.verdict != "identical" and most < RETRY_BUDGET:
                outcome.reasons.append(f"exit {run.code} within the retry budget: no request met more than {most} "
                                       f"faults, and each is tried {RETRY_BUDGET} times")
            if self.source_hashes(command, point.store) != before:
                outcome.reasons.append("the source changed")
        with _timed(phases, "next run"):
            self._recover(outcome, command, reference, proxy)
        outcome.verdict = "dirty" if outcome.reasons else outcome.verdict
        with _timed(phases, "look"):
            self.clear(command, point.store)
        self._clean.add((command.name, point.store))
        return outcome

    def killed_at(self, command: Command, store: str, phase: str, recover: bool = True) -> tuple[Outcome, dict]:
        """Run `command` on `store`, SIGKILL it where it pauses at `phase` (`testpoints.pause`),
        classify the run as a soak point's, then (`recover`) run it again as `_recover` does;
        also return what the killed run left."""
        proxy, point = self.proxies[0], Point(-1, self.seed, command.name, store, "sigkill")
        reference = self.reference(command, store, proxy)
        self.clear(command, store)
        before, initial = self.source_hashes(command, store), self.state(command, store)
        env = {**self._run_env(command, store, proxy), "CKPTTOOL_TEST_PAUSE": f"{phase}:60"}
        run = run_forked(self.zygote, self._args(command, store), env, self._logs(f"killed-at-{phase}"),
                         kill_at=f"ckpttool-test: paused at {phase}")
        outcome = Outcome(point, "", code=run.code, seconds=run.seconds, stderr=run.stderr.strip())
        left = self.state(command, store)
        self._classify(outcome, command, reference, left, initial)
        if self.source_hashes(command, store) != before:
            outcome.reasons.append("the source changed")
        if recover:
            self._recover(outcome, command, reference, proxy)
            outcome.verdict = "dirty" if outcome.reasons else outcome.verdict
        return outcome, left

    def run(self, command: Command, store: str, force: bool = False) -> Run:
        """A fault-free run of `command` on `store`."""
        return run_forked(self.zygote, self._args(command, store, force=force),
                          self._run_env(command, store, self.proxies[0]), self._logs("run"))

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
                # killed mid-commit: the keys made visible so far, each listed in the run's commit record
                unlisted = sorted(set(state["output"]) - state["listed"])
                if unlisted:
                    outcome.reasons.append(f"a partial commit not listed in a commit record: {unlisted[:4]}")
                outcome.undone = len(state["output"])
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
        output is there, but not where it is a partial commit the run removes first),
        byte-identical, leaving nothing beside it."""
        store = outcome.point.store
        if outcome.point.fault == "disk-full":  # the tmpfs is gone: its leftovers were looked at
            shutil.rmtree(self._tmpdir(command, store), ignore_errors=True)
        shutil.rmtree(self._tmpdir(command, store) / "ckpttool-push-preview", ignore_errors=True)
        if outcome.point.fault in ("sigkill", "torchrun-kill") or outcome.code == -signal.SIGTERM:
            # TMPDIR leftovers of a killed run are not the destination's
            shutil.rmtree(self._tmpdir(command, store), ignore_errors=True)
        present = self.state(command, store)["output"] is not None and command.verb != "push" and not outcome.undone
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


@contextlib.contextmanager
def _timed(phases: dict[str, float], name: str):
    start = time.monotonic()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.monotonic() - start


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
    """Faults by kind x command x store: identical / clean failure / dirty (markdown)."""
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
