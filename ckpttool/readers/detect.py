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
- `verl`: `model_world_size_W_rank_R.pt` per rank, in the folder or its `actor/`
  (verl/utils/checkpoint/fsdp_checkpoint_manager.py).
- `dcp-hf`: torch's HuggingFaceStorageWriter (see readers/dcp_hf.py), sharded or consolidated.
- `safetensors`: one `.safetensors` file.  `hub-folder`: `model.safetensors`, or shards plus
  `model.safetensors.index.json`.  `torch-pt`: one torch.save file (`.pt`, `.pth`, `.bin`, `.ckpt`)
  or a folder with `pytorch_model.bin`.

A run directory holds checkpoints (`step-*`, `step*` (OLMo-core), `iter_*`, `global_step_*`,
`checkpoint-*`, `checkpoint_*`, `ep*-ba*` (Composer, by batch), `global_stepN` (DeepSpeed)); the newest is the one a
`latest` link or file, Composer's `latest-rank0.pt` link, or `latest_checkpointed_iteration.txt`
(Megatron `iter_%07d`, verl `global_step_N`), names, else the highest number.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ckpttool.store import storage
from ckpttool.core.checkpoint import Checkpoint, as_path
from ckpttool.core.errors import CheckpointError, NotACheckpoint
from ckpttool.formats.dcp import METADATA_FILENAME, RANK_METADATA_PATTERN
from ckpttool.formats.model_config import HUB_CONFIG

DCP, DCP_HF, TORCHTITAN, ACCELERATE, LIGHTNING = "dcp", "dcp-hf", "torchtitan", "accelerate", "lightning"
MEGATRON, VERL, SAFETENSORS, HUB_FOLDER, TORCH_PT = "megatron-torch-dist", "verl", "safetensors", "hub-folder", "torch-pt"
OLMO_CORE, DEEPSPEED, DEEPSPEED_UNIVERSAL = "olmo-core", "deepspeed", "deepspeed-universal"
LAYOUTS = (DCP, DCP_HF, TORCHTITAN, ACCELERATE, LIGHTNING, MEGATRON, OLMO_CORE, DEEPSPEED, DEEPSPEED_UNIVERSAL, VERL,
           SAFETENSORS, HUB_FOLDER, TORCH_PT)
DCP_LAYOUTS = frozenset({DCP, TORCHTITAN, ACCELERATE, LIGHTNING, MEGATRON, OLMO_CORE})  # read as torch DCP

TORCHTITAN_KEYS = frozenset({"lr_scheduler", "dataloader", "train_state"})  # beside "optimizer"
ACCELERATE_MODEL_DIR = "pytorch_model_fsdp_0"  # f"{FSDP_MODEL_NAME}_{model_index}"
ACCELERATE_OPTIMIZER_DIR = "optimizer_0"  # f"{OPTIMIZER_NAME}_{optimizer_index}"
OLMO_CORE_DIR = "model_and_optim"  # olmo_core/train/checkpoint.py: f"{dir}/model_and_optim"
LIGHTNING_METADATA = "meta.pt"
MEGATRON_CONFIG = "metadata.json"
MEGATRON_COMMON = "common.pt"
MEGATRON_BACKEND = "torch_dist"
MAX_CONFIG_BYTES = 1 << 20  # metadata.json is ~100 bytes
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
LATEST_POINTER = "latest"  # train_minimal, DeepSpeed, many trainers: a link or a small text file
COMPOSER_LATEST = "latest-rank0.pt"  # composer/callbacks/checkpoint_saver.py: a link to the newest save
ITERATION_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM, verl
MAX_POINTER_BYTES = 4096
LOOKED_FOR = (
    ".metadata (dcp), shard-*.safetensors with DCP_SHARDING_INFO (dcp-hf), model.safetensors or "
    "model.safetensors.index.json (hub-folder), pytorch_model_fsdp_0/ (accelerate), model_and_optim/ "
    "(olmo-core), *_optim_states.pt beside *_model_states.pt (deepspeed), model_world_size_W_rank_R.pt (verl), pytorch_model.bin (torch-pt), or checkpoint folders "
    "step-*, step*, iter_*, global_step_*, global_stepN, checkpoint-*, ep*-ba* (run directory)"
)


@dataclass(frozen=True)
class Detection:
    """What `detect` found: the layout, the path that holds it, and for a run directory the
    checkpoints inside (oldest first) and which is the newest (the one `path` points at)."""

    layout: str
    path: Path
    requested: Path
    checkpoints: tuple[str, ...] = ()
    newest: str | None = None
    newest_by: str | None = None  # what named the newest: a pointer file, or "highest number"

    @property
    def run_directory(self) -> bool:
        return bool(self.checkpoints)

    def describe(self) -> str:
        """Return one line, e.g. `dcp-hf` or `dcp: step-20, newest of 3 checkpoints (by latest)`."""
        if not self.run_directory:
            return self.layout
        return (f"{self.layout}: {self.newest}, newest of {len(self.checkpoints)} checkpoints in "
                f"{self.requested} (by {self.newest_by})")


