"""A checkpoint whose chunks are ChunkTables (what the C `.metadata` reader gives) yields
exactly what the same checkpoint with tuples of Chunk (every other reader) yields: the
integrity gate's problems, inspect's report, its text and its `--json` bytes, and validate's
document.

Every fixture ckpttool reads, and damaged copies of a real checkpoint made in tmp_path, are
compared as tuples (`with_tuples`) and as tables (`with_tables`, and tables sharing one files
tuple as the C reader's do); synthetic checkpoints built in memory add hostile numbers (negative sizes, 10**18-element chunks, coinciding blobs) and block sharding,
where the columns must fall back to comparing boxes. Then the fast geometry proof
(`geometry.dim0_tiling`) against `find_overlaps` and `coverage` on random tilings.
"""

from __future__ import annotations

import io
import json
import random
import re
from pathlib import Path
from types import MappingProxyType
from typing import Mapping
from unittest import mock

import pytest

from conftest import FIXTURES, import_native
from test_validate import (CORRUPTIONS, EMBED, copy_fixture, rewrite_metadata, save_safetensors_format,
                           storage_key)
from test_integrity import shifted_chunk_with_equal_gap

from ckpttool import readers
from ckpttool.check import integrity
from ckpttool.core import geometry
from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, ChunkTable, Object, Tensor, with_tables
from ckpttool.commands import inspect as inspect_command
from ckpttool.commands import validate as validate_command
from ckpttool.core.errors import AmbiguousSource, NotACheckpoint, UnsupportedFormat
from ckpttool.render.inspect import inspect_document, inspect_text
from ckpttool.render.text import emit_json
from ckpttool.render.validate import validate_document, validate_text


