"""GPT-OSS in Megatron-Core names (issue 48 item 4): a `torch_dist` checkpoint that megatron-core
0.16.1's own GPTModel and `dist_checkpointing.save` wrote on 2 gloo ranks at expert parallel 2
(fixtures/frameworks/generate_megatron_gpt_oss.py: learnable softmax offsets, biases on every
linear layer, quick-GeGLU experts clamped at 7 with the (up + 1) offset, YaRN, a sliding window on
alternate layers, SequentialMLP experts stacked by torch_dist).

The references were written by the frameworks, and no megatron is imported here:
- hf/model.safetensors: Megatron-Bridge 0.3.1's GPTOSSBridge mapping of the weights (each expert's
  [gate; up] rows interleaved and transposed into `gate_up_proj`, `linear_fc2` transposed into
  `down_proj`): export, from the given config.json or from Megatron-LM's arguments in common.pt,
  writes exactly those bytes;
- logits.safetensors: Megatron's forward; transformers loads the export with nothing missing or
  unexpected and its logits match within the family's tolerance (1e-4; 4.8e-7 measured when the
  fixture was made: the same bytes, float32 sums in other orders);
- expected.json: what Megatron's own `dist_checkpointing.load` put in a fresh model, gathered by
  Megatron's sharding metadata: consolidate writes those bytes (sha256).
"""

from __future__ import annotations

import hashlib
import json

import pytest

from conftest import FIXTURES, assert_same_bytes, tensor_bytes

from ckpttool import naming
from ckpttool.core.errors import UnsupportedFormat
from ckpttool.naming.megatron_config import common_file, hf_config, megatron_hf_config, read_args

FIXTURE = FIXTURES / "frameworks" / "megatron_gpt_oss" / "gpt_oss_ep2"
RUN = FIXTURE / "checkpoints"
FAMILY = "megatron gpt_oss"
SOURCES = ["assets", "args"]  # export's config.json: the reference's (--assets), or from common.pt's arguments


def written(target) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(target.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.fixture(scope="module")
def exports(tmp_path_factory, run) -> dict:
    root = tmp_path_factory.mktemp("gpt_oss")
    out = {}
    for source in SOURCES:
        target = root / source
        assets = ("--assets", FIXTURE / "hf") if source == "assets" else ()
        out[source] = (target, run("export", RUN, target, *assets))
    return out


def test_every_fixture_file_is_on_disk():
    paths = [FIXTURE / file for file in ("hf/config.json", "hf/model.safetensors", "expected.json", "inputs.json",
                                          "logits.safetensors", "checkpoints/latest_checkpointed_iteration.txt")]
    assert [str(path) for path in paths if not path.exists()] == []


@pytest.mark.parametrize("source", SOURCES)
def test_export_equals_megatron_bridges_gpt_oss_mapping_byte_for_byte(exports, source):
    from safetensors.torch import load_file

    target, result = exports[source]
    assert result.exit_code == 0, result.output
    assert f"converted {FAMILY} names" in result.output, result.output
    mine, expected = written(target), load_file(str(FIXTURE / "hf" / "model.safetensors"))
    assert sorted(mine) == sorted(expected)
    for key, tensor in expected.items():
        assert_same_bytes(mine[key], tensor, key)


@pytest.mark.parametrize("source", SOURCES)
def test_transformers_loads_the_export_with_megatrons_logits(exports, source):
    """Nothing missing, unexpected or mismatched; the tolerance is the one the family states."""
    import torch
    import transformers
    from safetensors.torch import load_file

    target, result = exports[source]
    assert result.exit_code == 0, result.output
    model, info = transformers.AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    assert type(model).__name__ == "GptOssForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = json.loads((FIXTURE / "inputs.json").read_text())["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits
    (reference,) = load_file(str(FIXTURE / "logits.safetensors")).values()
    architecture = naming.family(FAMILY).architecture("GptOssForCausalLM")
    assert architecture is not None and architecture.logit_tolerance is not None
    assert float((logits - reference).abs().max()) < architecture.logit_tolerance


def test_consolidate_writes_what_megatrons_own_load_gives(run, tmp_path):
    """Megatron's names (the layer axis taken apart, the experts stacked as torch_dist stores them)."""
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = run("consolidate", RUN, out, "--quiet")
    assert result.exit_code == 0, result.output
    expected = json.loads((FIXTURE / "expected.json").read_text())["tensors"]
    described = {key: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                       "sha256": hashlib.sha256(tensor_bytes(value)).hexdigest()} for key, value in load_file(out).items()}
    assert described == expected


