"""Megatron-LM's legacy per-rank checkpoints (`--ckpt-format torch`), written by Megatron-LM's own
`save_checkpoint` (core_v0.16.1) at tensor parallel 2 x pipeline parallel 2 on 4 gloo ranks
(fixtures/frameworks/generate_megatron_legacy.py: GPTModel, Llama-style, GQA, SwiGLU, 4 layers, 100
tokens padded to 128 vocabulary rows, trained 2 steps): `checkpoints/iter_0000002/mp_rank_TT_PPP/
model_optim_rng.pt` and `latest_checkpointed_iteration.txt`; and the same model at virtual pipeline 2
(`virtual_pipeline/`: `model0`, `model1` chunks per rank, layers interleaved over the stages).

The reference (expected.json) is Megatron's own: a fresh model per rank loaded by Megatron-LM's
`load_checkpoint`, each rank's tensors placed by `sharded_state_dict()`'s global offsets (its
swiglu factory too) and gathered, so consolidate's bytes are checked against Megatron's sharding
metadata, not against ckpttool's merge rules. No megatron is imported here.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import pickletools
import shutil
import zipfile
from pathlib import Path

import pytest

from conftest import FIXTURES, tensor_bytes
from megatron_rank_files import resave

from ckpttool.outputs.temps import TEMP_PREFIX

LEGACY = FIXTURES / "frameworks" / "megatron_legacy"
RUN_DIR = LEGACY / "checkpoints"
ITERATION = RUN_DIR / "iter_0000002"
EXPECTED = json.loads((LEGACY / "expected.json").read_text())
VIRTUAL = LEGACY / "virtual_pipeline"  # the same model at --num-virtual-stages-per-pipeline-rank 2 (model0, model1)
RANK_FILES = [f"mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt" for p in range(2) for t in range(2)]
# Megatron's forward (TP-partial sums gathered, its own rotary and softmax) and transformers' eager one
# add float32 in other orders: the megatron gpt family's logit tolerance
LOGIT_TOLERANCE = 1e-4


def describe(tensor) -> dict:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(tensor_bytes(tensor)).hexdigest()}


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory, run):
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("legacy") / "model.safetensors"
    result = run("consolidate", RUN_DIR, out, "--quiet")
    assert result.exit_code == 0, result.output
    return load_file(out)


# -- detection, inspect, validate ----------------------------------------------------------------

@pytest.mark.parametrize("source", [RUN_DIR, ITERATION], ids=["run-folder", "iter-folder"])
def test_inspect_names_the_layout_from_the_run_and_the_iteration_folder(run, source):
    document = json.loads(run("inspect", source, "--json").stdout)
    assert document["layout"] == "megatron-legacy"
    assert Path(document["path"]).name == "iter_0000002"
    assert document["groups"]["model"]["tensors"] == len(EXPECTED["tensors"]) == 27


def test_the_run_folder_newest_is_named_by_megatrons_tracker_file():
    from ckpttool.readers import detect

    detection = detect(RUN_DIR)
    assert (detection.layout, detection.newest, detection.newest_by) == (
        "megatron-legacy", "iter_0000002", "latest_checkpointed_iteration.txt")


def test_one_rank_folder_is_refused_naming_its_iteration_folder(run):
    result = run("inspect", ITERATION / "mp_rank_01_000")
    assert result.exit_code == 1
    assert result.output.strip().endswith(f"name its iteration folder, {ITERATION}"), result.output
    assert "one tensor/pipeline rank of a Megatron-LM legacy save" in result.output


@pytest.mark.parametrize("flags", [(), ("--deep",)], ids=["validate", "validate-deep"])
@pytest.mark.parametrize("source", [RUN_DIR, ITERATION], ids=["run-folder", "iter-folder"])
def test_validate_finds_nothing(run, source, flags):
    result = run("validate", source, *flags)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("VALID"), result.output


def test_every_chunk_is_a_byte_range_of_a_rank_file_at_its_global_offset():
    from ckpttool.readers import open_checkpoint

    checkpoint = open_checkpoint(ITERATION)
    assert checkpoint.data_files() == sorted(RANK_FILES)
    fc1 = checkpoint.tensors["model.decoder.layers.3.mlp.linear_fc1.weight"]  # stage 1's local layer 1
    assert fc1.shape == (128, 32)
    # [gate; up] per rank: rank 0's gate rows 0-31, rank 1's 32-63, rank 0's up rows 64-95, rank 1's 96-127
    assert [(c.offsets, c.blob.file) for c in fc1.chunks] == [
        ((0, 0), "mp_rank_00_001/model_optim_rng.pt"), ((32, 0), "mp_rank_01_001/model_optim_rng.pt"),
        ((64, 0), "mp_rank_00_001/model_optim_rng.pt"), ((96, 0), "mp_rank_01_001/model_optim_rng.pt")]
    proj = checkpoint.tensors["model.decoder.layers.0.self_attention.linear_proj.weight"]
    assert [c.offsets for c in proj.chunks] == [(0, 0), (0, 16)]  # row-parallel: dim 1
    norm = checkpoint.tensors["model.decoder.layers.2.input_layernorm.weight"]
    assert [c.blob.file for c in norm.chunks] == ["mp_rank_00_001/model_optim_rng.pt"]  # replicated: rank 0's


# -- consolidate ---------------------------------------------------------------------------------

def test_consolidate_equals_megatrons_own_gathered_tensors_byte_for_byte(consolidated):
    assert {key: describe(value) for key, value in consolidated.items()} == EXPECTED["tensors"]


def test_a_virtual_pipeline_save_consolidates_chunk_major_to_megatrons_own_tensors(run, tmp_path):
    from safetensors.torch import load_file

    from ckpttool.readers import open_checkpoint

    # interleaved: stage 0 holds layers 0 (model0) and 2 (model1), stage 1 layers 1 and 3
    checkpoint = open_checkpoint(VIRTUAL / "checkpoints")
    assert {c.blob.file for c in checkpoint.tensors["model.decoder.layers.1.input_layernorm.weight"].chunks} == {
        "mp_rank_00_001/model_optim_rng.pt"}
    assert {c.blob.file for c in checkpoint.tensors["model.decoder.layers.2.input_layernorm.weight"].chunks} == {
        "mp_rank_00_000/model_optim_rng.pt"}
    out = tmp_path / "model.safetensors"
    result = run("consolidate", VIRTUAL / "checkpoints", out, "--quiet")
    assert result.exit_code == 0, result.output
    expected = json.loads((VIRTUAL / "expected.json").read_text())
    assert expected["virtual_pipeline"] == 2
    assert {key: describe(value) for key, value in load_file(out).items()} == expected["tensors"]


def test_consolidate_keeps_the_padded_vocabulary_rows(consolidated):
    assert EXPECTED["vocab"] == {"tokens": 100, "padded": 128}
    assert consolidated["embedding.word_embeddings.weight"].shape == (128, 32)
    assert consolidated["output_layer.weight"].shape == (128, 32)


def test_consolidate_from_the_iteration_folder_writes_the_same_bytes(run, tmp_path, consolidated):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert run("consolidate", ITERATION, out, "--quiet").exit_code == 0
    again = load_file(out)
    assert {k: describe(v) for k, v in again.items()} == {k: describe(v) for k, v in consolidated.items()}


# -- export --------------------------------------------------------------------------------------

def test_export_loads_in_transformers_and_its_logits_match_megatrons_forward(run, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    result = run("export", RUN_DIR, out, "--assets", LEGACY / "hf")
    assert result.exit_code == 0, result.output
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(torch.tensor(EXPECTED["input_ids"])).logits
    megatron = load_file(LEGACY / "logits.safetensors")["logits"]
    assert logits.shape == megatron.shape == (1, 8, 128)
    assert float((logits - megatron).abs().max()) < LOGIT_TOLERANCE


@pytest.mark.parametrize("save", [LEGACY, VIRTUAL], ids=["pipeline-2", "virtual-pipeline-2"])
def test_export_without_assets_trims_the_padding_and_its_logits_match_megatrons_forward(run, tmp_path, save):
    import torch
    from transformers import AutoModelForCausalLM

    from safetensors.torch import load_file

    expected = json.loads((save / "expected.json").read_text())
    out = tmp_path / "hf"
    result = run("export", save / "checkpoints", out)
    assert result.exit_code == 0, result.output
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(torch.tensor(expected["input_ids"])).logits
    megatron = load_file(save / "logits.safetensors")["logits"]  # over all 128 padded rows
    assert logits.shape == (1, 8, 100) and megatron.shape == (1, 8, 128)  # NullTokenizer: 99 + its EOD token
    assert float((logits - megatron[..., :100]).abs().max()) < LOGIT_TOLERANCE


def test_the_pickled_args_give_the_config_json_of_the_model():
    from ckpttool.naming.megatron_config import hf_config
    from ckpttool.readers.megatron_legacy import Namespace, read_legacy_args

    args = read_legacy_args(ITERATION)
    assert args["tensor_model_parallel_size"] == 2 and args["padded_vocab_size"] == 128
    assert not any(isinstance(value, Namespace) for value in args.values())
    config = hf_config(args, str(ITERATION))
    expected = json.loads((LEGACY / "hf" / "config.json").read_text())
    fields = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
              "rms_norm_eps", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias")
    assert {name: config[name] for name in fields} == {name: expected[name] for name in fields}


# -- hostile and damaged input -------------------------------------------------------------------

def _rewrite_pickle(path: Path, edit) -> None:
    """Write the torch.save zip at `path` again with its data.pkl edited (every other entry as it was)."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries:
            archive.writestr(name, edit(data) if name.endswith("/data.pkl") else data)