# Directories under fixtures/ that are not one checkpoint: what holds several fixtures (refused
# as ambiguous: SRC is searched a few folders down), framework configs, reference outputs,
# trainer state and PEFT adapters (read by the adapter commands). Every other directory must
# read: one a broken reader cannot read fails the test below.
NOT_CHECKPOINTS = {
    "frameworks", "frameworks/accelerate", "frameworks/composer", "frameworks/deepspeed",
    "frameworks/deepspeed/trainer_llama_zero2", "frameworks/lightning", "frameworks/lightning/checkpoints",
    "frameworks/megatron", "frameworks/megatron_families",
    # run folders checkpoints/ beside Megatron-Bridge's export hf/
    "frameworks/megatron_fsdp_dtensor", "frameworks/megatron_fsdp_dtensor/with_optimizer", "frameworks/megatron_torch_dcp",
    "frameworks/olmo_core", "frameworks/olmo_core/run/step2/train", "frameworks/torchtitan",
    "frameworks/torchtitan/hf_config", "frameworks/torchtitan_families",
    "frameworks/torchtitan_families/qwen3_moe/ep2_world4", "frameworks/torchtitan_model_only",
    "frameworks/verl", "frameworks/verl/checkpoints/global_step_2/actor/huggingface",
    "llama_tied_world2", "llama_tied_world2/config", "llama_world2", "llama_world2/config",
    "peft", "peft/attention", "peft/mlp_rslora", "peft/tied",
    "quantized", "quantized/compressed_reference", "structures", "structures/expected", "structures/recipe_config",
    "frameworks/hf_trainer_deepspeed", "frameworks/deepspeed_optimizers", "frameworks/torchtitan_v02",
    "frameworks/hf_trainer_plain", "frameworks/hf_trainer_plain/fsdp/model_config",
    "frameworks/torchtitan_v02/llama3/hf_config", "frameworks/torchtitan_v02/qwen3_moe/hf_config",
    "frameworks/lightning_deepspeed", *(f"frameworks/lightning_deepspeed/{case}/hf_config" for case in (
        "zero2_tied", "zero2_untied", "zero3_tied", "zero3_untied", "zero2_bf16_tied")),
    "frameworks/megatron_legacy/hf", "frameworks/megatron_legacy/virtual_pipeline/hf",
    "frameworks/megatron_legacy_distopt/hf",  # and its rank folders, refused as megatron_legacy's are:
    *(f"frameworks/megatron_legacy_distopt/checkpoints/iter_0000002/mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(2)),
    "frameworks/megatron_legacy_distopt_dp2/hf",  # and its rank folders (pipeline parallel 1: mp_rank_TT)
    *(f"frameworks/megatron_legacy_distopt_dp2/checkpoints/iter_0000002/mp_rank_{t:02d}" for t in range(2)),
    # Megatron-DeepSpeed's two saves and its reference; the legacy save's rank folders, refused as megatron_legacy's are
    "frameworks/megatron_deepspeed",
    *(f"frameworks/megatron_deepspeed/checkpoints/iter_0000002/mp_rank_{t:02d}" for t in range(2)),
    "frameworks/megatron_deepspeed/pipeline",
    *(f"frameworks/megatron_deepspeed/pipeline/checkpoints/iter_0000002/mp_rank_{t:02d}_{p:03d}" for t in range(2)
      for p in range(2)),
    "frameworks/megatron_deepspeed/pipeline_engine",  # DeepSpeed's pipeline engine's save beside its reference
    "frameworks/torchtitan_import", "frameworks/megatron_import", "frameworks/megatron_import/llama",
    "frameworks/megatron_import/qwen3_moe", "frameworks/megatron_more_families", "frameworks/megatron_gpt_oss",
    # NeMo 2: context/ holds the model's config, not weights; nemo2/ holds the run and NeMo's export of it
    "frameworks/nemo2",
    *(f"frameworks/nemo2/llama/checkpoints/model_name=0--val_loss=0.00-step=3-consumed_samples=4.0{last}/context"
      for last in ("", "-last")),
    # NeMo 2 beyond Llama: each family's run folder beside NeMo's export of it (reference/hf)
    "frameworks/nemo2_families", *(f"frameworks/nemo2_families/{name}" for name in ("qwen3", "qwen3_moe", "mixtral", "qwen2")),
    *(f"frameworks/nemo2_families/{name}/checkpoints/model_name=0--val_loss=0.00-step=3-consumed_samples=4.0-last/context"
      for name in ("qwen3", "qwen3_moe", "mixtral", "qwen2")),
}
# one rank of a Megatron-LM legacy save: refused with its iteration folder named (tests/test_megatron_legacy.py)
LEGACY_RANK_FOLDERS = re.compile(r"frameworks/megatron_legacy(/virtual_pipeline)?/checkpoints/iter_0000002/mp_rank_\d\d_\d{3}")
# a stage-3 save whose trainable parameter outside the optimizer is in no file: refused by name, on purpose
# (tests/test_deepspeed_optimizers.py)
REFUSED = re.compile(r"frameworks/deepspeed_optimizers/zero3_param_outside_optimizer(/checkpoints(/global_step2)?)?")
# DeepSpeed universal checkpoints keep a folder per tensor under zero/ (read through global_step2)
UNIVERSAL_TENSOR_FOLDERS = re.compile(r"frameworks/deepspeed/zero[123]_fp32/universal/global_step2/zero(/[^/]+)?")


def read_fixture_directories() -> tuple[list[Path], list[str]]:
    """Every directory under fixtures/ that ckpttool reads (a layout it detects), and what went
    wrong with any other that is not listed as no checkpoint (listed ones must say so:
    NotACheckpoint, not another error)."""
    found, unexpected = [], []
    for path in sorted(p for p in FIXTURES.rglob("*") if p.is_dir() and "__pycache__" not in p.parts):
        name = path.relative_to(FIXTURES).as_posix()
        try:
            readers.read(path)
        except (NotACheckpoint, AmbiguousSource) as error:
            if (name not in NOT_CHECKPOINTS and not UNIVERSAL_TENSOR_FOLDERS.fullmatch(name)
                    and not LEGACY_RANK_FOLDERS.fullmatch(name)):
                unexpected.append(f"{name}: {error}")
        except UnsupportedFormat as error:
            if not REFUSED.fullmatch(name):
                unexpected.append(f"{name}: {type(error).__name__}: {error}")
        except Exception as error:  # named by the test below, never dropped
            unexpected.append(f"{name}: {type(error).__name__}: {error}")
        else:
            found.append(path)
    return found, unexpected


READABLE, UNREADABLE = read_fixture_directories()


def test_every_fixture_directory_reads_unless_it_is_listed_as_no_checkpoint():
    assert UNREADABLE == []
    assert len(READABLE) > 50  # about 100 today


def outputs(checkpoint: Checkpoint, layout: str = "dcp") -> dict:
    """Everything inspect and validate (without --deep) derive from a checkpoint's metadata."""
    found = integrity.check(checkpoint)
    report = inspect_command.build_report(checkpoint, (), layout)
    filtered = inspect_command.build_report(checkpoint, ("model.*",), layout)
    document = io.StringIO()
    emit_json(inspect_document(report), document)
    validation = validate_command.ValidationReport(checkpoint.path, False, list(found.problems),
                                                   tensors=len(checkpoint.tensors), objects=len(checkpoint.objects),
                                                   chunks=sum(len(t.chunks) for t in checkpoint.tensors.values()),
                                                   files=found.files)
    return {
        "problems": found.problems, "sizes": found.sizes, "files": found.files,
        "report": report, "filtered": filtered,
        "text": inspect_text(report), "chunks text": inspect_text(report, chunks=True, by_file=True),
        "filtered text": inspect_text(filtered, chunks=True),
        "json": document.getvalue(), "document": json.loads(document.getvalue()),
        "validate": validate_document(validation), "validate text": validate_text(validation),
    }


def with_tuples(checkpoint: Checkpoint) -> Checkpoint:
    """`checkpoint` with every tensor's chunks as a tuple of Chunk (what readers other than the
    C `.metadata` reader give): the baseline the tables are compared with."""
    import dataclasses

    tensors = {fqn: Tensor(t.fqn, t.dtype, t.shape, tuple(t.chunks)) if isinstance(t.chunks, ChunkTable) else t
               for fqn, t in checkpoint.tensors.items()}
    return dataclasses.replace(checkpoint, tensors=tensors)


def with_shared_files(checkpoint: Checkpoint) -> Checkpoint:
    """`with_tables`, every table naming one files tuple: all data files, most unused by it
    (a parser may keep the storage table's file list once)."""
    import dataclasses

    import numpy as np

    tabled = with_tables(checkpoint)
    names = tuple(sorted({n for t in tabled.tensors.values() if isinstance(t.chunks, ChunkTable) for n in t.chunks.files}))
    tensors = {}
    for fqn, tensor in tabled.tensors.items():
        table = tensor.chunks
        if isinstance(table, ChunkTable):
            numbers = np.array([names.index(n) for n in table.files] + [-1], dtype=np.int32)
            table = ChunkTable(table.offsets, table.sizes, numbers[table.file], table.blob_offset, table.blob_length, names)
        tensors[fqn] = Tensor(tensor.fqn, tensor.dtype, tensor.shape, table)
    return dataclasses.replace(tabled, tensors=tensors)


def assert_same_with_tables(checkpoint: Checkpoint, layout: str = "dcp", tables: int | None = None) -> dict:
    tabled = with_tables(checkpoint)
    count = sum(isinstance(t.chunks, ChunkTable) for t in tabled.tensors.values())
    if tables is not None:
        assert count >= tables
    expected = outputs(with_tuples(checkpoint), layout)
    for variant in (tabled, with_shared_files(checkpoint)):
        actual = outputs(variant, layout)
        for key in expected:
            assert actual[key] == expected[key], key
    with mock.patch.object(integrity._Claims, "disjoint", lambda self, sizes: False):  # every claim sorted and swept
        assert integrity.check(tabled).problems == expected["problems"]
    return expected


@pytest.mark.parametrize("path", READABLE, ids=[str(p.relative_to(FIXTURES)) for p in READABLE])
def test_every_readable_fixture_gives_the_same_results_with_chunk_tables(path):
    detection, checkpoint = readers.read(path)
    assert_same_with_tables(checkpoint, detection.layout)


def test_the_fixtures_read_include_every_layout_with_tables():
    layouts = {readers.read(path)[0].layout for path in READABLE}
    assert {"dcp", "dcp-hf", "torchtitan", "accelerate", "lightning", "megatron-torch-dist", "olmo-core", "verl",
            "hub-folder"} <= layouts


# --- damaged copies of a real checkpoint ---------------------------------------------------------


def out_of_bounds_chunk(path: Path) -> None:
    def edit(metadata):
        import torch

        chunk = metadata.state_dict_metadata[EMBED].chunks[-1]
        chunk.sizes = torch.Size([chunk.sizes[0] + 3, chunk.sizes[1]])

    rewrite_metadata(path, edit)


def orphan_storage_entry(path: Path) -> None:
    def edit(metadata):
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = metadata.storage_data[storage_key(metadata, EMBED)]
        metadata.storage_data[MetadataIndex(EMBED, torch.Size([999, 0]))] = info

    rewrite_metadata(path, edit)


def two_blobs_on_the_same_bytes(path: Path) -> None:
    def edit(metadata):
        infos = [metadata.storage_data[storage_key(metadata, fqn)] for fqn in sorted(metadata.state_dict_metadata)
                 if hasattr(metadata.state_dict_metadata[fqn], "chunks")]
        same_file = [i for i in infos if i.relative_path == infos[0].relative_path]
        same_file[2].offset = same_file[1].offset + 8  # overlaps its neighbour, starts elsewhere

    rewrite_metadata(path, edit)


def every_kind_at_once(path: Path) -> None:
    shifted_chunk_with_equal_gap(path)
    orphan_storage_entry(path)
    CORRUPTIONS["truncated data file"][0](path)
    (path / "stray.distcp").write_bytes(b"left over")


DAMAGE = {name: corrupt for name, (corrupt, code, deep_only) in CORRUPTIONS.items()
          if not deep_only and code not in ("metadata-unreadable", "no-metadata", "unknown-dtype")}
DAMAGE.update({
    "chunk shifted into its neighbour": shifted_chunk_with_equal_gap,
    "out-of-bounds chunk": out_of_bounds_chunk,
    "orphan storage entry": orphan_storage_entry,
    "two blobs on the same bytes": two_blobs_on_the_same_bytes,
    "every kind at once": every_kind_at_once,
})


@pytest.mark.parametrize("name", DAMAGE)
def test_each_damaged_checkpoint_gives_the_same_problems_and_reports_with_chunk_tables(tmp_path, name):
    path = copy_fixture(tmp_path)
    DAMAGE[name](path)
    checkpoint = readers.open_checkpoint(path)
    expected = assert_same_with_tables(checkpoint, tables=len(checkpoint.tensors) - 1)
    assert any(p.severity == integrity.ERROR or p.code == "orphan-storage" for p in expected["problems"]), name


@pytest.mark.parametrize("truncated", [False, True], ids=["whole", "truncated"])
def test_safetensors_format_blobs_at_one_start_are_resolved_the_same_from_tables(tmp_path, truncated):
    save_safetensors_format(tmp_path / "st")
    if truncated:
        data = tmp_path / "st" / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:-20])
    checkpoint = readers.open_checkpoint(tmp_path / "st")
    expected = assert_same_with_tables(checkpoint, tables=3)
    assert bool(expected["problems"]) == truncated


