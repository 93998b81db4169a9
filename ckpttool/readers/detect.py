"""Which on-disk layout a path holds, from file names and small files only.

Layouts (one name each, as `inspect` shows them):

- `dcp`: torch.distributed.checkpoint (`.metadata` + `__R_N.distcp`).
- `torchtitan`: DCP whose top-level keys are model fqns beside `optimizer`, `lr_scheduler`,
  `dataloader`, `train_state` (torchtitan/components/checkpoint.py: MODEL, OPTIMIZER, ...);
  older torchtitan nests the model under `model`. Needs the metadata read to tell.
- `accelerate`: a folder with `pytorch_model_fsdp_0/` (and `optimizer_0/`) DCP dirs
  (accelerate/utils/constants.py FSDP_MODEL_NAME, fsdp_utils.py save_fsdp_model).
- `lightning`: DCP + `meta.pt` (lightning/fabric/strategies/fsdp.py _METADATA_FILENAME).
- `olmo-core`: a step folder whose `model_and_optim/` is DCP, beside `train/` (OLMo-core's
  olmo_core/train/checkpoint.py `Checkpointer.save`).
- `megatron-torch-dist`: DCP + `common.pt` + `metadata.json` whose `sharded_backend` is
  `torch_dist` (megatron/core/dist_checkpointing/core.py CONFIG_FNAME).
- `deepspeed`: a ZeRO tag folder (`global_stepN`): `*_optim_states.pt` per data-parallel
  rank beside `mp_rank_00_model_states.pt` or (stage 3) `zero_pp_rank_R_mp_rank_00_model_states.pt`
  (deepspeed/runtime/engine.py `_get_ckpt_name`, `_get_zero_ckpt_name`).
- `deepspeed-universal`: DeepSpeed's universal checkpoint (deepspeed/checkpoint/ds_to_universal.py):
  `zero/<fqn>/{fp32,exp_avg,exp_avg_sq,step}.pt` and `zero/optimizer_state.pt` beside copies
  of the model states files; `latest_universal` names it.
- `nemo2`: a NeMo 2 checkpoint folder, `context/` (the model's config: io.json, model.yaml) beside
  `weights/` (a `megatron-torch-dist` save, model keys under `module.`) (nemo/lightning/io/pl.py
  `ckpt_to_context_subdir`, `ckpt_to_weights_subdir`); read from `weights/`.
- `megatron-fsdp-dtensor`: Megatron-LM's `--ckpt-format fsdp_dtensor` (Megatron-FSDP): torch DCP in its
  `iter_%07d` folder, no common.pt; model tensors `model.module.<GPTModel key>`, the SwiGLU fc1 saved as
  `weight_w` / `weight_v`, `args` and `checkpoint_version` as byte entries (megatron/training/checkpointing.py
  `preprocess_fsdp_dtensor_state_dict`; readers/megatron_fsdp.py). Needs the metadata read to tell.
- `megatron-torch-dcp`: Megatron-LM's `--ckpt-format torch_dcp` (torch FSDP2): the same, the model
  tensors `model.<GPTModel key>` (no Megatron-FSDP wrapper, no split fc1), `_extra_state` byte entries.
- `megatron-legacy`: Megatron-LM's `--ckpt-format torch` iteration folder, `mp_rank_TT[_PPP]/model_optim_rng.pt`
  per tensor and pipeline rank (megatron/training/checkpointing.py `get_checkpoint_name`); also
  Megatron-DeepSpeed's DeepSpeed-engine tag folder with more than one `mp_rank_TT_model_states.pt`, or
  with its pipeline engine's `layer_XX-model_TT-model_states.pt` files beside them.
- `verl`: `model_world_size_W_rank_R.pt` per rank, in the folder or its `actor/`
  (verl/utils/checkpoint/fsdp_checkpoint_manager.py).
- `dcp-hf`: torch's HuggingFaceStorageWriter (see readers/dcp_hf.py), sharded or consolidated.
- `safetensors`: one `.safetensors` file.  `hub-folder`: `model.safetensors`, or shards plus
  `model.safetensors.index.json`.  `torch-pt`: one torch.save file (`.pt`, `.pth`, `.bin`, `.ckpt`)
  or a folder with `pytorch_model.bin`.

A run directory holds checkpoints (`step-*`, `step*` (OLMo-core), `iter_*`, `global_step_*`,
`checkpoint-*`, `checkpoint_*`, `ep*-ba*` (Composer, by batch), `global_stepN` (DeepSpeed), NeMo's
`<name>--...-step=N-...[-last]`); the newest is the one a
`latest` link or file, Composer's `latest-rank0.pt` link, or `latest_checkpointed_iteration.txt`
(Megatron `iter_%07d`, verl `global_step_N`), names, else the highest number; of two folders of
one step, Lightning's later `-vN`, then NeMo's `-last` (its save_last copy of the newest state).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ckpttool.store import storage
from ckpttool.core.checkpoint import Checkpoint, as_path
from ckpttool.core.errors import AmbiguousSource, CheckpointError, NotACheckpoint, UsageError
from ckpttool.formats.dcp import METADATA_FILENAME, RANK_METADATA_PATTERN
from ckpttool.formats.model_config import HUB_CONFIG

DCP, DCP_HF, TORCHTITAN, ACCELERATE, LIGHTNING = "dcp", "dcp-hf", "torchtitan", "accelerate", "lightning"
MEGATRON, VERL, SAFETENSORS, HUB_FOLDER, TORCH_PT = "megatron-torch-dist", "verl", "safetensors", "hub-folder", "torch-pt"
OLMO_CORE, DEEPSPEED, DEEPSPEED_UNIVERSAL = "olmo-core", "deepspeed", "deepspeed-universal"
MEGATRON_LEGACY, NEMO2 = "megatron-legacy", "nemo2"
MEGATRON_FSDP, MEGATRON_DCP = "megatron-fsdp-dtensor", "megatron-torch-dcp"
LAYOUTS = (DCP, DCP_HF, TORCHTITAN, ACCELERATE, LIGHTNING, MEGATRON, MEGATRON_LEGACY, NEMO2, OLMO_CORE, DEEPSPEED,
           DEEPSPEED_UNIVERSAL, VERL, SAFETENSORS, HUB_FOLDER, TORCH_PT, MEGATRON_FSDP, MEGATRON_DCP)
DCP_LAYOUTS = frozenset({DCP, TORCHTITAN, ACCELERATE, LIGHTNING, MEGATRON, NEMO2, OLMO_CORE, MEGATRON_FSDP,
                         MEGATRON_DCP})  # read as torch DCP

TORCHTITAN_KEYS = frozenset({"lr_scheduler", "dataloader", "train_state"})  # beside "optimizer"
ACCELERATE_MODEL_DIR = "pytorch_model_fsdp_0"  # f"{FSDP_MODEL_NAME}_{model_index}"
ACCELERATE_OPTIMIZER_DIR = "optimizer_0"  # f"{OPTIMIZER_NAME}_{optimizer_index}"
OLMO_CORE_DIR = "model_and_optim"  # olmo_core/train/checkpoint.py: f"{dir}/model_and_optim"
LIGHTNING_METADATA = "meta.pt"
MEGATRON_CONFIG = "metadata.json"
MEGATRON_COMMON = "common.pt"
MEGATRON_BACKEND = "torch_dist"
# Megatron-LM's generate_state_dict: state_dict['args'], state_dict['checkpoint_version'] (3.0), beside
# state_dict['model'] (MegatronFSDP.state_dict: `module.` + the GPTModel's keys) in an fsdp_dtensor save,
# the GPTModel's own keys in a torch_dcp save
MEGATRON_ARGS, MEGATRON_VERSION, MEGATRON_FSDP_MODEL = "args", "checkpoint_version", "model.module."
MEGATRON_DCP_MODEL = "model."
MEGATRON_ITERATION_FOLDER = re.compile(r"^(?:iter_\d{7,}|release)$")  # checkpointing.py get_checkpoint_name
MAX_CONFIG_BYTES = 1 << 20  # metadata.json is ~100 bytes
# Megatron-LM checkpointing.py get_checkpoint_name: iter_%07d/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt
MEGATRON_LEGACY_RANK = re.compile(r"^mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?$")
MEGATRON_LEGACY_FILE = "model_optim_rng.pt"
# Megatron-DeepSpeed with --deepspeed: DeepSpeed's engine saves each model-parallel rank's module as
# <tag>/mp_rank_TT_model_states.pt (deepspeed/runtime/engine.py `_get_ckpt_name`, ZeRO stage 0-2); more
# than one is a tensor-parallel save, read as a legacy one (readers/megatron_legacy.py)
DEEPSPEED_ENGINE_RANK = re.compile(r"^mp_rank_(\d{2,})_model_states\.pt$")
# DeepSpeed's pipeline engine (Megatron-DeepSpeed's GPTModelPipe): one file per pipeline layer index and
# tensor-parallel rank, <tag>/layer_XX-model_TT-model_states.pt (deepspeed/runtime/pipe/module.py
# `ckpt_layer_path`: the layer's global index, then the topology's rank without its pipe and data axes)
DEEPSPEED_PIPE_LAYER = re.compile(r"^layer_(\d{2,})-model_(\d{2,})-model_states\.pt$")
NEMO2_CONTEXT, NEMO2_WEIGHTS = "context", "weights"  # nemo/lightning/io/pl.py: ckpt_to_{context,weights}_subdir
# deepspeed/runtime/engine.py `_get_ckpt_name` (stage 1/2; stage 3 prefixes zero_pp_rank_R_) and
# `_get_zero_ckpt_name` (bf16_ when the BF16 optimizer saved it)
DEEPSPEED_MODEL_PATTERN = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
DEEPSPEED_OPTIM_PATTERN = re.compile(r"^(?:(?:bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
DEEPSPEED_UNIVERSAL_DIR = "zero"  # ds_to_universal: <tag>/zero/<fqn>/fp32.pt ..., zero/optimizer_state.pt
DEEPSPEED_UNIVERSAL_LATEST = "latest_universal"  # ds_to_universal's pointer beside the tag folder
VERL_MODEL_PATTERN = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
VERL_SUBDIRS = ("", "actor")
TORCH_PT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")  # .ckpt: Lightning's single-file checkpoints
HUB_TORCH_FILE = "pytorch_model.bin"  # transformers WEIGHTS_NAME

RUN_ENTRY_PATTERN = re.compile(r"^(step-|step|iter_|global_step_|global_step|checkpoint-|checkpoint_|ep\d+-ba)(\d+)$")
# Lightning's ModelCheckpoint: `epoch={epoch}-step={step}` (+ `-v1` on a clash), a folder for the
# DeepSpeed and sharded FSDP strategies (lightning/pytorch/callbacks/model_checkpoint.py)
LIGHTNING_ENTRY_PATTERN = re.compile(r"^epoch=(\d+)-step=(\d+)(?:-v(\d+))?(?:\.ckpt)?$")
# NeMo 2's ModelCheckpoint: its filename template's `{step}` field (the recipes' default is
# `{model_name}--{val_loss:.2f}-{step}-{consumed_samples}`), and `-last` on its save_last copy
# (nemo/lightning/pytorch/callbacks/model_checkpoint.py, nemo/collections/llm/recipes/log/default.py)
NEMO_ENTRY_PATTERN = re.compile(r"(?:^|-)step=(\d+)(?=-|$)")
NEMO_LAST_SUFFIX = "-last"
NEMO_UNFINISHED_SUFFIX = "-unfinished"  # ModelCheckpoint.UNFINISHED_CHECKPOINT_SUFFIX: a file beside a save in progress
LATEST_POINTER = "latest"  # train_minimal, DeepSpeed, many trainers: a link or a small text file
COMPOSER_LATEST = "latest-rank0.pt"  # composer/callbacks/checkpoint_saver.py: a link to the newest save
ITERATION_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM, verl
MAX_POINTER_BYTES = 4096
# What a trainer writes beside its training save for the same step: the module's weights (HF
# Trainer's model.safetensors at ZeRO-2, or ZeRO-3 with stage3_gather_16bit_weights_on_model_save)
MODULE_EXPORTS = frozenset({"hub-folder", "torch-pt", "dcp-hf", "safetensors"})
MAX_NESTING = 3  # run directory -> step folder -> save dir (`latest`) -> tag folder
MAX_SEARCH_DEPTH = 3  # folders below SRC looked into for a checkpoint (lightning_logs/version_0/checkpoints)
MAX_SEARCHED_FOLDERS = 2000  # folders of one level: past this, SRC is a data tree, not a run's output
MAX_LISTED = 8  # candidates named in an ambiguous-source error
LOOKED_FOR = (
    ".metadata (dcp), shard-*.safetensors with DCP_SHARDING_INFO (dcp-hf), model.safetensors or "
    "model.safetensors.index.json (hub-folder), pytorch_model_fsdp_0/ (accelerate), model_and_optim/ "
    "(olmo-core), mp_rank_TT[_PPP]/model_optim_rng.pt (megatron-legacy), context/ beside weights/ (nemo2), *_optim_states.pt beside *_model_states.pt (deepspeed), model_world_size_W_rank_R.pt (verl), pytorch_model.bin (torch-pt), or checkpoint folders "
    "step-*, step*, iter_*, global_step_*, global_stepN, checkpoint-*, ep*-ba*, epoch=E-step=S, NeMo's ...-step=N-... (run directory), "
    f"up to {MAX_SEARCH_DEPTH} folders down"
)


@dataclass(frozen=True)
class Detection:
    """What `detect` found: the layout, the path that holds it, and for a run directory the
    checkpoints inside (oldest first) and which is the newest (the one `path` points at).
    `beside`: other checkpoints of the same step that were not chosen (a Hub model a trainer
    wrote beside its ZeRO save), as (layout, path); `chosen_by` says why this one was."""

    layout: str
    path: Path
    requested: Path
    checkpoints: tuple[str, ...] = ()
    newest: str | None = None
    newest_by: str | None = None  # what named the newest: a pointer file, or "highest number"
    beside: tuple[tuple[str, Path], ...] = ()
    chosen_by: str | None = None

    @property
    def run_directory(self) -> bool:
        return bool(self.checkpoints)

    @property
    def found_below(self) -> bool:
        """True when SRC is not itself the checkpoint read: a run's newest step, a save a
        pointer names, one found further down, or one of two checkpoints of one step."""
        return self.run_directory or bool(self.beside) or self.path != _read_path(self.layout, self.requested)

    def describe(self) -> str:
        """Return one line, e.g. `dcp-hf` or `dcp: step-20, newest of 3 checkpoints (by latest)`."""
        if not self.run_directory:  # the path itself, or where it was found below (a pointer, a search)
            text = self.layout if self.path == _read_path(self.layout, self.requested) else f"{self.layout}: {self.path}"
        else:
            text = (f"{self.layout}: {self.newest}, newest of {len(self.checkpoints)} checkpoints in "
                    f"{self.requested} (by {self.newest_by})")
        return text + (f"; {self.choice()}" if self.beside else "")

    def choice(self) -> str | None:
        """Return the line saying which of several checkpoints of one step was read, or None."""
        if not self.beside:
            return None
        others = ", ".join(f"{layout} {path}" for layout, path in self.beside)
        picks = " or ".join(f"--layout {layout}" for layout in sorted({layout for layout, _ in self.beside}))
        return f"read the {self.layout} save {self.path} ({self.chosen_by}); not read: {others} ({picks} reads it)"


def detect(path: str | os.PathLike, layout: str | None = None, read_metadata: bool = True) -> Detection:
    """Return the layout at `path`, or raise NotACheckpoint listing what was looked for.

    `path` may be a checkpoint, a run directory of several steps (the newest is taken), or a
    folder holding either a few levels down. Where one step holds checkpoints of two layouts
    (a Hub model beside the ZeRO save it was written from), the training save is read, or the
    one of `layout`. DCP directories are told apart (torchtitan vs plain dcp) by their
    top-level keys, which reads `.metadata` (`readers.open_checkpoint` reuses that read);
    `read_metadata=False` names both `dcp` and reads only folder listings: where, not what.
    """
    return _detect(as_path(storage.location(path)), layout, read_metadata)[0]


def _detect(requested: Path, prefer: str | None = None,
            read_metadata: bool = True) -> tuple[Detection, Checkpoint | None]:
    """Return the detection and, when deciding needed it, the already-read Checkpoint."""
    if prefer is not None and prefer not in LAYOUTS:
        raise UsageError(f"--layout {prefer}: not a layout ckpttool reads; one of {', '.join(LAYOUTS)}")
    if not _lexists(requested):
        raise NotACheckpoint(f"{requested}: no such file or directory")
    if requested.is_file():
        layout = _file_layout(requested)
        if layout is None:
            raise NotACheckpoint(f"{requested}: not a checkpoint file ckpttool knows (.safetensors, "
                                 f"{', '.join(TORCH_PT_SUFFIXES)}) or a checkpoint directory")
        return _preferred(Detection(layout, requested, requested), prefer), None
    if not requested.is_dir():
        raise NotACheckpoint(f"{requested}: not a regular file or directory")
    found = _resolve(requested, requested, prefer, MAX_NESTING, read_metadata)
    if found is None:
        below = search(requested)
        if len(below) > 1:
            shown = "; ".join(str(path) for path in below[:MAX_LISTED]) + ("; ..." if len(below) > MAX_LISTED else "")
            raise AmbiguousSource(f"{requested}: holds {len(below)} checkpoints or runs, not one: {shown}; "
                                  "name one of them as the source")
        if below:
            found = _resolve(below[0], requested, prefer, MAX_NESTING, read_metadata)
    if found is None:
        if MEGATRON_LEGACY_RANK.match(requested.name) and requested.parent.name and legacy_rank_dirs(requested.parent):
            raise NotACheckpoint(f"{requested}: one tensor/pipeline rank of a Megatron-LM legacy save, not the model; "
                                 f"name its iteration folder, {requested.parent}")
        raise NotACheckpoint(f"{requested}: no checkpoint found; looked for {LOOKED_FOR}")
    return _preferred(found[0], prefer), found[1]


def _preferred(detection: Detection, prefer: str | None) -> Detection:
    """`detection` when it is of layout `prefer` (or none was asked for); else a usage error."""
    if prefer is None or detection.layout == prefer:
        return detection
    raise UsageError(f"{detection.requested}: --layout {prefer}, but it holds no {prefer} checkpoint "
                     f"(found {detection.layout} {detection.path})")


def _resolve(path: Path, requested: Path, prefer: str | None, depth: int,
             read_metadata: bool = True) -> tuple[Detection, Checkpoint | None] | None:
    """Return what the folder `path` holds as one checkpoint, or None: the folder itself, the
    newest step of a run directory, the save a `latest` pointer names, and where one step holds
    a module export beside a training save, the one chosen (`_choose`)."""
    layout, checkpoint = _directory_layout(path, read_metadata)
    if layout is not None and layout not in MODULE_EXPORTS:
        return Detection(layout, _read_path(layout, path), requested), checkpoint
    entries = run_checkpoints(path) if depth > 0 else []
    inner: tuple[Detection, Checkpoint | None] | None = None
    if entries:
        newest, by = newest_checkpoint(path, entries)
        inner = _resolve(path / newest, requested, prefer, depth - 1, read_metadata)
        if inner is None:
            raise NotACheckpoint(f"{path / newest}: the newest checkpoint of {path} (by {by}) holds "
                                 f"no checkpoint; looked for {LOOKED_FOR}")
        if layout is None:  # a step of a run: say which, of how many (the outermost run: a step's own save dir is one)
            inner = (replace(inner[0], checkpoints=tuple(entries), newest=newest, newest_by=by,
                             requested=requested), inner[1])
    elif depth > 0 and (pointed := _pointed_folder(path)) is not None:
        inner = _resolve(path / pointed, requested, prefer, depth - 1, read_metadata)  # Lightning's DeepSpeed `.ckpt/latest`
    if layout is None:
        return inner
    here = Detection(layout, _read_path(layout, path), requested)
    if inner is None or inner[0].layout in MODULE_EXPORTS:
        return here, checkpoint
    # one step's save (HF Trainer's checkpoint-N/: one global_stepN/ beside model.safetensors), or
    # a run's newest save beside a model written at some other time (the run's output folder)
    same_step = len(entries) <= 1 and inner[0].path == path / (entries[0] if entries else inner[0].path.name)
    if not same_step and prefer is None:
        raise AmbiguousSource(f"{path}: holds a {layout} model and the training saves {', '.join(entries)}, "
                              f"and nothing says they are the same step: --layout {layout} reads the model, "
                              f"--layout {inner[0].layout} the newest save ({inner[0].path}); or name one as SRC")
    return _choose(here, checkpoint, inner, prefer)


def _choose(export: Detection, export_checkpoint: Checkpoint | None, training: tuple[Detection, Checkpoint | None],
            prefer: str | None) -> tuple[Detection, Checkpoint | None]:
    """One step's module export (a Hub folder, a torch.save file) beside its training save
    (HF Trainer's `checkpoint-N/`: model.safetensors and `global_stepN/`): the training save,
    which holds the fp32 master weights and the optimizer state (the 16-bit module is their
    rounding), unless `prefer` names the export's layout."""
    saved = training[0]
    if prefer is not None and prefer == export.layout and prefer != saved.layout:
        return replace(export, checkpoints=saved.checkpoints, newest=saved.newest, newest_by=saved.newest_by,
                       beside=((saved.layout, saved.path),), chosen_by="--layout"), export_checkpoint
    return (replace(saved, beside=((export.layout, export.path),),
                    chosen_by="--layout" if prefer == saved.layout else
                    "the training save: master weights and optimizer state; the default"), training[1])


def _pointed_folder(path: Path, nested: bool = True) -> str | None:
    """Return the subfolder a `latest` file names when it is a checkpoint (Lightning's
    DeepSpeed `epoch=E-step=S.ckpt/`: `latest` says `checkpoint`), else None; `nested` as
    for `_looks_like_checkpoint`."""
    named = _pointer(path / LATEST_POINTER)
    if not named or named == "..":
        return None
    return named if (path / named).is_dir() and _looks_like_checkpoint(path / named, nested) else None


def search(path: Path, depth: int = MAX_SEARCH_DEPTH) -> list[Path]:
    """Return the checkpoints and run directories below `path`, at most `depth` folders down,
    not looking inside one once found (its own steps are its business), sorted. Reads only
    folder listings and small pointer files."""
    found: list[Path] = []
    level = [path]
    for _ in range(depth):
        below: list[Path] = []
        for folder in level:
            for name in sorted(_subfolders(folder)):
                child = folder / name
                if _looks_like_checkpoint(child) or run_checkpoints(child):
                    found.append(child)
                else:
                    below.append(child)
        if len(below) > MAX_SEARCHED_FOLDERS:
            break  # a data tree, not a training run's output: stop before reading all of it
        level = below
    return sorted(found)


def _subfolders(path: Path) -> list[str]:
    try:
        if storage.is_remote(path):
            return [entry.name for entry in path.iterdir() if entry.is_dir() and not entry.name.startswith(".")]
        return [entry.name for entry in os.scandir(path)
                if entry.is_dir(follow_symlinks=False) and not entry.name.startswith(".")]
    except OSError:
        return []


def _read_path(layout: str, path: Path) -> Path:
    return path / {ACCELERATE: ACCELERATE_MODEL_DIR, OLMO_CORE: OLMO_CORE_DIR, NEMO2: NEMO2_WEIGHTS}.get(layout, "")


def _file_layout(path: Path) -> str | None:
    from ckpttool.formats.safetensors import SUFFIX  # the safetensors code: only where a layout may be one

    if path.name.endswith(SUFFIX):
        return SAFETENSORS
    if path.name.endswith(TORCH_PT_SUFFIXES):
        return TORCH_PT
    return None


def _lexists(path: Path) -> bool:
    return path.exists() if storage.is_remote(path) else os.path.lexists(path)


def _names(path: Path) -> list[str]:
    """os.listdir, for a local or remote (`storage.RemotePath`) folder."""
    return [entry.name for entry in path.iterdir()] if storage.is_remote(path) else os.listdir(path)


def _is_dcp(path: Path) -> bool:
    if _lexists(path / METADATA_FILENAME):
        return True
    try:
        return any(RANK_METADATA_PATTERN.match(name) for name in _names(path))
    except OSError:
        return False


def _directory_layout(path: Path, read_metadata: bool = True) -> tuple[str | None, Checkpoint | None]:
    """Return (layout or None, the Checkpoint if it had to be read to decide; without
    `read_metadata`, plain `dcp` for torchtitan too)."""
    if _is_dcp(path):
        if _is_megatron(path):
            return MEGATRON, None
        if (path / LIGHTNING_METADATA).is_file():
            return LIGHTNING, None
        if not read_metadata:
            return DCP, None
        from ckpttool.readers.dcp import read_checkpoint

        checkpoint = read_checkpoint(path)
        if is_megatron_fsdp(checkpoint):
            return MEGATRON_FSDP, checkpoint
        if is_megatron_dcp(checkpoint):
            return MEGATRON_DCP, checkpoint
        return (TORCHTITAN if is_torchtitan(checkpoint.tensors.keys() | checkpoint.objects.keys()) else DCP), checkpoint
    if _is_dcp(path / ACCELERATE_MODEL_DIR):
        return ACCELERATE, None
    if _is_dcp(path / OLMO_CORE_DIR):
        return OLMO_CORE, None
    if is_nemo2(path):
        return NEMO2, None
    if any(verl_files(path / sub) for sub in VERL_SUBDIRS):
        return VERL, None
    if legacy_rank_dirs(path) or deepspeed_engine_rank_files(path):
        return MEGATRON_LEGACY, None
    if is_deepspeed(path):
        return DEEPSPEED, None
    if is_deepspeed_universal(path):
        return DEEPSPEED_UNIVERSAL, None
    layout = _safetensors_layout(path)
    if layout is not None:
        return layout, None
    if (path / HUB_TORCH_FILE).is_file():
        return TORCH_PT, None
    return None, None


def is_torchtitan(fqns) -> bool:
    """True for torchtitan's state dict: `optimizer` beside one of `lr_scheduler`,
    `dataloader`, `train_state` at the top level."""
    tops = {fqn.split(".", 1)[0] for fqn in fqns}
    return "optimizer" in tops and bool(tops & TORCHTITAN_KEYS)


def is_megatron_fsdp(checkpoint: Checkpoint) -> bool:
    """True for Megatron-LM's fsdp_dtensor save: its `args` and `checkpoint_version` byte entries
    beside model tensors under Megatron-FSDP's `model.module.`."""
    return (MEGATRON_ARGS in checkpoint.objects and MEGATRON_VERSION in checkpoint.objects
            and any(fqn.startswith(MEGATRON_FSDP_MODEL) for fqn in checkpoint.tensors))


def is_megatron_dcp(checkpoint: Checkpoint) -> bool:
    """True for Megatron-LM's torch_dcp save: its `args` and `checkpoint_version` byte entries beside
    model tensors under `model.`."""
    return (MEGATRON_ARGS in checkpoint.objects and MEGATRON_VERSION in checkpoint.objects
            and any(fqn.startswith(MEGATRON_DCP_MODEL) for fqn in checkpoint.tensors))


def _is_megatron(path: Path) -> bool:
    config = path / MEGATRON_CONFIG
    try:
        if not (config.is_file() and (path / MEGATRON_COMMON).is_file()) or config.stat().st_size > MAX_CONFIG_BYTES:
            return False
        import json  # on use: only a folder with Megatron's two files reads one

        document = json.loads(config.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(document, dict) and document.get("sharded_backend") == MEGATRON_BACKEND


def is_nemo2(path: Path) -> bool:
    """True for a NeMo 2 checkpoint folder: `context/` beside a Megatron `torch_dist` save in `weights/`."""
    weights = path / NEMO2_WEIGHTS
    try:
        return (path / NEMO2_CONTEXT).is_dir() and _is_dcp(weights) and _is_megatron(weights)
    except OSError:
        return False


def is_deepspeed(path: Path) -> bool:
    """True for a ZeRO tag folder: optim states files beside a model states file."""
    try:
        names = _names(path)
    except OSError:
        return False
    return (any(DEEPSPEED_OPTIM_PATTERN.match(name) for name in names)
            and any(DEEPSPEED_MODEL_PATTERN.match(name) for name in names))


def is_deepspeed_universal(path: Path) -> bool:
    """True for a DeepSpeed universal checkpoint's tag folder: `zero/optimizer_state.pt`
    beside a model states file."""
    try:
        names = _names(path)
    except OSError:
        return False
    return (DEEPSPEED_UNIVERSAL_DIR in names and (path / DEEPSPEED_UNIVERSAL_DIR / "optimizer_state.pt").is_file()
            and any(DEEPSPEED_MODEL_PATTERN.match(name) for name in names))


def deepspeed_engine_rank_files(path: Path) -> list[str]:
    """Return the `mp_rank_TT_model_states.pt` files of a DeepSpeed tag folder holding more than one
    (a tensor-parallel save: Megatron-DeepSpeed's with --deepspeed), or any beside pipeline layer
    files (`pipeline_layer_files`), sorted; else []."""
    try:
        found = sorted(name for name in _names(path) if DEEPSPEED_ENGINE_RANK.match(name))
    except OSError:
        return []
    return found if len(found) > 1 or (found and pipeline_layer_files(path)) else []


def pipeline_layer_files(path: Path) -> list[str]:
    """Return the `layer_XX-model_TT-model_states.pt` files of a DeepSpeed pipeline engine's tag
    folder (Megatron-DeepSpeed's GPTModelPipe), sorted; else []."""
    try:
        return sorted(name for name in _names(path) if DEEPSPEED_PIPE_LAYER.match(name))
    except OSError:
        return []


def legacy_rank_files(path: Path) -> list[str]:
    """Return the rank files of a Megatron-LM legacy save, relative to `path`, sorted: its
    `mp_rank_TT[_PPP]/model_optim_rng.pt`, or DeepSpeed's engine's `mp_rank_TT_model_states.pt`
    (`deepspeed_engine_rank_files`)."""
    return [f"{name}/{MEGATRON_LEGACY_FILE}" for name in legacy_rank_dirs(path)] or deepspeed_engine_rank_files(path)


def legacy_rank_dirs(path: Path) -> list[str]:
    """Return the `mp_rank_TT[_PPP]` folders of a Megatron-LM legacy save holding model_optim_rng.pt, sorted."""
    try:
        return sorted(name for name in _names(path) if MEGATRON_LEGACY_RANK.match(name)
                      and (path / name / MEGATRON_LEGACY_FILE).is_file())
    except OSError:
        return []


def verl_files(path: Path) -> list[str]:
    """Return verl's per-rank model files in a folder, sorted."""
    try:
        return sorted(name for name in _names(path) if VERL_MODEL_PATTERN.match(name))
    except OSError:
        return []


def _safetensors_layout(path: Path) -> str | None:
    from ckpttool.readers import dcp_hf, hub_folder
    from ckpttool.readers.safetensors import read_header

    if dcp_hf.shard_files(path):
        return DCP_HF
    files = hub_folder.safetensors_files(path)
    if not files:
        if not hub_folder.index_files(path):
            return None
        return DCP_HF if (path / dcp_hf.INDEX_FILENAME).is_file() else HUB_FOLDER  # the reader names the missing file
    if (path / dcp_hf.INDEX_FILENAME).is_file() and all(dcp_hf.MODEL_FILE_PATTERN.match(f) for f in files):
        # torch's rank-0 writer (DCP_SHARDING_INFO in each header) or its consolidator (no
        # __metadata__ at all, next to a `sharded/` folder when enable_consolidation)
        try:
            header = read_header(path, files[0], None)
        except CheckpointError:  # unreadable: the reader reports it
            return HUB_FOLDER
        if dcp_hf.SHARDING_INFO_KEY in header.metadata:
            return DCP_HF
        # no __metadata__ at all: torch's consolidator, or a Hub repo written by other tools
        # (gpt-oss's shards have none); a model's config.json beside them makes it a Hub folder
        return DCP_HF if not header.metadata and not (path / HUB_CONFIG).is_file() else HUB_FOLDER
    if hub_folder.index_files(path) or len(files) == 1 or hub_folder.SINGLE_FILENAME in files:
        return HUB_FOLDER
    return None


def run_checkpoints(path: Path) -> list[str]:
    """Return the checkpoint folders of a run directory (those holding a layout we know by
    its file names, and no NeMo `-unfinished` marker), oldest first: by the step their names
    carry, never by name order."""
    try:
        entries = path.iterdir() if storage.is_remote(path) else os.scandir(path)
        names = [entry.name for entry in entries if entry.is_dir() and step_of(entry.name) is not None]
    except OSError:
        return []
    names = [name for name in names if _looks_like_checkpoint(path / name) and not nemo_unfinished(path / name)]
    return sorted(names, key=run_entry_order)


def nemo_unfinished(path: Path) -> bool:
    """True when NeMo's ModelCheckpoint marks the save at `path` as not finished: the file
    `<path>-unfinished` beside it, written before the save starts and removed once it is whole
    (nemo/lightning/pytorch/callbacks/model_checkpoint.py `format_checkpoint_unfinished_marker_path`)."""
    return path.with_name(path.name + NEMO_UNFINISHED_SUFFIX).is_file()


def step_of(name: str) -> int | None:
    """Return the step a run directory's entry names (`step-900`, `global_step12`,
    `checkpoint-10`, `iter_0000005`, Lightning's `epoch=0-step=10.ckpt`), or None."""
    match = RUN_ENTRY_PATTERN.match(name)
    if match:
        return int(match.group(2))
    match = LIGHTNING_ENTRY_PATTERN.match(name)
    if match:
        return int(match.group(2))
    match = NEMO_ENTRY_PATTERN.search(name)
    return int(match.group(1)) if match else None


def run_entry_order(name: str) -> tuple[int, int, bool, str]:
    """Sort key of a run directory's checkpoint folder, oldest first: its step, then Lightning's
    version, then NeMo's `-last` after the other folder of its step (the save_last copy, written
    last), then its name.

    Example:
        >>> sorted(["a-step=3-x-last", "a-step=12-x", "a-step=3-x"], key=run_entry_order)
        ['a-step=3-x', 'a-step=3-x-last', 'a-step=12-x']
    """
    step = step_of(name)
    assert step is not None  # run_checkpoints keeps only the names that carry a step
    match = LIGHTNING_ENTRY_PATTERN.match(name)
    return step, int(match.group(3) or 0) if match else 0, name.endswith(NEMO_LAST_SUFFIX), name


def _looks_like_checkpoint(path: Path, nested: bool = True) -> bool:
    """True when `path` holds a layout we know by its file names; `nested`: or a save one
    level down that it names or numbers (HF Trainer's `checkpoint-N/global_stepN/`, Lightning's
    DeepSpeed `epoch=E-step=S.ckpt/checkpoint/` named by `latest`)."""
    from ckpttool.readers import hub_folder

    if (_is_dcp(path) or _is_dcp(path / ACCELERATE_MODEL_DIR) or _is_dcp(path / OLMO_CORE_DIR)
            or any(verl_files(path / s) for s in VERL_SUBDIRS) or is_deepspeed(path) or is_deepspeed_universal(path)
            or bool(legacy_rank_dirs(path)) or bool(pipeline_layer_files(path)) or is_nemo2(path)
            or bool(hub_folder.safetensors_files(path)) or bool(hub_folder.index_files(path))
            or (path / HUB_TORCH_FILE).is_file()):  # an index alone: a save whose data went missing, not "no checkpoint"
        return True
    if not nested:
        return False
    if _pointed_folder(path, nested=False) is not None:
        return True
    return any(step_of(name) is not None and _looks_like_checkpoint(path / name, nested=False)
               for name in _subfolders(path))


def newest_checkpoint(path: Path, found: list[str]) -> tuple[str, str]:
    """Return the newest of `found` and what said so: the `latest` link or file, Megatron's
    and verl's iteration tracker, or else the highest step."""
    for pointer in (path / LATEST_POINTER, path / COMPOSER_LATEST, path / DEEPSPEED_UNIVERSAL_LATEST):
        named = _pointer(pointer)
        if named in found:
            return named, pointer.name
    iteration = _small_text(path / ITERATION_TRACKER)
    if iteration.isdigit():
        for name in (f"iter_{int(iteration):07d}", f"global_step_{int(iteration)}"):
            if name in found:
                return name, ITERATION_TRACKER
    if len(found) > 1 and found[-1].endswith(NEMO_LAST_SUFFIX) and step_of(found[-2]) == step_of(found[-1]):
        return found[-1], f"highest number, then NeMo's {NEMO_LAST_SUFFIX}"
    return found[-1], "highest number"


def _pointer(pointer: Path) -> str | None:
    """Return the folder name a pointer names: a link's target, or a `latest` file's text."""
    if pointer.is_symlink():
        return Path(os.readlink(pointer)).name
    if pointer.is_file() and pointer.name in (LATEST_POINTER, DEEPSPEED_UNIVERSAL_LATEST):
        return Path(_small_text(pointer)).name or None
    return None


def _small_text(path: Path) -> str:
    try:
        if path.is_file() and path.stat().st_size <= MAX_POINTER_BYTES:
            return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        pass
    return ""