def _global_outside_the_allowlist(folder: Path) -> None:
    def edit(data: bytes) -> bytes:
        assert data.count(b"cargparse\nNamespace\n") == 1
        return data.replace(b"cargparse\nNamespace\n", b"cposix\nsystem\n")

    _rewrite_pickle(folder / RANK_FILES[0], edit)


def _missing_rank_file(folder: Path) -> None:
    shutil.rmtree(folder / "mp_rank_01_001")


def _shapes_disagree(folder: Path) -> None:
    def narrow(state):
        key = "decoder.layers.0.mlp.linear_fc2.weight"
        state["model"][key] = state["model"][key][:, :-1].clone()

    resave(folder / "mp_rank_01_000/model_optim_rng.pt", narrow)


def _replicas_differ(folder: Path) -> None:
    def bump(state):
        state["model"]["decoder.layers.1.input_layernorm.weight"] += 1

    resave(folder / "mp_rank_01_000/model_optim_rng.pt", bump)


def _legacy_model_nesting(folder: Path) -> None:
    """One rank's `model` nested by module, as Megatron-LM's legacy models (and Megatron-DeepSpeed) save
    it: read (flattened; tests/test_megatron_deepspeed.py), so its names disagree with the other ranks'."""
    def nest(state):
        state["model"] = {"language_model": {"embedding": dict(state["model"])}}

    resave(folder / "mp_rank_00_000/model_optim_rng.pt", nest)


