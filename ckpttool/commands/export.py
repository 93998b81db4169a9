"""`export`: a checkpoint as a folder `transformers` and the Hugging Face Hub accept.

The pipeline: plan the weights once with consolidate's planning step (`plan_output`: the
source read once, gated, selected, located; no byte written) -> read the assets'
`config.json` (or the one the save itself states, Megatron-LM's arguments or NeMo 2's
context/model.yaml: naming/saved_config.py, or the
trainer's stored `train.config`) -> check the planned keys and shapes
against what the config's architecture expects (and a reference index's key set) -> lay out
every other file (config.json with the written dtype, generation and tokenizer files, the
model card) -> in one temporary directory, consolidate's writing step (`write_output`) runs
that same plan (the streaming, byte-exact copy, `{"format": "pt"}` headers, shards + index or
one `model.safetensors`), the other files join them -> rename into place. A refused check
writes nothing.

Example:
    >>> report = export("runs/llama/step-00000200", "hub/llama", assets="base-model/")
    >>> [name for name, _ in report.files][:3]
    ['model.safetensors', 'config.json', 'generation_config.json']
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, cast

from dataclasses import replace

from ckpttool import __version__, naming, readers
from ckpttool.model import quantization
from ckpttool.store import storage
from ckpttool.core.checkpoint import Checkpoint, as_path
from ckpttool.commands.consolidate import (ConsolidateReport, Patch, Planned, load_objects, output_format,
                                           plan_output, report_of, write_output)
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import CheckpointError, InvalidCheckpoint, UsageError, VocabularyMismatch, WriteFailed
from ckpttool.run.execute import write_file
from ckpttool.check.expected_keys import transformers_expected, transformers_missing
from ckpttool.naming import saved_config
from ckpttool.store.safepaths import read_json_object
from ckpttool.formats import hub
from ckpttool.formats.card import CARD_FILENAME, CardFacts, CardTensor, model_card
from ckpttool.formats.safetensors import SUFFIX
from ckpttool.store.io import parse_size
from ckpttool.check.manifest import FILENAME as MANIFEST_FILENAME
from ckpttool.options import AdapterOptions, ConvertOptions, SourceOptions, WriteOptions
from ckpttool.plan.consolidate import ConsolidatePlan
from ckpttool.outputs import atomic_directory, check_destination, refuse_overlap
from ckpttool.readers.detect import DEEPSPEED, DEEPSPEED_UNIVERSAL
from ckpttool.readers.hub_folder import INDEX_FILENAME
from ckpttool.readers.safetensors import read_index
from ckpttool.torchsave import ptfile

# The Hub refuses files above 50 GB (huggingface_hub constants.MAX_HTTP_DOWNLOAD_SIZE, and
# HfApi.upload_file: "up to 50 GB"); a shard is never planned above it.
HUB_MAX_FILE_SIZE = 50 * 1000**3
CONFIG_FILENAME = "config.json"  # transformers.utils.CONFIG_NAME
# What --assets copies: transformers' GENERATION_CONFIG_NAME, the tokenizer files of
# PreTrainedTokenizerBase (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
# added_tokens.json), the slow tokenizers' vocabularies, and chat templates.
ASSET_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
)
MAX_CONFIG_BYTES = 16 << 20
NOT_CHECKED = "nothing"  # how `checked` starts when the weights could not be checked against a config
TRAINER_CONFIG = "train.config"  # train_minimal: TrainConfig JSON (train_minimal/checkpoint.py AppState)
TRAINER_STEP = "train.step"
TRAINER_MODEL_TYPE = "train_minimal"  # config.json of the trainer's own GPT: no transformers class loads it
_STEP_IN_NAME = re.compile(r"(?:step|global_step|iter)[-_]?0*(\d+)$")
_WEIGHTS_DIRECTORY = "weights"  # where consolidate writes inside the temporary directory


@dataclass(frozen=True)
class ExportReport:
    """What export wrote (or, with dry_run, would write)."""

    source: Path
    output: Path
    files: tuple[tuple[str, int], ...]  # (name in the output, bytes), weights first
    weights: ConsolidateReport  # consolidate's plan and report for the weight files
    dtype: str  # the dtype written (most bytes), as config.json's torch_dtype says
    parameters: int
    step: int | None
    config: str | None  # where config.json came from: the assets' file, `train.config`, common.pt's args, or None
    checked: str  # what the weights were checked against, or (starting NOT_CHECKED) why they were not
    assets: tuple[str, ...] = ()  # files copied from --assets
    dry_run: bool = False
    seconds: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    @property
    def config_checked(self) -> bool:
        """True when the weights' keys and shapes were checked against a config."""
        return not self.checked.startswith(NOT_CHECKED)