def test_the_config_from_common_pt_agrees_with_the_reference_on_every_field():
    from transformers import AutoConfig

    ours = megatron_hf_config(common_file(RUN))
    assert ours is not None
    mine = AutoConfig.for_model(**ours).to_dict()
    theirs = AutoConfig.for_model(**json.loads((FIXTURE / "hf" / "config.json").read_text())).to_dict()
    differing = {key for key in mine.keys() | theirs.keys() if mine.get(key, "absent") != theirs.get(key, "absent")}
    assert differing <= {"transformers_version"}, {key: (mine.get(key), theirs.get(key)) for key in differing}


def test_megatrons_window_of_w_is_transformers_sliding_window_w_plus_1():
    """Megatron's window (W, 0) sees token i - W .. i (W + 1 tokens), transformers' sliding_window S
    i - S + 1 .. i: the generator measured Megatron's logits against transformers' with S = W (other
    logits) and S = W + 1 (the same), on a sequence longer than the window."""
    args = read_args(common_file(RUN))
    checked = json.loads((FIXTURE / "inputs.json").read_text())
    window, right = args["window_size"]
    assert (right, window + 1 < len(checked["input_ids"][0])) == (0, True)
    config = hf_config(args, "common.pt")
    assert (config["sliding_window"], config["layer_types"]) == (window + 1, ["sliding_attention", "full_attention"])
    assert checked["max_abs_logits_difference"] < 1e-4 < checked["max_abs_logits_difference_with_sliding_window_W"]


@pytest.mark.parametrize("frequency, types", [
    (None, ["sliding_attention"] * 4),
    (2, ["sliding_attention", "full_attention"] * 2),
    (4, ["sliding_attention"] * 3 + ["full_attention"]),
    ([1, 0, 0, 1], ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]),
])
def test_windowed_layers_are_megatrons_window_attn_skip_freq(frequency, types):
    args = {**read_args(common_file(RUN)), "num_layers": 4, "window_attn_skip_freq": frequency}
    assert hf_config(args, "common.pt")["layer_types"] == types


@pytest.mark.parametrize("change, named", [
    ({"glu_linear_offset": 0.0}, "glu_linear_offset=0.0"),
    ({"quick_geglu": False}, "quick_geglu=False"),
    ({"add_bias_linear": False}, "add_bias_linear=False"),
    ({"activation_func_clamp_value": None}, "activation_func_clamp_value=None"),
    ({"window_size": (4, 2)}, "window_size=(4, 2)"),
    ({"window_attn_skip_freq": [1, 0, 1]}, "window_attn_skip_freq=[1, 0, 1]"),
    ({"yarn_mscale": 1.0}, "yarn_mscale=1.0"),
    ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True"),
    ({"qk_layernorm": True}, "qk_layernorm=True"),
    ({"num_experts": None}, "without num_experts"),
    ({"position_embedding_type": "learned_absolute"}, "position_embedding_type='learned_absolute'"),
])
def test_gpt_oss_arguments_its_config_cannot_state_are_refused_naming_the_argument(change, named):
    args = read_args(common_file(RUN))
    with pytest.raises(UnsupportedFormat, match="--assets") as raised:
        hf_config({**args, **change}, "common.pt")
    assert named in str(raised.value)


def test_diff_of_the_checkpoint_against_its_export_says_identical(exports, cli):
    target, result = exports["args"]
    assert result.exit_code == 0, result.output
    for assets in (("--assets", FIXTURE / "hf"), ()):
        compared = cli("diff", RUN, target, *assets)
        assert compared.exit_code == 0 and compared.output.startswith("IDENTICAL"), compared.output


def test_the_family_is_found_by_its_sinks(run):
    document = json.loads(run("inspect", RUN, "--json").stdout)
    assert document["family"]["name"] == FAMILY
    assert document["family"]["named_by"]["architecture"] == "GptOssForCausalLM"
    assert naming.candidates(["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
                              "decoder.layers.0.self_attention.core_attention.softmax_offset"])[0] == FAMILY


