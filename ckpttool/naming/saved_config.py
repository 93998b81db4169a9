"""The config.json a framework's own save states, where it states one: Megatron-LM's arguments
(a `torch_dist` save's common.pt, a legacy save's rank files: megatron_config.py) or NeMo 2's
context/model.yaml (nemo_config.py), Megatron's first. The one home for that question:
export asks it of the source the user named (`found_in`, without --assets), inspect, diff and
`ckpttool.open` of the checkpoint folder a reader read (`beside`, by file names alone).

Example:
    >>> saved = found_in("checkpoints")            # a run folder: its newest step's
    >>> saved.config["architectures"], saved.label
    (['LlamaForCausalLM'], "common.pt's Megatron-LM arguments")
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from ckpttool.naming import megatron_config, nemo_config
from ckpttool.naming.megatron_config import Vocabulary


@dataclass(frozen=True)
class SavedConfig:
    """A config.json built from a save's own files: `file` is the arguments' file (common.pt,
    mp_rank_*/model_optim_rng.pt) when `megatron`, else NeMo's context/model.yaml. `vocabulary`:
    the rows the embedding and output layer hold and the tokenizer's vocabulary where the save
    states it; config's `vocab_size` is the tokenizer's then (the naming tables write only those
    rows: engine.VOCAB_ROWS), else the rows."""

    config: dict[str, Any]
    file: Path
    megatron: bool
    vocabulary: Vocabulary | None = None

    @property
    def where(self) -> str:
        """The file, as export's report names the config's source."""
        return f"{self.file}: {megatron_config.ARGS}" if self.megatron else str(self.file)

    @property
    def label(self) -> str:
        """Which of the save's files states it, as inspect says."""
        if self.megatron:
            if self.file.name == megatron_config.METADATA_FILENAME:  # a DCP save by Megatron-LM: its byte entry
                return f"the Megatron-LM arguments in its DCP entry `{megatron_config.ARGS}`"
            return f"{self.file.name}'s Megatron-LM arguments"
        return f"NeMo's {self.file.parent.name}/{self.file.name}"


def found_in(src: str | os.PathLike, follow_symlinks: bool = False) -> SavedConfig | None:
    """Return the config the save at `src` states (a checkpoint folder, its run folder: the
    newest, NeMo's weights/), or None when it is neither framework's or states none. Raises
    UnsupportedFormat naming the argument or field a transformers config cannot represent."""
    return _stated(megatron_config.common_file(src), lambda: nemo_config.context_dir(src), follow_symlinks)


def beside(path: str | os.PathLike, follow_symlinks: bool = False) -> SavedConfig | None:
    """`found_in` of the checkpoint folder a reader read (Checkpoint.path), found by file names
    alone: no detection, nothing read unless an arguments file or NeMo's context is there."""
    return _stated(megatron_config.args_file_beside(path), lambda: nemo_config.context_beside(path), follow_symlinks)


def _stated(common: Path | None, context_of: Callable[[], Path | None], follow_symlinks: bool) -> SavedConfig | None:
    if common is not None and (args := megatron_config.saved_args(common, follow_symlinks)) is not None:
        config = megatron_config.hf_config(args, str(common))
        return _cut(SavedConfig(config, common, True, megatron_config.vocabulary(args, str(common))))
    if (context := context_of()) is not None:  # read as data: nemo_config's docstring
        path = context / nemo_config.MODEL_YAML
        model = nemo_config.read_model_yaml(path)
        return _cut(SavedConfig(nemo_config.hf_config_of(model, path), path, False, nemo_config.vocabulary(model, path)))
    return None


def _cut(saved: SavedConfig) -> SavedConfig:
    """`saved` with config.json's vocab_size the tokenizer's, where the save states a smaller one than its rows."""
    vocabulary = saved.vocabulary
    if vocabulary is None or not vocabulary.padded:
        return saved
    return replace(saved, config={**saved.config, "vocab_size": vocabulary.size})