HOSTILE = {
    "legacy-model-nesting": (_legacy_model_nesting, "is on one tensor-parallel rank of stage 0 and not on mp_rank_00_000"),
    "global-outside-allowlist": (_global_outside_the_allowlist, "refuses to load `posix.system`"),
    "missing-rank-file": (_missing_rank_file, "mp_rank_01_001/model_optim_rng.pt: missing"),
    "shapes-disagree": (_shapes_disagree, "decoder.layers.0.mlp.linear_fc2.weight is float32 [32, 31]"),
    "replicas-differ": (_replicas_differ, "decoder.layers.1.input_layernorm.weight is replicated"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("command", ["validate", "consolidate", "export"])
def test_hostile_or_damaged_input_exits_1_in_one_line_and_writes_nothing(run, tmp_path, case, command):
    damage, message = HOSTILE[case]
    copy = tmp_path / "checkpoints"
    shutil.copytree(RUN_DIR, copy)
    damage(copy / ITERATION.name)
    out = tmp_path / "out"
    out.mkdir()
    args = {"validate": ("validate", copy), "consolidate": ("consolidate", copy, out / "model.safetensors", "--quiet"),
            "export": ("export", copy, out / "hf", "--assets", LEGACY / "hf")}[command]
    result = run(*args)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert message in lines[0], result.output
    # one line; validate adds its verdict, as for any checkpoint
    assert len(lines) == 1 or (command == "validate" and len(lines) == 2 and lines[1].startswith("INVALID")), result.output
    assert "Traceback" not in result.output
    assert list(out.iterdir()) == []
    assert not any(p.name.startswith(TEMP_PREFIX) for p in tmp_path.rglob("*"))


def test_a_file_holding_a_global_outside_the_allowlist_runs_nothing(tmp_path, monkeypatch):
    """The refused global is never looked up: posix.system would run if it were called."""
    import posix

    from ckpttool.core.errors import UnsafeMetadata
    from ckpttool.readers.megatron_legacy import read_megatron_legacy

    called = []
    monkeypatch.setattr(posix, "system", lambda *args: called.append(args))
    copy = tmp_path / "iter_0000002"
    shutil.copytree(ITERATION, copy)
    _global_outside_the_allowlist(copy)
    with pytest.raises(UnsafeMetadata):
        read_megatron_legacy(copy)
    assert called == []


# -- the rules as data ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, gated, rule", [
    ("embedding.word_embeddings.weight", True, "column"),
    ("decoder.layers.7.self_attention.linear_qkv.weight", True, "column"),
    ("decoder.layers.7.self_attention.linear_proj.weight", True, "row"),
    ("decoder.layers.7.mlp.linear_fc1.weight", True, "gated"),
    ("decoder.layers.7.mlp.linear_fc1.weight", False, "column"),
    ("decoder.layers.7.mlp.linear_fc2.weight", True, "row"),
    ("decoder.layers.7.pre_mlp_layernorm.weight", True, "replicated"),
    ("decoder.final_layernorm.weight", True, "replicated"),
    ("output_layer.weight", True, "column"),
    ("decoder.layers.7.mlp.router.weight", True, None),
])
def test_merge_rules_by_name_suffix(name, gated, rule):
    from ckpttool.readers.megatron_legacy import merge_rule

    assert merge_rule(name, gated) == rule