def test_the_cli_prints_the_same_bytes_when_the_reader_gives_tables(tmp_path, cli, monkeypatch):
    path = copy_fixture(tmp_path)
    every_kind_at_once(path)
    commands = [("inspect",), ("inspect", "--json"), ("inspect", "--chunks", "--by-file"), ("validate",),
                ("validate", "--json")]
    seconds = re.compile(r'[0-9.]+ s$|"seconds": [0-9.e-]+')

    def run_all() -> list[str]:
        return [seconds.sub("", cli(*command, path).output) for command in commands]

    read, open_checkpoint = readers.read, readers.open_checkpoint

    def reading(form) -> None:
        monkeypatch.setattr(readers, "read", lambda *a, **k: (lambda d, c: (d, form(c)))(*read(*a, **k)))
        monkeypatch.setattr(readers, "open_checkpoint", lambda *a, **k: form(open_checkpoint(*a, **k)))

    reading(with_tuples)
    assert isinstance(next(iter(readers.open_checkpoint(path).tensors.values())).chunks, tuple)
    expected = run_all()
    reading(with_tables)
    assert isinstance(next(iter(readers.open_checkpoint(path).tensors.values())).chunks, ChunkTable)
    assert run_all() == expected


# --- synthetic checkpoints: hostile numbers and sharding the fast proof cannot cover -----------