def detect(path: str | os.PathLike) -> Detection:
    """Return the layout at `path`, or raise NotACheckpoint listing what was looked for.

    DCP directories are told apart (torchtitan vs plain dcp) by their top-level keys, which
    reads `.metadata`; `readers.open_checkpoint` reuses that read.
    """
    return _detect(as_path(storage.location(path)))[0]


def _detect(requested: Path) -> tuple[Detection, Checkpoint | None]:
    """Return the detection and, when deciding needed it, the already-read Checkpoint."""
    if not _lexists(requested):
        raise NotACheckpoint(f"{requested}: no such file or directory")
    if requested.is_file():
        layout = _file_layout(requested)
        if layout is None:
            raise NotACheckpoint(f"{requested}: not a checkpoint file ckpttool knows (.safetensors, "
                                 f"{', '.join(TORCH_PT_SUFFIXES)}) or a checkpoint directory")
        return Detection(layout, requested, requested), None
    if not requested.is_dir():
        raise NotACheckpoint(f"{requested}: not a regular file or directory")
    layout, checkpoint = _directory_layout(requested)
    if layout is not None:
        return Detection(layout, _read_path(layout, requested), requested), checkpoint
    found = run_checkpoints(requested)
    if found:
        newest, by = newest_checkpoint(requested, found)
        inner, checkpoint = _directory_layout(requested / newest)
        if inner is None:
            raise NotACheckpoint(f"{requested / newest}: the newest checkpoint of {requested} (by {by}) holds "
                                 f"no checkpoint; looked for {LOOKED_FOR}")
        return Detection(inner, _read_path(inner, requested / newest), requested, tuple(found), newest, by), checkpoint
    raise NotACheckpoint(f"{requested}: no checkpoint found; looked for {LOOKED_FOR}")


def _read_path(layout: str, path: Path) -> Path:
    return path / {ACCELERATE: ACCELERATE_MODEL_DIR, OLMO_CORE: OLMO_CORE_DIR}.get(layout, "")


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


def _directory_layout(path: Path) -> tuple[str | None, Checkpoint | None]:
    """Return (layout or None, the Checkpoint if it had to be read to decide)."""
    if _is_dcp(path):
        if _is_megatron(path):
            return MEGATRON, None
        if (path / LIGHTNING_METADATA).is_file():
            return LIGHTNING, None
        from ckpttool.readers.dcp import read_checkpoint

        checkpoint = read_checkpoint(path)
        return (TORCHTITAN if is_torchtitan(checkpoint.tensors.keys() | checkpoint.objects.keys()) else DCP), checkpoint
    if _is_dcp(path / ACCELERATE_MODEL_DIR):
        return ACCELERATE, None
    if _is_dcp(path / OLMO_CORE_DIR):
        return OLMO_CORE, None
    if any(verl_files(path / sub) for sub in VERL_SUBDIRS):
        return VERL, None
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
    its file names), oldest first."""
    try:
        entries = path.iterdir() if storage.is_remote(path) else os.scandir(path)
        names = [entry.name for entry in entries if entry.is_dir() and RUN_ENTRY_PATTERN.match(entry.name)]
    except OSError:
        return []
    names = [name for name in names if _looks_like_checkpoint(path / name)]
    return sorted(names, key=_run_entry_order)


def _run_entry_order(name: str) -> tuple[int, str]:
    """Sort key of a run directory's checkpoint folder (one RUN_ENTRY_PATTERN matches): its number, then its name."""
    match = RUN_ENTRY_PATTERN.match(name)
    assert match is not None  # run_checkpoints keeps only the names it matches
    return int(match.group(2)), name


def _looks_like_checkpoint(path: Path) -> bool:
    from ckpttool.readers import hub_folder

    return (_is_dcp(path) or _is_dcp(path / ACCELERATE_MODEL_DIR) or _is_dcp(path / OLMO_CORE_DIR) or any(verl_files(path / s) for s in VERL_SUBDIRS)
            or is_deepspeed(path) or is_deepspeed_universal(path)
            or bool(hub_folder.safetensors_files(path)) or bool(hub_folder.index_files(path))
            or (path / HUB_TORCH_FILE).is_file())  # an index alone: a save whose data went missing, not "no checkpoint"


def newest_checkpoint(path: Path, found: list[str]) -> tuple[str, str]:
    """Return the newest of `found` and what said so: the `latest` link or file, Megatron's
    and verl's iteration tracker, or else the highest number."""
    for pointer in (path / LATEST_POINTER, path / COMPOSER_LATEST, path / DEEPSPEED_UNIVERSAL_LATEST):
        named = None
        if pointer.is_symlink():
            named = Path(os.readlink(pointer)).name
        elif pointer.is_file() and pointer.name in (LATEST_POINTER, DEEPSPEED_UNIVERSAL_LATEST):
            named = Path(_small_text(pointer)).name
        if named in found:
            return named, pointer.name
    iteration = _small_text(path / ITERATION_TRACKER)
    if iteration.isdigit():
        for name in (f"iter_{int(iteration):07d}", f"global_step_{int(iteration)}"):
            if name in found:
                return name, ITERATION_TRACKER
    return found[-1], "highest number"


def _small_text(path: Path) -> str:
    try:
        if path.is_file() and path.stat().st_size <= MAX_POINTER_BYTES:
            return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        pass
    return ""
