"""Planning a consolidation needs no files: keys, geometry, layouts, as pure data."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import pytest

from ckpttool.dcp.blobs import RawData
from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor
from ckpttool.core.errors import KeyCollision, UsageError
from ckpttool.formats import hub, safetensors
from ckpttool.model.keys import KeyRules, Rename, normalise, output_keys
from ckpttool.model.model_view import find_model
from ckpttool.plan import unique_chunks
from ckpttool.plan.consolidate import bands, plan_tensor, target_dtype
from ckpttool.plan.operations import CONVERT_BLOCK, GATHER_PART, Band, Convert, Copy, Gather
from ckpttool.torchsave import ptfile


def tensor(fqn, shape, boxes, dtype="float32"):
    return Tensor(fqn, dtype, shape, tuple(Chunk(o, s, Blob(f"__{i}_0.distcp", 0, 1)) for i, (o, s) in enumerate(boxes)))


def raw_for(t, base=1000):
    return {i: RawData(c.blob.file, base, c.numel * t.itemsize, crc32=i) for i, c in enumerate(t.chunks)}


# --- keys ---------------------------------------------------------------------------------------


def test_normalise_strips_wrapper_components_and_a_leading_ddp_module():
    assert normalise("module.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.fc.weight") == "layers.0.fc.weight"
    assert normalise("_orig_mod.embed.weight") == "embed.weight"
    assert normalise("layers.module.weight") == "layers.module.weight"  # only a leading `module.`


def model_keys(fqns):
    """The model view of a `{"model": ...}` checkpoint: fqn -> its key under `model.`."""
    return {fqn: fqn.removeprefix("model.") for fqn in fqns if fqn.startswith("model.")}


def test_model_keys_are_the_model_subtree_without_its_prefix():
    nesting = {"model.a.weight": ("model", "a.weight"), "optim.state.a.weight.step": ("optim", "state", "a.weight", "step")}
    checkpoint = Checkpoint(Path("ckpt"), ".metadata", None,
                            {fqn: tensor(fqn, (2,), [((0,), (2,))]) for fqn in nesting}, {}, nesting)
    assert output_keys(nesting, KeyRules(), find_model(checkpoint).keys) == {"a.weight": "model.a.weight"}
    assert set(output_keys(nesting, KeyRules(everything=True), {})) == set(nesting)


def test_rename_rules_apply_in_order_after_normalisation():
    rules = KeyRules(renames=(Rename.parse(r"^layers\.(\d+)\.=h.\1."), Rename.parse("weight$=w")))
    assert output_keys(["model.layers.3._orig_mod.fc.weight"], rules, model_keys(["model.layers.3._orig_mod.fc.weight"])) == {"h.3.fc.w": "model.layers.3._orig_mod.fc.weight"}


def test_a_rename_that_merges_two_keys_is_an_error_naming_both():
    rules = KeyRules(renames=(Rename.parse(r"\.\d+\.=."),))
    with pytest.raises(KeyCollision, match="model.layers.0.w and model.layers.1.w both become 'layers.w'"):
        output_keys(["model.layers.0.w", "model.layers.1.w"], rules, model_keys(["model.layers.0.w", "model.layers.1.w"]))


def test_normalisation_collision_suggests_keep_keys():
    with pytest.raises(KeyCollision, match="--keep-keys"):
        output_keys(["model._orig_mod.w", "model.w"], KeyRules(), model_keys(["model._orig_mod.w", "model.w"]))


def test_filter_matches_the_fqn_or_the_output_key():
    fqns = ["model.a.weight", "model.b.weight", "model.b.bias"]
    assert list(output_keys(fqns, KeyRules(filters=("b.*",)), model_keys(fqns))) == ["b.bias", "b.weight"]
    assert list(output_keys(fqns, KeyRules(filters=("model.a.*",)), model_keys(fqns))) == ["a.weight"]


def test_bad_rename_is_a_usage_error():
    with pytest.raises(UsageError):
        Rename.parse("no-equals-sign")
    with pytest.raises(UsageError):
        Rename.parse("(unclosed=x")


def test_only_floating_tensors_are_cast():
    assert target_dtype("float32", "bfloat16") == "bfloat16"
    assert target_dtype("int64", "bfloat16") == "int64"
    assert target_dtype("bool", "float16") == "bool"
    assert target_dtype("bfloat16", None) == "bfloat16"


# --- geometry -----------------------------------------------------------------------------------


def test_dim0_chunks_become_one_copy_each_at_their_row_offset():
    t = tensor("w", (7, 4), [((0, 0), (3, 4)), ((3, 0), (3, 4)), ((6, 0), (1, 4)), ((7, 0), (0, 4))])
    operations = plan_tensor(t, raw_for(t), "float32", "out", 100)
    assert operations == (
        Copy("__0_0.distcp", 1000, "out", 100, 48, 0),
        Copy("__1_0.distcp", 1000, "out", 148, 48, 1),
        Copy("__2_0.distcp", 1000, "out", 196, 16, 2),
    )  # the empty shard of rank 3 is skipped


def test_block_sharded_chunks_are_assembled_in_a_band_of_whole_rows():
    t = tensor("w", (2, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2))])
    (band,) = plan_tensor(t, raw_for(t), "float32", "out", 0)
    assert isinstance(band, Band) and (band.offset, band.length) == (0, 32)
    # (offset in the chunk's bytes, output offset, length): each chunk row lands in its output row
    assert band.parts[0].pieces == ((0, 0, 8), (8, 16, 8))
    assert band.parts[1].pieces == ((0, 8, 8), (8, 24, 8))
    assert [part.source for part in band.parts] == [RawData("__0_0.distcp", 1000, 16), RawData("__1_0.distcp", 1000, 16)]
    assert band.memory == 32 + 16  # the band, and one chunk's rows at a time


def test_a_band_reads_only_its_rows_of_each_chunk_and_casts_them():
    t = tensor("w", (4, 8), [((0, 0), (4, 4)), ((0, 4), (4, 4))])
    raw = raw_for(t)
    first, second = bands([op for op in _gathers(t, raw, "bfloat16")], 16, 0, 32)
    assert (first.offset, first.length, second.offset, second.length) == (0, 32, 32, 32)
    # rows 2-3 of each [4, 4] float32 chunk: bytes 32-63 of its raw data; pieces in bf16 bytes
    assert [part.source for part in second.parts] == [RawData("__0_0.distcp", 1032, 32), RawData("__1_0.distcp", 1032, 32)]
    assert second.parts[1].pieces == ((0, 40, 8), (8, 56, 8))


def test_wide_pieces_and_decoded_chunks_stay_whole_gathers():
    wide = tensor("w", (2, 2 * GATHER_PART), [((0, 0), (2, GATHER_PART)), ((0, GATHER_PART), (2, GATHER_PART))], "uint8")
    assert [type(op) for op in plan_tensor(wide, raw_for(wide), "uint8", "out", 0)] == [Gather, Gather]
    t = tensor("w", (2, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2))])
    assert [type(op) for op in plan_tensor(t, {0: None, 1: raw_for(t)[1]}, "float32", "out", 0)] == [Gather, Gather]


def _gathers(t, raw, dtype):
    return [Gather(op.tensor, op.chunk, op.source, op.dtype, op.dst, op.pieces)
            for band in plan_tensor(t, raw, dtype, "out", 0) for op in band.parts]


def test_replicated_boxes_are_read_once():
    t = tensor("step", (), [((), ()), ((), ())])
    assert len(unique_chunks(t)) == 1
    assert plan_tensor(t, raw_for(t), "float32", "out", 8) == (Copy("__0_0.distcp", 1000, "out", 8, 4, 0),)


def test_a_cast_is_split_into_bounded_convert_blocks():
    rows = 2 * CONVERT_BLOCK // (4 * 1024) + 1
    t = tensor("w", (rows, 1024), [((0, 0), (rows, 1024))])
    operations = plan_tensor(t, raw_for(t), "bfloat16", "out", 0)
    assert all(isinstance(op, Convert) and op.length <= CONVERT_BLOCK for op in operations)
    assert sum(op.output_length for op in operations) == rows * 1024 * 2
    assert [op.dst_offset for op in operations] == [i * CONVERT_BLOCK // 2 for i in range(3)]


def test_a_chunk_that_must_be_decoded_is_gathered():
    t = tensor("w", (4,), [((0,), (4,))])
    (operation,) = plan_tensor(t, {0: None}, "float32", "out", 0)
    assert isinstance(operation, Gather) and operation.source is None


# --- layouts ------------------------------------------------------------------------------------


def test_safetensors_layout_orders_like_save_file_and_pads_the_header():
    layout = safetensors.layout_file([("b", "bool", (3,)), ("a", "bfloat16", (2,)), ("c", "float32", ())])
    (length,) = struct.unpack("<Q", layout.header[:8])
    header = json.loads(layout.header[8:])
    assert length % 8 == 0 and length == len(layout.header) - 8
    assert list(header) == ["__metadata__", "c", "a", "b"]  # widest dtype first
    assert header["__metadata__"] == {"format": "pt"}
    assert layout.offsets == {"c": len(layout.header), "a": len(layout.header) + 4, "b": len(layout.header) + 8}
    assert layout.size == len(layout.header) + 11


def test_shards_follow_huggingface_hub_split():
    split = hub.plan_shards({"a": 6, "b": 3, "c": 2, "d": 9}, max_shard_size=8)
    assert split.files == {
        "model-00001-of-00003.safetensors": ("a",),
        "model-00002-of-00003.safetensors": ("d",),  # too big for any shard: its own, at once
        "model-00003-of-00003.safetensors": ("b", "c"),
    }
    index = json.loads(split.index)
    assert index["metadata"] == {"total_size": 20}
    assert index["weight_map"]["c"] == "model-00003-of-00003.safetensors"
    assert hub.plan_shards({"a": 1}, 8) == hub.ShardSplit({"model.safetensors": ("a",)}, None, None)


def test_crc32_combine_equals_the_crc_of_the_concatenation():
    left, right = os.urandom(1000), os.urandom(77777)
    assert ptfile.crc32_combine(zlib.crc32(left), zlib.crc32(right), len(right)) == zlib.crc32(left + right)


def test_zip_layout_aligns_storages_to_64_bytes_and_uses_zip64_past_4gib():
    pickled = ptfile.PickledState(b"\x80\x02}q\x00.", ())
    layout = ptfile.lay_out(pickled, [10, 5 << 30, 3])
    assert all(offset % 64 == 0 for offset in layout.data_offsets)
    big = layout.archive_layout.storages[1]
    extra = big.header[30 + len(big.name):]  # after the fixed header and the name
    assert extra.startswith(struct.pack("<HHQQ", 1, 16, 5 << 30, 5 << 30))  # zip64 sizes
    assert layout.data_offsets[2] >= layout.data_offsets[1] + (5 << 30)


@pytest.mark.parametrize("source, target", [("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32"),
                                            ("float64", "bfloat16"), ("float16", "bfloat16")])
def test_a_cast_block_converted_in_place_equals_tensor_to(source, target):
    import torch

    from ckpttool.run.execute import cast_in_place

    torch.manual_seed(0)
    values = (torch.randn(4099) * 1e4).to(getattr(torch, source))
    values[:9] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-45, 65504.1, 65520.0, 0.0, -0.0])
    data = values.view(torch.uint8).numpy().tobytes()
    buffer = bytearray(data) + bytearray(b"\xff" * 13)  # a reused buffer is longer than the block
    got = cast_in_place(buffer, len(data), source, target)
    assert bytes(got) == values.to(getattr(torch, target)).view(torch.uint8).numpy().tobytes()