def synthetic(tmp_path: Path, tensors: dict[str, tuple[tuple[int, ...], list[Chunk]]], files: dict[str, int],
              objects: Mapping[str, Blob | None] = MappingProxyType({}), dtype: str = "float32") -> Checkpoint:
    """A checkpoint of these tensors (shape, chunks) with data files of these sizes (sparse)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, size in files.items():
        with open(tmp_path / name, "wb") as handle:
            handle.truncate(size)
    entries = {fqn: Tensor(fqn, dtype, shape, tuple(sorted(chunks, key=lambda c: c.offsets)))
               for fqn, (shape, chunks) in sorted(tensors.items())}
    return Checkpoint(tmp_path, ".metadata", "1.0.0", entries,
                      {fqn: Object(fqn, blob) for fqn, blob in sorted(objects.items())})


def dim0_chunks(rows: int, columns: int, world: int, file_of=lambda rank: f"__{rank}_0.distcp", at=None) -> list[Chunk]:
    at = at if at is not None else {}
    chunks = []
    for rank, (offset, size) in enumerate(geometry.split_dim0(rows, world)):
        name = file_of(rank)
        length = size * columns * 4
        chunks.append(Chunk((offset, 0), (size, columns), Blob(name, at.get(name, 0), length)))
        at[name] = at.get(name, 0) + length
    return chunks


def test_hostile_numbers_give_the_same_problems_from_tables(tmp_path):
    files = {"__0_0.distcp": 4096, "__1_0.distcp": 64, 'odd%d "1".distcp': 48, "odd%s 2\\.distcp": 16}
    tensors = {
        "huge": ((10**18, 8), [Chunk((0, 0), (10**18, 8), Blob("__0_0.distcp", 0, 64))]),
        "negative size": ((4, 4), [Chunk((0, 0), (-2, -2), Blob("__0_0.distcp", 64, 16)),
                                   Chunk((2, 0), (2, 4), Blob("__0_0.distcp", 80, 32))]),
        "negative offset": ((4, 4), [Chunk((-1, 0), (4, 4), Blob("__0_0.distcp", -5, 64))]),
        "no storage": ((4, 4), [Chunk((0, 0), (2, 4), None), Chunk((2, 0), (2, 4), Blob("__1_0.distcp", 0, 32))]),
        "past the end": ((4, 4), [Chunk((0, 0), (4, 4), Blob("__1_0.distcp", 32, 64))]),
        "missing file": ((4,), [Chunk((0,), (4,), Blob("__9_0.distcp", 0, 16))]),
        "coinciding": ((4, 4), [Chunk((0, 0), (2, 4), Blob("__0_0.distcp", 200, 32)),
                                Chunk((2, 0), (2, 4), Blob("__0_0.distcp", 200, 32))]),
        "scalar": ((), [Chunk((), (), Blob("__0_0.distcp", 300, 4))]),
        "no chunks": ((3,), []),
        "empty tensor": ((0, 5), [Chunk((0, 0), (0, 5), Blob("__0_0.distcp", 400, 0))]),
        "odd file names": ((4, 2), [Chunk((0, 0), (2, 2), Blob('odd%d "1".distcp', 0, 16)),
                                    Chunk((2, 0), (2, 2), Blob("odd%s 2\\.distcp", 0, 16))]),
        "one odd file": ((4, 2), [Chunk((0, 0), (2, 2), Blob('odd%d "1".distcp', 16, 16)),
                                  Chunk((2, 0), (2, 2), Blob('odd%d "1".distcp', 32, 16))]),
    }
    objects = {"extra.step": Blob("__0_0.distcp", 210, 8), "extra.none": None, "extra.far": Blob("__1_0.distcp", 60, 99)}
    checkpoint = synthetic(tmp_path, tensors, files, objects)
    expected = assert_same_with_tables(checkpoint, tables=len(tensors))
    codes = {p.code for p in expected["problems"]}
    assert {"size-mismatch", "bad-range", "chunk-without-storage", "beyond-eof", "blob-overlap", "missing-file",
            "chunk-out-of-bounds", "gap", "object-without-storage"} <= codes


@pytest.mark.parametrize("seed", range(12))
def test_random_dim0_and_block_shardings_with_damage_give_the_same_results_from_tables(tmp_path, seed):
    rng = random.Random(seed)
    tensors, at = {}, {}
    for t in range(6):
        rows, columns, world = rng.randint(1, 40), rng.randint(1, 6), rng.randint(1, 9)
        if rng.random() < 0.4:  # 2-D blocks: the fast proof does not apply
            half = columns // 2 or 1
            chunks = []
            for offset, size in geometry.split_dim0(rows, world):
                for start, width in ((0, half), (half, columns - half)):
                    if width:
                        name = f"__{rng.randrange(3)}_0.distcp"
                        chunks.append(Chunk((offset, start), (size, width), Blob(name, at.get(name, 0), size * width * 4)))
                        at[name] = at.get(name, 0) + size * width * 4
        else:
            chunks = dim0_chunks(rows, columns, world, lambda rank: f"__{rank % 3}_0.distcp", at)
        damage = rng.choice(["none", "none", "shift", "drop", "duplicate", "grow", "same-bytes", "unstored"])
        pick = rng.randrange(len(chunks))
        chunk = chunks[pick]
        if damage == "shift":
            chunks[pick] = chunk._replace(offsets=(max(chunk.offsets[0] - 1, 0),) + chunk.offsets[1:])
        elif damage == "drop" and len(chunks) > 1:
            chunks.pop(pick)
        elif damage == "duplicate":
            chunks.append(chunk)
        elif damage == "grow":
            chunks[pick] = chunk._replace(sizes=(chunk.sizes[0] + 1,) + chunk.sizes[1:])
        elif damage == "same-bytes" and len(chunks) > 1:
            other = chunks[(pick + 1) % len(chunks)]
            chunks[pick] = chunk._replace(blob=other.blob)
        elif damage == "unstored":
            chunks[pick] = chunk._replace(blob=None)
        tensors[f"model.t{t}"] = ((rows, columns), chunks)
    files = {f"__{r}_0.distcp": at.get(f"__{r}_0.distcp", 0) - (8 if seed % 3 == 0 and r == 1 else 0) for r in range(3)}
    assert_same_with_tables(synthetic(tmp_path, tensors, files), tables=len(tensors))


def test_a_large_dim0_checkpoint_is_checked_from_columns_without_building_chunks(tmp_path, monkeypatch):
    at: dict[str, int] = {}
    tensors = {f"model.layers.{i}.weight": ((5600, 8), dim0_chunks(5600, 8, 700, at=at)) for i in range(4)}
    files = {f"__{r}_0.distcp": 4 * 8 * 8 * 4 for r in range(700)}
    checkpoint = with_tables(synthetic(tmp_path, tensors, files))

    def refuse(*args):
        raise AssertionError("a Chunk was built")

    monkeypatch.setattr(ChunkTable, "__iter__", refuse)
    monkeypatch.setattr(ChunkTable, "__getitem__", refuse)
    found = integrity.check(checkpoint)
    assert not found.problems and found.files == 700
    report = inspect_command.build_report(checkpoint)
    assert report.summary.chunks == 4 * 700 and str(report.tensors[0].sharding) == "dim0"
    document = io.StringIO()
    emit_json(inspect_document(report), document)
    assert len(json.loads(document.getvalue())["tensors"][0]["chunks"]) == 700


def test_inspect_chunk_infos_read_as_chunk_info_tuples(tmp_path):
    chunks = dim0_chunks(10, 3, 4)
    chunks[1] = chunks[1]._replace(blob=None)
    checkpoint = synthetic(tmp_path, {"model.w": ((10, 3), chunks)}, {f"__{r}_0.distcp": 64 for r in range(4)})
    plain = inspect_command.build_report(checkpoint).tensors[0].chunks
    tabled = inspect_command.build_report(with_tables(checkpoint)).tensors[0].chunks
    assert isinstance(tabled, inspect_command.ChunkInfos)
    assert tuple(tabled) == plain and tabled[1] == plain[1] and tabled[1:3] == plain[1:3] and len(tabled) == 4
    assert tabled[1].file is None and tabled[0].nbytes == 3 * 3 * 4
    rows = inspect_document(inspect_command.build_report(with_tables(checkpoint)))["tensors"][0]["chunks"]
    assert list(rows) == [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "offset": c.offset,
                           "length": c.length, "bytes": c.nbytes} for c in plain]
    assert json.dumps(rows) == json.dumps(list(rows))


# --- the fast geometry proof against the per-box functions ---------------------------------------


def random_boxes(rng: random.Random) -> tuple[tuple[int, ...], list[geometry.Box]]:
    """A shape and boxes: a dim-0 split (sometimes with empty shards), blocks, or either damaged."""
    ndim = rng.randint(1, 3)
    shape = tuple(rng.randint(0 if d else 1, 9) for d in range(ndim))
    kind = rng.choice(["dim0", "dim0", "blocks"])
    boxes: list[geometry.Box] = []
    if kind == "dim0":
        for offset, size in geometry.split_dim0(shape[0], rng.randint(1, 12)):
            boxes.append(((offset,) + (0,) * (ndim - 1), (size,) + shape[1:]))
    else:
        cut = rng.randint(0, shape[-1])
        for offset, size in geometry.split_dim0(shape[0], rng.randint(1, 4)):
            for start, width in ((0, cut), (cut, shape[-1] - cut)):
                if ndim == 1:
                    boxes.append(((offset,), (size,)))
                    break
                boxes.append(((offset,) + (0,) * (ndim - 2) + (start,), (size,) + shape[1:-1] + (width,)))
    damage = rng.choice(["none", "none", "drop", "shift", "shrink", "duplicate"])
    if boxes and damage != "none":
        i = rng.randrange(len(boxes))
        offsets, sizes = boxes[i]
        if damage == "drop":
            boxes.pop(i)
        elif damage == "shift" and offsets[0] > 0:
            boxes[i] = ((offsets[0] - 1,) + offsets[1:], sizes)
        elif damage == "shrink" and sizes[0] > 0:
            boxes[i] = (offsets, (sizes[0] - 1,) + sizes[1:])
        elif damage == "duplicate":
            boxes.insert(i, boxes[i])
    return shape, sorted(boxes)


def columns(boxes: list[geometry.Box], ndim: int):
    import numpy as np

    offsets = np.array([o for o, _ in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    sizes = np.array([s for _, s in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    return offsets, sizes


def test_the_dim0_proof_agrees_with_find_overlaps_and_coverage_on_random_tilings():
    rng = random.Random(21)
    proven = 0
    for _ in range(3000):
        shape, boxes = random_boxes(rng)
        offsets, sizes = columns(boxes, len(shape))
        inside = geometry.columns_in_bounds(offsets, sizes, shape)
        assert inside.tolist() == [geometry.in_bounds(o, s, shape) for o, s in boxes]
        kept = [box for box, ok in zip(boxes, inside.tolist()) if ok]
        found = geometry.dim0_tiling(offsets[inside], sizes[inside], shape)
        assert geometry.classify_columns(sizes, shape) == geometry.classify(boxes, shape)
        if found is None:
            continue
        proven += 1
        assert geometry.find_overlaps(kept) == []
        assert found == geometry.coverage(kept, shape)
    assert proven > 1500


def test_every_fsdp_split_is_proven_whole_without_comparing_boxes():
    for rows in range(0, 30):
        for world in range(1, 40):
            boxes = [((offset, 0), (size, 3)) for offset, size in geometry.split_dim0(rows, world)]
            found = geometry.dim0_tiling(*columns(boxes, 2), (rows, 3))
            assert found is not None and found.complete and found == geometry.coverage(boxes, (rows, 3))


def test_a_gap_names_the_missing_rows_as_coverage_does():
    boxes = [((0, 0), (2, 4)), ((3, 0), (0, 4)), ((5, 0), (2, 4))]
    found = geometry.dim0_tiling(*columns(boxes, 2), (9, 4))
    assert found == geometry.coverage(boxes, (9, 4))
    assert found.missing_rows == ((2, 5), (7, 9))


def test_the_proof_declines_what_it_cannot_decide():
    blocks = [((0, 0), (4, 2)), ((0, 2), (4, 2))]
    assert geometry.dim0_tiling(*columns(blocks, 2), (4, 4)) is None  # block sharding: boxes must be compared
    overlapping = [((0, 0), (3, 4)), ((2, 0), (2, 4))]
    assert geometry.dim0_tiling(*columns(overlapping, 2), (4, 4)) is None
    assert geometry.column_volumes(columns([((0, 0), (-1, 4))], 2)[1]) is None
    assert geometry.column_volumes(columns([((0, 0), (1 << 40, 1 << 40))], 2)[1]) is None
    assert geometry.columns_in_bounds(*columns([((0,), (1,))], 1), (1, 1)) is None  # rank differs


def test_the_stage_benchmark_builds_what_reading_its_metadata_gives(tmp_path):
    """benchmarks/metadata_scale.py --stages times tables built from columns: they must be what
    with_tables(read_checkpoint(...)) makes of the same synthetic checkpoint's .metadata."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("metadata_scale", FIXTURES.parent / "benchmarks" / "metadata_scale.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    benchmark.build(tmp_path / "read", 7, 7 * 40, 16)
    built, chunks = benchmark.build_tables(tmp_path / "built", 7, 7 * 40, 16)
    read = with_tables(readers.open_checkpoint(tmp_path / "read"))
    assert chunks == 7 * 40 and list(built.tensors) == list(read.tensors) and built.nesting == read.nesting
    for fqn, tensor in read.tensors.items():
        assert (built.tensors[fqn].dtype, built.tensors[fqn].shape) == (tensor.dtype, tensor.shape)
        assert built.tensors[fqn].chunks == tensor.chunks
    assert {p.name: p.stat().st_size for p in (tmp_path / "built").iterdir()} == \
        {p.name: p.stat().st_size for p in (tmp_path / "read").iterdir() if p.name != ".metadata"}
    assert outputs(built)["json"] == outputs(read)["json"].replace(str(tmp_path / "read"), str(tmp_path / "built"))


