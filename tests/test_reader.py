"""The safe reader: chunk bytes equal torch's, every blob format, old metadata, no code runs."""

from __future__ import annotations

import builtins
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, flatten, tensor_bytes

from ckpttool.dcp.blobs import DataFiles, locate, read_chunk
from ckpttool.readers.dcp import read_checkpoint
from ckpttool.core.errors import CorruptMetadata, NotACheckpoint, UnsafeMetadata, UnsupportedFormat


def chunk_of(full, chunk):
    if not chunk.sizes:
        return full
    return full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]


def assert_chunks_match(path, expected: dict) -> int:
    checkpoint = read_checkpoint(path)
    count = 0
    with DataFiles(path) as files:
        for fqn, tensor in checkpoint.tensors.items():
            for chunk in tensor.chunks:
                assert read_chunk(files, tensor, chunk) == tensor_bytes(chunk_of(expected[fqn], chunk)), fqn
                count += 1
    return count


def test_every_chunk_reads_as_torch_loads_it(fixture_checkpoint, reference):
    assert assert_chunks_match(fixture_checkpoint, reference(fixture_checkpoint)) > 0


def test_raw_bytes_sit_uncompressed_inside_the_torch_save_record():
    checkpoint = read_checkpoint(FIXTURES / "fsdp2_world2")
    tensor = checkpoint.tensors["model.embed.weight"]
    with DataFiles(checkpoint.path) as files:
        raw = locate(files, tensor, tensor.chunks[0])
    blob = tensor.chunks[0].blob
    assert raw.file == blob.file and blob.offset < raw.offset < blob.offset + blob.length
    assert raw.length == tensor.chunks[0].numel * 4 and (raw.offset - blob.offset) % 64 == 0


def test_reading_one_tensor_opens_only_the_files_of_its_chunks(monkeypatch):
    checkpoint = read_checkpoint(FIXTURES / "fsdp2_world2_adamw")
    tensor = checkpoint.tensors["model.position_ids"]  # replicated: one chunk, one file
    opened = []
    real_open = DataFiles.fd

    def counting_fd(self, relative):
        opened.append(relative)
        return real_open(self, relative)

    monkeypatch.setattr(DataFiles, "fd", counting_fd)
    with DataFiles(checkpoint.path) as files:
        read_chunk(files, tensor, tensor.chunks[0])
    assert set(opened) == {tensor.chunks[0].blob.file}


def save_single_process(path, state, **writer_options):
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path, **writer_options)
    dcp.save(state, storage_writer=writer, no_dist=True)


def sample_state():
    import torch

    generator = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(6, 4, generator=generator),
            "half": torch.randn(5, generator=generator).to(torch.bfloat16),
            "ids": torch.arange(7),
            "flag": torch.tensor(True),
        },
        "step": 3,
    }


def test_safetensors_serialization_format_is_read(tmp_path):
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    state = sample_state()
    save_single_process(tmp_path / "st", state, serialization_format=SerializationFormat.SAFETENSORS)
    assert assert_chunks_match(tmp_path / "st", flatten(state)) == 4


def test_zstd_compressed_blobs_are_read_when_zstandard_is_installed(tmp_path, monkeypatch):
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    state = sample_state()
    save_single_process(tmp_path / "z", state, _extensions=[ZStandard()])
    checkpoint = read_checkpoint(tmp_path / "z")
    assert all(c.blob.transforms for t in checkpoint.tensors.values() for c in t.chunks)
    assert assert_chunks_match(tmp_path / "z", flatten(state)) == 4

    real_import = builtins.__import__

    def no_zstandard(name, *args, **kwargs):
        if name == "zstandard":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_zstandard)
    tensor = checkpoint.tensors["model.w"]
    with DataFiles(checkpoint.path) as files, pytest.raises(UnsupportedFormat, match="zstandard"):
        read_chunk(files, tensor, tensor.chunks[0])


