"""Megatron's distributed optimizer at data parallel 2 with several buckets (issue 48 items 1 and 5):
how ckpttool finds each parameter's range in distrib_optim.pt.

Fixture `megatron_legacy_distopt_dp2/` (fixtures/frameworks/generate_megatron_legacy_distopt_dp2.py:
megatron-core 0.16.1 + Megatron-LM core_v0.16.1 `save_checkpoint`, --ckpt-format torch, TP 2 x PP 1
x DP 2, --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 2049, 2 Adam steps): each
rank's grad buffer is cut into buckets, some ending on a 32-element norm, and each DP rank owned and
stepped half of every bucket; distrib_optim.pt holds the buckets' unpadded parts gathered on DP
rank 0. The migration itself (every parameter's exp_avg / exp_avg_sq / step equal to Megatron's own
reload byte for byte after `reshard --to transformers` and set_state_dict into fully_shard + AdamW
at world 2 and 3, one AdamW step) is tests/test_megatron_legacy_migration.py's, as
`distributed_optimizer_dp2`. Here: the layout rules as data, and the parameter buffer of the real
save (the main parameters, saved beside the moments) placed by them equals every weight byte for
byte, a check independent of the moments.

Fixture `megatron_distopt_torch_dist/` (generate_megatron_distopt_torch_dist.py): the same run saved
with --ckpt-format torch_dist, so in Megatron-LM 0.16.1's default distributed-optimizer sharding,
`dp_reshardable` (each model-parallel rank's state per bucket, as DCP tensors): its buckets are shown
to be distrib_optim.pt's, byte for byte at every parameter's range; its migration is
tests/test_megatron_dp_reshardable.py's.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES
from megatron_rank_files import resave

from ckpttool.outputs.temps import TEMP_PREFIX

DP2 = FIXTURES / "frameworks" / "megatron_legacy_distopt_dp2"
ITERATION = DP2 / "checkpoints" / "iter_0000002"
BUCKET_SIZE = 2049  # the generator's --ddp-bucket-size


def _rank_state(rank: str) -> tuple[dict, dict]:
    """(model tensors, distrib_optim.pt's one grad buffer) of a rank folder, by torch.load."""
    import pickle
    import types

    import torch

    from megatron_rank_files import _MegatronFree

    module = types.SimpleNamespace(Unpickler=_MegatronFree, load=pickle.load, __name__="pickle")
    model = torch.load(ITERATION / rank / "model_optim_rng.pt", weights_only=False, pickle_module=module)["model"]
    state = torch.load(ITERATION / rank / "distrib_optim.pt", weights_only=False)
    assert state["buckets_coalesced"] is True and sorted(k for k in state if k != "buckets_coalesced") == [0]
    [buffer] = state[0].values()
    return {name: value for name, value in model.items() if isinstance(value, torch.Tensor)}, buffer


# -- the layout, as data ----------------------------------------------------------------------------

def test_a_bucket_ends_after_the_parameter_that_fills_it_and_its_end_padding_is_not_saved():
    from ckpttool.readers.megatron_legacy_optimizer import parameter_offsets

    # one bucket: every parameter at a multiple of 64
    assert parameter_offsets([2048, 32, 100, 10], None) == ([0, 2048, 2112, 2240], 2250)
    # a bucket of 2049: [2048, 32] fill the first (ends at 2080, padded in the grad buffer, not in
    # distrib_optim.pt), so 100 starts right after it, at the start of the next bucket, and 10 at
    # that bucket's next multiple of 64
    assert parameter_offsets([2048, 32, 100, 10], 2049) == ([0, 2048, 2080, 2208], 2218)
    assert parameter_offsets([2049, 1, 1], 2049) == ([0, 2049, 2113], 2114)  # a bucket ending on a parameter


def test_the_bucket_size_is_megatron_lms_from_the_saved_arguments():
    from ckpttool.readers.megatron_legacy_optimizer import grad_bucket_size

    overlap = {"overlap_grad_reduce": True, "data_parallel_size": 64, "context_parallel_size": 1}
    assert grad_bucket_size({**overlap, "ddp_bucket_size": 2049}, 0, 0, 10**6) == 2049
    assert grad_bucket_size({**overlap, "ddp_num_buckets": 4}, 0, 0, 10**6) == 250_000
    assert grad_bucket_size(overlap, 0, 0, 10**6) == 64_000_000  # max(40M, 1M x DP)
    assert grad_bucket_size({**overlap, "data_parallel_size": 2}, 0, 0, 10**6) == 40_000_000
    assert grad_bucket_size({**overlap, "ddp_bucket_size": 2049, "overlap_grad_reduce": False}, 0, 0, 10**6) is None
    assert grad_bucket_size({**overlap, "ddp_bucket_size": 2049}, 1, 0, 10**6) is None  # a later pipeline stage
    assert grad_bucket_size({**overlap, "ddp_bucket_size": 2049}, 0, 1, 10**6) is None  # a later model chunk
    assert grad_bucket_size({**overlap, "ddp_bucket_size": 2049, "overlap_param_gather_with_optimizer_step": True},
                            0, 0, 10**6) is None


# -- the real save --------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", ["mp_rank_00", "mp_rank_01"])
def test_the_parameter_buffer_placed_by_the_layout_is_every_weight_byte_for_byte(rank):
    """distrib_optim.pt's `param` (the DP ranks' main parameters, gathered) at each parameter's
    range equals the weight model_optim_rng.pt holds: the ranges are right for every parameter,
    those cut between the DP ranks and those after a bucket's end among them. Laid out as one
    bucket (what a reader without the bucket rule would do), the buffer's size disagrees."""
    from ckpttool.readers.megatron_legacy_optimizer import parameter_offsets

    weights, buffer = _rank_state(rank)
    names = list(reversed(list(weights)))
    numels = [weights[name].numel() for name in names]
    offsets, length = parameter_offsets(numels, BUCKET_SIZE)
    assert length == buffer["numel_unpadded"] == buffer["param"].numel()
    for name, start, numel in zip(names, offsets, numels):
        assert buffer["param"][start:start + numel].numpy().tobytes() == weights[name].numpy().tobytes(), name
    assert parameter_offsets(numels, None)[1] != buffer["numel_unpadded"]
    ends = [start + numel for start, numel in zip(offsets, numels)]
    buckets = sum(1 for end, following in zip(ends, offsets[1:]) if following == end) + 1
    assert buckets >= 8, buckets  # several buckets, some ending off the 64-element alignment
    assert any(end % 64 and following == end for end, following in zip(ends, offsets[1:]))


def test_the_dp2_save_is_recorded_as_data_parallel_2():
    expected = json.loads((DP2 / "expected.json").read_text())
    assert (expected["tensor_parallel"], expected["pipeline_parallel"], expected["data_parallel"]) == (2, 1, 2)
    assert "--ddp-bucket-size" in expected["megatron_argv"] and "--use-distributed-optimizer" in expected["megatron_argv"]
    assert sorted(p.name for p in ITERATION.iterdir()) == ["mp_rank_00", "mp_rank_01"]  # written by DP rank 0 only


def test_the_moments_are_byte_ranges_of_distrib_optim_pt_at_the_bucketed_offsets():
    from ckpttool.core.checkpoint import is_raw_range
    from ckpttool.readers.megatron_legacy_optimizer import parameter_offsets, read_legacy_optimizer

    read = read_legacy_optimizer(ITERATION)
    weights, _ = _rank_state("mp_rank_01")
    names = list(reversed(list(weights)))
    offsets, _ = parameter_offsets([weights[name].numel() for name in names], BUCKET_SIZE)
    column_parallel = {"embedding.word_embeddings.weight", "output_layer.weight"}
    for name, start in zip(names, offsets):
        tensor = read.checkpoint.tensors[f"optimizer.state.exp_avg.{name}"]
        assert all(is_raw_range(chunk.blob) and chunk.blob.file.endswith("/distrib_optim.pt") for chunk in tensor.chunks)
        if name in column_parallel:  # tensor-parallel rank 1's rows: its chunk starts at that offset of its file
            [ours] = [chunk for chunk in tensor.chunks if chunk.blob.file.startswith("mp_rank_01/")]
            assert ours.offsets[0] == 64 and ours.blob.length == 4 * math.prod(weights[name].shape)
            first = [chunk for chunk in read.checkpoint.tensors[f"optimizer.state.exp_avg.{names[0]}"].chunks
                     if chunk.blob.file.startswith("mp_rank_01/")][0]
            assert ours.blob.offset - first.blob.offset == 4 * start


def _saved_argument(key: str, value):
    """Every rank file's saved arguments with `key` set to `value`."""
    def damage(folder: Path) -> None:
        def edit(state):
            setattr(state["args"], key, value)

        for rank in sorted(folder.glob("mp_rank_*")):
            resave(rank / "model_optim_rng.pt", edit)

    return damage


REFUSED = {
    # the arguments say another bucket size than the grad buffers were cut with
    "another-bucket-size": (_saved_argument("ddp_bucket_size", 4096),
                            "mp_rank_00/distrib_optim.pt: grad buffer 0 holds 22976 elements, model chunk 0's parameters "
                            "laid out in buckets of 4096 elements"),
    "no-bucket-count": (_saved_argument("ddp_num_buckets", 0),
                        "mp_rank_00/model_optim_rng.pt: args.ddp_num_buckets is 0, not a positive integer"),
    "a-bucket-size-of-text": (_saved_argument("ddp_bucket_size", "2049"),
                              "args.ddp_bucket_size is '2049', not a positive integer"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_buffer_the_saved_arguments_do_not_lay_out_is_refused_with_nothing_written(run, tmp_path, case):
    damage, message = REFUSED[case]
    copy = tmp_path / "checkpoints"
    shutil.copytree(DP2 / "checkpoints", copy)
    damage(copy / "iter_0000002")
    result = run("reshard", copy, tmp_path / "out", "--world", "2", "--to", "transformers")
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(TEMP_PREFIX) for p in tmp_path.rglob("*"))


# -- the same run saved as torch_dist: Megatron-LM's default distributed-optimizer sharding ------------

TORCH_DIST = FIXTURES / "frameworks" / "megatron_distopt_torch_dist"
TORCH_DIST_ITERATION = TORCH_DIST / "checkpoints" / "iter_0000002"


def _bucket_tensors(model_parallel_rank: int, kind: str) -> list:
    """The dp_reshardable DCP tensors of one model-parallel rank's grad buffer 0, by bucket number."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(TORCH_DIST_ITERATION)
    metadata = reader.read_metadata()
    prefix = f"optimizer.distributed.dp_group_idx_{model_parallel_rank}.gbuf_idx_0.dtype_(torch.float32, torch.float32)."
    keys = sorted((key for key in metadata.state_dict_metadata if key.startswith(prefix) and key.endswith(f".{kind}")),
                  key=lambda key: int(key.removeprefix(prefix + "bucket_idx_").split(".")[0]))
    state = {key: torch.empty(tuple(metadata.state_dict_metadata[key].size)) for key in keys}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return [state[key] for key in keys]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("model_parallel_rank", [0, 1])
def test_the_torch_dist_buckets_hold_distrib_optim_pts_bytes_at_the_same_offsets(model_parallel_rank):
    """Megatron-LM's default torch_dist sharding (dp_reshardable: each model-parallel rank's
    `...bucket_idx_{b}.{param,exp_avg,exp_avg_sq}`, a bucket's unpadded length each) of the same
    run as megatron_legacy_distopt_dp2 (same seeds, byte-identical training): its buckets are the
    ones parameter_offsets lays out, and one after another they hold, at every parameter's range,
    the bytes distrib_optim.pt holds there. The two layouts differ only in where the buckets are
    kept; the references of both runs are equal."""
    from ckpttool.readers.megatron_legacy_optimizer import parameter_offsets

    weights, buffer = _rank_state(f"mp_rank_{model_parallel_rank:02d}")
    names = list(reversed(list(weights)))
    numels = [weights[name].numel() for name in names]
    offsets, length = parameter_offsets(numels, BUCKET_SIZE)
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        buckets = _bucket_tensors(model_parallel_rank, kind)
        assert len(buckets) == 9 and sum(bucket.numel() for bucket in buckets) == length
        import torch

        flat = torch.cat(buckets)
        for name, start, numel in zip(names, offsets, numels):
            assert flat[start:start + numel].numpy().tobytes() == buffer[kind][start:start + numel].numpy().tobytes(), (
                kind, name)
    ours = json.loads((DP2 / "optimizer_expected.json").read_text())
    theirs = json.loads((TORCH_DIST / "optimizer_expected.json").read_text())
    assert (ours["tensors"], ours["step"], ours["groups"]) == (theirs["tensors"], theirs["step"], theirs["groups"])


def test_the_torch_dist_distributed_optimizer_saves_model_still_exports(run, tmp_path):
    """The model of that save exports to the same tensors as the legacy save of the same run."""
    from safetensors.torch import load_file

    from conftest import tensor_bytes

    exported = {}
    for name, source in (("torch_dist", TORCH_DIST), ("legacy", DP2)):
        assert run("export", source / "checkpoints", tmp_path / name, "--quiet").exit_code == 0
        exported[name] = {key: tensor_bytes(value) for path in sorted((tmp_path / name).glob("*.safetensors"))
                          for key, value in load_file(path).items()}
    assert exported["torch_dist"] == exported["legacy"] and len(exported["legacy"]) == 39
