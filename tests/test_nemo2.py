"""NeMo 2 checkpoints: a run folder written by NeMo 2.7.3's own `llm.train` (ModelCheckpoint and
MegatronCheckpointIO) of a tiny Llama on CPU (fixtures/frameworks/generate_nemo2.py): two
checkpoints of step 3, `<name>--...-step=3-consumed_samples=4.0` and its `-last` copy, each
`context/` (model.yaml, io.json, a pickled artifact) beside `weights/` (Megatron `torch_dist`,
model keys under `module.`).

The references are NeMo's own, from the `-last` checkpoint (fixtures/frameworks/nemo2/reference/):
hf/ is NeMo's HF exporter's output (`llm.export_ckpt(..., target="hf")`), expected.json the
sha256 of every tensor of the model that exporter loaded (megatron's dist_checkpointing.load),
logits.json that model's forward. No NeMo or megatron is imported here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, tensor_bytes

from ckpttool.outputs.temps import TEMP_PREFIX

NEMO2 = FIXTURES / "frameworks" / "nemo2"
RUN_DIR = NEMO2 / "llama" / "checkpoints"
NAME = "model_name=0--val_loss=0.00-step=3-consumed_samples=4.0"
NEWEST = RUN_DIR / f"{NAME}-last"
REFERENCE = NEMO2 / "reference"
EXPECTED = json.loads((REFERENCE / "expected.json").read_text())
SOURCES = [RUN_DIR, NEWEST, RUN_DIR / NAME]
SOURCE_IDS = ["run-folder", "checkpoint-last", "checkpoint"]
# NeMo's forward (megatron-core's local spec: its rotary, core attention and softmax) and
# transformers' eager Llama add float32 in other orders: the megatron gpt family's logit tolerance
LOGIT_TOLERANCE = 1e-4
# config.json keys NeMo's exporter writes that ckpttool's does not: transformers' defaults
# `save_pretrained` writes for any LlamaConfig, and the tokenizer's ids (read from NeMo's tokenizer
# object, which ckpttool never builds). ckpttool's adds torch_dtype and rope_parameters (the
# names transformers 4 and 5 read), and writes `dtype` as NeMo's does.
NOT_WRITTEN = {"bos_token_id", "eos_token_id", "pretraining_tp", "rope_scaling", "transformers_version", "use_cache"}


def describe(tensor) -> dict:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(tensor_bytes(tensor)).hexdigest()}


# -- detection, inspect, validate, latest --------------------------------------------------------

@pytest.mark.parametrize("source", SOURCES, ids=SOURCE_IDS)
def test_inspect_finds_the_nemo2_layout_by_structure(run, source):
    result = run("inspect", source, "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["layout"] == "nemo2"
    expected = NEWEST if source == RUN_DIR else source
    assert Path(document["path"]) == expected / "weights"
    assert document["groups"]["model"]["tensors"] == len(EXPECTED["tensors"]) == 15
    # the names are Megatron's under DDP's `module.`; the architecture is what context/model.yaml says
    assert document["family"]["name"] == "megatron gpt"
    assert document["family"]["named_by"] == {"architecture": "LlamaForCausalLM", "config": "NeMo's context/model.yaml"}
    text = run("inspect", source).stdout
    assert text.startswith(f"{expected / 'weights'}  (DCP 1.0.0, .metadata)")
    assert "writes them as LlamaForCausalLM names (the config: NeMo's context/model.yaml;" in text


def test_the_run_folder_reads_the_newest_step_then_the_last_copy():
    from ckpttool.readers import detect

    detection = detect(RUN_DIR)
    assert (detection.layout, detection.newest, detection.newest_by) == (
        "nemo2", NEWEST.name, "highest number, then NeMo's -last")
    assert detection.checkpoints == (NAME, NEWEST.name)


def test_run_folders_are_ordered_by_the_step_in_the_name_never_by_name_order():
    from ckpttool.readers.detect import run_entry_order, step_of

    names = ["m--val_loss=0.50-step=12-consumed_samples=96.0", "m--val_loss=0.10-step=3-consumed_samples=24.0-last",
             "m--val_loss=0.90-step=100-consumed_samples=800.0-last", "m--val_loss=0.10-step=3-consumed_samples=24.0"]
    assert [step_of(name) for name in names] == [12, 3, 100, 3]
    assert sorted(names, key=run_entry_order) == [names[3], names[1], names[0], names[2]]
    assert step_of("epoch=0-step=10.ckpt") == 10 and step_of("restep=4-x") is None


def test_the_parent_folders_of_the_run_read_its_newest_checkpoint():
    from ckpttool.readers import detect

    assert detect(NEMO2 / "llama").path == NEWEST / "weights"


def test_latest_picks_the_last_copy_of_the_newest_step():
    from ckpttool.commands.latest import latest

    report = latest(RUN_DIR)
    assert report.chosen == NEWEST
    assert [(step.name, step.verdict, step.layout) for step in report.steps] == [(NEWEST.name, "whole", "nemo2")]
    assert report.not_looked_at == 1


@pytest.mark.parametrize("flags", [(), ("--deep",)], ids=["validate", "validate-deep"])
@pytest.mark.parametrize("source", SOURCES[:2], ids=SOURCE_IDS[:2])
def test_validate_finds_nothing(run, source, flags):
    result = run("validate", source, *flags)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("VALID"), result.output


# -- consolidate ---------------------------------------------------------------------------------

@pytest.mark.parametrize("source", SOURCES[:2], ids=SOURCE_IDS[:2])
def test_consolidate_equals_the_tensors_megatron_loaded_into_nemos_model(run, tmp_path, source):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = run("consolidate", source, out, "--quiet")
    assert result.exit_code == 0, result.output
    assert {key: describe(value) for key, value in load_file(out).items()} == EXPECTED["tensors"]


# -- export --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory, run):
    """`ckpttool export RUN_DIR OUT` without --assets: config.json from context/model.yaml."""
    out = tmp_path_factory.mktemp("nemo2") / "hf"
    result = run("export", RUN_DIR, out)
    assert result.exit_code == 0, result.output
    assert f"config: {NEWEST / 'context' / 'model.yaml'}" in result.output
    return out


def test_export_equals_nemos_own_exporter_byte_for_byte(exported):
    from safetensors.torch import load_file

    ours, nemo = load_file(exported / "model.safetensors"), load_file(REFERENCE / "hf" / "model.safetensors")
    assert sorted(ours) == sorted(nemo)
    assert {key: describe(value) for key, value in ours.items()} == {key: describe(value) for key, value in nemo.items()}


def test_export_from_the_checkpoint_folder_and_weights_folder_write_the_same_bytes(run, tmp_path, exported):
    for source in (NEWEST, NEWEST / "weights"):
        out = tmp_path / source.name
        result = run("export", source, out)
        assert result.exit_code == 0, result.output
        assert (out / "model.safetensors").read_bytes() == (exported / "model.safetensors").read_bytes()
        assert (out / "config.json").read_bytes() == (exported / "config.json").read_bytes()


def test_the_config_json_states_what_nemos_exporter_states(exported):
    ours = json.loads((exported / "config.json").read_text())
    nemo = json.loads((REFERENCE / "hf" / "config.json").read_text())
    assert {key: ours[key] for key in nemo if key not in NOT_WRITTEN} == {
        key: value for key, value in nemo.items() if key not in NOT_WRITTEN}
    assert set(ours) - set(nemo) == {"torch_dtype", "rope_parameters"}
    assert nemo["rope_scaling"] is None and ours["rope_parameters"]["rope_type"] == "default"


def test_export_loads_in_transformers_and_its_logits_match_nemos_forward(exported):
    import torch
    from transformers import AutoModelForCausalLM

    reference = json.loads((REFERENCE / "logits.json").read_text())
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(torch.tensor(reference["input_ids"])).logits
    nemo = torch.tensor(reference["logits"], dtype=torch.float32)
    assert logits.shape == nemo.shape == (1, 12, 256)
    assert float((logits - nemo).abs().max()) < LOGIT_TOLERANCE


def test_the_vocabulary_is_the_tokenizers_padded_as_nemo_pads_it():
    from ckpttool.naming.nemo_config import megatron_args, read_model_yaml

    model = read_model_yaml(NEWEST / "context" / "model.yaml")
    assert megatron_args(model, "model.yaml")["padded_vocab_size"] == 256  # 256 bytes: a multiple of 128
    model["tokenizer"]["vocab_size"] = 300
    model["config"]["tensor_model_parallel_size"] = 2
    assert megatron_args(model, "model.yaml")["padded_vocab_size"] == 512  # up to a multiple of 128 x TP 2
    model["config"]["vocab_size"] = 320  # the config's own, when set, as GPTConfig.configure_model takes it
    assert megatron_args(model, "model.yaml")["padded_vocab_size"] == 320


# -- hostile and unsupported input ---------------------------------------------------------------

def _edit(old: str, new: str):
    def edit(yaml_path: Path) -> None:
        text = yaml_path.read_text()
        assert text.count(old) == 1, old
        yaml_path.write_text(text.replace(old, new))
    return edit


# case -> (the edit of the newest checkpoint's model.yaml, what the one line says)
HOSTILE = {
    "context-disagrees-with-weights": (_edit("  vocab_size: 256\n", "  vocab_size: 300\n"),
                                       "config-mismatch"),
    "python-tag": (_edit("  num_layers: 2\n", "  num_layers: !!python/object/apply:posix.system ['touch pwned']\n"),
                   "config.num_layers carries the tag tag:yaml.org,2002:python/object/apply:posix.system"),
    "model-class-without-table": (
        _edit("_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\n",
              "_target_: nemo.collections.llm.gpt.model.gemma.GemmaModel\n"),
        "_target_='nemo.collections.llm.gpt.model.gemma.GemmaModel': a NeMo model class with no table"),
    "llama31-rope-scaling": (
        _edit("  _target_: nemo.collections.llm.gpt.model.llama.LlamaConfig\n",
              "  _target_: nemo.collections.llm.gpt.model.llama.Llama31Config\n"),
        "config._target_='nemo.collections.llm.gpt.model.llama.Llama31Config'"),
    "unrepresentable-field": (_edit("  rotary_interleaved: false\n", "  rotary_interleaved: true\n"),
                              "config.rotary_interleaved=True"),
    "other-activation": (_edit("    _target_: torch.nn.functional.silu\n", "    _target_: torch.nn.functional.gelu\n"),
                         "config.activation_func="),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("source", ["run-folder", "checkpoint"])
def test_a_bad_context_exits_1_in_one_line_naming_the_file_and_field_and_writes_nothing(
        run, tmp_path, monkeypatch, case, source):
    import posix

    called: list = []
    monkeypatch.setattr(posix, "system", lambda *args: called.append(args))
    edit, message = HOSTILE[case]
    copy = tmp_path / "checkpoints"
    shutil.copytree(RUN_DIR, copy)
    model_yaml = copy / NEWEST.name / "context" / "model.yaml"
    edit(model_yaml)
    out = tmp_path / "out"
    out.mkdir()
    result = run("export", copy if source == "run-folder" else copy / NEWEST.name, out / "hf")
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert message in lines[0], result.output
    assert str(model_yaml) in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert list(out.iterdir()) == [] and called == []
    assert not any(p.name.startswith(TEMP_PREFIX) for p in tmp_path.rglob("*"))


def test_a_config_that_disagrees_with_the_weights_names_the_key(run, tmp_path):
    copy = tmp_path / "checkpoints"
    shutil.copytree(RUN_DIR, copy)
    HOSTILE["context-disagrees-with-weights"][0](copy / NEWEST.name / "context" / "model.yaml")
    result = run("export", copy, tmp_path / "hf")
    assert result.exit_code == 1
    assert "model.embed_tokens.weight" in result.output and "384" in result.output and "256" in result.output, \
        result.output


def test_the_pickled_context_artifact_is_never_opened(tmp_path, monkeypatch):
    """The uuid-named pickle beside model.yaml: replaced by bytes that are no pickle, export still reads."""
    from ckpttool.naming.nemo_config import context_dir, nemo_hf_config

    copy = tmp_path / "checkpoints"
    shutil.copytree(RUN_DIR, copy)
    context = context_dir(copy)
    assert context == copy / NEWEST.name / "context"
    (artifact,) = [p for p in context.iterdir() if p.name not in ("io.json", "model.yaml")]
    artifact.write_bytes(b"not a pickle")
    (context / "io.json").write_text("not json")
    assert nemo_hf_config(context)["architectures"] == ["LlamaForCausalLM"]


def test_model_yaml_aliases_are_walked_once_not_expanded(tmp_path):
    """A YAML alias bomb (10^24 leaves if expanded) is checked in the size of the file."""
    from ckpttool.core.errors import CorruptMetadata
    from ckpttool.naming.nemo_config import read_model_yaml

    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 25)]
    path = tmp_path / "model.yaml"
    path.write_text("\n".join(lines) + "\n")
    assert set(read_model_yaml(path)) == {f"a{i}" for i in range(25)}
    path.write_text("&a [*a]\n")
    with pytest.raises(CorruptMetadata, match="holds a list"):
        read_model_yaml(path)


def test_a_higher_step_wins_over_name_order_and_an_unfinished_save_is_passed_over(tmp_path):
    from ckpttool.commands.latest import latest
    from ckpttool.readers import detect

    run_dir = tmp_path / "checkpoints"
    shutil.copytree(RUN_DIR, run_dir)
    step12 = run_dir / "model_name=0--val_loss=0.00-step=12-consumed_samples=13.0"  # before step=3 in name order
    shutil.copytree(NEWEST, step12)
    assert detect(run_dir).newest == step12.name
    step20 = run_dir / "model_name=0--val_loss=0.00-step=20-consumed_samples=21.0-last"
    shutil.copytree(NEWEST, step20)
    marker = step20.with_name(step20.name + "-unfinished")  # NeMo's ModelCheckpoint: the save did not finish
    marker.touch()
    assert detect(run_dir).newest == step12.name
    report = latest(run_dir)
    assert report.chosen == step12
    assert [step.name for step in report.steps] == [step20.name, step12.name]
    assert "-unfinished marker beside it: the save did not finish" in report.steps[0].reason()
    marker.unlink()
    assert detect(run_dir).newest == latest(run_dir).chosen.name == step20.name


def test_diff_compares_the_run_with_nemos_export_under_transformers_names(run):
    for a, b in ((RUN_DIR, REFERENCE / "hf"), (REFERENCE / "hf", RUN_DIR)):
        result = run("diff", a, b)
        assert result.exit_code == 0, result.output
        assert result.output.startswith(f"IDENTICAL: {a} and {b}: 21 tensors"), result.output
