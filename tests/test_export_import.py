"""`export` to a transformers/Hub folder and `import` back to a DCP checkpoint, proven with
the real loaders: transformers' `from_pretrained` and torch's `dcp.load`.

The fixtures (fixtures/generate_llama.py) are transformers' own tiny `LlamaForCausalLM`,
untied and tied, trained 2 steps under FSDP2 on 2 gloo ranks and saved with `dcp.save`,
with the full state dict taken from the live model. Logits are compared with those of a
model built on this machine from that state dict (`reference_logits`): the logits recorded in
the fixture come from the CPU that wrote it, and another CPU's kernels round differently in
the last bit. transformers is imported once per module (about 5 s).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, assert_same_bytes

pytest.importorskip("transformers")

CKPTTOOL = Path(sys.executable).with_name("ckpttool")
UNTIED, TIED = FIXTURES / "llama_world2", FIXTURES / "llama_tied_world2"
INPUT_IDS = [[1, 5, 9, 2, 33, 63, 0, 17], [40, 3, 3, 8, 21, 60, 11, 4]]  # fixtures/generate_llama.py


@pytest.fixture(scope="module")
def transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each fixture exported once with --assets config/: fixture dir -> output folder."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    root = tmp_path_factory.mktemp("exported")
    outputs = {}
    for fixture in (UNTIED, TIED):
        out = root / fixture.name
        result = CliRunner().invoke(main, ["export", str(fixture / "checkpoint"), str(out), "--assets",
                                           str(fixture / "config"), "-q"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        outputs[fixture] = out
    return outputs


def load_file(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def reference_logits(transformers, fixture: Path):
    """Logits of transformers' own model holding the live model's full state dict."""
    import torch

    config = transformers.AutoConfig.from_pretrained(fixture / "config")
    model = transformers.AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(load_file(fixture / "reference.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: one copy
    model.tie_weights()
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor(INPUT_IDS)).logits


def assert_loads_exactly(transformers, folder: Path, fixture: Path):
    """from_pretrained: nothing missing, unexpected or newly initialised; weights and logits exact."""
    import torch

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    state = model.state_dict()
    for key, expected in load_file(fixture / "reference.safetensors").items():
        assert_same_bytes(state[key], expected, key)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(INPUT_IDS)).logits
    assert_same_bytes(logits, reference_logits(transformers, fixture), "logits")
    return model


def test_export_with_assets_loads_in_transformers_with_the_live_models_weights_and_logits(transformers, exported):
    out = exported[UNTIED]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    # one shard: the whole file is what safetensors.save_file wrote for the gathered state dict
    assert (out / "model.safetensors").read_bytes() == (UNTIED / "reference.safetensors").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")} == json.loads(
        (UNTIED / "config" / "config.json").read_text())
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "Parameters: 19,616" in card and "step 2" in card
    assert_loads_exactly(transformers, out, UNTIED)


def test_export_of_a_tied_model_writes_one_copy_and_loads_tied(transformers, exported):
    out = exported[TIED]
    assert (out / "model.safetensors").read_bytes() == (TIED / "reference.safetensors").read_bytes()
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    model = assert_loads_exactly(transformers, out, TIED)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_export_bf16_equals_the_reference_cast_to_bfloat16_and_says_so_in_config(cli, tmp_path):
    import torch

    out = tmp_path / "bf16"
    result = cli("export", UNTIED / "checkpoint", out, "--assets", UNTIED / "config", "--dtype", "bf16",
                 "--max-shard-size", "30kB", "-q", "--json")
    document = json.loads(result.stdout)
    assert document["schema"] == "ckpttool.export/1" and document["dtype"] == "bfloat16"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    written = {}
    for shard in sorted(set(index["weight_map"].values())):
        assert json.loads((out / shard).read_bytes()[8:8 + struct.unpack("<Q", (out / shard).read_bytes()[:8])[0]])[
            "__metadata__"] == {"format": "pt"}
        written.update(load_file(out / shard))
    reference = load_file(UNTIED / "reference.safetensors")
    assert written.keys() == reference.keys()
    for key, value in reference.items():
        assert_same_bytes(written[key], value.to(torch.bfloat16), key)


def test_export_writes_the_trainers_stored_config_as_a_llama_config(transformers, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool import export

    reference = load_file(UNTIED / "reference.safetensors")
    saved = {"arch": "llama", "dim": 32, "layers": 2, "heads": 4, "vocab": 64, "seq_len": 64,
             "tie_embeddings": False}
    source = tmp_path / "step-00000007"
    dcp.save({"model": reference, "train": {"step": 7, "config": json.dumps(saved)}}, checkpoint_id=str(source))
    report = export(source, tmp_path / "out")
    assert report.step == 7 and report.config.endswith("train.config") and report.checked.startswith("every key")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["architectures"], config["num_key_value_heads"], config["intermediate_size"]) == (
        ["LlamaForCausalLM"], 2, 48)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(INPUT_IDS)).logits
    assert_same_bytes(logits, reference_logits(transformers, UNTIED), "logits")


def test_export_without_config_writes_weights_and_card_and_says_no_config(cli, tmp_path):
    result = cli("export", UNTIED / "checkpoint", tmp_path / "out", "-q")
    assert result.exit_code == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["README.md", "model.safetensors"]
    assert "no config.json written" in result.stderr


def test_export_copies_tokenizer_and_generation_files(cli, tmp_path):
    assets = tmp_path / "assets"
    shutil.copytree(UNTIED / "config", assets)
    for name in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        (assets / name).write_text(f"{name}\n")
    (assets / "notes.txt").write_text("not copied")
    cli("export", UNTIED / "checkpoint", tmp_path / "out", "--assets", assets, "-q")
    for name in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_text() == f"{name}\n"
    assert not (tmp_path / "out" / "notes.txt").exists()


@pytest.mark.parametrize("change, words", [
    ({"intermediate_size": 64}, ["model.layers.0.mlp.gate_proj.weight", "[48, 32]", "[64, 32]"]),
    ({"num_hidden_layers": 3}, ["model.layers.2.", "do not hold"]),
    ({"tie_word_embeddings": True}, ["lm_head.weight", "tie_word_embeddings"]),
])
def test_export_refuses_a_config_that_disagrees_with_the_weights_and_writes_nothing(cli, tmp_path, change, words):
    assets = tmp_path / "assets"
    shutil.copytree(UNTIED / "config", assets)
    config = json.loads((assets / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**config, **change}))
    result = cli("export", UNTIED / "checkpoint", tmp_path / "out", "--assets", assets)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "[config-mismatch]" in lines[0] and all(w in lines[0] for w in words), lines
    assert list(tmp_path.iterdir()) == [assets]


def test_export_refuses_weights_missing_from_a_reference_index(cli, tmp_path, exported):
    assets = tmp_path / "assets"
    shutil.copytree(UNTIED / "config", assets)
    weight_map = {key: "model.safetensors" for key in load_file(UNTIED / "reference.safetensors")}
    weight_map["model.extra.weight"] = "model.safetensors"
    (assets / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    result = cli("export", UNTIED / "checkpoint", tmp_path / "out", "--assets", assets)
    assert result.exit_code == 1 and "model.extra.weight" in result.stderr and not (tmp_path / "out").exists()


def test_export_caps_shards_at_the_hubs_50gb_file_limit(cli, tmp_path):
    result = cli("export", UNTIED / "checkpoint", tmp_path / "out", "--max-shard-size", "60GB")
    assert result.exit_code == 2 and "50GB" in result.stderr and not (tmp_path / "out").exists()


def test_import_of_the_export_at_world_3_loads_with_stock_dcp_and_consolidates_to_the_same_bytes(exported, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    for fixture, out in exported.items():
        imported = tmp_path / f"{fixture.name}-world3"
        result = subprocess.run([CKPTTOOL, "import", out, imported, "--world", "3", "-q"], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in imported.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
        reference = load_file(fixture / "reference.safetensors")
        state = {"model": {key: torch.zeros_like(value) for key, value in reference.items()}}
        dcp.load(state, checkpoint_id=str(imported), no_dist=True)
        for key, value in reference.items():
            assert_same_bytes(state["model"][key], value, key)
        again = tmp_path / f"{fixture.name}.safetensors"
        subprocess.run([CKPTTOOL, "consolidate", imported, again, "-q"], check=True)
        assert again.read_bytes() == (out / "model.safetensors").read_bytes()


def test_import_dry_run_plans_every_key_under_the_prefix_and_writes_nothing(cli, exported, tmp_path):
    result = cli("import", exported[UNTIED], tmp_path / "dst", "--world", "2", "--prefix", "", "--dry-run", "--json")
    document = json.loads(result.stdout)
    assert document["schema"] == "ckpttool.import/1" and document["prefix"] == "" and document["rule"] == "every-tensor"
    assert "lm_head.weight" in {t["fqn"] for t in document["tensors"]}
    assert not (tmp_path / "dst").exists()


def _corrupt_header(folder: Path) -> None:
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:12] = b"\x00{{{"
    (folder / "model.safetensors").write_bytes(bytes(data))


def _index_naming(shard: str):
    def damage(folder: Path) -> None:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": shard}}))
    return damage


@pytest.mark.parametrize("damage, words", [
    (_corrupt_header, ["model.safetensors", "header"]),
    (_index_naming("model-00002-of-00002.safetensors"), ["model-00002-of-00002.safetensors"]),
    (_index_naming("../x.safetensors"), ["../x.safetensors"]),
], ids=["corrupt-header", "missing-shard", "outside-the-folder"])
def test_import_of_bad_inputs_exits_1_with_one_line_and_leaves_nothing(cli, exported, tmp_path, damage, words):
    source = tmp_path / "src"
    shutil.copytree(exported[UNTIED], source)
    damage(source)
    (tmp_path / "x.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    result = cli("import", source, tmp_path / "dst", "--world", "3")
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and all(w in lines[0] for w in words), lines
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("library", [None, "transformers"])
def test_the_model_card_is_what_huggingface_hubs_model_card_writes(library):
    """The front matter is spelled out (importing huggingface_hub would cost every export
    0.4 s): byte for byte ModelCardData's YAML, and ModelCard parses the card back unchanged."""
    from huggingface_hub import ModelCard, ModelCardData

    from ckpttool.formats.card import CardFacts, CardTensor, model_card

    facts = CardFacts(source="runs/x/step-00000010", layout="dcp", step=10, dtype="bfloat16", parameters=12,
                      tensors=(CardTensor("model.layers.0.w", "bfloat16", (3, 4), 24),), files=(("model.safetensors", 120),),
                      command="ckpttool export runs/x out", version="0", architecture="LlamaForCausalLM", library=library)
    card = model_card(facts)
    yaml = ModelCardData(library_name=library, tags=["ckpttool"]).to_yaml()
    assert card.startswith(f"---\n{yaml}\n---\n\n") and str(ModelCard(card)) == card
    assert ModelCard(card).data.to_dict() == {**({"library_name": library} if library else {}), "tags": ["ckpttool"]}
