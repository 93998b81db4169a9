"""Benchmark `ckpttool.load_into` of a fused-expert MoE (transformers 5's Qwen3-MoE:
`mlp.experts.gate_up_proj` [E, 2F, D]) against transformers' own `from_pretrained`, on the
same `save_pretrained` folder (one safetensors key per expert, as the Hub and `export` write).

Each row is its own subprocess, the two taking turns `--repeat` times (median wall, largest
peak), the page cache warmed first:

- ckpttool: the model built on the meta device and given uninitialised CPU storage
  (`to_empty`), then `load_into(model, folder)`: each expert's gate/up/down read straight into
  its rows of the fused tensors;
- transformers: `AutoModelForCausalLM.from_pretrained(folder)` (its loader joins the experts
  by conversion_mapping.py's MergeModulelist + Concatenate).

Peak is the process's RSS high-water mark (VmHWM: `ru_maxrss` would keep the parent's across
exec) less its RSS after the imports (the
model's modeling module included), as a multiple of the model's bytes; "added by the load" less
its RSS once the model is built (ckpttool: after `to_empty`; transformers: the same as peak,
its build and load being one call).

    python benchmarks/load_fused.py [--experts 32] [--hidden 512] [--layers 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
import torch, transformers
import ckpttool
import ckpttool.load, transformers.models.qwen3_moe.modeling_qwen3_moe  # imported before the baseline
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
base = rss()
started = time.perf_counter()
if sys.argv[2] == "ckpttool":
    config = transformers.AutoConfig.from_pretrained(sys.argv[1])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu")
    built, loading = rss(), time.perf_counter()
    assert ckpttool.load_into(model, sys.argv[1]) == ([], [])
else:
    built, loading = base, started
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
done = time.perf_counter()
# VmHWM, the high-water mark of this process's own memory: ru_maxrss keeps the parent's across exec
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps({"wall": done - started, "load": done - loading, "peak": peak - base, "added": peak - built,
                  "size": size}))
"""


def make_folder(root: Path, experts: int, hidden: int, layers: int) -> Path:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden,
                                         moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=hidden // 8, num_experts=experts,
                                         num_experts_per_tok=4, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf")
    return root / "hf"


def run(folder: Path, how: str) -> dict:
    output = subprocess.run([sys.executable, "-c", CHILD, str(folder), how], check=True, capture_output=True,
                            text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp), args.experts, args.hidden, args.layers)
        for file in folder.iterdir():  # warm the page cache
            file.read_bytes()
        results: dict[str, list[dict]] = {"ckpttool": [], "transformers": []}
        for _ in range(args.repeat):
            for how in results:  # alternating pairs
                results[how].append(run(folder, how))
        size = results["ckpttool"][0]["size"]
        print(f"Qwen3-MoE, {args.layers} layers x {args.experts} experts, hidden {args.hidden}: "
              f"{size / 1e6:.1f} MB fp32; load average {os.getloadavg()[0]:.2f}; {time.strftime('%H:%M:%S')}")
        print(f"{'':14} {'wall s (median)':>16} {'peak / model':>13} {'added by the load / model':>26}")
        for how, rows in results.items():
            print(f"{how:14} {statistics.median(r['wall'] for r in rows):16.3f} "
                  f"{max(r['peak'] for r in rows) / size:13.2f} {max(r['added'] for r in rows) / size:26.2f}")
        wall = {how: statistics.median(r["wall"] for r in rows) for how, rows in results.items()}
        for how, rows in results.items():
            print(f"{how} per run: wall {[round(r['wall'], 2) for r in rows]}, "
                  f"added / model {[round(r['added'] / size, 2) for r in rows]}")
        print(f"ckpttool / transformers wall: {wall['ckpttool'] / wall['transformers']:.2f}x; "
              f"pairs: {[round(a['wall'] / b['wall'], 2) for a, b in zip(results['ckpttool'], results['transformers'])]}")


if __name__ == "__main__":
    main()