def _random_chunks(rng: random.Random, shape: tuple[int, ...]) -> list[Chunk]:
    """Dim-0 slabs of `shape` (some empty, some repeated as HSDP replicas save them), or boxes
    split along another dim too, with blobs."""
    chunks = []
    rows = sorted(rng.sample(range(1, shape[0]), rng.randrange(0, min(6, shape[0] - 1)))) if shape[0] > 1 else []
    cuts = [0, *rows, shape[0]]
    split = len(shape) > 1 and shape[1] > 1 and rng.random() < 0.3
    for start, end in zip(cuts, cuts[1:]):
        for _copy in range(rng.choice((1, 1, 2))):
            if split:
                half = shape[1] // 2
                chunks.append(Chunk((start, 0, *[0] * (len(shape) - 2)), (end - start, half, *shape[2:]), None))
                chunks.append(Chunk((start, half, *[0] * (len(shape) - 2)), (end - start, shape[1] - half, *shape[2:]), None))
            else:
                chunks.append(Chunk((start, *[0] * (len(shape) - 1)), (end - start, *shape[1:]), None))
    if rng.random() < 0.3:
        chunks.append(Chunk((shape[0], *[0] * (len(shape) - 1)), (0, *shape[1:]), None))  # an empty shard past the end
    return [Chunk(c.offsets, c.sizes, Blob(f"__{i % 3}_0.distcp", 100 * i, 10, ())) for i, c in enumerate(chunks)]


