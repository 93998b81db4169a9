"""Benchmark dequantising a fine-grained FP8 Hub folder to bf16 against `cat` writing as many bytes.

Builds a >= 1 GB FP8 folder shaped like DeepSeek-V3's (float8_e4m3fn `*.weight` with float32
`weight_scale_inv` per 128x128 block, shards of about 500 MB, an index, config.json with its
quantization_config), with ragged dims (7168 x 576 style edge blocks: rows not a multiple of
128, a 1-row edge block), then, one after another in this run, each as its own subprocess
(wall time, peak RSS from that process's ru_maxrss), alternating the order over `--runs`:

- cat (floor): `cat` of a bf16 file of the same size as the dequantised output, to a file,
  then `sync` (what writing the output's bytes costs on this disk)
- dequantise: `ckpttool consolidate SRC OUT --dtype bf16 --max-memory 256MB` (a Hub directory of
  shards; then `sync`). `export` writes the same weights and also checks them against the model
  transformers builds from config.json, which this synthetic folder is not.

and prints the median of each and the ratio. The goal: at most 2x cat's wall, at most 300 MB.

    python benchmarks/quant.py               # 1.16 GB of FP8 codes -> 2.3 GB of bf16
    python benchmarks/quant.py --layers 2    # smaller, quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from paired import alternate, table

HIDDEN = 7168
SHAPES = {  # a DeepSeek-V3 layer's attention and a few experts' projections: (rows, cols)
    "self_attn.q_a_proj": (1536, HIDDEN),
    "self_attn.kv_a_proj_with_mqa": (576, HIDDEN),  # 576 = 4 x 128 + 64: a partial edge block
    "self_attn.kv_b_proj": (32768, 512),
    "self_attn.o_proj": (HIDDEN, 16384),
    "mlp.shared_experts.gate_proj": (2048, HIDDEN),
    "mlp.shared_experts.down_proj": (HIDDEN, 2048),
    "mlp.experts.0.up_proj": (2049, HIDDEN),  # a 1-row edge block
}
SHARD_BYTES = 500 << 20


def make_folder(path: Path, layers: int) -> int:
    """Write the FP8 folder; return the bytes of its bf16 dequantisation."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    path.mkdir(parents=True)
    weight_map, shard, shard_bytes, number, out_bytes = {}, {}, 0, 0, 0
    names = []

    def flush() -> None:
        nonlocal shard, shard_bytes, number
        if shard:
            number += 1
            name = f"model-{number:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({key: name for key in shard})
            names.append(name)
            shard, shard_bytes = {}, 0

    for layer in range(layers):
        for module, (rows, cols) in SHAPES.items():
            key = f"model.layers.{layer}.{module}.weight"
            codes = (torch.randn(rows, cols) * 100).clamp_(-448, 448).to(torch.float8_e4m3fn)
            scale = torch.rand(-(-rows // 128), -(-cols // 128)) * 1e-4
            shard[key], shard[key + "_scale_inv"] = codes, scale
            shard_bytes += codes.numel() + scale.numel() * 4
            out_bytes += codes.numel() * 2
            if shard_bytes >= SHARD_BYTES:
                flush()
    flush()
    total = len(names)
    renamed = {name: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, name in enumerate(names)}
    for old, new in renamed.items():
        os.rename(path / old, path / new)
    index = {"metadata": {"total_size": sum((path / n).stat().st_size for n in renamed.values())},
             "weight_map": {key: renamed[name] for key, name in sorted(weight_map.items())}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [128, 128]}}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return out_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to build the folder (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpttool-quant-", dir=args.dir))
    try:
        source = root / "fp8"
        started = time.perf_counter()
        out_bytes = make_folder(source, args.layers)
        source_bytes = sum(p.stat().st_size for p in source.iterdir())
        print(f"built {source_bytes / 1e9:.2f} GB FP8 folder ({out_bytes / 1e9:.2f} GB as bf16) in "
              f"{time.perf_counter() - started:.1f} s; {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores")
        floor_file = root / "floor.bin"
        with open(floor_file, "wb") as handle:
            handle.truncate(out_bytes)
            handle.write(b"\0")  # a real file of the output's size (sparse apart from one byte)
        with open(floor_file, "r+b") as handle:
            block = os.urandom(16 << 20)
            for offset in range(0, out_bytes, len(block)):
                handle.seek(offset)
                handle.write(block[: out_bytes - offset])
        ckpttool = shutil.which("ckpttool") or "ckpttool"
        commands = {
            "cat (floor)": ["sh", "-c", f"cat {floor_file} > {root / 'cat.out'}"],
            "dequantise": [ckpttool, "consolidate", str(source), str(root / "out"), "--dtype", "bf16",
                           "--max-memory", "256MB", "-q"],
        }

        def clean() -> None:
            shutil.rmtree(root / "out", ignore_errors=True)
            (root / "cat.out").unlink(missing_ok=True)

        print("\n" + table(alternate(commands, args.runs, clean), "cat (floor)"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
