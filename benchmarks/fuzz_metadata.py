"""Fuzz the `.metadata` reader: seeded mutants of the bundled fixtures, each read in a fork.

    python benchmarks/fuzz_metadata.py [--count 10000] [--seed 0] [--workers N]

Mutants start from fixtures/*/.metadata (torch's protocol-4 pickles) and the same checkpoints
as our writer pickles them (protocol 2). Two in five get one well-formed change of a whole
opcode (an int or a string's value, e.g. a `../` path, a memo slot fetched, the opcode dropped
or doubled); one in five a bomb inserted between two opcodes, leaving the rest valid: shared
halves (2**200 unfolded), deep tuples, lists or dicts (up to 300k levels), each often hashed
as a dict key, billion-laughs lists, memo bombs (huge PUT/GET slots, BINBYTES8 of 2**40);
the others one to three byte-level mutations: byte and bit flips, truncation, deleted,
repeated and swapped ranges, spliced pickle opcodes, GETs of another memo slot.
Each mutant is written next to symlinks of its fixture's data files and read in a forked
child under RLIMIT_AS (`--memory`, 300 MB) and an alarm (`--timeout`, 10 s), which runs
`read_checkpoint`, then `ckpttool.check.integrity.check`, then the loader without its fast paths
(the two must build the same checkpoint). The table counts:

- ok / refused: the checkpoint was read, or refused with a CheckpointError (one line)
- tracebacks: any other exception (written to --out with the mutant for replay)
- signals: the child died of a signal (a crash), timeouts: it ran past the alarm
- memory: MemoryError under the RLIMIT_AS (a memory bomb)
- fast != general: the loader's fast paths and its opcode-by-opcode path disagree
- peak RSS: the largest resident size of any child (wait4's ru_maxrss)

The goal is 0 tracebacks, signals, timeouts, memory and disagreements, peak RSS < 300 MB.
"""

from __future__ import annotations

import argparse
import os
import pickletools
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ckpttool.check import integrity  # noqa: E402
from ckpttool.core.checkpoint import Checkpoint, paused_gc  # noqa: E402
from ckpttool.dcp import writer  # noqa: E402
from ckpttool.formats.dcp import METADATA_FILENAME  # noqa: E402
from ckpttool.readers.dcp import _convert, read_checkpoint  # noqa: E402
from ckpttool.safepickle.allowlist import _ALLOWED, _find_allowed  # noqa: E402
from ckpttool.safepickle.loader import _Loader  # noqa: E402
from ckpttool.core.errors import CheckpointError  # noqa: E402

OUTCOMES = ("ok", "refused", "tracebacks", "signals", "timeouts", "memory", "fast != general")
EXIT_OK, EXIT_REFUSED, EXIT_TRACEBACK, EXIT_MEMORY, EXIT_DIFFER = 0, 10, 11, 12, 13

# opcode snippets spliced into mutants: structure, memo and size edge cases
SNIPPETS = (
    b"(", b")", b"]", b"}", b"t", b"l", b"d", b"e", b"a", b"u", b"s", b"b", b"R", b"\x81", b"\x85",
    b"\x86", b"\x87", b"\x93", b"\x94", b"N", b"0", b"1", b"2", b".", b"\x8f", b"\x90", b"\x91",
    b"h\x00", b"h\xff", b"j\x00\x00\x00\x00", b"j\xff\xff\xff\x7f", b"q\x00", b"q\xff",
    b"r\xff\xff\xff\x7f", b"r\x00\x00\x00\x01", b"K\xff", b"J\xff\xff\xff\xff", b"\x8a\x08" + b"\xff" * 8,
    b"\x8c\xff", b"X\xff\xff\xff\x7f", b"B\xff\xff\xff\x7f", b"\x8e" + b"\xff" * 8, b"\x96" + b"\xff" * 8,
    b"\x95" + b"\xff" * 8, b"\x8b\xff\xff\xff\x7f", b"\x80\x05", b"\x80\xff", b"Q", b"\x92", b"\x82\x01",
    b"cposix\nsystem\n", b"cbuiltins\neval\n", b"\x8c\x05torch\x94\x8c\x04Size\x94\x93\x94",
    b"\x8c\x0bcollections\x8c\x0bOrderedDict\x93", b"\x8c\x08builtins\x8c\x03set\x93",
)


