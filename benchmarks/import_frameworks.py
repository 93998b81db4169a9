"""Benchmark `ckpttool import --to torchtitan|megatron` against consolidate of the same bytes
and the frameworks' own converters (issue 46).

Makes a Llama-shaped bf16 Hub folder (config.json + safetensors shards, random weights:
hidden 2048, 12 layers, 16 heads / 4 key-value heads, ffn 5632, vocab 32000: 1.34 GB), warms
the page cache, then runs each command as its own process, all of them in turn, `--repeats`
times (default 3), and reports the median wall time, the median CPU time and the largest peak
RSS (os.wait4's ru_maxrss, as /usr/bin/time -v reports it); `sync` runs before each command, so
no run flushes the previous one's writes:

- consolidate: `ckpttool consolidate HUB out.safetensors` (the same bytes read and written once)
- `ckpttool import --to torchtitan --world 8`, and `--to megatron`
- torchtitan 0.3.0's own (with `--torchtitan-python`, a Python that has torchtitan 0.3.0, e.g.
  TT_VENV as fixtures/frameworks/generate_torchtitan_import.py makes it): every Hub
  shard loaded whole (safetensors `load_file`), `Llama3StateDictAdapter.from_hf`, `dcp.save` from
  one process. torchtitan's own offline converter (scripts/checkpoint_conversion/
  convert_from_hf.py) also builds the model first; this is the least work its adapter allows.
- Megatron-Bridge 0.3.1's `AutoBridge.import_ckpt` (with `--bridge-python`, BRIDGE_VENV):
  benchmarks/bridge_import.py, which states the CPU workarounds it needs and why.

Each framework's output is compared once with ckpttool's (`ckpttool diff --exact-names`):
torchtitan's with `import --to torchtitan`, Bridge's with `import --to megatron`; the table's last
column says IDENTICAL when every tensor (and for Megatron every `_extra_state` entry) is equal
byte for byte. Timings on a shared machine vary run to run: compare the medians of one run.

    python benchmarks/import_frameworks.py [--torchtitan-python TT_VENV/bin/python]
                                           [--bridge-python BRIDGE_VENV/bin/python]
                                           [--repeats 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False,
}

# torchtitan 0.3.0's own: the Hub tensors loaded whole, Llama3StateDictAdapter.from_hf (its
# model config built as fixtures/frameworks/generate_torchtitan_import.py builds it), dcp.save
TORCHTITAN_BASELINE = r"""
import json, sys
from pathlib import Path
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
hub, out, fixtures = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, fixtures)
import generate_torchtitan_import as g
c = json.loads((hub / "config.json").read_text())
args = dict(g.LLAMA3, vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
            n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"], hidden_dim=c["intermediate_size"],
            rope=dict(cls="ComplexRoPE", dim=c["head_dim"], max_seq_len=c["max_position_embeddings"],
                      theta=c.get("rope_theta") or c["rope_parameters"]["rope_theta"]))
from torchtitan.models.llama3 import Llama3StateDictAdapter
adapter = Llama3StateDictAdapter(g.llama3_config(args), None)
state = {}
for shard in sorted(hub.glob("*.safetensors")):
    state.update(load_file(shard))
dcp.save(adapter.from_hf(state), checkpoint_id=out)
"""


def make_hub(directory: Path) -> None:
    """Write the Hub folder in a child process (torch's allocations stay out of this one's RSS)."""
    subprocess.run([sys.executable, __file__, "--make", str(directory)], check=True)


def _make(directory: Path) -> None:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    c = CONFIG
    hidden, heads, groups, head_dim = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    generator = torch.Generator().manual_seed(0)

    def weight(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    shards: list[dict] = [{}]
    index = {}
    for layer in range(c["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors = {
            prefix + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": weight(groups * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": weight(groups * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": weight(c["intermediate_size"], hidden),
            prefix + "mlp.up_proj.weight": weight(c["intermediate_size"], hidden),
            prefix + "mlp.down_proj.weight": weight(hidden, c["intermediate_size"]),
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
        if layer % 4 == 3:
            shards.append({})
        shards[-1].update(tensors)
    shards[-1].update({"model.embed_tokens.weight": weight(c["vocab_size"], hidden),
                       "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                       "lm_head.weight": weight(c["vocab_size"], hidden)})
    for number, tensors in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, directory / name, metadata={"format": "pt"})
        index.update({key: name for key in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))


def measure(command: list[str]) -> tuple[float, float, int, str]:
    """Return (wall seconds, CPU seconds, peak RSS bytes, error text or "") of one subprocess
    (os.wait4: the child's own ru_maxrss, and its CPU time with its waited-for children's)."""
    subprocess.run(["sync"], check=True)  # the previous run's dirty pages are not this run's to flush
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert process.stderr is not None
    error = process.stderr.read().decode(errors="replace").strip().splitlines()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    failed = [line for line in error if "Error" in line] or error
    return (wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024,
            "" if status == 0 else (failed[-1] if failed else f"exit {status}"))


def same_tensors(tool: str, a: Path, b: Path) -> str:
    """`ckpttool diff --exact-names A B`'s verdict line (IDENTICAL: every tensor byte for byte)."""
    done = subprocess.run([tool, "diff", str(a), str(b), "--exact-names"], capture_output=True, text=True)
    verdict = (done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or ["?"])[-1]
    return verdict.split(":")[0] if verdict.startswith(("IDENTICAL", "SAME", "DIFFERENT")) else verdict[:80]


