"""Real framework checkpoints: ckpttool names each layout, validates it, consolidates the model
weights under the framework's own names and bytes, exports everything with --all, diffs against
the framework's own export and reshards to world 3.

fixtures/frameworks/ holds checkpoints written by each framework's own save code (generators
beside them): torchtitan 0.3.0's CheckpointManager (a run dir: `step-20` full DCP with model
fqns at the top level, `step-30` its HF export), accelerate 1.15.0's save_state functions
(`checkpoint_0/` holding `pytorch_model_fsdp_0/` and `optimizer_0/`, plus `merged/` from
`accelerate merge-weights`), Lightning 2.6.6's FSDPStrategy (a DCP dir with `meta.pt`, plus the
`.consolidated` file of its consolidate_checkpoint). Each `expected.json` lists the model tensors
as the framework's exporter names them (shape, dtype, sha256 of the row-major bytes).
No framework is imported here; torch's own DCP reader is the second opinion.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import FIXTURES, assert_same_bytes, flatten, tensor_bytes

FRAMEWORKS = FIXTURES / "frameworks"
TORCHTITAN_RUN = FRAMEWORKS / "torchtitan" / "checkpoint"
TORCHTITAN_HF_FILE = TORCHTITAN_RUN / "step-30" / "model-00001-of-00001.safetensors"
ACCELERATE = FRAMEWORKS / "accelerate" / "checkpoints" / "checkpoint_0"
ACCELERATE_MERGED = FRAMEWORKS / "accelerate" / "merged"
LIGHTNING = FRAMEWORKS / "lightning" / "checkpoints" / "epoch=0-step=2.ckpt"
LIGHTNING_CONSOLIDATED = LIGHTNING.with_name(LIGHTNING.name + ".consolidated")
# torchtitan's training-state entries beside the model fqns (components/checkpointer/base.py:26-30)
TORCHTITAN_TRAINING_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state")


@dataclass(frozen=True)
class Case:
    id: str
    src: Path               # what the user points ckpttool at
    layout: str             # what `inspect` should call it
    expected: Path          # expected.json: the framework exporter's model tensors
    dcp_dirs: tuple = ()    # the DCP directories the checkpoint is made of (torch's view of it)


TORCHTITAN = Case("torchtitan", TORCHTITAN_RUN / "step-20", "torchtitan",
                  FRAMEWORKS / "torchtitan" / "expected.json", (TORCHTITAN_RUN / "step-20",))
TORCHTITAN_RUN_DIR = Case("torchtitan-run-dir", TORCHTITAN_RUN, "dcp-hf",
                          FRAMEWORKS / "torchtitan" / "expected_hf.json")
ACCELERATE_TOP = Case("accelerate", ACCELERATE, "accelerate", FRAMEWORKS / "accelerate" / "expected.json",
                      (ACCELERATE / "pytorch_model_fsdp_0", ACCELERATE / "optimizer_0"))
LIGHTNING_DIR = Case("lightning", LIGHTNING, "lightning", FRAMEWORKS / "lightning" / "expected.json", (LIGHTNING,))
CASES = [TORCHTITAN, TORCHTITAN_RUN_DIR, ACCELERATE_TOP, LIGHTNING_DIR]
DCP_CASES = [TORCHTITAN, ACCELERATE_TOP, LIGHTNING_DIR]
by_id = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
dcp_by_id = pytest.mark.parametrize("case", DCP_CASES, ids=[c.id for c in DCP_CASES])


def test_every_framework_case_is_on_disk():
    """The cases are listed by name, not found by a glob: a fixture that went missing fails here
    instead of leaving its tests to skip or pass on nothing."""
    paths = [path for case in CASES for path in (case.src, case.expected, *case.dcp_dirs)]
    paths += [TORCHTITAN_HF_FILE, ACCELERATE_MERGED, LIGHTNING_CONSOLIDATED]
    assert [str(path) for path in paths if not path.exists()] == []
    assert all((path / ".metadata").is_file() for case in DCP_CASES for path in case.dcp_dirs)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return tmp_path_factory.mktemp("frameworks")


@pytest.fixture(scope="module")
def consolidated(run, outputs):
    """`consolidated(case)` -> (consolidate --json document, {key: tensor}) of
    `ckpttool consolidate SRC out.safetensors` without --all, run once per case."""
    from safetensors.torch import load_file

    cache = {}

    def get(case: Case):
        if case.id not in cache:
            out = outputs / f"{case.id}.safetensors"
            result = run("consolidate", case.src, out, "--quiet", "--json")
            assert result.exit_code == 0, result.output
            cache[case.id] = json.loads(result.stdout), load_file(out)
        return cache[case.id]

    return get


@pytest.fixture(scope="module")
def torch_saved(outputs):
    """`torch_saved(dcp_dir)` -> the nested state dict torch's own `dcp_to_torch_save` writes."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    cache = {}

    def get(path: Path):
        if path not in cache:
            out = outputs / f"torch-{len(cache)}.pt"
            dcp_to_torch_save(path, out)
            cache[path] = torch.load(out, weights_only=True)
        return cache[path]

    return get