@pytest.mark.parametrize("seed", range(3))
def test_planning_from_columns_gives_what_planning_each_chunk_gives(seed):
    """unique_chunks and the output runs of a consolidate plan, computed from a table's
    columns, equal the per-chunk computation on the same chunks as tuples."""
    from ckpttool.plan import unique_chunks
    from ckpttool.plan.consolidate import _chunk_runs

    rng = random.Random(seed)
    for trial in range(200):
        shape = tuple(rng.randrange(1, 9) for _ in range(rng.randrange(1, 4)))
        chunks = _random_chunks(rng, shape)
        table = ChunkTable.from_chunks(chunks, len(shape))
        as_tuples = Tensor("t", "float32", shape, tuple(table))
        as_table = Tensor("t", "float32", shape, table)
        assert unique_chunks(as_table) == unique_chunks(as_tuples), trial
        indices = unique_chunks(as_tuples)
        for itemsize in (1, 4):
            assert _chunk_runs(as_table, indices, itemsize) == _chunk_runs(as_tuples, indices, itemsize), trial


def _brute_disjoint(ranges: list[tuple[int, int, int]]) -> bool:
    """Whether every range (file, start, end) is non-empty and shares no byte with another."""
    return all(start < end for _, start, end in ranges) and not any(
        a[0] == b[0] and a[1] < b[2] and b[1] < a[2] for i, a in enumerate(ranges) for b in ranges[i + 1:])


