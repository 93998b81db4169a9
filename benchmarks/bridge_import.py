"""Megatron-Bridge 0.3.1's own HF -> Megatron import, run on CPU: the baseline row of
benchmarks/import_frameworks.py (issue 46 item 5).

    BRIDGE_VENV/bin/python benchmarks/bridge_import.py HUB DST

Runs the three steps of `AutoBridge.import_ckpt(HUB, DST)` (auto_bridge.py), in one process:
`AutoBridge.from_hf_pretrained(HUB)`, `bridge.to_megatron_model(wrap_with_ddp=False,
use_cpu_initialization=True)` (builds the GPTModel and loads every weight through Bridge's mapping
registry in its pre-wrap hook), `bridge.save_megatron_model(model, DST, low_memory_save=True)`
(Megatron-LM's run folder: DST/latest_checkpointed_iteration.txt + DST/iter_0000000/, torch_dist).

Versions (venv BRIDGE_VENV): torch 2.13.0+cpu, megatron-core 0.16.1, megatron-bridge 0.3.1
(`pip install --no-deps`), transformers 5.24.0, safetensors, numpy, psutil, omegaconf, six, rich,
einops, triton 3.9.0 (megatron.core.ssm, imported by Bridge's package __init__, needs triton.language).

As shipped it does not run here, and these are the changes that make it run on CPU (none changes a
stored weight: on fixtures/frameworks/megatron_import/llama/hub the result is IDENTICAL to
`reference/`, `ckpttool diff --exact-names`, every tensor and `_extra_state` entry byte for byte):
- `from megatron.bridge import AutoBridge` fails: `ModuleNotFoundError: No module named
  'transformer_engine'` (model_bridge.py -> peft_bridge.py -> peft/lora.py and peft/lora_layers.py
  `import transformer_engine.pytorch as te`). Those two modules are stand-ins (PEFT is not used).
- `save_megatron_model` imports megatron.bridge.training, which imports modelopt
  (nvidia-modelopt), datasets and torch.utils.tensorboard (tensorboard): stand-ins, unused by the
  save. Without them: `ImportError: megatron.bridge.training is not available.`
- Bridge initialises `nccl` after `torch.cuda.set_device` when no process group exists: a 1-rank
  gloo group and `initialize_model_parallel(1)` are set up first.
- Bridge's provider asks for Transformer Engine's fusions and layer spec:
  `provider.finalize()` raises `ValueError: apply_rope_fusion is not available. Please install
  TE >= 1.4.` The provider gets the CPU settings of fixtures/frameworks/generate_megatron_import.py
  (CPU_SETTINGS: fusions off, use_cpu_initialization) and megatron-core's local layer spec
  (`get_gpt_layer_local_spec`): the same weights and torch_dist keys (see that generator).
- The generator's `patch_for_cpu` (torch.cuda.synchronize a no-op, torch.cuda.current_device
  "cpu", the CUDA RNG tracker's fork a no-op, moe_utils.te_general_gemm None), and
  `torch.cuda.get_rng_state` returns the CPU generator's state (save_megatron_model records the
  RNG state: `AssertionError: Torch not compiled with CUDA enabled`).
- `hf_tokenizer_path=None`: the benchmark's Hub folder has no tokenizer (import_ckpt passes the
  Hub folder, and Bridge's tokenizer build fails on it after the checkpoint is written).

Exits through os._exit (gloo aborts at interpreter exit otherwise), after stopping the results-queue
Manager that megatron-core's async filesystem writer starts.
"""

from __future__ import annotations

import os
import sys
import traceback
import types
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "frameworks"
TE_IMPORTERS = ("megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora")
TRAINING_ONLY = ("modelopt", "modelopt.torch", "modelopt.torch.opt", "modelopt.torch.opt.plugins", "datasets",
                 "torch.utils.tensorboard", "torch.utils.tensorboard.writer")


class StandIn(types.ModuleType):
    """A module that is not there: every name it is asked for is an empty class."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *args, **kwargs: None})
        setattr(self, name, value)
        return value


def run_on_cpu() -> None:
    """The CPU changes of the module docstring, before Bridge is imported."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(FIXTURES))
    import generate_megatron_import as generator
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    generator.patch_for_cpu()
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    for name in TE_IMPORTERS + TRAINING_ONLY:
        module = StandIn(name)
        module.__path__ = []
        sys.modules[name] = module

    from megatron.bridge import AutoBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    to_provider = AutoBridge.to_megatron_provider

    def cpu_provider(self, *args, **kwargs):
        provider = to_provider(self, *args, **kwargs)
        for name, value in generator.CPU_SETTINGS.items():
            setattr(provider, name, value)
        provider.transformer_layer_spec = lambda config: get_gpt_layer_local_spec(
            normalization=config.normalization, qk_layernorm=config.qk_layernorm)
        return provider

    AutoBridge.to_megatron_provider = cpu_provider


def import_ckpt(hub: str, destination: str) -> None:
    """AutoBridge.import_ckpt's body (megatron-bridge 0.3.1), without the tokenizer."""
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hub)
    model = bridge.to_megatron_model(wrap_with_ddp=False, use_cpu_initialization=True)
    bridge.save_megatron_model(model, destination, hf_tokenizer_path=None, low_memory_save=True)


def main() -> None:
    import multiprocessing

    code = 0
    try:
        hub, destination = sys.argv[1:3]
        run_on_cpu()
        import_ckpt(hub, destination)
    except BaseException:  # noqa: BLE001 - report and exit non-zero
        traceback.print_exc()
        code = 1
    for child in multiprocessing.active_children():  # megatron's results-queue Manager
        child.terminate()
        child.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