def test_ordered_dict_builds_become_pops_and_the_namespace_build_stays():
    import argparse
    from collections import OrderedDict

    from ckpttool.readers.megatron_legacy import ordered_dict_builds_as_pops

    state = OrderedDict(w=1)
    state._metadata = OrderedDict({"": {"version": 1}})  # what module.state_dict() carries
    raw = pickle.dumps({"args": argparse.Namespace(lr=0.1), "model": state}, protocol=2)
    edited = ordered_dict_builds_as_pops(raw)
    builds = [pos for op, _, pos in pickletools.genops(raw) if op.name == "BUILD"]
    assert len(builds) == 2 and len(edited) == len(raw)
    assert [edited[pos:pos + 1] for pos in builds] == [pickle.BUILD, pickle.POP]  # the Namespace's, the OrderedDict's
    loaded = pickle.load(io.BytesIO(edited))
    assert vars(loaded["args"]) == {"lr": 0.1} and not hasattr(loaded["model"], "_metadata")


# -- the pickled args stand in for --assets ------------------------------------------------------

def test_export_without_assets_takes_the_config_from_the_pickled_args(run, tmp_path):
    with_assets, without = tmp_path / "with", tmp_path / "without"
    # hf/config.json states the 128 padded rows; the args' NullTokenizer states 100 tokens (test_megatron_vocab.py)
    tokens = EXPECTED["vocab"]["tokens"]
    assert run("export", RUN_DIR, with_assets, "--assets", LEGACY / "hf", "--vocab-size", tokens, "--quiet").exit_code == 0
    result = run("export", RUN_DIR, without)
    assert result.exit_code == 0, result.output
    assert f"config: {ITERATION / RANK_FILES[0]}: args" in result.output
    assert (without / "model.safetensors").read_bytes() == (with_assets / "model.safetensors").read_bytes()
    config, expected = (json.loads((folder / "config.json").read_text()) for folder in (without, LEGACY / "hf"))
    fields = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings")
    assert {name: config[name] for name in fields} == {name: expected[name] for name in fields}
    assert config["vocab_size"] == tokens