@pytest.mark.parametrize("seed", range(40))
def test_the_disjoint_proof_agrees_with_comparing_every_pair_of_claims(seed):
    rng = random.Random(seed)
    sizes = {f"__{r}_0.distcp": rng.randint(0, 60) for r in range(rng.randint(1, 4))}
    names = list(sizes)
    claims = integrity._Claims(integrity._FileIndex())
    ranges = []
    for _ in range(rng.randint(0, 12)):
        name = rng.choice(names)
        if not sizes[name]:
            continue
        start = rng.randrange(sizes[name])
        end = rng.randint(start, min(sizes[name], start + rng.choice((1, 3, 9, 30))))
        claims.add(name, start, end, f"claim {len(ranges)}", None)
        ranges.append((names.index(name), start, end))
    assert claims.disjoint(sizes) == _brute_disjoint(ranges)


def test_a_whole_checkpoint_is_proven_without_sorting_its_claims(tmp_path, monkeypatch):
    at: dict[str, int] = {}
    tensors = {f"model.layers.{i}.weight": ((600, 8), dim0_chunks(600, 8, 60, at=at)) for i in range(3)}
    checkpoint = with_tables(synthetic(tmp_path, tensors, {f"__{r}_0.distcp": 3 * 10 * 8 * 4 for r in range(60)}))

    def refuse(*args):
        raise AssertionError("a table was checked on its own, or the claims were sorted")

    monkeypatch.setattr(integrity._Claims, "columns", refuse)
    monkeypatch.setattr(integrity, "_check_table_blobs", refuse)
    monkeypatch.setattr(integrity, "_check_table_geometry", refuse)
    monkeypatch.setattr(integrity, "SOUND_BATCH_ROWS", 70)  # tables checked in batches of two
    assert not integrity.check(checkpoint).problems


@pytest.mark.parametrize("seed", range(6))
def test_tables_checked_in_batches_report_what_each_table_checked_alone_reports(tmp_path, monkeypatch, seed):
    path = copy_fixture(tmp_path)
    list(DAMAGE.values())[seed % len(DAMAGE)](path)
    checkpoint = with_tables(readers.open_checkpoint(path))
    expected = integrity.check(with_tuples(checkpoint)).problems
    for rows in (1, 5, 1 << 19):
        monkeypatch.setattr(integrity, "SOUND_BATCH_ROWS", rows)
        assert integrity.check(checkpoint).problems == expected


def test_file_bytes_summed_from_table_columns_are_the_sums_of_each_chunk(monkeypatch):
    """The C reader's `file_sums` (every table's rows added where they lie) gives what adding
    chunk by chunk gives, and so does inspect without it (not built)."""
    import sys

    checkpoint = with_tables(readers.open_checkpoint(FIXTURES / "fsdp2_world2_adamw"))
    expected = inspect_command.build_report(with_tuples(checkpoint)).files
    assert sum(len(f.tensor_bytes) for f in expected) > 2
    assert inspect_command.build_report(checkpoint).files == expected
    assert inspect_command.build_report(with_shared_files(checkpoint)).files == expected
    monkeypatch.setitem(sys.modules, "ckpttool.readers._dcpscan", None)  # not built: `import` fails
    assert inspect_command.build_report(checkpoint).files == expected


def test_file_bytes_past_int64_are_summed_exactly(tmp_path):
    """Blob lengths whose sum in one file passes 2**63 - 1 (a hostile `.metadata`): the C sums
    give up and inspect adds them as Python ints, as it does for tuples."""
    chunks = [Chunk((0,), (4,), Blob("__0_0.distcp", 0, 2**62)), Chunk((4,), (4,), Blob("__0_0.distcp", 16, 2**62)),
              Chunk((8,), (4,), Blob("__1_0.distcp", 0, 16)), Chunk((12,), (4,), None)]
    checkpoint = synthetic(tmp_path, {"model.w": ((16,), chunks)}, {"__0_0.distcp": 64, "__1_0.distcp": 64})
    files = inspect_command.build_report(with_tables(checkpoint)).files
    assert [(f.file, f.referenced_bytes, f.tensor_bytes) for f in files] == [
        ("__0_0.distcp", 2**63, {"model": 32}), ("__1_0.distcp", 16, {"model": 16})]
    assert files == inspect_command.build_report(checkpoint).files