def export(
    src: str | os.PathLike,
    outdir: str | os.PathLike,
    assets: str | os.PathLike | None = None,
    convert: ConvertOptions = ConvertOptions(),
    write: WriteOptions = WriteOptions(),
    source: SourceOptions = SourceOptions(),
    merge_adapter: AdapterOptions | None = None,
    manifest: bool = False,
) -> ExportReport:
    """Return a report after writing `src` as a Hub model folder at `outdir`.

    Weights as consolidate writes a directory (`convert`: dtype, max_shard_size, drop_tied,
    renames); `assets` (a folder with config.json, generation_config.json, tokenizer files)
    are copied, and its config decides the check: a transformers Llama/Mistral/Qwen2 config
    must match every key and shape, a `model.safetensors.index.json` beside it every key. A
    tied config writes one copy of the tied pair. Raises InvalidCheckpoint
    (`config-mismatch`) and writes nothing when the weights disagree. `merge_adapter` writes a
    LoRA model as its base model with the adapter merged in (`adapter.AdapterMerge`); the
    adapter itself is `export_adapter.export_adapter`. `manifest` also writes `manifest.json`
    (`ckpttool manifest` of the weights written, hashed before the folder is committed).

    Example:
        >>> export("ckpt/step-00000010", "out/", "config/", ConvertOptions(dtype="bf16")).dtype
        'bfloat16'
    """
    started = time.perf_counter()
    target = as_path(source.locate(outdir))  # a URL carries the storage options to the upload
    if assets is None:  # a Hub folder, or the trainer's step folder it was found in, carries its own config.json
        assets = next((folder for folder in _own_folders(src, source) if _has_config(folder)), None)
    asset_dir = _check_arguments(target, assets, convert)
    if not write.dry_run:
        check_destination(target, write.force, write.notify)
    config, config_from, saved, vocab_by = _source_config(src, asset_dir, convert, source)
    tied = bool(config and config.get("tie_word_embeddings", _TIE_DEFAULT.get(config.get("model_type"), False)))
    weights_convert = replace(convert, max_shard_size=convert.shard_bytes or parse_size(hub.DEFAULT_MAX_SHARD_SIZE),
                              drop_tied=convert.drop_tied or tied)
    kind = output_format(target, weights_convert.max_shard_size)
    refuse_overlap(target, src)
    merge = None
    if merge_adapter is not None:  # LoRA's modules are imported by the commands that merge only
        from ckpttool.run.adapter import AdapterMerge, check_merge_target

        merge = AdapterMerge(merge_adapter, assets, source.follow_symlinks, write.verify)
        check_merge_target(target)
    try:
        planned = plan_output(src, target.name, kind, weights_convert, source, write.threads,  # the source is read once, here
                              adapt=merge.view if merge else None, config=config, families=naming.FAMILIES)
    except VocabularyMismatch as error:  # said of what stated the vocabulary: the file, or --vocab-size
        raise _vocabulary_refused(error, config_from, saved, convert.vocab_size) from None
    plan, checkpoint = planned.plan, planned.checkpoint
    vocab_notes = _vocab_notes(planned, config, vocab_by, saved, convert.vocab_size)
    if merge is not None:
        merge.plan(plan)
    extras = _trainer_entries(checkpoint, source.follow_symlinks)
    # the config names the model's weights; --quantize's scales sit beside them
    scale_keys = {key + "_scale_inv" for key in planned.quantized_keys}
    shapes = {t.key: t.shape for t in plan.tensors if t.key not in scale_keys}
    oversized = [f for f in plan.files if f.size > HUB_MAX_FILE_SIZE]
    if oversized:
        raise UsageError(f"{target / oversized[0].name}: {oversized[0].size} bytes, over the Hub's 50GB per-file limit "
                         f"(one tensor larger than that cannot be uploaded)")
    check_shapes = shapes
    if planned.quantization is not None and not planned.dequantized:  # codes and scales as stored: checked as
        check_shapes = quantization.dequantized_shapes(plan.tensors, planned.quantization)  # what they dequantise to
    config, config_from, checked, notes = _check_config(config, config_from, asset_dir, extras, checkpoint, plan,
                                                        shapes, planned.quantization if planned.dequantized else None,
                                                        check_shapes)
    if planned.family is not None and config is None:  # a framework's model with nothing to name it as transformers does
        raise UsageError(f"{checkpoint.path}: the weights use {planned.family.name}'s names, and nothing gives the "
                         "model's config.json to export them as a transformers model; pass --assets DIR (the folder "
                         "with its config.json, e.g. the Hub model it was trained from)")
    notes.extend(vocab_notes)
    if checked.startswith(NOT_CHECKED) and config is not None:  # never silently: say why on stderr and in --json
        notes.append(f"the weights were not checked against {config_from}: {checked.removeprefix(NOT_CHECKED).strip(' ()')}")
    if merge is not None:
        notes.append(merge.note())
    config, written_dtype, documents = _config_document(config, config_from, asset_dir, planned, convert, notes)
    copied = [name for name in ASSET_FILES if asset_dir is not None and (asset_dir / name).exists()]
    step = _step(extras, checkpoint.path)
    weight_files = tuple((f.name, f.size) for f in plan.files) + (
        ((plan.index_name, len(cast(bytes, plan.index))),) if plan.index_name else ())  # an index name comes with its index
    documents[CARD_FILENAME] = model_card(_card(src, assets, convert, planned, step, written_dtype, config,
                                                weight_files, merge.note() if merge else None)).encode()
    files = weight_files + tuple((name, _size(asset_dir / name)) for name in copied if asset_dir is not None) + tuple(
        (name, len(data)) for name, data in documents.items())
    weights = report_of(planned, target, (), (), False, True, 0.0)
    if not write.dry_run:
        weights = _write_folder(planned, target, write, source, weight_files, asset_dir, copied, documents,
                                merge.patch if merge else None, manifest)
        if manifest:  # manifest (issue 34)
            files += ((MANIFEST_FILENAME, len(documents[MANIFEST_FILENAME])),)
    return ExportReport(
        source=checkpoint.path, output=target, files=files, weights=weights, dtype=written_dtype,
        parameters=sum(_numel(shape) for shape in check_shapes.values()), step=step, config=config_from, checked=checked,
        assets=tuple(copied), dry_run=write.dry_run, seconds=time.perf_counter() - started, notes=tuple(notes),
    )


