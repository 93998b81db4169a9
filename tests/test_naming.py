"""Framework names -> transformers names (ckpttool/naming): the engine applied to torchtitan's
tables, on checkpoints torchtitan 0.3.0 wrote itself (fixtures/frameworks/generate_torchtitan.py).

The engine is pure and tested without files; export of a real torchtitan Llama then writes
what torchtitan's own `Llama3StateDictAdapter.to_hf` computes (its `_permute`, ported below
as the literal view/transpose), and transformers loads it with nothing missing.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import FIXTURES, assert_same_bytes

from ckpttool import naming
from ckpttool.core.errors import InvalidCheckpoint
from ckpttool.naming import convert, find_family, rotary_rows

FAMILIES = naming.FAMILIES
LLAMA3, QWEN3 = naming.family("torchtitan llama3"), naming.family("torchtitan qwen3")

TITAN = FIXTURES / "frameworks" / "torchtitan"
STEP = TITAN / "checkpoint" / "step-20"
CONFIG = TITAN / "hf_config"


def titan_permute(w, heads: int):
    """torchtitan 0.3.0 llama3/state_dict_adapter.py `_permute` (HF's conversion script)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("rows, heads", [(8, 2), (64, 4), (48, 1), (96, 12)])
def test_rotary_rows_is_torchtitans_permute(rows, heads):
    import torch

    weight = torch.arange(rows * 3).reshape(rows, 3)
    assert torch.equal(weight[rotary_rows(rows, heads)], titan_permute(weight, heads))


def test_the_family_is_found_from_the_names_and_unknown_keys_are_refused():
    keys = ["tok_embeddings.weight", "layers.0.attention.qkv_linear.wq.weight", "norm.weight"]
    assert find_family(keys, FAMILIES) is LLAMA3
    assert find_family(keys + ["layers.0.attention.q_norm.weight"], FAMILIES) is QWEN3
    assert find_family(["model.embed_tokens.weight"], FAMILIES) is None
    with pytest.raises(InvalidCheckpoint, match="layers.0.attention.mystery.weight"):
        convert(LLAMA3, {"layers.0.attention.mystery.weight": (4, 4)}, {"num_attention_heads": 2}, "ckpt")


def test_grouped_experts_become_one_key_per_expert():
    targets = convert(QWEN3, {"layers.1.moe.routed_experts.inner_experts.w2_EDF": (3, 8, 5),
                              "layers.1.moe.tokens_per_expert": (3,)}, {}, "ckpt")
    assert list(targets) == [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(3)]
    assert all(t.shape == (8, 5) for t in targets.values())
    assert targets["model.layers.1.mlp.experts.2.down_proj.weight"].pieces[0].box == ((2, 0, 0), (1, 8, 5))


def test_a_head_count_that_does_not_fit_the_rows_is_a_config_mismatch():
    with pytest.raises(InvalidCheckpoint, match="wq.weight of shape \\[16, 16\\] does not split into 3 heads"):
        convert(LLAMA3, {"layers.0.attention.qkv_linear.wq.weight": (16, 16)}, {"num_attention_heads": 3}, "ckpt")


def test_export_of_a_torchtitan_llama_writes_torchtitans_to_hf(tmp_path, cli):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    result = cli("export", STEP, out, "--assets", CONFIG)
    assert result.exit_code == 0, result.output
    assert "converted torchtitan llama3 names" in result.output
    written = load_file(str(out / "model.safetensors"))
    expected = json.loads((TITAN / "expected.json").read_text())
    import ckpttool

    source = ckpttool.load_state_dict(STEP)
    heads = json.loads((CONFIG / "config.json").read_text())["num_attention_heads"]
    assert_same_bytes(written["model.layers.0.self_attn.q_proj.weight"],
                      titan_permute(source["layers.0.attention.qkv_linear.wq.weight"], heads))
    assert_same_bytes(written["model.layers.0.self_attn.k_proj.weight"],
                      titan_permute(source["layers.0.attention.qkv_linear.wk.weight"], heads))
    assert_same_bytes(written["model.embed_tokens.weight"], source["tok_embeddings.weight"])
    assert len(written) == len([k for k in expected["tensors"]])
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_without_the_head_counts_export_exits_2_naming_them_and_assets(tmp_path, cli):
    result = cli("export", STEP, tmp_path / "hf")
    assert result.exit_code == 2 and "num_attention_heads" in result.output and "--assets" in result.output
    assert not (tmp_path / "hf").exists()


def test_a_config_with_other_head_counts_exits_1_and_writes_nothing(tmp_path, cli):
    assets = tmp_path / "assets"
    shutil.copytree(CONFIG, assets)
    config = json.loads((assets / "config.json").read_text())
    config["num_attention_heads"] = 3
    (assets / "config.json").write_text(json.dumps(config))
    result = cli("export", STEP, tmp_path / "hf", "--assets", assets)
    assert result.exit_code == 1 and "config-mismatch" in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_consolidate_keeps_the_frameworks_own_names(tmp_path, cli):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert cli("consolidate", STEP, out).exit_code == 0
    assert "layers.0.attention.qkv_linear.wq.weight" in load_file(str(out))


def test_rules_are_data_one_table_per_family():
    """Each family is one file of naming/families/ holding one FAMILY, listed once in the
    registry (naming.REGISTRY) with its own name and signature (what `inspect` matches without
    importing the file); every rule
    names a transform of the engine's TRANSFORMS, with as many targets as it gives."""
    from pathlib import Path

    from ckpttool.naming import REGISTRY, families

    files = sorted(p.stem for p in Path(families.__file__).parent.glob("*.py") if p.stem != "__init__")
    assert sorted(entry.module for entry in REGISTRY) == files
    assert len({entry.name for entry in REGISTRY}) == len(REGISTRY)
    for entry, family in zip(REGISTRY, FAMILIES):
        assert (entry.name, entry.signature) == (family.name, family.signature), entry.module
    assert all(rule.transform in naming.TRANSFORMS and len(rule.targets) == naming.TRANSFORMS[rule.transform].targets
               for family in FAMILIES for rule in family.rules)


def test_inspect_names_the_family_and_each_tensors_transformers_name(cli):
    document = json.loads(cli("inspect", STEP, "--json").output)
    assert document["family"] == {"name": "torchtitan llama3", "architectures": ["LlamaForCausalLM"], "named_by": None}
    names = {t["fqn"]: t["hf_names"] for t in document["tensors"] if t["group"] == "model"}
    assert names["layers.0.attention.qkv_linear.wq.weight"] == ["model.layers.0.self_attn.q_proj.weight"]
    assert names["tok_embeddings.weight"] == ["model.embed_tokens.weight"]
    assert "torchtitan llama3" in cli("inspect", STEP).output


def test_a_config_of_another_architecture_exits_1_naming_both(tmp_path, cli):
    assets = tmp_path / "assets"
    shutil.copytree(CONFIG, assets)
    config = json.loads((assets / "config.json").read_text())
    config["architectures"], config["model_type"] = ["Qwen3ForCausalLM"], "qwen3"
    (assets / "config.json").write_text(json.dumps(config))
    result = cli("export", STEP, tmp_path / "hf", "--assets", assets)
    assert result.exit_code == 1 and "Qwen3ForCausalLM" in result.output and "LlamaForCausalLM" in result.output
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------------
# torchtitan 0.3.0's families, written by torchtitan itself (generate_torchtitan_families.py)


FAMILY_FIXTURES = FIXTURES / "frameworks" / "torchtitan_families"
# listed, not globbed: a fixture that went missing fails (test_every_family_fixture_is_on_disk), never skips
CHECKPOINTS = ["deepseek_v3", "llama3", "qwen3", "qwen3_moe", "qwen3_moe/ep2_world4"]


def family_of(name: str):
    return FAMILY_FIXTURES / name.split("/")[0]


def raw_sha256(tensor) -> str:
    import hashlib

    import torch

    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def family_exports(tmp_path_factory, run) -> dict:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name in CHECKPOINTS:
        step = next((FAMILY_FIXTURES / name / "checkpoint").iterdir())
        target = root / name.replace("/", "-")
        # torchtitan's to_hf leaves the MoE router's load-balancing bias out too (transformers' Qwen3-MoE
        # has no place for it): told so, as export asks (tests/test_export_never_guesses.py)
        drop = ("--drop", "*.moe.expert_bias_E") if name.startswith("qwen3_moe") else ()
        result = run("export", step, target, "--assets", family_of(name) / "hf", *drop)
        out[name] = (target, result)
    return out


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_export_equals_torchtitans_own_to_hf_byte_for_byte(family_exports, name):
    from safetensors.torch import load_file

    target, result = family_exports[name]
    assert result.exit_code == 0, result.output
    expected = json.loads((FAMILY_FIXTURES / name / "expected_hf.json").read_text())["tensors"]
    written = {}
    for file in sorted(target.glob("*.safetensors")):
        written.update(load_file(str(file)))
    assert sorted(written) == sorted(expected)
    for key, tensor in written.items():
        assert [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")] == [expected[key]["shape"],
                                                                                   expected[key]["dtype"]], key
        assert raw_sha256(tensor) == expected[key]["sha256"], key


def logit_tolerance(checkpoint, config_dir) -> float:
    """The largest |framework logits - transformers logits| allowed: what the family naming
    `checkpoint` states for the architecture of `config_dir`'s config.json
    (`Architecture.logit_tolerance`, with why it is not 0: the weights are the same bytes, the
    forwards add float32 in other orders)."""
    import ckpttool

    family = naming.family(ckpttool.inspect(checkpoint).family)
    (name,) = json.loads((config_dir / "config.json").read_text())["architectures"]
    architecture = family.architecture(name)
    assert architecture is not None and architecture.logit_tolerance is not None, (family.name, name)
    return architecture.logit_tolerance


@pytest.mark.parametrize("name", [n for n in CHECKPOINTS if "/" not in n])
def test_transformers_loads_the_export_with_torchtitans_logits(family_exports, name):
    """transformers loads the export with nothing missing; only DeepSeek's MTP layer, which
    transformers does not build (it ignores the layer after the main ones), is unexpected."""
    import torch
    import transformers
    from safetensors.torch import load_file

    target, result = family_exports[name]
    assert result.exit_code == 0, result.output
    model, info = transformers.AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    config = json.loads((target / "config.json").read_text())
    mtp = f"model.layers.{config['num_hidden_layers']}."
    unexpected = [key for key in info["unexpected_keys"] if not (config.get("num_nextn_predict_layers") and key.startswith(mtp))]
    assert not info["missing_keys"] and not unexpected and not info["mismatched_keys"], info
    ids = json.loads((family_of(name) / "inputs.json").read_text())["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits
    expected = load_file(str(family_of(name) / "logits.safetensors"))
    (reference,) = expected.values()
    step = next((FAMILY_FIXTURES / name / "checkpoint").iterdir())
    assert float((logits - reference).abs().max()) < logit_tolerance(step, family_of(name) / "hf")


# ---------------------------------------------------------------------------------------------
# Megatron-Core GPT (torch_dist), written by megatron-core itself (generate_megatron_families.py);
# the reference is Megatron-Bridge's own mapping of the gathered weights


MEGATRON = FIXTURES / "frameworks" / "megatron_families"
MEGATRON_CASES = ["llama_tp2", "moe", "moe_ep2"]


def test_every_family_fixture_is_on_disk():
    """The families' fixtures are listed by name, not found by a glob: one that went missing
    fails here instead of its tests quietly not being collected."""
    paths = [FAMILY_FIXTURES / name / file for name in CHECKPOINTS for file in ("expected_hf.json", "checkpoint")]
    paths += [family_of(name) / "hf" for name in CHECKPOINTS]
    paths += [MEGATRON / name / file for name in MEGATRON_CASES for file in ("hf/config.json", "checkpoints")]
    assert [str(path) for path in paths if not path.exists()] == []
    assert all(any((FAMILY_FIXTURES / name / "checkpoint").iterdir()) for name in CHECKPOINTS)


@pytest.fixture(scope="module")
def megatron_exports(tmp_path_factory, run) -> dict:
    root = tmp_path_factory.mktemp("megatron")
    return {name: (root / name, run("export", MEGATRON / name / "checkpoints", root / name, "--assets",
                                    MEGATRON / name / "hf")) for name in MEGATRON_CASES}


@pytest.mark.parametrize("name", MEGATRON_CASES)
def test_megatron_export_equals_megatron_bridges_conversion_byte_for_byte(megatron_exports, name):
    from safetensors.torch import load_file

    target, result = megatron_exports[name]
    assert result.exit_code == 0, result.output
    written = {}
    for file in sorted(target.glob("*.safetensors")):
        written.update(load_file(str(file)))
    expected = load_file(str(MEGATRON / name / "hf" / "model.safetensors"))
    assert sorted(written) == sorted(expected)
    for key, tensor in expected.items():
        assert_same_bytes(written[key], tensor, key)


@pytest.mark.parametrize("name", MEGATRON_CASES)
def test_transformers_loads_the_megatron_export_with_megatrons_logits(megatron_exports, name):
    """Within the family's stated tolerance (1e-4: Megatron's forward, tensor-parallel partial
    sums gathered, its own rotary and softmax, and transformers' eager one add float32 in other
    orders); the weights are the same bytes."""
    import torch
    import transformers
    from safetensors.torch import load_file

    target, result = megatron_exports[name]
    assert result.exit_code == 0, result.output
    model, info = transformers.AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = json.loads((MEGATRON / name / "inputs.json").read_text())["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits
    (reference,) = load_file(str(MEGATRON / name / "logits.safetensors")).values()
    assert float((logits - reference).abs().max()) < logit_tolerance(MEGATRON / name / "checkpoints", MEGATRON / name / "hf")


# ---------------------------------------------------------------------------------------------
# The same view everywhere: diff --assets, ckpttool.open(assets=), load_into


@pytest.mark.parametrize("name", CHECKPOINTS + [f"megatron:{n}" for n in MEGATRON_CASES])
def test_diff_of_a_checkpoint_against_its_export_says_identical(family_exports, megatron_exports, cli, name):
    if name.startswith("megatron:"):
        case = name.split(":", 1)[1]
        source, (target, result), assets = MEGATRON / case / "checkpoints", megatron_exports[case], MEGATRON / case / "hf"
    else:
        source = next((FAMILY_FIXTURES / name / "checkpoint").iterdir())
        (target, result), assets = family_exports[name], family_of(name) / "hf"
    assert result.exit_code == 0, result.output
    compared = cli("diff", source, target, "--assets", assets)
    assert compared.exit_code == 0 and compared.output.startswith("IDENTICAL"), compared.output


@pytest.mark.parametrize("name, source", [("qwen3", "torchtitan"), ("llama3", "torchtitan"), ("llama_tp2", "megatron")])
def test_load_into_a_transformers_model_straight_from_the_frameworks_checkpoint(name, source):
    import transformers

    import ckpttool

    if source == "megatron":
        checkpoint, assets = MEGATRON / name / "checkpoints", MEGATRON / name / "hf"
    else:
        checkpoint, assets = next((FAMILY_FIXTURES / name / "checkpoint").iterdir()), FAMILY_FIXTURES / name / "hf"
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(assets))
    assert ckpttool.load_into(model, checkpoint, assets=assets) == ([], [])  # a tied lm_head loads with the embedding
    reference = transformers.AutoModelForCausalLM.from_pretrained(assets)  # the framework's own conversion
    for (key, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        assert_same_bytes(value, expected, key)
    with ckpttool.open(checkpoint, assets=assets) as handle:
        key = "model.layers.0.self_attn.q_proj.weight"
        assert_same_bytes(handle.get_tensor(key), reference.state_dict()[key], key)


# ---------------------------------------------------------------------------------------------
# The engine's vocabulary: patterns, transforms, and the families as values


def test_a_pattern_matches_exactly_what_its_regex_fullmatched():
    """The split patterns (no regex compiled per table) take the keys the placeholder regex took."""
    import random
    import re

    def regex(pattern: str) -> re.Pattern:
        text = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
        return re.compile(text.replace(r"\{M\}", r"(?P<M>\d+)"))

    patterns = sorted({rule.source for family in FAMILIES for rule in family.rules} |
                      {pattern for family in FAMILIES for pattern in (*family.ignored, *family.signature)})
    rng = random.Random(0)
    keys = [p.replace("{L}", str(rng.choice([0, 7, 12, 305]))).replace("{E}", str(rng.choice([0, 3, 64])))
            .replace("{M}", "1") for p in patterns]
    keys += [key[:cut] + rng.choice(["x", "1", ".", "", "01", "٣"]) + key[cut:] for key in keys
             for cut in rng.sample(range(len(key) + 1), 4)]
    matched = 0
    for pattern in patterns:
        split = naming.Rule("x", pattern).pattern
        for key in keys:
            found = regex(pattern).fullmatch(key)
            assert split.match(key) == (found.groupdict() if found else None), (pattern, key)
            matched += found is not None
    assert matched > len(patterns)


def test_a_pattern_whose_placeholder_runs_into_digits_is_refused_when_built():
    from ckpttool.naming import Pattern

    for text in ("layers.{L}{E}.w", "layers.{L}1.w", "experts.{E}.w{E}"):
        with pytest.raises(ValueError, match="ambiguous"):
            Pattern(text)


def test_every_transform_states_its_targets_and_its_inverse_and_a_rule_is_checked_against_them():
    """Each transform says how many tensors it gives and the transform that undoes it (issue 46
    runs the same tables backwards); a rule naming the wrong number fails when its table is built."""
    for name, transform in naming.TRANSFORMS.items():
        assert transform.targets >= 1 and (transform.inverse is None or isinstance(transform.inverse, str)), name
    assert naming.TRANSFORMS[naming.RENAME].inverse == naming.RENAME
    with pytest.raises(ValueError, match="split-halves"):
        naming.Rule(("a", "b", "c"), "layers.{L}.w", naming.SPLIT_HALVES)
    with pytest.raises(ValueError, match="no-such"):
        naming.Rule("a", "layers.{L}.w", "no-such")
    assert naming.Rule("a", "w").targets == ("a",) and naming.Rule(("a", "b"), "w", naming.SPLIT_HALVES).targets == ("a", "b")


def test_families_are_values_and_agree_on_what_they_state_of_an_architecture():
    """A family is a frozen value holding nothing mutable (it hashes); families converting to
    the same architecture state the same model_type, dense biases and fused layout; Megatron's
    arguments choose one architecture each."""
    assert len({hash(family) for family in FAMILIES}) == len(FAMILIES)
    stated: dict[tuple[str, str], object] = {}
    for family in FAMILIES:
        for architecture in family.converts_to:
            for fact in ("model_type", "dense_biases", "fused"):
                value = getattr(architecture, fact)
                if value is not None:
                    assert stated.setdefault((architecture.name, fact), value) == value, (family.name, architecture.name)
    flags = [(a.megatron.moe, a.megatron.qk_layernorm, a.megatron.add_qkv_bias)
             for family in FAMILIES for a in family.converts_to if a.megatron is not None]
    assert len(flags) == len(set(flags)) == 5
    assert naming.dense_attention_biases() == {"llama": None, "mistral": (False, False), "qwen2": (True, False)}