def test_the_c_writers_read_columns_in_any_strides_and_refuse_other_types():
    """`json_rows` and `file_sums` read a table's columns where they are (views of the scanned
    columns: strided, int32 file ids) as they read contiguous copies; other types are refused."""
    np = pytest.importorskip("numpy")
    _dcpscan = import_native("ckpttool.readers._dcpscan")
    coords = np.arange(-40, 40, dtype=np.int64).reshape(20, 4) * 7919
    offsets, sizes = coords[:, :2], coords[::-1, 2:]  # interleaved rows, one of them read backwards
    file = np.array([r % 3 - 1 for r in range(20)], dtype=np.int32)
    offset, length, nbytes = coords[:, 0], coords[:, 3], coords[::-1, 1]
    files = tuple(json.dumps(f"__{r}_0.distcp").encode() for r in range(2))
    strided = _dcpscan.json_rows(20, 2, offsets, sizes, file, offset, length, nbytes, files, True)
    copies = [np.ascontiguousarray(c, dtype=np.int64) for c in (offsets, sizes, file, offset, length, nbytes)]
    assert strided == _dcpscan.json_rows(20, 2, *copies, files, True) == _dcpscan.json_rows(20, 2, *copies, files)[:-2]
    rows = json.loads(b"[" + strided + b"]")
    assert [r["file"] for r in rows[:3]] == [None, "__0_0.distcp", "__1_0.distcp"] and rows[5]["sizes"] == sizes[5].tolist()
    with pytest.raises(ValueError):
        _dcpscan.json_rows(20, 2, offsets.astype(np.float64), sizes, file, offset, length, nbytes, files)
    with pytest.raises(ValueError):
        _dcpscan.json_rows(20, 2, offsets, sizes, file, offset.astype(np.int32), length, nbytes, files)
    totals = [np.zeros(6, dtype=np.int64) for _ in range(3)]
    assert _dcpscan.file_sums(20, file, length, nbytes, np.array([0, 3]), 1, *totals)
    for bin_number, name in ((1, 0), (4, 1)):
        mine = file == name
        assert [t[bin_number] for t in totals] == [mine.sum(), length[mine].sum(), nbytes[mine].sum()]
    assert sum(int(t.sum()) for t in totals) == sum(int(t[1] + t[4]) for t in totals)
    with pytest.raises(IndexError):
        _dcpscan.file_sums(20, file, length, nbytes, np.array([0, 5]), 1, *totals)


def test_json_written_as_bytes_under_a_text_stream_is_the_text_written_in_order():
    """`emit_json` writes a table's chunks as bytes to a text stream's buffer: after what was
    written as text before, before what is written after, the same bytes as the text path."""
    checkpoint = with_tables(readers.open_checkpoint(FIXTURES / "fsdp2_world3_uneven"))
    document = inspect_document(inspect_command.build_report(checkpoint))
    as_text = io.StringIO()
    emit_json(document, as_text)
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="utf-8", newline="\n")
    stream.write("before\n")
    emit_json(document, stream)
    stream.write("after\n")
    stream.flush()
    assert raw.getvalue().decode() == "before\n" + as_text.getvalue() + "after\n"
    plain = {**document, "tensors": [{**t, "chunks": list(t["chunks"])} for t in document["tensors"]]}
    assert as_text.getvalue() == json.dumps(plain) + "\n"
    assert any(type(t["chunks"]).__name__ == "ChunkRows" and len(t["chunks"]) > 1 for t in document["tensors"])


def test_chunk_json_from_the_c_writer_is_json_dumps_of_the_rows_in_any_block_size(tmp_path, monkeypatch):
    """`ChunkRows.json_text` (the C reader's `json_rows`, a block of rows at a time) writes what
    `json.dumps` writes for the rows' dicts, and so does its fallback without the C module:
    negative, 2**63-1 and -2**63 values, an unstored chunk, names JSON escapes, a 0-d tensor."""
    import sys

    from ckpttool.render import chunk_tables

    chunks = dim0_chunks(13, 3, 5, file_of=lambda rank: f'__{rank}_0 "\\ \u00e9.distcp')
    chunks[1] = chunks[1]._replace(blob=None)
    chunks[2] = chunks[2]._replace(offsets=(-7, 2**40))
    chunks[3] = chunks[3]._replace(blob=Blob(chunks[3].blob.file, -2**63, 2**63 - 1))
    checkpoint = synthetic(tmp_path, {"model.w": ((13, 3), chunks), "model.step": ((), [Chunk((), (), Blob("__0_0.distcp", 0, 8))])},
                           {f'__{r}_0 "\\ \u00e9.distcp': 4096 for r in range(5)} | {"__0_0.distcp": 8})
    report = inspect_command.build_report(with_tables(checkpoint))
    rows = [tensor["chunks"] for tensor in inspect_document(report)["tensors"]]
    assert all(isinstance(r, chunk_tables.ChunkRows) for r in rows)
    expected = [json.dumps(list(r)) for r in rows]
    assert [r.json_text() for r in rows] == expected
    monkeypatch.setattr(chunk_tables, "ROWS_PER_BLOCK", 2)
    assert [r.json_text({}) for r in rows] == expected
    monkeypatch.setitem(sys.modules, "ckpttool.readers._dcpscan", None)  # not built: `import` fails
    assert [r.json_text() for r in rows] == expected
