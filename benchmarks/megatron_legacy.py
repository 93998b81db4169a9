"""Benchmark exporting a Megatron-LM legacy per-rank save (`--ckpt-format torch`) against
consolidate of the same save (issue 48 item 6: <= 1.2x consolidate, <= 150 MB peak RSS).

Makes a >= 1 GB tensor parallel 2 x pipeline parallel 2 save in the layout Megatron-LM's
`save_checkpoint` writes (fixtures/frameworks/generate_megatron_legacy.py has the real one, tiny):
`iter_0000001/mp_rank_TT_PPP/model_optim_rng.pt`, each a `torch.save` of {args, checkpoint_version,
iteration, model} with the stage's tensor-parallel parts under the local layer spec's names,
layers numbered from 0 on each stage, plus `latest_checkpointed_iteration.txt`. The args are the
fixture's own (read as ckpttool reads them: its two enum values left out, dtypes as torch's)
with the model's sizes: a Llama-shaped bf16 model, hidden 2048, 12 layers, 16 heads in 4 query
groups, SwiGLU 5632, vocabulary 32000 (Megatron's NullTokenizer: --vocab-size 31999 and its EOD token;
already a multiple of 128 x 2, so no padding rows), untied output.
Random weights; the optimizer state is left out (neither command reads it).

Rows, each command its own process, warm page cache, `--repeats` interleaved runs (medians; the
CPU time is user + system, os.wait4's, as is the peak RSS):
- `ckpttool consolidate SAVE out.safetensors` (baseline: the same bytes read and written once,
  under Megatron's names),
- `ckpttool export SAVE OUT` (transformers' names: linear_qkv split per query group, linear_fc1
  into gate and up, the vocabulary rows the tokenizer's (all 32000 here), config.json from the args),
- `cat` of the rank files to /dev/null (the read floor).

    python benchmarks/megatron_legacy.py [--repeats 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from import_frameworks import interleaved, table  # benchmarks/: the same timing and table as the import benchmark

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "frameworks" / "megatron_legacy" / "checkpoints" / "iter_0000002"
SIZES = {"num_layers": 12, "hidden_size": 2048, "ffn_hidden_size": 5632, "num_attention_heads": 16,
         "num_query_groups": 4, "kv_channels": 128, "vocab_size": 31999, "padded_vocab_size": 32000,
         "make_vocab_size_divisible_by": 128, "seq_length": 4096, "max_position_embeddings": 4096,
         "bf16": True, "fp16": False}
TP, PP = 2, 2


def make_save(run: Path) -> None:
    """Write the save in a child process (torch's allocations stay out of this one's RSS)."""
    subprocess.run([sys.executable, __file__, "--make", str(run)], check=True)


def _make(run: Path) -> None:
    import torch

    from ckpttool.readers.megatron_legacy import read_legacy_args

    plain: dict = {}
    for key, value in read_legacy_args(FIXTURE).items():
        name = type(value).__name__
        if name == "DTypeName":
            plain[key] = getattr(torch, value.name)
        elif name != "EnumValue":  # attention_backend, exit_signal: Megatron's enums, unused here
            plain[key] = value
    plain.update(SIZES, params_dtype=torch.bfloat16, tensor_model_parallel_size=TP,
                 pipeline_model_parallel_size=PP, world_size=TP * PP)
    args = argparse.Namespace(**plain)
    hidden, layers, ffn = SIZES["hidden_size"], SIZES["num_layers"], SIZES["ffn_hidden_size"]
    heads, groups, head_dim = SIZES["num_attention_heads"], SIZES["num_query_groups"], SIZES["kv_channels"]
    vocab = SIZES["padded_vocab_size"]
    generator = torch.Generator().manual_seed(0)

    def weight(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    folder = run / "iter_0000001"
    for pipeline in range(PP):
        for tensor in range(TP):
            model: dict = {}
            if pipeline == 0:
                model["embedding.word_embeddings.weight"] = weight(vocab // TP, hidden)
            for local in range(layers // PP):
                prefix = f"decoder.layers.{local}."
                model[prefix + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
                model[prefix + "self_attention.linear_proj.weight"] = weight(hidden, heads * head_dim // TP)
                model[prefix + "self_attention.linear_proj._extra_state"] = None
                model[prefix + "self_attention.linear_qkv.weight"] = weight((heads + 2 * groups) * head_dim // TP, hidden)
                model[prefix + "self_attention.linear_qkv._extra_state"] = None
                model[prefix + "pre_mlp_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
                model[prefix + "mlp.linear_fc1.weight"] = weight(2 * ffn // TP, hidden)
                model[prefix + "mlp.linear_fc1._extra_state"] = None
                model[prefix + "mlp.linear_fc2.weight"] = weight(hidden, ffn // TP)
                model[prefix + "mlp.linear_fc2._extra_state"] = None
            if pipeline == PP - 1:
                model["decoder.final_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
                model["output_layer.weight"] = weight(vocab // TP, hidden)
                model["output_layer._extra_state"] = None
            rank = folder / f"mp_rank_{tensor:02d}_{pipeline:03d}"
            rank.mkdir(parents=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model},
                       rank / "model_optim_rng.pt")
    (run / "latest_checkpointed_iteration.txt").write_text("1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command, interleaved (default 3)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (the save is reused)")
    args = parser.parse_args()
    if args.make:
        _make(args.make)
        return
    root = args.keep or Path(tempfile.mkdtemp(prefix="ckpttool-legacy-bench-"))
    save = root / "checkpoints"
    if not save.exists():
        make_save(save)
    files = sorted(map(str, save.glob("iter_*/mp_rank_*/model_optim_rng.pt")))
    size = sum(os.path.getsize(file) for file in files)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    tool = str(Path(sys.executable).with_name("ckpttool"))
    out = root / "out"
    runs = [
        ("ckpttool consolidate -> .safetensors (baseline)",
         [tool, "consolidate", str(save), str(out / "model.safetensors"), "-q"]),
        ("ckpttool export -> transformers folder", [tool, "export", str(save), str(out / "hub"), "-q"]),
        ("cat of the rank files > /dev/null (read floor)", ["cat", *files]),
    ]
    measured = interleaved(runs, args.repeats, out)
    print(f"\n{size / 1e9:.2f} GB legacy save, TP {TP} x PP {PP} ({len(files)} rank files), bf16; "
          f"{platform.machine()}, {os.cpu_count()} cores, page cache warm; median of {args.repeats} interleaved runs; "
          f"load average {' '.join(f'{load:.1f}' for load in os.getloadavg())} at the end\n")
    print(table(measured))
    if not args.keep:
        shutil.rmtree(root)
    else:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
