"""Editing a Megatron-LM legacy rank file (`mp_rank_TT_PPP/model_optim_rng.pt`) as the damaged
and hostile cases of tests/test_megatron_legacy*.py need it: torch.load without megatron
installed, edit the state dict, torch.save it back."""

from __future__ import annotations

import pickle
import types
from pathlib import Path


class _MegatronFree(pickle.Unpickler):
    """Loads a rank file without megatron: its Enum-valued arguments as their values."""

    def find_class(self, module, name):
        if module.startswith("megatron."):
            return lambda value: value
        return super().find_class(module, name)


def resave(path: Path, edit) -> None:
    """torch.load the rank file (megatron-free), `edit` its state dict, torch.save it back."""
    import torch

    state = torch.load(path, weights_only=False, pickle_module=types.SimpleNamespace(
        Unpickler=_MegatronFree, load=pickle.load, __name__="pickle"))
    edit(state)
    torch.save(state, path)