def _source_config(src: str | os.PathLike, asset_dir: Path | None, convert: ConvertOptions, source: SourceOptions
                   ) -> tuple[dict[str, Any] | None, str | None, saved_config.SavedConfig | None, str | None]:
    """Return the config the export checks against (--assets' config.json, else the one the
    save states), where it came from, the save's own config, and what stated the vocabulary
    (`_vocab_source`); `--vocab-size` replaces the config's vocab_size."""
    config = _read_json(asset_dir / CONFIG_FILENAME) if asset_dir and (asset_dir / CONFIG_FILENAME).exists() else None
    config_from = str(asset_dir / CONFIG_FILENAME) if config is not None and asset_dir is not None else None
    # read beside --assets too: a setting the tables cannot represent (rotary_interleaved, zero-centred
    # norms, ...) changes the forward whatever config.json says, and is refused naming the argument or field
    saved = saved_config.found_in(src, source.follow_symlinks)
    if config is None and saved is not None:
        config, config_from = saved.config, saved.where
    vocab_by = _vocab_source(config, config_from, saved, convert.vocab_size)
    if convert.vocab_size is not None and config is not None:
        config = {**config, "vocab_size": convert.vocab_size}
    return config, config_from, saved, vocab_by


def _config_document(config: dict[str, Any] | None, config_from: str | None, asset_dir: Path | None, planned: Planned,
                     convert: ConvertOptions, notes: list[str]) -> tuple[dict[str, Any] | None, str, dict[str, bytes]]:
    """Return (config.json as written, the dtype it names, {CONFIG_FILENAME: bytes} or {}), and
    add export's notes: torch_dtype is what was written; quantised weights passed through keep
    their config byte for byte, dequantised ones lose `quantization_config`, --quantize's gain it."""
    plan = planned.plan
    written_dtype = _written_dtype(plan)
    documents: dict[str, bytes] = {}
    passed_through = planned.quantization is not None and not planned.dequantized
    if passed_through and config is not None and asset_dir is not None and config_from == str(asset_dir / CONFIG_FILENAME):
        # quantised weights as they are: their config too, byte for byte (its torch_dtype is
        # the compute dtype, not the codes')
        written_dtype = str(config.get("torch_dtype") or config.get("dtype") or written_dtype)
        documents[CONFIG_FILENAME] = (asset_dir / CONFIG_FILENAME).read_bytes()
    elif config is not None:
        config = quantization.dequantized_config(config, written_dtype) if planned.dequantized else \
            {**config, "torch_dtype": written_dtype, "dtype": written_dtype}
        # transformers' PretrainedConfig.to_json_string: indent 2, sorted keys, a final newline
        documents[CONFIG_FILENAME] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    if planned.dequantized and planned.quantization is not None:
        notes.append(_dequantized_note(planned.quantization, written_dtype))
    if planned.family is not None:
        notes.append(f"converted {planned.family.name} names to transformers' ({len(plan.tensors)} tensors)")
    if planned.quantized_keys:
        written_dtype = _compute_dtype(plan, planned.quantized_keys)
        if config is not None:
            config = {**config, "torch_dtype": written_dtype, "dtype": written_dtype,
                      quantization.CONFIG_KEY: quantization.fp8_config(convert.block, _not_converted(plan, planned))}
            documents[CONFIG_FILENAME] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        notes.append(f"quantized {len(planned.quantized_keys)} projection weights to FP8 in "
                     f"{convert.block[0]}x{convert.block[1]} blocks (DeepSeek's weight_quant: scale = amax / 448)")
    return config, written_dtype, documents