def test_every_rule_import_writes_runs_backwards():
    """`import --to megatron` writes GPT-OSS (tests/test_import_gpt_oss.py proves the bytes): the
    rules it chooses (the stacked experts, megatron-core's torch_dist names) all have an inverse;
    the per-expert source names (STACK_EXPERTS) are read by export only."""
    from ckpttool.naming.backward import INVERSES, chosen_rules
    from ckpttool.naming.engine import TRANSFORMS

    chosen = chosen_rules(naming.family(FAMILY))
    assert all(TRANSFORMS[rule.transform].inverse in INVERSES for rule in chosen), chosen
    assert not any(".local_experts." in rule.source or "{E}" in rule.source for rule in chosen)


def test_load_into_a_transformers_model_straight_from_megatrons_checkpoint():
    import transformers

    import ckpttool

    assets = FIXTURE / "hf"
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(assets))
    missing, unexpected = ckpttool.load_into(model, RUN, assets=assets)
    assert (missing, unexpected) == ([], [])
    expected = transformers.AutoModelForCausalLM.from_pretrained(assets).state_dict()
    assert sorted(model.state_dict()) == sorted(expected)
    for key, value in model.state_dict().items():
        assert_same_bytes(value, expected[key], key)


# ---------------------------------------------------------------------------------------------
# The experts' transposes as chunks: one per expert, or one per source row when an expert straddles chunks


def bridge_gate_up(fc1):
    """GPTOSSMLPGateUpProjMapping.megatron_to_hf of one expert: un-interleave, then transpose."""
    import torch

    gate, up = torch.chunk(fc1, 2, dim=0)
    out = torch.empty_like(fc1)
    out[::2], out[1::2] = gate, up
    return out.transpose(0, 1) if fc1.dim() == 2 else out


def test_each_experts_matrix_is_one_chunk_marked_rows_as_columns():
    shapes = {"decoder.layers.0.mlp.experts.experts.linear_fc1.weight": (4, 64, 32),
              "decoder.layers.0.mlp.experts.experts.linear_fc2.weight": (4, 32, 32),
              "decoder.layers.0.mlp.experts.experts.linear_fc1.bias": (4, 64)}
    targets = naming.convert(naming.family(FAMILY), shapes, {"num_attention_heads": 4}, "test")
    gate_up, down, bias = (targets[f"model.layers.0.mlp.experts.{name}"] for name in
                           ("gate_up_proj", "down_proj", "gate_up_proj_bias"))
    assert (gate_up.shape, down.shape, bias.shape) == ((4, 32, 64), (4, 32, 32), (4, 64))
    assert [piece.columns for piece in gate_up.pieces] == [(2, 32)] * 4
    assert [piece.columns for piece in down.pieces] == [(1, 32)] * 4
    assert [piece.columns for piece in bias.pieces] == [(2, 32)] * 4


def read_converted(root, tensors: dict, config: dict):
    """{transformers key: tensor} of the GPT-OSS table's conversion of `tensors` (fqn -> Tensor of
    raw-range chunks of files under `root`), each chunk read as export reads it (read_chunk)."""
    import torch

    from ckpttool.core.checkpoint import Checkpoint
    from ckpttool.dcp.blobs import DataFiles, read_chunk
    from ckpttool.naming.engine import converted_checkpoint
    from ckpttool.run import locating

    checkpoint = Checkpoint(root, "", None, tensors, {})
    targets = naming.convert(naming.family(FAMILY), {key: tensor.shape for key, tensor in tensors.items()},
                             {"num_attention_heads": 4, **config}, "test")
    made = {}
    with DataFiles(root) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values())
        for key, tensor in converted_checkpoint(checkpoint, targets, located).tensors.items():
            made[key] = value = torch.full(tensor.shape, float("nan"))
            for chunk in tensor.chunks:
                region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
                value[region] = torch.frombuffer(bytearray(read_chunk(files, tensor, chunk)), dtype=torch.float32
                                                 ).reshape(chunk.sizes)
            made[key] = (value, tensor)
    return made


def bridges(rule: str, experts):
    """Megatron-Bridge's GPT-OSS export of `rule`'s experts (a sequence of one expert's tensors)."""
    import torch

    if rule == "linear_fc2.weight":
        return torch.stack([expert.transpose(0, 1) for expert in experts])
    if rule == "linear_fc2.bias":
        return torch.stack(list(experts))
    return torch.stack([bridge_gate_up(expert) for expert in experts])