def test_metadata_from_older_torch_without_version_or_storage_meta(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    path = tmp_path / "old"
    shutil.copytree(FIXTURES / "fsdp2_world2", path)
    metadata = FileSystemReader(path).read_metadata()
    del metadata.version, metadata.storage_meta, metadata.planner_data  # fields added after 2.0
    with open(path / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    checkpoint = read_checkpoint(path)
    assert checkpoint.version is None and len(checkpoint.tensors) == 16


def test_per_rank_metadata_file_is_found(tmp_path):
    path = tmp_path / "ranked"
    shutil.copytree(FIXTURES / "fsdp2_world2", path)
    (path / ".metadata").rename(path / "__0.metadata")
    checkpoint = read_checkpoint(path)
    assert checkpoint.metadata_file == "__0.metadata" and len(checkpoint.tensors) == 16


def test_unsafe_globals_are_refused_before_anything_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil"
    path.mkdir()

    class Exploit:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    (path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": Exploit()}))
    with pytest.raises(UnsafeMetadata, match="builtins.exec"):
        read_checkpoint(path)
    assert not marker.exists()


def test_reader_never_imports_torch():
    import subprocess

    code = "import sys; from ckpttool.readers.dcp import read_checkpoint as r; r(sys.argv[1]); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code, str(FIXTURES / "fsdp2_world2")], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_not_a_checkpoint_errors_name_the_path(tmp_path):
    with pytest.raises(NotACheckpoint, match="no .metadata"):
        read_checkpoint(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(CorruptMetadata, match="empty"):
        read_checkpoint(tmp_path)


def test_a_run_directory_of_checkpoints_is_refused_with_the_ones_inside_and_the_latest(tmp_path):
    for step in ("step-2", "step-10", "step-9"):
        shutil.copytree(FIXTURES / "fsdp2_world2", tmp_path / step)
    (tmp_path / "latest").write_text("step-9\n")
    with pytest.raises(NotACheckpoint) as refused:
        read_checkpoint(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path}: a directory of checkpoints (step-2, step-9, step-10; latest: step-9), not a "
        f"checkpoint itself: pass one of them, e.g. {tmp_path / 'step-9'}"
    )


def test_metadata_pickled_by_python_3_11_early_releases_reads_the_same(tmp_path):
    """CPython 3.11.0-3.11.4 (Debian bookworm ships 3.11.2) pickle enum members by name, as
    `getattr(_MEM_FORMAT_ENCODING, 'TORCH_CONTIGUOUS_FORMAT')`; torch's `.metadata` then holds a
    `builtins.getattr` call, which the allowlist admits for that enum's members only."""
    import enum

    from torch.distributed.checkpoint import FileSystemReader

    class EarlyPython311Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    # Megatron's torch_dist `.metadata` holds its SavePlans too: WriteItemType members by name
    megatron = Path(__file__).parent.parent / "fixtures" / "frameworks" / "megatron" / "checkpoints" / "iter_0000002"
    for number, source in enumerate((FIXTURES / "fsdp2_world2_adamw", megatron)):
        copy = tmp_path / f"ckpt{number}"
        shutil.copytree(source, copy)
        with open(copy / ".metadata", "wb") as handle:
            EarlyPython311Pickler(handle).dump(FileSystemReader(source).read_metadata())
        assert b"getattr" in (copy / ".metadata").read_bytes()
        expected, got = read_checkpoint(source), read_checkpoint(copy)
        assert got.tensors == expected.tensors and got.objects == expected.objects
    assert b"WriteItemType" in (tmp_path / "ckpt1" / ".metadata").read_bytes()


def test_getattr_in_metadata_reaches_nothing_but_the_memory_format_enum(tmp_path):
    (tmp_path / "ckpt").mkdir()
    for target in ((pickle.GLOBAL + b"os\nsystem\n"), (pickle.GLOBAL + b"torch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"),
                   (pickle.GLOBAL + b"torch.distributed.checkpoint.planner\nWriteItemType\n")):
        for name in (b"__class__", b"mro", b"TORCH_NO_SUCH_FORMAT"):
            data = (b"\x80\x02" + pickle.GLOBAL + b"builtins\ngetattr\n" + target + pickle.SHORT_BINSTRING
                    + bytes([len(name)]) + name + pickle.TUPLE2 + pickle.REDUCE + pickle.STOP)
            (tmp_path / "ckpt" / ".metadata").write_bytes(data)
            with pytest.raises((UnsafeMetadata, CorruptMetadata)):
                read_checkpoint(tmp_path / "ckpt")