def expected_tensors(case: Case) -> dict:
    tensors = json.loads(case.expected.read_text())["tensors"]
    return lightning_model(tensors) if case is LIGHTNING_DIR else tensors


def lightning_model(state: dict) -> dict:
    """Lightning's state dict as the model's own: past the LightningModule's `model` attribute,
    which holds every parameter (ckpttool reads the model, not the LightningModule)."""
    assert all(key.startswith("model.") for key in state), sorted(state)
    return {key.removeprefix("model."): value for key, value in state.items()}


def describe(tensor) -> dict:
    """The expected.json row of a tensor: shape, dtype, sha256 of its row-major bytes."""
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(tensor_bytes(tensor)).hexdigest()}


def assert_same_state(actual: dict, expected: dict) -> None:
    """Same flattened keys; tensors byte-identical, other values equal."""
    import torch

    actual, expected = flatten(actual), flatten(expected)
    assert sorted(actual) == sorted(expected), sorted(set(actual) ^ set(expected))
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert_same_bytes(actual[key], value, key)
        else:
            assert type(actual[key]) is type(value) and actual[key] == value, key


# -- inspect, validate ---------------------------------------------------------------------------

@by_id
def test_inspect_names_the_framework_layout(run, case):
    document = json.loads(run("inspect", case.src, "--json").stdout)
    assert document["layout"] == case.layout
    text = run("inspect", case.src)
    assert text.exit_code == 0 and f"  layout: {case.layout}\n" in text.output


def test_a_torchtitan_run_dir_names_its_newest_step(run, consolidated):
    document = json.loads(run("inspect", TORCHTITAN_RUN, "--json").stdout)
    assert Path(document["path"]).resolve() == TORCHTITAN_RUN / "step-30"
    assert "step-30" in run("inspect", TORCHTITAN_RUN).output
    choice, _ = consolidated(TORCHTITAN_RUN_DIR)
    assert "step-30, newest of 2 checkpoints" in choice["layout"], choice["layout"]


def test_accelerate_top_folder_finds_its_model_dir(run, consolidated):
    # the save_state folder reads as one checkpoint: its model dir and its optimizer dir
    document = json.loads(run("inspect", ACCELERATE, "--json").stdout)
    assert document["summary"]["metadata_file"] == "pytorch_model_fsdp_0/.metadata"
    assert {t["group"] for t in document["tensors"]} == {"model", "optimizer"}
    choice, _ = consolidated(ACCELERATE_TOP)
    assert Path(choice["source"]).name == "checkpoint_0" and choice["layout"].startswith("accelerate")


@by_id
def test_validate_deep_reads_every_byte_and_finds_nothing(run, case):
    result = run("validate", case.src, "--deep", "--json")
    document = json.loads(result.stdout)
    assert result.exit_code == 0 and document["valid"], document["problems"]
    assert document["problems"] == [] and document["checked"]["bytes_read"] > 0


# -- consolidate: the model weights, as the framework names them -----------------------------------

@by_id
def test_consolidate_writes_the_framework_model_names_shapes_dtypes_and_bytes(consolidated, case):
    choice, ours = consolidated(case)
    assert choice["selected"].startswith("model weights"), choice["selected"]
    assert {name: describe(tensor) for name, tensor in ours.items()} == expected_tensors(case)


def test_torchtitan_consolidate_equals_torch_dcp_to_torch_save_model_entries(consolidated, torch_saved):
    _, ours = consolidated(TORCHTITAN)
    saved = torch_saved(TORCHTITAN.src)
    model = {key: value for key, value in saved.items() if key not in TORCHTITAN_TRAINING_STATE}
    assert_same_state(ours, model)


def test_torchtitan_run_dir_consolidate_equals_its_hf_export(consolidated):
    from safetensors.torch import load_file

    _, ours = consolidated(TORCHTITAN_RUN_DIR)
    assert_same_state(ours, load_file(TORCHTITAN_HF_FILE))


def test_accelerate_consolidate_equals_accelerate_merge_weights(consolidated):
    from safetensors.torch import load_file

    _, ours = consolidated(ACCELERATE_TOP)
    assert_same_state(ours, load_file(ACCELERATE_MERGED / "model.safetensors"))


def test_lightning_consolidate_equals_lightning_consolidate_checkpoint(consolidated):
    import torch

    _, ours = consolidated(LIGHTNING_DIR)
    # Lightning's consolidate_checkpoint writes a plain torch.save dict that weights_only=True accepts
    reference = torch.load(LIGHTNING_CONSOLIDATED, weights_only=True)
    assert_same_state(ours, lightning_model(reference["state_dict"]))