def seeds() -> list[tuple[str, bytes, Path]]:
    """Return (name, .metadata bytes, checkpoint directory) of each fixture, as torch and as
    our writer pickles it."""
    found = []
    for directory in sorted((ROOT / "fixtures").iterdir()):
        path = directory / METADATA_FILENAME
        if not path.is_file():
            continue
        found.append((directory.name, path.read_bytes(), directory))
        checkpoint = read_checkpoint(directory)
        tensors = [
            writer.StoredTensor(t.fqn, t.dtype, t.shape, tuple(
                writer.StoredChunk(c.offsets, c.sizes, c.blob.file, c.blob.offset, c.blob.length) for c in t.chunks))
            for t in checkpoint.tensors.values()
        ]
        objects = [writer.StoredObject(o.fqn, o.blob.file, o.blob.offset, o.blob.length, o.blob.transforms)
                   for o in checkpoint.objects.values()]
        data = writer.metadata_bytes(tensors, objects, checkpoint.nesting, PurePosixPath("/fuzz"), "fuzz")
        found.append((f"{directory.name} (our writer)", data, directory))
    return found


def _get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def opcodes(data: bytes) -> list[tuple[int, int, str]]:
    """Return (start, end, name) of each opcode of a well-formed pickle."""
    found = [(pos, op.name) for op, _, pos in pickletools.genops(data)]
    ends = [pos for pos, _ in found[1:]] + [len(data)]
    return [(pos, end, name) for (pos, name), end in zip(found, ends)]


def mutate_opcode(data: bytes, ops: list[tuple[int, int, str]], rng: random.Random) -> tuple[bytes, str]:
    """Return `data` with one opcode changed as a whole: an int or a string's value, a memo
    slot fetched, the opcode dropped or doubled (the rest stays well-formed)."""
    start, end, name = rng.choice(ops)
    out = bytearray(data)
    if name in ("BININT1", "BININT2", "BININT") and rng.random() < 0.8:
        out[start + 1:end] = rng.randbytes(end - start - 1)
        return bytes(out), "int"
    if name in ("SHORT_BINUNICODE", "BINUNICODE") and end - start > 2:
        width = 2 if name == "SHORT_BINUNICODE" else 5
        text = bytes(out[start + width:end])
        choice = rng.random()
        if choice < 0.3:
            new = b"../" * rng.randint(1, 3) + text[: max(0, len(text) - 9)]  # a path leaving the checkpoint
        elif choice < 0.6:
            new = bytes(rng.choice(b"abcz._0/") for _ in text)
        else:
            new = text[::-1]
        new = new[: len(text)].ljust(len(text), b"x")
        out[start + width:end] = new
        return bytes(out), "string"
    if name in ("BINGET", "LONG_BINGET"):
        slot = rng.randrange(max(1, sum(1 for _, _, n in ops if n in ("MEMOIZE", "BINPUT", "LONG_BINPUT"))))
        out[start:end] = _get(slot)
        return bytes(out), "get-slot"
    if rng.random() < 0.5:
        del out[start:end]
        return bytes(out), "drop-opcode"
    out[start:start] = data[start:end]
    return bytes(out), "double-opcode"


def bomb(kind: str, base: int, rng: random.Random) -> bytes:
    """Return opcodes that build something costly and leave the stack as they found it; the
    memo slots they fill start at `base` (the slots filled before them)."""
    if kind == "share":  # shared halves: 2**levels unfolded, hashed as a dict key (or kept)
        levels = rng.choice((20, 64, 200))
        out = bytearray(b"N\x94")
        for level in range(levels):
            out += _get(base + level) * 2 + b"\x86\x94"
        return bytes(out + (b"}" + _get(base + levels) + b"Ns0" if rng.random() < 0.7 else b"0"))
    if kind == "nest":  # a deep tuple, list or dict, hashed as a dict key (or kept)
        depth = rng.choice((20, 1000, 300_000))
        deep = rng.choice((b"N" + b"\x85" * depth, b"N" + b"\x85" * depth, b"(" * depth + b"N" + b"l" * depth,
                           b"(K\x01" * depth + b"N" + b"d" * depth))
        return b"}" + deep + b"Ns0" if rng.random() < 0.7 else deep + b"0"
    if kind == "laughs":  # each list holds the previous one ten times
        out = bytearray(b"\x8c\x03lol\x94")
        for level in range(rng.choice((6, 12, 30))):
            out += b"](" + _get(base + level) * 10 + b"e\x94"
        return bytes(out + b"0")
    slot = rng.choice(((1 << 31) - 1, 1 << 28, base + 1, base + 1000))
    return rng.choice((b"Nr" + struct.pack("<I", slot) + b"0", b"j" + struct.pack("<I", slot) + b"0",
                       b"N\x8e" + struct.pack("<Q", 1 << rng.choice((20, 33, 40))) + b"0"))