# ---------------------------------------------------------------------------------------------
# The vocabulary: Megatron pads its embedding and output layer rows (engine.VOCAB_ROWS cuts them)

# the token ids a transformers config names (PretrainedConfig): a vocabulary must hold each
SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id")


def _vocab_source(config: Mapping[str, Any] | None, config_from: str | None, saved: saved_config.SavedConfig | None,
                  requested: int | None) -> str | None:
    """Return what states the vocabulary export writes (--vocab-size, the assets' config.json or
    the save's own tokenizer arguments), or None when nothing does (the rows are kept). Refuses
    --vocab-size without a config to state it in, or below a special-token id the config names."""
    if requested is not None:
        if config is None:
            raise UsageError(f"--vocab-size {requested}: no config.json to state it in; pass --assets DIR too")
        for field in SPECIAL_TOKEN_FIELDS:
            values = config.get(field)
            for value in values if isinstance(values, list) else [values]:
                if type(value) is int and value >= requested:
                    raise InvalidCheckpoint(f"--vocab-size {requested}: {config_from} names {field} {value}, which a "
                                            f"vocabulary of {requested} tokens does not hold", code="config-mismatch")
        return f"--vocab-size {requested}"
    if saved is not None and config is saved.config:
        vocabulary = saved.vocabulary
        return vocabulary.stated_by if vocabulary is not None and vocabulary.size is not None else None
    return config_from


def _vocabulary_refused(error: VocabularyMismatch, config_from: str | None, saved: saved_config.SavedConfig | None,
                        requested: int | None) -> VocabularyMismatch:
    """The engine's refusal of a vocabulary the weights' rows cannot hold, said of what stated it."""
    held = f"{error.target} is made of {error.key}, which holds {error.rows} vocabulary rows"
    vocabulary = saved.vocabulary if saved is not None and config_from == saved.where else None
    if requested is not None:
        message = f"--vocab-size {requested}: {held}"
    elif vocabulary is not None:
        message = (f"{config_from}: states {vocabulary.rows} vocabulary rows ({vocabulary.stated_by}: "
                   f"{error.vocab} tokens), but {held} in the weights")
    else:
        message = f"{config_from}: vocab_size {error.vocab!r}, but {held} in the weights"
    return VocabularyMismatch(message, error.target, error.key, error.rows, error.vocab)


def _vocab_notes(planned: Planned, config: Mapping[str, Any] | None, vocab_by: str | None,
                 saved: saved_config.SavedConfig | None, requested: int | None) -> list[str]:
    """Say what became of Megatron's padded vocabulary rows: cut to the vocabulary (and what stated
    it), or all kept because nothing states the tokenizer's vocabulary (then --vocab-size N cuts
    them). Refuses --vocab-size for weights no table cuts (engine.VOCAB_ROWS)."""
    family = planned.family
    if family is None:
        cuts = False
    else:  # a naming table converted the weights: the engine is loaded
        from ckpttool.naming.engine import VOCAB_ROWS

        cuts = any(rule.transform == VOCAB_ROWS for rule in family.rules)
    if not cuts:
        if requested is not None:
            raise UsageError(f"--vocab-size {requested}: {planned.checkpoint.path} is no Megatron or NeMo save "
                             "(--vocab-size cuts their padded embedding and output layer rows)")
        return []
    vocabulary = saved.vocabulary if saved is not None else None
    rows = vocabulary.rows if vocabulary is not None else None
    vocab = (config or {}).get("vocab_size")
    if vocab_by is None and vocab == rows:
        return [f"kept all {rows} vocabulary rows of the embedding and output layer, Megatron's padding included "
                f"(config.json vocab_size {rows}): {vocabulary.stated_by if vocabulary else 'the save states no vocabulary'}; "
                "--vocab-size N writes the first N (the tokenizer's vocabulary)"]
    if vocabulary is not None and vocabulary.padded and vocab == rows and requested is None:
        return [f"kept all {rows} vocabulary rows of the embedding and output layer, as {vocab_by} states "
                f"(vocab_size {rows}), though the save states {vocabulary.size} tokens ({vocabulary.stated_by}); "
                f"--vocab-size {vocabulary.size} writes those"]
    if rows is not None and type(vocab) is int and vocab < rows:
        padding = " (Megatron's padding)" if vocabulary is not None and vocabulary.size == vocab else ""
        return [f"wrote the first {vocab} of the {rows} vocabulary rows (the vocabulary: {vocab_by}); the other "
                f"{rows - vocab} rows{padding} are left out"]
    if rows is None and requested is not None:
        return [f"wrote the first {requested} vocabulary rows of the embedding and output layer (--vocab-size)"]
    return []