def test_lightning_consolidate_all_carries_meta_pt_as_lightning_consolidate_checkpoint_does(run, outputs):
    import torch

    out = outputs / "lightning-meta.pt"
    assert run("consolidate", LIGHTNING_DIR.src, out, "--all", "--quiet").exit_code == 0
    ours = torch.load(out, weights_only=True)
    reference = torch.load(LIGHTNING_CONSOLIDATED, weights_only=True)
    meta = set(reference) - {"state_dict", "optimizer_states"}  # Lightning's names for model, optimizer_0
    assert meta == {"epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks", "lr_schedulers",
                    "hparams_name", "hyper_parameters"}
    for key in meta:
        assert type(ours[key]) is type(reference[key]) and ours[key] == reference[key], key
    assert_same_state(ours["model"], reference["state_dict"])


# -- consolidate --all: everything, nested as saved ------------------------------------------------

@dcp_by_id
def test_consolidate_all_exports_everything_nested_as_saved(run, outputs, torch_saved, case):
    import torch

    out = outputs / f"{case.id}-all.pt"
    result = run("consolidate", case.src, out, "--all", "--quiet")
    assert result.exit_code == 0, result.output
    ours = torch.load(out, weights_only=True)
    saved = {}
    for path in case.dcp_dirs:  # accelerate: the model dir and optimizer_0 hold disjoint top keys
        saved.update(torch_saved(path))
    if case is LIGHTNING_DIR:  # meta.pt's entries beside them, as Lightning's consolidate_checkpoint merges them
        saved.update(torch.load(LIGHTNING / "meta.pt", weights_only=True))
    assert sorted(ours) == sorted(saved)
    assert any(key.startswith("optimizer") for key in ours), sorted(ours)
    assert_same_state(ours, saved)


# -- diff against the framework's export -----------------------------------------------------------

@pytest.mark.parametrize("a, b", [
    (ACCELERATE, ACCELERATE_MERGED / "model.safetensors"),
    (ACCELERATE, ACCELERATE_MERGED),
    (TORCHTITAN_RUN, TORCHTITAN_HF_FILE),
    (TORCHTITAN_RUN / "step-30" / "sharded", TORCHTITAN_HF_FILE),
], ids=["accelerate-merged-file", "accelerate-merged-folder", "torchtitan-run-hf", "torchtitan-hf-shards"])
def test_diff_against_the_framework_export_is_identical(run, a, b):
    result = run("diff", a, b, "--normalize", "--only", "model", "--quiet")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("IDENTICAL"), result.output


@pytest.mark.parametrize("case", [TORCHTITAN, LIGHTNING_DIR], ids=["torchtitan", "lightning"])
def test_diff_against_our_consolidation_is_identical(run, outputs, consolidated, case):
    # torchtitan's step-20 and Lightning have no safetensors export (torch.save files, which the
    # tests above compare); their consolidation is checked byte for byte against those
    consolidated(case)
    result = run("diff", case.src, outputs / f"{case.id}.safetensors", "--normalize", "--only", "model", "--quiet")
    assert result.exit_code == 0, result.output


def test_diff_finds_one_changed_element_in_the_accelerate_export(run, outputs):
    import torch
    from safetensors.torch import load_file, save_file

    changed = load_file(ACCELERATE_MERGED / "model.safetensors")
    changed["model.norm.weight"].view(torch.int32)[3] += 1  # one ulp
    save_file(changed, outputs / "accelerate-one-ulp.safetensors")
    result = run("diff", ACCELERATE, outputs / "accelerate-one-ulp.safetensors", "--normalize", "--only", "model",
                 "--json", "--quiet")
    assert result.exit_code == 1, result.output
    different = [t for t in json.loads(result.stdout)["tensors"] if t["status"] != "equal"]
    assert [(t["key"], t["differing"], t["first_index"]) for t in different] == [("model.norm.weight", 1, [3])]


# -- reshard ---------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in this one process
@pytest.mark.parametrize("case", [TORCHTITAN, TORCHTITAN_RUN_DIR, ACCELERATE_TOP, LIGHTNING_DIR],
                         ids=["torchtitan", "torchtitan-run-dir", "accelerate", "lightning"])
def test_reshard_to_world_3_loads_with_stock_dcp_load(run, outputs, torch_saved, case):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    out = outputs / f"{case.id}-world3"
    result = run("reshard", case.src, out, "--world", "3", "--quiet")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    # the source as torch reads it: accelerate's model dir (its optimizer_0 is a separate DCP)
    source = torch_saved(case.dcp_dirs[0]) if case.dcp_dirs else load_file(TORCHTITAN_HF_FILE)
    state = _empty_like(source)
    dcp.load(state, checkpoint_id=str(out))
    assert_same_state(state, source)


def _empty_like(state):
    """The state dict to `dcp.load` into: tensors filled with 7 (so a missed read shows),
    objects None (DCP replaces them), dicts and lists of dicts kept as structure."""
    import torch

    if isinstance(state, dict):
        return {key: _empty_like(value) for key, value in state.items()}
    if isinstance(state, list) and any(isinstance(value, dict) for value in state):
        return [_empty_like(value) for value in state]
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, 7)
    return None
