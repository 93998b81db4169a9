"""ckpttool finds the model in a checkpoint by its structure, not by the name `model` (issue 19).

The checkpoints are saved the ways people save them, each by its own save code (generators in
fixtures/): torch's "Getting Started with DCP" recipe (`{"app": AppState}`, so `app.model.*`
beside `app.optim.*`), a plain `dcp.save(model.state_dict())`, a model under a name of the
user's choosing beside its optimizer (`weights.*`, `opt.*`), two models of one architecture
(`student.*`, `teacher.*`: ambiguous), and the frameworks: OLMo-core's Checkpointer (`model.*`
beside a flattened `optim.*`), Composer's Trainer (`state.model.*` beside
`state.optimizers.AdamW.*` and `rng.*`), torchtitan's model-only last-step export (model FQNs at
the top level, nothing else), and the fixtures/frameworks checkpoints of test_frameworks.py.

Each fixture's expected.json lists the model's own full state dict, gathered from the live model
(`model.state_dict()` keys; shape, dtype, sha256 of the bytes) and, for the new ones, the
model's parameter count. With no flags:

- `consolidate SRC out.safetensors` writes exactly those tensors;
- `inspect --json SRC` counts the model's parameters (`summary.parameters`);
- `diff SRC out.safetensors` of a checkpoint and its consolidation exits 0;
- `reshard SRC DST --world 3` then `consolidate DST` gives the same tensors;
- `export` of the recipe (a transformers Llama) loads with `from_pretrained`, weights exact;
- two equally good readings (`two_models`) exit 2 naming both and `--model-prefix`, which picks one.

No framework is imported here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from math import prod
from pathlib import Path

import pytest

from conftest import FIXTURES, assert_same_bytes, tensor_bytes

STRUCTURES = FIXTURES / "structures"
FRAMEWORKS = FIXTURES / "frameworks"
TWO_MODELS = STRUCTURES / "two_models"


@dataclass(frozen=True)
class Case:
    id: str
    src: Path            # what the user points ckpttool at
    expected: Path       # the model's own full state dict (fixtures/frameworks/_fixture_common.py)
    cast_to: str = ""    # verl: expected.json is its merger's output, which casts to bf16


RECIPE = Case("recipe", STRUCTURES / "recipe", STRUCTURES / "expected" / "recipe.json")
PLAIN = Case("plain", STRUCTURES / "plain", STRUCTURES / "expected" / "plain.json")
WEIGHTS_OPT = Case("weights-opt", STRUCTURES / "weights_opt", STRUCTURES / "expected" / "weights_opt.json")
OLMO_CORE = Case("olmo-core", FRAMEWORKS / "olmo_core" / "run" / "step2" / "model_and_optim",
                 FRAMEWORKS / "olmo_core" / "expected.json")
COMPOSER = Case("composer", FRAMEWORKS / "composer" / "checkpoints" / "ep0-ba2",
                FRAMEWORKS / "composer" / "expected.json")
TORCHTITAN_MODEL_ONLY = Case("torchtitan-model-only", FRAMEWORKS / "torchtitan_model_only" / "checkpoint" / "step-2",
                             FRAMEWORKS / "torchtitan_model_only" / "expected.json")
# the run directories the trainers leave: OLMo-core's `step{N}/model_and_optim`, Composer's
# `ep{E}-ba{B}` folders beside its `latest-rank0.pt` link
OLMO_CORE_RUN = Case("olmo-core-run-dir", FRAMEWORKS / "olmo_core" / "run", OLMO_CORE.expected)
COMPOSER_RUN = Case("composer-run-dir", FRAMEWORKS / "composer" / "checkpoints", COMPOSER.expected)
NEW_CASES = [RECIPE, PLAIN, WEIGHTS_OPT, OLMO_CORE, OLMO_CORE_RUN, COMPOSER, COMPOSER_RUN, TORCHTITAN_MODEL_ONLY]
# the fixtures test_frameworks.py, test_megatron.py and test_verl.py check with their exporters
EXISTING_CASES = [
    Case("torchtitan", FRAMEWORKS / "torchtitan" / "checkpoint" / "step-20", FRAMEWORKS / "torchtitan" / "expected.json"),
    Case("torchtitan-run-dir", FRAMEWORKS / "torchtitan" / "checkpoint", FRAMEWORKS / "torchtitan" / "expected_hf.json"),
    Case("accelerate", FRAMEWORKS / "accelerate" / "checkpoints" / "checkpoint_0",
         FRAMEWORKS / "accelerate" / "expected.json"),
    Case("lightning", FRAMEWORKS / "lightning" / "checkpoints" / "epoch=0-step=2.ckpt",
         FRAMEWORKS / "lightning" / "expected.json"),
    Case("megatron", FRAMEWORKS / "megatron" / "checkpoints", FRAMEWORKS / "megatron" / "expected.json"),
    Case("verl", FRAMEWORKS / "verl" / "checkpoints" / "global_step_2" / "actor", FRAMEWORKS / "verl" / "expected.json",
         cast_to="bfloat16"),
]
CASES = NEW_CASES + EXISTING_CASES
by_case = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])


def expected_document(case: Case) -> dict:
    return json.loads(case.expected.read_text())


def model_parameters(case: Case) -> int:
    """The model's parameter count: recorded by the new generators; the older fixtures' models
    have no buffers in their state dicts, so it is the element count of their tensors."""
    document = expected_document(case)
    if "parameters" in document:
        return document["parameters"]
    return sum(prod(row["shape"]) for row in document["tensors"].values())


def describe(tensor) -> dict:
    """The expected.json row of a tensor: shape, dtype, sha256 of its row-major bytes."""
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(tensor_bytes(tensor)).hexdigest()}


def described(path: Path, cast_to: str = "") -> dict:
    import torch
    from safetensors.torch import load_file

    tensors = load_file(path)
    if cast_to:
        tensors = {key: value.to(getattr(torch, cast_to)) for key, value in tensors.items()}
    return {key: describe(value) for key, value in tensors.items()}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return tmp_path_factory.mktemp("by-structure")


@pytest.fixture(scope="module")
def consolidated(run, outputs):
    """`consolidated(case)` -> the file `ckpttool consolidate SRC out.safetensors` (no flags) wrote,
    run once per case."""
    cache = {}

    def get(case: Case) -> Path:
        if case.id not in cache:
            out = outputs / f"{case.id}.safetensors"
            result = run("consolidate", case.src, out, "--quiet")
            assert result.exit_code == 0, result.output
            cache[case.id] = out
        return cache[case.id]

    return get


# -- consolidate and inspect, no flags -------------------------------------------------------------

@by_case
def test_consolidate_without_flags_writes_the_models_own_state_dict(consolidated, case):
    # verl: no flags keeps the stored float32; its merger's bf16 is the same values cast
    expected = expected_document(case)["tensors"]
    if case.id == "lightning":  # the LightningModule's `model` attribute holds every parameter: the model's own names
        expected = {key.removeprefix("model."): row for key, row in expected.items()}
    assert described(consolidated(case), case.cast_to) == expected


@by_case
def test_inspect_counts_the_models_parameters(run, case):
    result = run("inspect", case.src, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["summary"]["parameters"] == model_parameters(case)


# -- two models of one architecture: ambiguous -----------------------------------------------------

def test_two_equally_good_models_exit_2_naming_both_and_model_prefix(run, outputs):
    out = outputs / "two-models.safetensors"
    result = run("consolidate", TWO_MODELS, out, "--quiet")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "student" in lines[0] and "teacher" in lines[0] and "--model-prefix" in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("name", ["teacher", "student"])
def test_model_prefix_picks_one_of_two_models(run, outputs, name):
    out = outputs / f"two-models-{name}.safetensors"
    result = run("consolidate", TWO_MODELS, out, "--model-prefix", name, "--quiet")
    assert result.exit_code == 0, result.output
    expected = json.loads((STRUCTURES / "expected" / f"two_models_{name}.json").read_text())
    assert described(out) == expected["tensors"]


# -- export: the recipe's Llama loads in transformers -----------------------------------------------

def test_export_of_the_dcp_recipe_loads_with_from_pretrained_weights_exact(run, outputs, reference):
    transformers = pytest.importorskip("transformers")
    out = outputs / "recipe-hub"
    result = run("export", RECIPE.src, out, "--assets", STRUCTURES / "recipe_config", "--quiet")
    assert result.exit_code == 0, result.output
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    state = model.state_dict()
    # torch's own reading of the checkpoint (dcp_to_torch_save): the recipe nests the model at app.model
    saved = {key.removeprefix("app.model."): value for key, value in reference(RECIPE.src).items()
             if key.startswith("app.model.")}
    assert sorted(state) == sorted(saved) == sorted(expected_document(RECIPE)["tensors"])
    for key, value in saved.items():
        assert_same_bytes(state[key], value, key)


@pytest.mark.parametrize("case", [PLAIN, WEIGHTS_OPT], ids=lambda c: c.id)
def test_export_of_the_other_llama_saves_loads_with_from_pretrained(run, outputs, case):
    transformers = pytest.importorskip("transformers")
    out = outputs / f"{case.id}-hub"
    result = run("export", case.src, out, "--assets", STRUCTURES / "recipe_config", "--quiet")
    assert result.exit_code == 0, result.output
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert {key: describe(value) for key, value in model.state_dict().items()} == expected_document(case)["tensors"]


# -- reshard, then consolidate ---------------------------------------------------------------------

@pytest.mark.parametrize("case", [RECIPE, PLAIN, TORCHTITAN_MODEL_ONLY], ids=lambda c: c.id)
def test_reshard_to_world_3_then_consolidate_gives_the_same_model(run, outputs, case):
    resharded = outputs / f"{case.id}-world3"
    result = run("reshard", case.src, resharded, "--world", "3", "--quiet")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in resharded.glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    out = outputs / f"{case.id}-world3.safetensors"
    result = run("consolidate", resharded, out, "--quiet")
    assert result.exit_code == 0, result.output
    assert described(out) == expected_document(case)["tensors"]


# -- diff a checkpoint against its consolidation ----------------------------------------------------

@by_case
def test_diff_of_a_checkpoint_and_its_consolidation_is_identical_without_flags(run, consolidated, case):
    result = run("diff", case.src, consolidated(case), "--quiet")
    assert result.exit_code == 0, result.output


def test_diff_names_the_tensor_after_a_one_ulp_change(run, outputs, consolidated):
    import torch
    from safetensors.torch import load_file, save_file

    changed = load_file(consolidated(RECIPE))
    changed["model.norm.weight"].view(torch.int32)[3] += 1  # one ulp
    save_file(changed, outputs / "recipe-one-ulp.safetensors")
    result = run("diff", RECIPE.src, outputs / "recipe-one-ulp.safetensors", "--json", "--quiet")
    assert result.exit_code == 1, result.output
    different = [t for t in json.loads(result.stdout)["tensors"] if t["status"] != "equal"]
    assert [(t["differing"], t["first_index"]) for t in different] == [(1, [3])]
    assert different[0]["key"].endswith("model.norm.weight"), different