def _compute_dtype(plan: ConsolidatePlan, quantized: tuple[str, ...]) -> str:
    """The dtype a model quantised by --quantize computes in: what its other floating tensors hold."""
    skip = set(quantized) | {key + "_scale_inv" for key in quantized}
    by_dtype: Counter = Counter()
    for tensor in plan.tensors:
        if tensor.key not in skip:
            by_dtype[tensor.dtype] += tensor.nbytes
    return by_dtype.most_common(1)[0][0] if by_dtype else "bfloat16"


def _not_converted(plan: ConsolidatePlan, planned: Planned) -> list[str]:
    """The modules of 2-D weights left unquantised (transformers' FP8 integration must leave them
    as they are: `modules_to_not_convert`)."""
    quantized = set(planned.quantized_keys)
    return sorted({t.key[: -len(".weight")] for t in plan.tensors
                   if t.key.endswith(".weight") and len(t.shape) == 2 and t.key not in quantized})


def _own_folders(src: str | os.PathLike, source: SourceOptions) -> list[Any]:
    """Return the folders whose config.json and tokenizer files are the source's own: SRC, the
    checkpoint found in it (a run's newest step), and for a ZeRO save the step folder holding it
    (HF Trainer's checkpoint-N/, where the Trainer writes config.json beside global_stepN/)."""
    if storage.is_remote(src) or not os.path.isdir(src):
        return [src]
    try:
        found = readers.detect(src, read_metadata=False)  # where, not what: consolidate reads the source next
    except CheckpointError:
        return [src]  # the read that follows says what is wrong
    folders = [src, found.path, *(path for _, path in found.beside)]
    if found.layout in (DEEPSPEED, DEEPSPEED_UNIVERSAL):
        folders.append(found.path.parent)
    return folders


def _has_config(src: str | os.PathLike) -> bool:
    """True for a local folder holding a config.json (a Hub folder)."""
    return not storage.is_remote(src) and os.path.isfile(Path(src) / CONFIG_FILENAME)


def _dequantized_note(found: quantization.Quantization, dtype: str) -> str:
    block = f" {found.block[0]}x{found.block[1]}" if found.block else ""
    return (f"dequantized {len(found.weights)} {found.scheme}{block} weights to {dtype} (scales left out, "
            "quantization_config removed from config.json)")


def _check_arguments(target: Path, assets: str | os.PathLike | None, convert: ConvertOptions) -> Path | None:
    """Refuse a file name for the folder, shards over the Hub's limit, a missing or overlapping
    assets folder; return the assets folder."""
    if target.suffix.lower() in (SUFFIX, *ptfile.SUFFIXES):
        raise UsageError(f"{target}: export writes a folder; give a directory name (or use `ckpttool consolidate`)")
    shard_size = convert.shard_bytes if convert.shard_bytes is not None else parse_size(hub.DEFAULT_MAX_SHARD_SIZE)
    if shard_size > HUB_MAX_FILE_SIZE:
        raise UsageError(f"--max-shard-size {convert.max_shard_size}: the Hub refuses files over 50GB; choose at most 50GB")
    asset_dir = Path(assets) if assets is not None else None
    if asset_dir is not None:
        if not asset_dir.is_dir():
            raise UsageError(f"--assets {asset_dir}: not a directory")
        refuse_overlap(target, asset_dir)
    return asset_dir


