"""Benchmark export with framework-name conversion against consolidate of the same checkpoint.

Builds a torchtitan-named Llama 3 checkpoint (torchtitan 0.3.0's FQNs: `tok_embeddings`,
`layers.N.attention.qkv_linear.wq`, ...; GQA, 8 query heads over 2 key/value heads) of about
1.2 GB in float32, written by torch's own `dcp.save` in one process and resharded to world 4 by
`ckpttool reshard` (FSDP2's dim-0 layout of 4 ranks), and a transformers LlamaConfig beside it.
Then, one after another in this run, each as its own subprocess (wall, peak RSS of that
process), alternating the order over `--runs`:

- consolidate: `ckpttool consolidate SRC OUT` (torchtitan's names kept: the copy floor)
- export: `ckpttool export SRC OUT --assets CONFIG` (transformers' names: q/k rows permuted per
  head as torchtitan's `to_hf` does, then checked against the model transformers builds)
- with `--torchtitan-python PYTHON` (a Python with torchtitan 0.3.0 installed), torchtitan's own
  conversion: `dcp.load` of the model into memory, `Llama3StateDictAdapter.to_hf`, `save_file`

then both ckpttool commands again with `--dry-run`: everything but the copy (reading the
metadata, converting the names, locating and planning), the part of the wall that conversion
adds to, without the disk's noise.

    python benchmarks/naming.py                       # ~1.2 GB, world 4
    python benchmarks/naming.py --layers 4 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from paired import alternate, table

DIM, HEADS, KV_HEADS, FFN, VOCAB = 2048, 16, 4, 5632, 32000

# torchtitan's conversion as its checkpoint manager's HF export runs it: the model loaded whole
# (dcp.load), `to_hf`, one safetensors file; the adapter given the config fields `to_hf` reads
TORCHTITAN = """
import sys, types, torch, torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
src, out = sys.argv[1], sys.argv[2]
meta = dcp.FileSystemReader(src).read_metadata()
state = {{k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()}}
dcp.load(state, checkpoint_id=src, no_dist=True)
attention = types.SimpleNamespace(n_heads={heads}, n_kv_heads={kv_heads}, head_dim=None)
config = types.SimpleNamespace(dim={dim}, enable_weight_tying=False, layers=[types.SimpleNamespace(attention=attention)])
save_file(Llama3StateDictAdapter(config, None).to_hf(state), out)
""".format(dim=DIM, heads=HEADS, kv_heads=KV_HEADS)


def make_checkpoint(root: Path, layers: int) -> tuple[Path, Path]:
    """Write the world-1 checkpoint, reshard it to world 4, write the config; return (source, config dir)."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    head_dim = DIM // HEADS
    state = {"tok_embeddings.weight": torch.randn(VOCAB, DIM), "norm.weight": torch.randn(DIM),
             "lm_head.weight": torch.randn(VOCAB, DIM)}
    for layer in range(layers):
        prefix = f"layers.{layer}."
        state.update({
            prefix + "attention.qkv_linear.wq.weight": torch.randn(HEADS * head_dim, DIM),
            prefix + "attention.qkv_linear.wk.weight": torch.randn(KV_HEADS * head_dim, DIM),
            prefix + "attention.qkv_linear.wv.weight": torch.randn(KV_HEADS * head_dim, DIM),
            prefix + "attention.wo.weight": torch.randn(DIM, HEADS * head_dim),
            prefix + "feed_forward.w1.weight": torch.randn(FFN, DIM), prefix + "feed_forward.w3.weight": torch.randn(FFN, DIM),
            prefix + "feed_forward.w2.weight": torch.randn(DIM, FFN),
            prefix + "attention_norm.weight": torch.randn(DIM), prefix + "ffn_norm.weight": torch.randn(DIM),
        })
    world1 = root / "world1"
    dcp.save(state, checkpoint_id=str(world1), no_dist=True)
    source = root / "step-10"
    subprocess.run([shutil.which("ckpttool") or "ckpttool", "reshard", str(world1), str(source), "--world", "4", "-q"],
                   check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(world1)
    config_dir = root / "hf_config"
    config_dir.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": DIM,
              "intermediate_size": FFN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": head_dim, "vocab_size": VOCAB,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "torch_dtype": "float32"}
    (config_dir / "config.json").write_text(json.dumps(config))
    return source, config_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--torchtitan-python", default=None, help="a python with torchtitan 0.3.0 (the baseline)")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpttool-naming-", dir=args.dir))
    try:
        source, config = make_checkpoint(root, args.layers)
        size = sum(p.stat().st_size for p in source.iterdir())
        print(f"torchtitan llama3 checkpoint: {size / 1e9:.2f} GB at world 4, {os.cpu_count()} cores")
        ckpttool = shutil.which("ckpttool") or "ckpttool"
        commands = {
            "consolidate (names kept)": [ckpttool, "consolidate", str(source), str(root / "out"), "-q"],
            "export (to transformers)": [ckpttool, "export", str(source), str(root / "out"), "--assets", str(config),
                                         "-q"],
        }
        if args.torchtitan_python:
            script = root / "to_hf.py"
            script.write_text(TORCHTITAN)
            commands["torchtitan to_hf + save_file"] = [args.torchtitan_python, str(script), str(source),
                                                         str(root / "out.safetensors")]

        def clean() -> None:
            shutil.rmtree(root / "out", ignore_errors=True)
            (root / "out.safetensors").unlink(missing_ok=True)

        print("\n" + table(alternate(commands, args.runs, clean), "consolidate (names kept)"))
        planning = {f"{name} --dry-run": commands[name] + ["--dry-run"] for name in list(commands)[:2]}
        print("\n" + table(alternate(planning, args.runs, clean), "consolidate (names kept) --dry-run"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