def test_inspect_and_diff_read_the_pickled_args_as_export_does(run, tmp_path):
    result = run("inspect", RUN_DIR)
    assert "`ckpttool export` writes them as LlamaForCausalLM names (the config: model_optim_rng.pt's Megatron-LM " \
           "arguments" in result.output
    out = tmp_path / "hf"
    assert run("export", RUN_DIR, out, "--quiet").exit_code == 0
    for a, b in ((RUN_DIR, out), (out, RUN_DIR)):  # against its export: compared under transformers' names
        result = run("diff", a, b)
        assert result.exit_code == 0 and result.output.startswith(f"IDENTICAL: {a} and {b}: 39 tensors"), result.output
    flat = tmp_path / "megatron-names.safetensors"  # consolidate keeps Megatron's names: compared as they are
    assert run("consolidate", RUN_DIR, flat, "--quiet").exit_code == 0
    result = run("diff", RUN_DIR, flat)
    assert result.exit_code == 0 and "27 tensors" in result.output, result.output


# -- Megatron-Bridge's export --------------------------------------------------------------------

@pytest.mark.parametrize("save", [LEGACY, VIRTUAL], ids=["pipeline-2", "virtual-pipeline-2"])
def test_export_equals_megatron_bridges_export_with_the_padding_cut_byte_for_byte(run, tmp_path, save):
    # bridge_expected.json: Megatron-LM's load_checkpoint at the saved parallelism, then Megatron-Bridge
    # 0.3.1 LlamaBridge's stream_weights_megatron_to_hf, embedding and lm_head cut to the 100 tokens
    # (NeMo's prune_padding; Bridge has no cut): fixtures/frameworks/generate_megatron_legacy_bridge.py
    from safetensors.torch import load_file

    bridge = json.loads((save / "bridge_expected.json").read_text())
    out = tmp_path / "hf"
    result = run("export", save / "checkpoints", out)
    assert result.exit_code == 0, result.output
    exported = {name: describe(tensor) for path in sorted(out.glob("*.safetensors"))
                for name, tensor in load_file(path).items()}
    assert exported == bridge["tensors"] and len(exported) == 39
    assert exported["lm_head.weight"]["shape"] == [bridge["vocab"]["tokens"], 32] == [100, 32]


def test_a_signal_pickled_by_name_is_read_as_the_member(run, tmp_path, monkeypatch):
    """Python 3.11.0-3.11.4 pickle a global enum's member by name (`signal.SIGTERM`, not
    `signal.Signals(15)`): Megatron-LM's `args.exit_signal` in every save made there."""
    import signal

    from ckpttool.readers.megatron_legacy import EnumValue, read_legacy_args

    copy = tmp_path / "checkpoints"
    shutil.copytree(LEGACY / "checkpoints", copy)
    monkeypatch.setattr(signal.Signals, "__reduce_ex__", lambda member, protocol: member.name)
    for name in RANK_FILES:
        resave(copy / "iter_0000002" / name, lambda state: None)
    monkeypatch.undo()
    assert b"csignal\nSIGTERM\n" in (copy / "iter_0000002" / RANK_FILES[0]).read_bytes()
    assert read_legacy_args(copy / "iter_0000002")["exit_signal"] == EnumValue("Signals", signal.SIGTERM.value)
    result = run("export", copy, tmp_path / "hf", "--quiet")
    assert result.exit_code == 0, result.output