def _check_config(config: dict[str, Any] | None, config_from: str | None, asset_dir: Path | None,
                  extras: Mapping[str, Any], checkpoint: Checkpoint, plan: ConsolidatePlan,
                  shapes: Mapping[str, tuple[int, ...]],
                  dequantized: quantization.Quantization | None = None,
                  check_shapes: Mapping[str, tuple[int, ...]] | None = None,
                  ) -> tuple[dict[str, Any] | None, str | None, str, list[str]]:
    """Return (config, where it came from, what was checked, notes): the given config (the
    assets', or Megatron-LM's args: `config_from` says), else the trainer's stored one, checked
    against the planned keys and shapes (a reference index of quantised weights names what they
    dequantise to: `dequantized`)."""
    notes, checked = [], f"{NOT_CHECKED} (no config)"
    if config is not None:
        assert config_from is not None  # a config comes with where it came from
        _check_tie(config, plan, shapes)
        checked = check_against_config(config, check_shapes if check_shapes is not None else shapes, Path(config_from))
    elif TRAINER_CONFIG in extras:
        config = trainer_hf_config(json.loads(extras[TRAINER_CONFIG]), shapes)
        config_from = f"{checkpoint.path}: {TRAINER_CONFIG}"
        checked = check_against_config(config, shapes, Path(config_from))
    else:
        notes.append("no config.json written: no --assets given and the checkpoint stores no trainer config")
    if asset_dir is not None and (asset_dir / INDEX_FILENAME).exists():
        weight_map = read_index(asset_dir / INDEX_FILENAME)
        if dequantized is not None:
            weight_map = quantization.dequantized_keys(weight_map, dequantized)
        checked += "; " + _check_index_keys(weight_map, shapes, asset_dir / INDEX_FILENAME)
    return config, config_from, checked, notes


def _card(src: str | os.PathLike, assets: str | os.PathLike | None, convert: ConvertOptions, planned: Planned,
          step: int | None, written_dtype: str, config: Mapping[str, Any] | None,
          weight_files: tuple[tuple[str, int], ...], merged: str | None = None) -> CardFacts:
    plan = planned.plan
    architectures = config.get("architectures") if config else None
    return CardFacts(
        source=str(src), layout=planned.layout, step=step, dtype=written_dtype,
        parameters=sum(_numel(t.shape) for t in plan.tensors),
        tensors=tuple(CardTensor(t.key, t.dtype, t.shape, t.nbytes) for t in plan.tensors),
        files=weight_files, command=_command_line(src, assets, convert, merged is not None), merged=merged,
        version=__version__, architecture=(architectures or [config.get("model_type") if config else None])[0],
        library="transformers" if config and config.get("model_type") not in (None, TRAINER_MODEL_TYPE) else None,
    )


def _write_folder(planned: Planned, target: Path, write: WriteOptions, source: SourceOptions,
                  weight_files: tuple[tuple[str, int], ...], asset_dir: Path | None, copied: list[str],
                  documents: dict[str, bytes], patch: Patch | None = None, manifest: bool = False) -> ConsolidateReport:
    """Write the planned weights, the copied assets and the documents into one temporary
    directory renamed to `target`; return the weights' report. With `manifest`, the weights
    written are hashed (`ckpttool manifest` of them) into `documents["manifest.json"]`, which
    is committed with the rest."""
    started = time.perf_counter()
    try:
        with atomic_directory(target, force=write.force, notify=write.notify) as output:
            weights_at = output.path / _WEIGHTS_DIRECTORY
            inner = replace(write, force=False)  # a fresh directory inside the temporary one
            written, processes = write_output(planned, weights_at, inner, source, patch=patch)
            weights = report_of(planned, weights_at, written, processes, write.verify, False,
                                time.perf_counter() - started)
            if manifest:  # manifest (issue 34): what was written, read back before the commit
                from ckpttool.commands.manifest import compute

                documents[MANIFEST_FILENAME] = compute(weights_at, write=inner)[0].to_json()
            for name, _ in weight_files:
                os.rename(output.path / _WEIGHTS_DIRECTORY / name, output.path / name)
            os.rmdir(output.path / _WEIGHTS_DIRECTORY)
            for name in copied:
                assert asset_dir is not None  # `copied` names files of the assets folder
                _copy_regular(asset_dir / name, output.path / name)
            for name, data in documents.items():
                write_file(output.path / name, data)
    except OSError as error:
        raise WriteFailed(f"{target}: writing failed ({error.strerror or error}); nothing was left there") from None
    return weights


# ---------------------------------------------------------------------------------------------
# What a config says the weights must be

