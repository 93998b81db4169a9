"""Per-rank parameter and optimizer memory of the trainer under FSDP, for N = 1, 2, 4 ranks.

    python benchmarks/train_memory.py [--size small] [--worlds 1 2 4] [--fsdp 2] [--steps 2]

For each world size N, runs `python -m train_minimal --size SIZE --nproc N --steps STEPS`
(gloo on CPU) and reads its per-step log: the bytes of parameters and of AdamW state
(exp_avg, exp_avg_sq, step) each rank holds after the last step, and each rank's peak RSS.
The baseline, measured in the same session, is the unsharded model: its parameter count x 4
bytes, and twice that for AdamW's two moments (plus one 4-byte `step` per parameter tensor).
Prints a table; the per-rank columns show the largest rank (shards can be uneven).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


def full_model_bytes(size: str) -> tuple[int, int, int]:
    """Return (parameters, parameter bytes, AdamW state bytes) of the unsharded fp32 model."""
    sys.path.insert(0, str(ROOT))
    import torch

    from train_minimal.config import parse_args
    from train_minimal.model import GPT

    config = parse_args(["--size", size])
    with torch.device("meta"):
        model = GPT(config.dim, config.layers, config.heads, config.vocab, config.seq_len,
                    tie_embeddings=config.tie_embeddings)
    parameters = [parameter for parameter in model.parameters()]
    count = sum(parameter.numel() for parameter in parameters)
    return count, count * 4, count * 8 + len(parameters) * 4


def run(size: str, world_size: int, fsdp: int, steps: int, directory: Path) -> dict:
    """Run the trainer at one world size; return its last log record."""
    log = directory / f"world{world_size}.jsonl"
    command = [sys.executable, "-m", "train_minimal", "--size", size, "--nproc", str(world_size),
               "--steps", str(steps), "--fsdp", str(fsdp), "--quiet", "--log-file", str(log)]
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"world {world_size} failed:\n{result.stderr}")
    return json.loads(log.read_text().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="trainer preset (default small)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2, help="FSDP version (default 2)")
    parser.add_argument("--steps", type=int, default=2, help="steps per run (default 2)")
    args = parser.parse_args()

    count, param_full, optimizer_full = full_model_bytes(args.size)
    print(f"--size {args.size}: {count:,} parameters; unsharded: parameters {param_full / MIB:.2f} MiB, "
          f"AdamW state {optimizer_full / MIB:.2f} MiB (FSDP{args.fsdp}, gloo on CPU)")
    print()
    print("| N | params / rank MiB | x full | AdamW state / rank MiB | x full | params + state / rank MiB | 1/N | peak RSS / rank MiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as scratch:
        for world_size in args.worlds:
            record = run(args.size, world_size, args.fsdp, args.steps, Path(scratch))
            params, state = max(record["param_bytes"]), max(record["optimizer_bytes"])
            rss = max(record["peak_rss_bytes"])
            both = max(p + o for p, o in zip(record["param_bytes"], record["optimizer_bytes"]))
            print(f"| {world_size} | {params / MIB:.2f} | {params / param_full:.3f} | {state / MIB:.2f} | "
                  f"{state / optimizer_full:.3f} | {both / MIB:.2f} | {1 / world_size:.3f} | {rss / MIB:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