def mutate(data: bytes, ops: list[tuple[int, int, str]], rng: random.Random) -> tuple[bytes, str]:
    """Return a mutant of `data` and the names of the mutations applied: two in five a
    well-formed change of a whole opcode, one in five a bomb between two opcodes, else one to
    three byte-level mutations."""
    choice = rng.random()
    if choice < 0.4:
        return mutate_opcode(data, ops, rng)
    if choice < 0.6:
        kind = rng.choice(("share", "nest", "laughs", "memo"))
        index = rng.randrange(2, len(ops))  # after PROTO and FRAME
        start = ops[index][0]
        base = sum(1 for pos, _, name in ops[:index] if name in ("MEMOIZE", "BINPUT", "LONG_BINPUT"))
        return data[:start] + bomb(kind, base, rng) + data[start:], kind
    out = bytearray(data)
    names = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        kind = rng.choice(("flip", "flip", "bits", "truncate", "delete", "repeat", "swap", "splice", "splice", "get"))
        names.append(kind)
        n = len(out)
        if n < 4:
            out += b"."
            continue
        at = rng.randrange(n)
        if kind == "flip":
            for _ in range(rng.randint(1, 8)):
                out[rng.randrange(len(out))] = rng.randrange(256)
        elif kind == "bits":
            for _ in range(rng.randint(1, 4)):
                out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            del out[at:]
        elif kind == "delete":
            del out[at:at + rng.randint(1, 64)]
        elif kind == "repeat":
            piece = out[at:at + rng.randint(1, 256)]
            out[at:at] = piece * rng.randint(1, 50)
        elif kind == "swap":
            other = rng.randrange(n)
            a, b = sorted((at, other))
            width = min(rng.randint(1, 64), b - a)
            out[a:b + width] = out[b:b + width] + out[a + width:b] + out[a:a + width]
        elif kind == "splice":
            out[at:at] = b"".join(rng.choice(SNIPPETS) for _ in range(rng.randint(1, 6)))
        elif kind == "get":
            gets = [i for i in range(n - 1) if out[i] == 0x68]
            if gets:
                out[rng.choice(gets) + 1] = rng.randrange(256)
    return bytes(out), "+".join(names)


def read_in_child(directory: Path) -> int:
    """Read the checkpoint in `directory` as every command does; return the exit status."""
    checkpoint = None
    try:
        checkpoint = read_checkpoint(directory)
        integrity.check(checkpoint)
    except CheckpointError as error:
        message = str(error)
        if "\n" in message or "Traceback" in message:
            raise AssertionError(f"a CheckpointError message is not one line: {message!r:.300}") from None
    except MemoryError:
        return EXIT_MEMORY
    # the same file read opcode by opcode (without the fast paths) must give the same outcome
    raw = (directory / METADATA_FILENAME).read_bytes()
    source = directory / METADATA_FILENAME
    find_class = lambda module, name: _find_allowed(_ALLOWED, str(source), module, name)  # noqa: E731
    try:
        loader = _Loader(raw, find_class, build=True)
        loader.records = None
        with paused_gc():
            general = _convert(directory, source, loader.load())
    except MemoryError:
        return EXIT_MEMORY
    except Exception:  # refused or malformed: read_checkpoint must have refused it too
        general = None
    if (checkpoint is None) != (general is None) or (checkpoint is not None and not same(checkpoint, general)):
        return EXIT_DIFFER
    return EXIT_OK if checkpoint is not None else EXIT_REFUSED