# The dense Llama-shaped model types export checks by its own table, model_type -> (q/k/v bias,
# o_proj bias) or None (both as the config's `attention_bias` says): as the naming families state
# them (`Architecture.dense_biases`: transformers' LlamaAttention uses attention_bias for all
# four, Qwen2Attention has q/k/v biases and none on o_proj, MistralAttention none).
# PretrainedConfig defaults tie_word_embeddings to True; these model types default to False
_TIE_DEFAULT: dict[Any, bool] = {"llama": False, "mistral": False, "qwen2": False}
_HEADS = ("lm_head.weight", "model.embed_tokens.weight")


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Return key -> shape of the state dict transformers' `<Llama|Mistral|Qwen2>ForCausalLM`
    builds from `config` (tied: no `lm_head.weight`, as save_pretrained writes it).

    Example:
        >>> expected_shapes({"model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
        ...     "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10})["lm_head.weight"]
        (10, 8)
    """
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab = int(config["vocab_size"])
    model_type = config.get("model_type")
    qkv_bias, o_bias = naming.dense_attention_biases().get(model_type) or (bool(config.get("attention_bias")),) * 2
    mlp_bias = bool(config.get("mlp_bias")) if model_type == "llama" else False
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for layer in range(int(config["num_hidden_layers"])):
        prefix = f"model.layers.{layer}."
        projections = {
            "self_attn.q_proj": ((heads * head_dim, hidden), qkv_bias), "self_attn.k_proj": ((kv_heads * head_dim, hidden), qkv_bias),
            "self_attn.v_proj": ((kv_heads * head_dim, hidden), qkv_bias), "self_attn.o_proj": ((hidden, heads * head_dim), o_bias),
            "mlp.gate_proj": ((inter, hidden), mlp_bias), "mlp.up_proj": ((inter, hidden), mlp_bias),
            "mlp.down_proj": ((hidden, inter), mlp_bias),
        }
        for name, (shape, bias) in projections.items():
            shapes[f"{prefix}{name}.weight"] = shape
            if bias:
                shapes[f"{prefix}{name}.bias"] = (shape[0],)
        shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", _TIE_DEFAULT.get(model_type, False)):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def check_against_config(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: Path) -> str:
    """Return what was checked; raise InvalidCheckpoint (`config-mismatch`) on the first key
    the architecture expects that is missing, has another shape, or is not expected."""
    architectures = config.get("architectures") or []
    lora = next((key for key in shapes if ".lora_A." in key or ".lora_embedding_A" in key), None)
    if lora is not None:
        raise InvalidCheckpoint(f"{where}: the weights are a LoRA model ({lora}); export the adapter with --adapter, "
                                "or the base model with it merged in with --merge-adapter", code="config-mismatch")
    causal_lm = not architectures or any(a.endswith("ForCausalLM") for a in architectures)
    # the architectures export's own table knows exactly are checked by it (no torch or
    # transformers import: seconds per command); every other one against what transformers itself
    # builds from the config, where transformers is importable
    known = config.get("model_type") in naming.dense_attention_biases() and causal_lm
    expected = None if known else transformers_expected(config)
    if expected is not None:
        problems = expected.problems(shapes)
        if problems:
            more = f" ({len(problems)} such problems)" if len(problems) > 1 else ""
            raise InvalidCheckpoint(f"{where}: {problems[0][1]}{more}", code="config-mismatch")
        return f"every key and shape transformers builds for {expected.model} ({len(expected.shapes)} tensors)"
    if not known:
        why = transformers_missing() or "transformers cannot build a model of this config"
        return (f"{NOT_CHECKED} (model_type {config.get('model_type')!r} of {where.name} is not one export knows the "
                f"shapes of, and {why})")
    try:
        table = expected_shapes(config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise InvalidCheckpoint(f"{where}: cannot tell the expected shapes ({type(error).__name__}: {error})",
                                code="config-mismatch") from None
    for key, shape in table.items():
        if key not in shapes:
            raise InvalidCheckpoint(f"{where}: the config expects {key} of shape {list(shape)}, which the weights "
                                    "do not hold (wrong --assets or --rename?)", code="config-mismatch")
        if tuple(shapes[key]) != shape:
            raise InvalidCheckpoint(f"{where}: {key} has shape {list(shapes[key])} in the weights, the config "
                                    f"expects {list(shape)}", code="config-mismatch")
    extra = sorted(set(shapes) - set(table))
    if extra:
        raise InvalidCheckpoint(f"{where}: the weights hold {extra[0]} (shape {list(shapes[extra[0]])}), which "
                                f"{config.get('model_type')} does not have ({len(extra)} such keys; --rename?)",
                                code="config-mismatch")
    return f"every key and shape of {(architectures or [config.get('model_type')])[0]} ({len(table)} tensors)"


def _check_index_keys(weight_map: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]], where: Path) -> str:
    missing = sorted(set(weight_map) - set(shapes))
    extra = sorted(set(shapes) - set(weight_map))
    if missing or extra:
        key, what = (missing[0], "names it, the weights do not hold it") if missing else (
            extra[0], "does not name it, the weights hold it")
        raise InvalidCheckpoint(f"{where}: {key}: the index {what} ({len(missing)} missing, {len(extra)} extra)",
                                code="config-mismatch")
    return f"the key set of {where.name} ({len(weight_map)} keys)"


def _check_tie(config: Mapping[str, Any], plan: ConsolidatePlan, shapes: Mapping[str, tuple]) -> None:
    """A tied config loads lm_head from the embedding: a different lm_head would be lost."""
    head, embedding = _HEADS
    tied = config.get("tie_word_embeddings", _TIE_DEFAULT.get(config.get("model_type"), False))
    if tied and head in shapes and embedding in shapes and head not in plan.dropped:
        raise InvalidCheckpoint(f"{head}: config.json says tie_word_embeddings, but the checkpoint's {head} differs "
                                f"from {embedding}; transformers would replace it (use a config with "
                                "tie_word_embeddings false)", code="config-mismatch")


def trainer_hf_config(saved: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """Return config.json for a train_minimal checkpoint from its stored TrainConfig: a
    `LlamaConfig` for `arch: llama` (widths the TrainConfig does not name are read from the
    weights), else the TrainConfig itself under `model_type: train_minimal`."""
    if saved.get("arch") != "llama":
        return {"model_type": TRAINER_MODEL_TYPE, "architectures": ["train_minimal.GPT"], "train_minimal": dict(saved)}
    hidden, heads = int(saved["dim"]), int(saved["heads"])
    head_dim = int(saved.get("head_dim") or hidden // heads)
    k_proj = shapes.get("model.layers.0.self_attn.k_proj.weight")
    gate = shapes.get("model.layers.0.mlp.gate_proj.weight")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": int(saved["layers"]), "num_attention_heads": heads,
        "num_key_value_heads": int(saved.get("kv_heads") or (k_proj[0] // head_dim if k_proj else heads)),
        "head_dim": head_dim,
        "intermediate_size": int(saved.get("intermediate_size") or saved.get("hidden") or (gate[0] if gate else 4 * hidden)),
        "vocab_size": int(saved["vocab"]), "max_position_embeddings": int(saved.get("seq_len", 2048)),
        "rms_norm_eps": float(saved.get("norm_eps", saved.get("rms_norm_eps", 1e-6))),
        "rope_theta": float(saved.get("rope_theta", 10000.0)),
        "tie_word_embeddings": bool(saved.get("tie_embeddings", False)),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    }


# ---------------------------------------------------------------------------------------------
# Small reads

def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, MAX_CONFIG_BYTES)


def _trainer_entries(checkpoint: Checkpoint, follow_symlinks: bool) -> dict[str, Any]:
    """Return train_minimal's `train.step` and `train.config` values, where the checkpoint has them."""
    wanted = {fqn: fqn for fqn in (TRAINER_STEP, TRAINER_CONFIG) if fqn in checkpoint.objects}
    if not wanted:
        return {}
    with DataFiles(checkpoint.path, follow_symlinks) as files:
        values = load_objects(checkpoint, files, wanted)
    if TRAINER_CONFIG in values and not isinstance(values[TRAINER_CONFIG], str):
        del values[TRAINER_CONFIG]
    return values


def _step(extras: Mapping[str, Any], path: Path) -> int | None:
    value = extras.get(TRAINER_STEP)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _STEP_IN_NAME.search(path.name)
    return int(match.group(1)) if match else None


def _written_dtype(plan: ConsolidatePlan) -> str:
    by_dtype: Counter = Counter()
    for tensor in plan.tensors:
        by_dtype[tensor.dtype] += tensor.nbytes
    return by_dtype.most_common(1)[0][0] if by_dtype else "float32"


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _size(path: Path) -> int:
    return os.stat(path).st_size


def _copy_regular(source: Path, destination: Path) -> None:
    """Copy an asset's bytes (a Hub cache symlink is followed: the folder gets the file)."""
    if not stat.S_ISREG(os.stat(source).st_mode):
        raise UsageError(f"{source}: not a regular file")
    with open(source, "rb") as reader, open(destination, "wb") as writer:
        shutil.copyfileobj(reader, writer, 16 << 20)
        writer.flush()
        os.fsync(writer.fileno())


def _command_line(src, assets, convert: ConvertOptions, merged: bool = False) -> str:
    parts = ["ckpttool export", str(Path(src).name) or str(src), "OUTDIR"]
    if assets is not None:
        parts += ["--assets", Path(assets).name or str(assets)]
    if convert.dtype:
        parts += ["--dtype", convert.dtype]
    if convert.max_shard_size is not None:
        parts += ["--max-shard-size", str(convert.max_shard_size)]
    if convert.drop_tied:
        parts.append("--drop-tied")
    for rule in convert.renames:
        parts += ["--rename", repr(rule)]
    if convert.vocab_size is not None:
        parts += ["--vocab-size", str(convert.vocab_size)]
    if merged:
        parts.append("--merge-adapter")
    return " ".join(parts)
