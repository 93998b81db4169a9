"""Benchmark `consolidate --merge-adapter` memory against a plain consolidate of the same checkpoint.

Builds a ~1 GB fp32 LoRA checkpoint with real `dcp.save` (one process): PEFT's key names
(`base_model.model.model.layers.N...base_layer.weight`, `lora_A/lora_B.default.weight`) on a
Llama-shaped model, LoRA (r 16) on every linear (q/k/v/o, gate/up/down), then measures one
after another in this run, each as its own subprocess (peak RSS: that process's ru_maxrss):

- consolidate: `ckpttool consolidate SRC out.safetensors` (byte copy, no torch)
- consolidate + torch (floor): the same in a process that imported torch first: everything the
  merge's process holds but the merge (torch, the copy's buffers)
- merge: `ckpttool consolidate SRC out.safetensors --merge-adapter --lora-alpha 32`

and prints peak RSS above the floor as a multiple of the largest single module (its base
weight + A + B), the bound the merge promises: one module in memory at a time (base weight,
delta, A, B: about 2x the base weight).

    python benchmarks/merge_adapter.py                 # ~1 GB base
    python benchmarks/merge_adapter.py --layers 2      # smaller, quicker
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTERMEDIATE, VOCAB, RANK = 2048, 5632, 8192, 16
PROJECTIONS = {  # name -> (out, in)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN), "self_attn.v_proj": (HIDDEN, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}


def make_checkpoint(path: Path, layers: int) -> int:
    """Write the checkpoint; return the largest module's bytes (base weight + A + B)."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    prefix = "base_model.model."
    state = {f"{prefix}model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN),
             f"{prefix}model.norm.weight": torch.ones(HIDDEN), f"{prefix}lm_head.weight": torch.randn(VOCAB, HIDDEN)}
    largest = 0
    for layer in range(layers):
        for name, (out, inner) in PROJECTIONS.items():
            module = f"{prefix}model.layers.{layer}.{name}"
            state[f"{module}.base_layer.weight"] = torch.randn(out, inner)
            state[f"{module}.lora_A.default.weight"] = torch.randn(RANK, inner) * 0.01
            state[f"{module}.lora_B.default.weight"] = torch.randn(out, RANK) * 0.01
            largest = max(largest, 4 * (out * inner + RANK * inner + out * RANK))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"{prefix}model.layers.{layer}.{norm}.weight"] = torch.ones(HIDDEN)
    dcp.save({"model": state}, checkpoint_id=str(path))
    return largest


def measure(command: list[str]) -> tuple[float, int]:
    """Return (wall seconds, peak RSS bytes) of one subprocess."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        raise SystemExit(f"failed ({status}): {command}")
    return time.perf_counter() - started, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=5, help="decoder layers (5: about 1 GB)")
    parser.add_argument("--keep", type=Path, help="write here and keep the files")
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)  # the child that writes the checkpoint
    args = parser.parse_args()
    if args.make:
        print(make_checkpoint(args.make, args.layers))
        return
    root = args.keep or Path(tempfile.mkdtemp(prefix="merge-bench-"))
    try:
        source = root / "ckpt"
        started = time.perf_counter()
        # written by a child process: this one stays small, and Linux carries a parent's peak RSS
        # into the ru_maxrss of the children it forks
        largest = int(subprocess.run([sys.executable, __file__, "--make", str(source), "--layers", str(args.layers)],
                                     capture_output=True, text=True, check=True).stdout.split()[-1])
        size = sum(p.stat().st_size for p in source.iterdir())
        print(f"# {size / 1e9:.2f} GB checkpoint, {args.layers} layers, dcp.save took "
              f"{time.perf_counter() - started:.1f} s; largest module {largest / 1e6:.1f} MB", file=sys.stderr)
        for data in source.glob("*.distcp"):  # warm the page cache: every row reads from memory alike
            with open(data, "rb") as file:
                while file.read(64 << 20):
                    pass
        tool = str(Path(sys.executable).with_name("ckpttool"))
        out = root / "out.safetensors"
        rows = []
        for label, command in (
            ("consolidate", [tool, "consolidate", str(source), str(out), "-q", "--force"]),
            ("consolidate + torch (floor)", [sys.executable, "-c", "import sys, torch, ckpttool.run.merge; from ckpttool.cli "
                                             "import main; sys.argv[0] = 'ckpttool'; main()", "consolidate", str(source),
                                             str(out), "-q", "--force"]),
            ("consolidate --merge-adapter", [tool, "consolidate", str(source), str(out), "-q", "--force",
                                             "--merge-adapter", "--lora-alpha", "32"]),
        ):
            rows.append((label, *measure(command)))
        floor = rows[1][2]
        print(f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}")
        print(f"{'command':<30} {'seconds':>8} {'peak RSS MB':>12} {'above floor MB':>15} {'x largest module':>17}")
        for label, seconds, rss in rows:
            above = rss - floor
            print(f"{label:<30} {seconds:>8.2f} {rss / 1e6:>12.1f} {above / 1e6:>15.1f} {above / largest:>17.2f}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
