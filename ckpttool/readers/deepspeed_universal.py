"""Read DeepSpeed's universal checkpoints (deepspeed/checkpoint/ds_to_universal.py) as the ZeRO
save they were made from, without DeepSpeed and without torch.

A universal checkpoint's tag folder (`latest_universal` names it) holds copies of the save's
model states files and `zero/`: one folder per trained parameter, each state a whole tensor of
its own (`zero/<fqn>/{fp32,exp_avg,exp_avg_sq,step}.pt`: `{"param": t, "cat_dim": 0}` from
stage 1/2, the bare flat tensor from stage 3), and `zero/optimizer_state.pt` with the param
groups (and, from stage 3, rank 0's optimizer state, where the step is). Every state is one
chunk: the whole tensor's bytes in its own file. Frozen parameters, buffers and tied names come
from the model states files as in readers/deepspeed.py, whose pieces this reader shares.

Example:
    >>> checkpoint = read_deepspeed_universal("runs/x/universal/global_step2")
    >>> checkpoint.tensors["optim.state.model.norm.weight.exp_avg"].chunks[0].blob.file
    'zero/model.norm.weight/exp_avg.pt'
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ckpttool.core.checkpoint import Checkpoint, Chunk, as_path
from ckpttool.core.errors import CorruptMetadata, MissingFile
from ckpttool.dcp.blobs import DataFiles
from ckpttool.readers.deepspeed import (OPTIM_STATE, Entries, Layout, Number, Param, PickleReader, SaveFiles, Stored,
                                        checkpoint_of, group_of_flats, listing, model_files, shapes, stage_and_world,
                                        untrained)
from ckpttool.readers.detect import DEEPSPEED_UNIVERSAL_DIR as UNIVERSAL_DIR
from ckpttool.store import storage
from ckpttool.torchsave.record import _Rebuilt

UNIVERSAL_OPTIMIZER = f"{UNIVERSAL_DIR}/optimizer_state.pt"
UNIVERSAL_STATES = ("exp_avg", "exp_avg_sq")  # beside fp32.pt, as ds_to_universal writes them for AdamW


def read_deepspeed_universal(path: str | os.PathLike, follow_symlinks: bool = False) -> Checkpoint:
    """Return a universal checkpoint's tag folder as `read_deepspeed` gives a ZeRO save: the
    same names, each state one chunk (the whole tensor's bytes in its own file)."""
    folder = as_path(storage.location(path))
    model, per_rank = model_files(listing(folder))
    if model is None:
        raise MissingFile(f"{folder}: no mp_rank_00_model_states.pt beside {UNIVERSAL_DIR}/ (ds_to_universal copies it)")
    found = SaveFiles(model, per_rank, {})
    with DataFiles(folder, follow_symlinks) as files:
        reader = PickleReader(files, folder)
        model_state = reader.load(model)
        where = str(folder / UNIVERSAL_OPTIMIZER)
        optimizer = reader.load(UNIVERSAL_OPTIMIZER)
        partitioning = stage_and_world(optimizer, where)
        groups = optimizer.get("param_groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
            raise CorruptMetadata(f"{where}: param_groups is missing or malformed")
        param_shapes = shapes(model_state, "param_shapes", str(folder / model))
        what = "sub-group" if partitioning.stage == 3 else "flat group"
        group = group_of_flats(groups, len(param_shapes), where, what)
        steps = _steps(reader, optimizer, where)
        layout = Layout(groups=groups)
        entries = Entries(str(folder / model))
        for index, members in enumerate(param_shapes):
            number = group(index, list(members))
            for name, shape in members.items():
                layout.params.append(Param(name, shape, number))
                _param(entries, reader, folder, name, shape, steps.get(index))
        notes = untrained(entries, reader, found, model_state, partitioning, {p.name for p in layout.params}, folder)
    return checkpoint_of(folder, model, model_state, entries, layout, notes)


def _steps(reader: PickleReader, optimizer: dict, where: str) -> dict[int, Stored | Number]:
    """Flat group -> its `step` (stage 3 keeps rank 0's optimizer state in optimizer_state.pt):
    a 0-d tensor, or the plain number DeepSpeedCPUAdam keeps."""
    base = optimizer.get("optimizer_state_dict")
    state = base.get("state") if isinstance(base, dict) else None
    steps: dict[int, Stored | Number] = {}
    for index, entry in (state.items() if isinstance(state, dict) else ()):
        value = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(value, _Rebuilt) and not value.shape:
            steps[index] = reader.stored(UNIVERSAL_OPTIMIZER, value, f"{where}: optimizer state {index}.step")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            steps[index] = value
    return steps


def _param(entries: Entries, reader: PickleReader, folder: Path, name: str, shape: tuple[int, ...],
           step: Stored | Number | None) -> None:
    """A trained parameter's fp32 weight and optimizer state, each its own file."""
    for key in ("fp32", *UNIVERSAL_STATES, "step"):
        file = f"{UNIVERSAL_DIR}/{name}/{key}.pt"
        try:
            reader.files.size(file)
        except MissingFile:
            if key == "fp32":
                raise MissingFile(f"{folder / file}: missing (the universal checkpoint names {name} in param_shapes)") from None
            if key == "step" and isinstance(step, Stored):
                entries.add((*OPTIM_STATE, name, key), step.dtype, (), (Chunk((), (), step.blob),))
            elif key == "step" and isinstance(step, (int, float)):
                entries.add_value((*OPTIM_STATE, name, key), step)
            continue
        value = reader.load(file, whole=False)
        value = value.get("param") if isinstance(value, dict) else value
        here = f"{folder / file}: {name}"
        stored = reader.stored(file, value, here)
        wanted = shape if key != "step" else ()
        if stored.numel != math.prod(wanted):
            raise CorruptMetadata(f"{here}: holds {stored.numel} elements, its shape {list(wanted)} has {math.prod(wanted)}")
        chunks = (Chunk((0,) * len(wanted), wanted, stored.blob),)
        if key == "fp32":
            entries.add_parameter(name, stored.dtype, wanted, chunks)
        else:
            entries.add((*OPTIM_STATE, name, key), stored.dtype, wanted, chunks)

