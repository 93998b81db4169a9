"""`ckpttool validate`: exit 0 on every real checkpoint, 1 with a named fault on each corruption.

Corrupted variants are made from the bundled fixtures in tmp dirs; metadata edits go through
torch's own reader and pickle.dump, the way a buggy or hostile writer would produce them.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURE_NAMES, FIXTURES

from ckpttool.readers.dcp import read_checkpoint

WORLD2 = FIXTURES / "fsdp2_world2_adamw"
EMBED = "model.embed.weight"


def copy_fixture(tmp_path: Path, name: str = "fsdp2_world2_adamw") -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    return target


def rewrite_metadata(checkpoint: Path, edit) -> None:
    """Load `.metadata` with torch's reader (our own fixture), edit it, write it back."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(checkpoint).read_metadata()
    edit(metadata)
    with open(checkpoint / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


def storage_key(metadata, fqn: str, position: int = 0):
    """Return the storage_data key of chunk `position` of `fqn`."""
    chunk = metadata.state_dict_metadata[fqn].chunks[position]
    return next(k for k in metadata.storage_data if k.fqn == fqn and tuple(k.offset) == tuple(chunk.offsets))


def validate_json(cli, path: Path, *flags: str) -> tuple[int, dict]:
    result = cli("validate", path, "--json", *flags)
    return result.exit_code, json.loads(result.stdout)


def codes(document: dict) -> set[str]:
    return {p["code"] for p in document["problems"] if p["severity"] == "error"}


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_fixture_is_valid_including_deep(cli, name):
    status, document = validate_json(cli, FIXTURES / name, "--deep")
    assert status == 0, document["problems"]
    assert document["valid"] and document["errors"] == 0 and document["warnings"] == 0
    assert document["checked"]["bytes_read"] > 0


# --- corruptions: each builds a variant and names the code validate must report --------------


def truncated_data_file(path: Path) -> None:
    data = path / "__1_0.distcp"
    os.truncate(data, data.stat().st_size // 2)


def missing_data_file(path: Path) -> None:
    (path / "__1_0.distcp").unlink()


def truncated_metadata(path: Path) -> None:
    metadata = path / ".metadata"
    os.truncate(metadata, metadata.stat().st_size // 2)


def garbage_metadata(path: Path) -> None:
    (path / ".metadata").write_bytes(os.urandom(4096))


def offset_past_eof(path: Path) -> None:
    def edit(metadata):
        key = storage_key(metadata, EMBED)
        metadata.storage_data[key].offset = (path / metadata.storage_data[key].relative_path).stat().st_size + 100

    rewrite_metadata(path, edit)


def overlapping_chunks(path: Path) -> None:
    def edit(metadata):
        import torch

        key = storage_key(metadata, EMBED, 1)
        info = metadata.storage_data.pop(key)
        chunk = metadata.state_dict_metadata[EMBED].chunks[1]
        chunk.offsets = torch.Size([chunk.offsets[0] - 2, 0])  # rows now overlap chunk 0
        from torch.distributed.checkpoint.metadata import MetadataIndex

        metadata.storage_data[MetadataIndex(EMBED, chunk.offsets)] = info

    rewrite_metadata(path, edit)


def coverage_gap(path: Path) -> None:
    def edit(metadata):
        entry = metadata.state_dict_metadata[EMBED]
        metadata.storage_data.pop(storage_key(metadata, EMBED, 1))
        entry.chunks = entry.chunks[:1]

    rewrite_metadata(path, edit)


def path_traversal(path: Path) -> None:
    (path.parent / "outside.distcp").write_bytes(b"x" * 10)

    def edit(metadata):
        metadata.storage_data[storage_key(metadata, EMBED)].relative_path = "../outside.distcp"

    rewrite_metadata(path, edit)


def absurd_chunk(path: Path) -> None:
    def edit(metadata):
        import torch

        entry = metadata.state_dict_metadata[EMBED]
        entry.size = torch.Size([10**12, 8])
        entry.chunks[-1].sizes = torch.Size([10**12 - entry.chunks[-1].offsets[0], 8])

    rewrite_metadata(path, edit)


def unknown_dtype(path: Path) -> None:
    metadata = path / ".metadata"
    raw = metadata.read_bytes()
    assert b"float32" in raw
    metadata.write_bytes(raw.replace(b"float32", b"float99"))


def empty_directory(path: Path) -> None:
    shutil.rmtree(path)
    path.mkdir()


def flipped_data_byte(path: Path) -> None:
    from ckpttool.dcp.blobs import DataFiles, locate
    from ckpttool.readers.dcp import read_checkpoint

    checkpoint = read_checkpoint(path)
    tensor = checkpoint.tensors[EMBED]
    with DataFiles(path) as files:
        raw = locate(files, tensor, tensor.chunks[0])
    with open(path / raw.file, "r+b") as handle:
        handle.seek(raw.offset + 3)
        byte = handle.read(1)
        handle.seek(raw.offset + 3)
        handle.write(bytes([byte[0] ^ 0x40]))


def chunk_without_storage(path: Path) -> None:
    rewrite_metadata(path, lambda metadata: metadata.storage_data.pop(storage_key(metadata, EMBED, 1)))


CORRUPTIONS = {
    "truncated data file": (truncated_data_file, "beyond-eof", False),
    "missing data file": (missing_data_file, "missing-file", False),
    "truncated metadata": (truncated_metadata, "metadata-unreadable", False),
    "garbage metadata": (garbage_metadata, "metadata-unreadable", False),
    "offset past EOF": (offset_past_eof, "beyond-eof", False),
    "overlapping chunks": (overlapping_chunks, "overlap", False),
    "coverage gap": (coverage_gap, "gap", False),
    "../ path": (path_traversal, "path-traversal", False),
    "10**12-element chunk": (absurd_chunk, "size-mismatch", False),
    "unknown dtype": (unknown_dtype, "unknown-dtype", False),
    "empty directory": (empty_directory, "no-metadata", False),
    "chunk without storage entry": (chunk_without_storage, "chunk-without-storage", False),
    "flipped data byte (deep only)": (flipped_data_byte, "checksum", True),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_validate_reports_each_corruption_by_name(cli, tmp_path, name):
    corrupt, code, deep_only = CORRUPTIONS[name]
    path = copy_fixture(tmp_path)
    corrupt(path)
    status, document = validate_json(cli, path, "--deep")
    assert status == 1
    assert code in codes(document), document["problems"]
    if deep_only:
        shallow_status, _ = validate_json(cli, path)
        assert shallow_status == 0
    text = cli("validate", path, *(("--deep",) if deep_only else ()))
    assert text.exit_code == 1
    assert "Traceback" not in text.output and f"[{code}]" in text.output


def test_malicious_metadata_pickle_is_refused_and_never_executed(cli, tmp_path):
    path = copy_fixture(tmp_path)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    for flags in ((), ("--deep",)):
        status, document = validate_json(cli, path, *flags)
        assert status == 1 and "metadata-unsafe" in codes(document)
        assert "os" in document["problems"][0]["message"]
    result = cli("inspect", path)
    assert result.exit_code == 1 and "refuses to load" in result.stderr
    assert not marker.exists()


def test_collects_all_problems_not_just_the_first(cli, tmp_path):
    path = copy_fixture(tmp_path)
    coverage_gap(path)
    truncated_data_file(path)
    (path / "stray.distcp").write_bytes(b"left over")
    status, document = validate_json(cli, path)
    assert status == 1
    assert {"gap", "beyond-eof"} <= codes(document)
    assert any(p["code"] == "unreferenced-file" and p["severity"] == "warning" for p in document["problems"])
    messages = " ".join(p["message"] for p in document["problems"])
    assert EMBED in messages and "__1_0.distcp" in messages


def test_missing_path_is_a_usage_error(cli, tmp_path):
    result = cli("validate", tmp_path / "nope")
    assert result.exit_code == 2


def test_deep_reports_nan_and_inf_as_information(cli, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.tensor([1.0, float("nan"), float("inf"), -float("inf")]), "ok": torch.ones(3)}}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    status, document = validate_json(cli, tmp_path / "ckpt", "--deep")
    assert status == 0
    assert document["numerics"] == [{"fqn": "model.w", "nan": 1, "inf": 2}]


def test_deep_counts_nan_in_float8_and_bf16_blocks_larger_than_the_read_block(cli, tmp_path, monkeypatch):
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool.commands import validate as validate_module

    monkeypatch.setattr(validate_module, "DEEP_BLOCK", 64)  # many blocks per chunk, a short last one
    fp8 = torch.zeros(100, dtype=torch.float8_e4m3fn)  # e4m3fn has NaN but no infinity
    fp8.view(torch.uint8)[[3, 97]] = 0x7F
    bf16 = torch.ones(301, dtype=torch.bfloat16)
    bf16[[0, 150]] = float("inf")
    bf16[300] = float("nan")
    dcp.save({"model": {"fp8": fp8, "bf16": bf16}}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    status, document = validate_json(cli, tmp_path / "ckpt", "--deep")
    assert status == 0
    assert document["numerics"] == [{"fqn": "model.bf16", "nan": 1, "inf": 2}, {"fqn": "model.fp8", "nan": 2, "inf": 0}]


def save_safetensors_format(path: Path) -> dict:
    """A checkpoint torch writes with serialization_format=SAFETENSORS: python objects first,
    then one safetensors blob whose tensors the metadata all records at the blob's start."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(7, 5), "b": torch.randn(5).to(torch.bfloat16), "i": torch.arange(4)},
             "extra": {"step": 3, "note": "safetensors"}}
    dcp.save(state, storage_writer=FileSystemWriter(path, serialization_format=SerializationFormat.SAFETENSORS), no_dist=True)
    return state


def test_safetensors_serialization_format_is_valid_although_the_metadata_ranges_coincide(cli, tmp_path):
    save_safetensors_format(tmp_path / "st")
    starts = {c.blob.offset for t in read_checkpoint(tmp_path / "st").tensors.values() for c in t.chunks}
    assert len(starts) == 1  # every tensor "at" the blob's start: the header says where
    for flags in ((), ("--deep",)):
        status, document = validate_json(cli, tmp_path / "st", *flags)
        assert status == 0, document["problems"]
        assert document["errors"] == 0


def test_safetensors_format_with_a_truncated_data_section_is_invalid(cli, tmp_path):
    save_safetensors_format(tmp_path / "st")
    data = tmp_path / "st" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-20])
    status, document = validate_json(cli, tmp_path / "st")
    assert status == 1
    assert "beyond-eof" in codes(document), document["problems"]


def test_deep_validation_of_torch_save_checkpoints_never_imports_torch(tmp_path):
    script = ("import sys\nfrom ckpttool.commands.validate import validate\n"
              "for path in sys.argv[1:]:\n"
              "    report = validate(path, deep=True)\n"
              "    assert report.valid and report.bytes_read > 0, [p.message for p in report.problems]\n"
              "print('torch' in sys.modules)")
    paths = [str(FIXTURES / name) for name in FIXTURE_NAMES]
    out = subprocess.run([sys.executable, "-c", script, *paths], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("fqn, old, new", [("extra.note", b"fixture", b"fixturf"),  # a python object's data.pkl
                                           (EMBED, b"little", b"big\x00\x00\x00")])  # a tensor record's byteorder
def test_deep_checks_the_crc_of_every_record_entry_not_only_the_tensor_data(cli, tmp_path, fqn, old, new):
    path = copy_fixture(tmp_path)
    checkpoint = read_checkpoint(path)
    entry = checkpoint.objects.get(fqn) or checkpoint.tensors[fqn]
    blob = entry.blob if hasattr(entry, "blob") else entry.chunks[0].blob
    data_file = path / blob.file
    data = bytearray(data_file.read_bytes())
    at = data.index(old, blob.offset, blob.offset + blob.length)
    data[at:at + len(old)] = new
    data_file.write_bytes(bytes(data))
    assert validate_json(cli, path)[0] == 0  # metadata and sizes cannot see it
    status, document = validate_json(cli, path, "--deep")
    assert status == 1
    assert any(p["code"] == "checksum" and p["fqn"] == fqn for p in document["problems"]), document["problems"]


def test_a_malicious_object_blob_is_refused_under_deep_and_never_executed(cli, tmp_path):
    import io
    import zipfile

    path = copy_fixture(tmp_path)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    record = io.BytesIO()
    with zipfile.ZipFile(record, "w") as archive:  # shaped like a torch.save record
        archive.writestr("archive/data.pkl", pickle.dumps(Exploit(), protocol=2))
        archive.writestr("archive/version", "3\n")
    data_file = path / "__0_0.distcp"
    offset = data_file.stat().st_size
    with open(data_file, "ab") as handle:
        handle.write(record.getvalue())

    def point_an_object_at_the_exploit(metadata):
        key = next(k for k in metadata.storage_data if k.fqn == "extra.note")
        info = metadata.storage_data[key]
        info.relative_path, info.offset, info.length = "__0_0.distcp", offset, len(record.getvalue())

    rewrite_metadata(path, point_an_object_at_the_exploit)
    status, document = validate_json(cli, path, "--deep")
    assert status == 1 and "corrupt-blob" in codes(document)
    assert any(p["fqn"] == "extra.note" for p in document["problems"])
    assert not marker.exists()


def test_installed_command_runs_as_a_subprocess(tmp_path):
    path = copy_fixture(tmp_path)
    missing_data_file(path)
    ok = subprocess.run([sys.executable, "-m", "ckpttool", "validate", str(WORLD2)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "ckpttool", "validate", str(path)], capture_output=True, text=True)
    assert bad.returncode == 1 and "missing-file" in bad.stdout and "Traceback" not in bad.stderr