Result = tuple[float, float, int, str]  # wall s, CPU s, peak RSS bytes, error text


def interleaved(commands: Sequence[tuple[str, list[str]]], repeats: int, out: Path,
                after_first: Callable[[dict[str, list[Result]]], None] | None = None) -> dict[str, list[Result]]:
    """Run every command `repeats` times, in turn (OUT emptied before each round), and return
    label -> its results; `after_first` sees them once the first round is done (its outputs still there)."""
    measured: dict[str, list[Result]] = {label: [] for label, _ in commands}
    for repeat in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for label, command in commands:
            result = measure(command)
            measured[label].append(result)
            print(f"# {label}: {result[0]:.2f} s, CPU {result[1]:.2f} s, peak RSS {result[2] / 1e6:.0f} MB"
                  f"{' FAILED ' + result[3] if result[3] else ''}", file=sys.stderr)
        if repeat == 0 and after_first is not None:
            after_first(measured)
    return measured


def table(measured: dict[str, list[Result]], notes: dict[str, str] | None = None) -> str:
    """The markdown table of `measured` (its first label the baseline): medians, every run's
    wall, ratios to the baseline's medians, the largest peak RSS; `notes` a last column."""
    first = next(iter(measured.values()))
    base, base_cpu = statistics.median(r[0] for r in first), statistics.median(r[1] for r in first)
    extra = (" tensors |", "---|") if notes is not None else ("", "")
    lines = [f"| run | median wall s | runs s | x consolidate | median CPU s | CPU x consolidate | peak RSS MB |{extra[0]}",
             f"|---|---:|---|---:|---:|---:|---:|{extra[1]}"]
    for label, results in measured.items():
        errors = [error for *_, error in results if error]
        if errors:
            lines.append(f"| {label} | - | - | - | - | - | - | failed: {errors[0][:200]} |")
            continue
        wall, cpu = statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)
        note = f" {notes.get(label, '')} |" if notes is not None else ""
        lines.append(f"| {label} | {wall:.2f} | {', '.join(f'{r[0]:.2f}' for r in results)} | {wall / base:.2f}x | "
                     f"{cpu:.2f} | {cpu / base_cpu:.2f}x | {max(r[2] for r in results) / 1e6:.0f} |{note}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--torchtitan-python", type=Path)
    parser.add_argument("--bridge-python", type=Path)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command, interleaved (default 3)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (the Hub folder is reused)")
    args = parser.parse_args()
    if args.make:
        _make(args.make)
        return
    root = args.keep or Path(tempfile.mkdtemp(prefix="ckpttool-import-bench-"))
    hub = root / "hub"
    if not hub.exists():
        make_hub(hub)
    size = sum(path.stat().st_size for path in hub.glob("*.safetensors"))
    subprocess.run(["cat", *map(str, sorted(hub.glob("*.safetensors")))], stdout=subprocess.DEVNULL, check=True)
    tool = str(Path(sys.executable).with_name("ckpttool"))
    out = root / "out"
    # (label, output, command, the ckpttool output whose tensors it must equal)
    runs: list[tuple[str, Path, list[str], Path | None]] = [
        ("ckpttool consolidate -> .safetensors (baseline)", out / "model.safetensors",
         [tool, "consolidate", str(hub), str(out / "model.safetensors"), "-q"], None),
        ("ckpttool import --to torchtitan --world 8", out / "tt",
         [tool, "import", str(hub), str(out / "tt"), "--to", "torchtitan", "--world", "8", "-q"], None),
        ("ckpttool import --to megatron", out / "mg",
         [tool, "import", str(hub), str(out / "mg"), "--to", "megatron", "-q"], None),
    ]
    if args.torchtitan_python:
        fixtures = Path(__file__).resolve().parent.parent / "fixtures" / "frameworks"
        runs.append(("torchtitan 0.3.0: load_file + from_hf + dcp.save", out / "tt-own",
                     [str(args.torchtitan_python), "-c", TORCHTITAN_BASELINE, str(hub), str(out / "tt-own"),
                      str(fixtures)], out / "tt"))
    if args.bridge_python:
        runs.append(("Megatron-Bridge 0.3.1 import_ckpt (CPU workarounds: bridge_import.py)", out / "bridge",
                     [str(args.bridge_python), str(Path(__file__).with_name("bridge_import.py")), str(hub),
                      str(out / "bridge")], out / "mg"))
    checked: dict[str, str] = {}

    def check(measured: dict[str, list[Result]]) -> None:  # every output against ckpttool's, once
        for label, output, _, twin in runs:
            if twin is not None and not measured[label][0][3]:
                checked[label] = f"{same_tensors(tool, output, twin)} to {twin.name}"

    measured = interleaved([(label, command) for label, _, command, _ in runs], args.repeats, out, check)
    print(f"\n{size / 1e9:.2f} GB Llama-shaped bf16 Hub folder ({len(list(hub.glob('*.safetensors')))} shards); "
          f"{platform.machine()}, {os.cpu_count()} cores, page cache warm; median of {args.repeats} interleaved runs; "
          f"load average {' '.join(f'{load:.1f}' for load in os.getloadavg())} at the end\n")
    print(table(measured, checked))
    if not args.keep:
        shutil.rmtree(root)
    else:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
