"""Benchmark consolidating a DeepSpeed ZeRO-3 checkpoint: ckpttool against DeepSpeed's zero_to_fp32.

Writes a real ZeRO-3 fp32 checkpoint of about 268M parameters (16 Linear(4096, 4096) layers, one
AdamW step) with DeepSpeed's own `engine.save_checkpoint`, 2 gloo ranks on CPU, in a Python that
has DeepSpeed (`--deepspeed-python`; DeepSpeed 0.19.8 runs on CPU with DS_ACCELERATOR=cpu, and its
`--safe_serialization` needs huggingface_hub installed beside it). Then,
one after another in this run, each as its own subprocess (wall, peak RSS), alternating the order
over `--runs`:

- zero_to_fp32: `python -m deepspeed.utils.zero_to_fp32 SRC OUT --safe_serialization` (the
  baseline: torch.load of every rank's partitions, then safetensors' save_file)
- ckpttool: `ckpttool consolidate SRC OUT/model.safetensors` (the same tensors: fp32 master weights)
- cat: `cat` of the optim states files into one file (the copy floor for those bytes)

    python benchmarks/deepspeed.py --deepspeed-python /path/to/venv-with-deepspeed/bin/python
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from paired import alternate, table

SAVE = """
import os, sys, torch, deepspeed
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
layers, width, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "lr": 1e-4}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
loss = engine(torch.randn(1, width)).square().mean()
engine.backward(loss)
engine.step()
engine.save_checkpoint(out, tag="global_step1")
torch.distributed.barrier()
os._exit(0)
"""


def make_checkpoint(root: Path, python: str, layers: int, width: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    script = root / "save.py"
    script.write_text(SAVE)
    torchrun = str(Path(python).parent / "torchrun")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script), str(layers), str(width),
                    str(root / "run")], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return root / "run" / "global_step1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-python", required=True, help="a python with deepspeed 0.19.8 installed")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--keep", default=None, help="keep the checkpoint in this folder, and reuse it when it is there")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpttool-deepspeed-", dir=args.dir))
    try:
        kept = Path(args.keep) / "run" / "global_step1" if args.keep else None
        if kept is not None and kept.is_dir():
            source = kept
        else:
            source = make_checkpoint(Path(args.keep) if args.keep else root, args.deepspeed_python, args.layers,
                                     args.width)
        size = sum(p.stat().st_size for p in source.iterdir())
        parameters = args.layers * (args.width * args.width + args.width)
        print(f"ZeRO-3 fp32 checkpoint: {parameters / 1e6:.0f}M parameters, {size / 1e9:.2f} GB on disk, 2 ranks, "
              f"{os.cpu_count()} cores")
        out = root / "out"
        optim = sorted(str(p) for p in source.glob("*_optim_states.pt"))
        commands = {
            "cat optim files": ["sh", "-c", f"mkdir -p {out} && cat {' '.join(optim)} > {out}/all"],
            # from another folder: this file's name would shadow the deepspeed package on sys.path
            "zero_to_fp32 --safe_serialization": ["sh", "-c", f"cd {root} && exec {args.deepspeed_python} -m "
                                                  f"deepspeed.utils.zero_to_fp32 {source.parent} {out} --safe_serialization"],
            "ckpttool consolidate": [shutil.which("ckpttool") or "ckpttool", "consolidate", str(source),
                                     str(out / "model.safetensors"), "-q"],
        }
        os.environ["DS_ACCELERATOR"] = "cpu"

        def clean() -> None:
            shutil.rmtree(out, ignore_errors=True)

        print("\n" + table(alternate(commands, args.runs, clean), "zero_to_fp32 --safe_serialization"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