@pytest.mark.parametrize("cuts", [(), (1, 3), (12,), (16, 17, 90, 200)])
@pytest.mark.parametrize("rule", ["linear_fc1.weight", "linear_fc2.weight", "linear_fc1.bias"])
def test_experts_read_as_bridges_mapping_whichever_rows_the_source_chunks_hold(tmp_path, cuts, rule):
    """Source chunks cut on the stacked rows (experts x rows): an expert inside one chunk is one
    chunk of raw bytes marked rows-as-columns; one that straddles chunks is a chunk per row part,
    each a column of the target. Either way its bytes are the bridge's."""
    import torch

    from ckpttool.core.checkpoint import Blob, Chunk, Tensor, raw_range_transforms, rows_as_columns

    experts, rows, width = 3, 8, (5,) if rule.endswith("weight") else ()
    source = torch.randn(experts, rows, *width)
    (tmp_path / "w.bin").write_bytes(b"\0" * 4 + source.numpy().tobytes())
    flat = experts * rows  # chunks of whole rows of the [experts * rows, width] view
    row_bytes = (width[0] if width else 1) * 4
    bounds = [0, *(cut for cut in cuts if cut < flat), flat]
    key = f"decoder.layers.0.mlp.experts.experts.{rule}"
    chunks = []
    for first, stop in zip(bounds, bounds[1:]):  # a chunk is a box: split a cut that crosses experts
        while first < stop:
            expert, row = divmod(first, rows)
            take = min(stop - first, rows - row)
            chunks.append(Chunk((expert, row, *(0,) * len(width)), (1, take, *width),
                                Blob("w.bin", 4 + first * row_bytes, take * row_bytes, raw_range_transforms())))
            first += take
    ((made, tensor),) = read_converted(tmp_path, {key: Tensor(key, "float32", tuple(source.shape), tuple(chunks))},
                                       {"num_local_experts": experts}).values()
    assert torch.equal(made, bridges(rule, source))
    whole = sum(1 for chunk in chunks if chunk.sizes[1] == rows)
    assert sum(1 for chunk in tensor.chunks if rows_as_columns(chunk.blob)) == whole


@pytest.mark.parametrize("names", ["decoder.layers.0.mlp.experts.local_experts.{E}.{rule}",
                                   "decoder.layers.0.mlp.experts.{rule}{E}"])
@pytest.mark.parametrize("rule", ["linear_fc1.weight", "linear_fc2.weight", "linear_fc1.bias", "linear_fc2.bias"])
def test_one_tensor_per_expert_is_gathered_into_bridges_stacked_tensor(tmp_path, names, rule):
    """SequentialMLP's `local_experts.E` and TE's grouped `weightE`, as a state dict names them:
    each expert placed in the one transformers tensor, whole experts one chunk each."""
    import torch

    from ckpttool.core.checkpoint import Blob, Chunk, Tensor, raw_range_transforms

    experts, rows, width = 3, 8, (5,) if rule.endswith("weight") else ()
    source = torch.randn(experts, rows, *width)
    (tmp_path / "w.bin").write_bytes(source.numpy().tobytes())
    size = source[0].numel() * 4
    tensors = {}
    for expert in range(experts):
        key = names.replace("{E}", str(expert)).replace("{rule}", rule)
        tensors[key] = Tensor(key, "float32", tuple(source.shape[1:]), (Chunk(
            (0,) * source[0].dim(), tuple(source.shape[1:]), Blob("w.bin", expert * size, size, raw_range_transforms())),))
    ((made, tensor),) = read_converted(tmp_path, tensors, {"num_local_experts": experts}).values()
    assert torch.equal(made, bridges(rule, source))
    assert len(tensor.chunks) == experts


def test_an_expert_missing_from_one_tensor_per_expert_is_refused_naming_it():
    from ckpttool.core.errors import InvalidCheckpoint

    shapes = {f"decoder.layers.0.mlp.experts.local_experts.{expert}.linear_fc1.weight": (8, 5) for expert in (0, 2)}
    with pytest.raises(InvalidCheckpoint, match=r"gate_up_proj holds 3 experts, but the checkpoint has no expert \[1\]"):
        naming.convert(naming.family(FAMILY), shapes, {"num_attention_heads": 4, "num_local_experts": 3}, "test")