def same(a: Checkpoint, b: Checkpoint) -> bool:
    return (a.version, a.tensors, a.objects, a.nesting, a.orphan_blobs, a.save_id, a.notes) == (
        b.version, b.tensors, b.objects, b.nesting, b.orphan_blobs, b.save_id, b.notes)


def child(directory: Path, memory: int, timeout: int, report: int) -> None:
    """Body of a forked child: limits, read, exit (never returns)."""
    status = EXIT_TRACEBACK
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        signal.alarm(timeout)  # SIGALRM's default action ends the process, even inside C code
        status = read_in_child(directory)
    except BaseException:
        try:
            os.write(report, traceback.format_exc().encode()[-4000:])
        except BaseException:
            pass
    finally:
        os._exit(status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000, help="mutants to run (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mutations (default 0)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="children at once (default: cores)")
    parser.add_argument("--timeout", type=int, default=10, help="seconds per mutant (default 10)")
    parser.add_argument("--memory", type=int, default=300, help="RLIMIT_AS per child, MB (default 300)")
    parser.add_argument("--out", type=Path, default=Path("fuzz-failures"), help="where failing mutants go")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    sources = seeds()
    parsed = {name: opcodes(data) for name, data, _ in sources}
    counts: Counter = Counter()
    by_seed: dict[str, Counter] = {name: Counter() for name, _, _ in sources}
    peak_kb = 0
    failures = 0
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="fuzz-metadata-"))
    running: dict[int, tuple[Path, str, str, int]] = {}  # pid -> (directory, seed, mutations, read end)

    def reap(block: bool) -> None:
        nonlocal peak_kb, failures
        pid, status, usage = os.wait4(-1, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        directory, name, mutations, read_end = running.pop(pid)
        peak_kb = max(peak_kb, usage.ru_maxrss)
        detail = os.read(read_end, 8192).decode(errors="replace")
        os.close(read_end)
        if os.WIFSIGNALED(status):
            outcome = "timeouts" if os.WTERMSIG(status) == signal.SIGALRM else "signals"
            detail = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
        else:
            outcome = {EXIT_OK: "ok", EXIT_REFUSED: "refused", EXIT_MEMORY: "memory",
                       EXIT_DIFFER: "fast != general"}.get(os.WEXITSTATUS(status), "tracebacks")
        counts[outcome] += 1
        by_seed[name][outcome] += 1
        if outcome not in ("ok", "refused"):
            failures += 1
            args.out.mkdir(parents=True, exist_ok=True)
            stem = args.out / f"{failures:04d}-{outcome.replace(' ', '').replace('!=', '-vs-')}"
            shutil.copy(directory / METADATA_FILENAME, stem.with_suffix(".metadata"))
            stem.with_suffix(".txt").write_text(f"seed fixture: {name}\nmutations: {mutations}\n{detail}\n")
        shutil.rmtree(directory, ignore_errors=True)

    try:
        for number in range(args.count):
            name, data, source = rng.choice(sources)
            mutant, mutations = mutate(data, parsed[name], rng)
            directory = scratch / str(number)
            directory.mkdir()
            (directory / METADATA_FILENAME).write_bytes(mutant)
            for path in source.iterdir():
                if path.name != METADATA_FILENAME:
                    (directory / path.name).symlink_to(path)
            while len(running) >= args.workers:
                reap(block=True)
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_end)
                child(directory, args.memory << 20, args.timeout, write_end)
            os.close(write_end)
            running[pid] = (directory, name, mutations, read_end)
        while running:
            reap(block=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    elapsed = time.perf_counter() - started
    print(f"{args.count} mutants (seed {args.seed}) of {len(sources)} seed files in {elapsed:.1f} s "
          f"({args.count / elapsed:.0f}/s, {args.workers} workers, {args.timeout} s and {args.memory} MB each)")
    print(f"{'seed file':38} " + " ".join(f"{o:>10}" for o in OUTCOMES))
    for name, counter in by_seed.items():
        print(f"{name:38} " + " ".join(f"{counter[o]:>10}" for o in OUTCOMES))
    print(f"{'total':38} " + " ".join(f"{counts[o]:>10}" for o in OUTCOMES))
    print(f"peak RSS of any child: {peak_kb / 1024:.0f} MB")
    if failures:
        print(f"{failures} failing mutants written to {args.out}/")


if __name__ == "__main__":
    main()
