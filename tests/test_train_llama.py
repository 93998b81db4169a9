"""The trainer's Llama-shaped model (`python -m train_minimal --arch llama`) round trip:
train on 2 FSDP2 ranks -> `ckpttool export` -> transformers' `from_pretrained` -> `ckpttool
import` at world 3 -> `--resume` at world 3.

Each trainer run is a real 2-rank job (gloo on CPU), written once per session. The model is
tiny (dim 32, 2 layers, 4 query heads sharing 2 key/value heads, vocab 64, seq 16) and uses a
non-default rope_theta and RMSNorm epsilon, so a value lost between the trainer's config and
config.json would change the logits. Logits are compared exactly: our forward pass performs
transformers' float32 operations in the same order (see train_minimal/model.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_same_bytes
from trainer_runs import latest_step, read_log, run_trainer

pytest.importorskip("transformers")

LLAMA_FLAGS = ("--arch", "llama", "--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
               "--vocab", "64", "--seq-len", "16", "--rope-theta", "500000", "--norm-eps", "1e-5")
# A fixed input of seq-len tokens, every token below vocab 64.
INPUT_IDS = [[1, 5, 9, 2, 33, 63, 0, 17, 4, 4, 50, 12, 13, 8, 61, 3],
             [40, 3, 3, 8, 21, 60, 11, 4, 9, 9, 9, 1, 2, 0, 0, 7]]
VARIANTS = {"untied": (), "tied": ("--tie-embeddings",)}


@pytest.fixture(scope="module")
def transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def ckpttool(*args: str) -> None:
    from click.testing import CliRunner

    from ckpttool.cli import main

    result = CliRunner().invoke(main, [*map(str, args), "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="session")
def llama_runs(tmp_path_factory) -> dict[str, Path]:
    """variant -> run directory: ckpt/ (2 steps, world 2), full.safetensors (the live model's
    full state dict, gathered by the trainer), hub/ (`ckpttool export` of the checkpoint)."""
    runs = {}
    for variant, flags in VARIANTS.items():
        directory = tmp_path_factory.mktemp(f"llama_{variant}")
        ckpt = run_trainer(directory, *LLAMA_FLAGS, *flags, "--export", directory / "full.safetensors")
        ckpttool("export", latest_step(ckpt), directory / "hub")
        runs[variant] = directory
    return runs


def trainer_model(*flags: str) -> torch.nn.Module:
    """Return the trainer's model for these flags, built in this process as every rank builds it."""
    from train_minimal.config import parse_args
    from train_minimal.model import build_model

    return build_model(parse_args([*LLAMA_FLAGS, *flags]))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_llama_checkpoint_keys_are_llama_for_causal_lm_keys(variant, llama_runs, transformers):
    config = transformers.LlamaConfig(**json.loads((llama_runs[variant] / "hub" / "config.json").read_text()))
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(config)
    expected = set(reference.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # save_pretrained writes one copy of a tied pair
    assert set(trainer_model(*VARIANTS[variant]).state_dict()) == expected
    assert set(load_file(llama_runs[variant] / "full.safetensors")) == expected


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_exported_llama_loads_in_transformers_with_the_trainers_logits(variant, llama_runs, transformers):
    hub = llama_runs[variant] / "hub"
    config = json.loads((hub / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["rms_norm_eps"], config["rope_theta"], config["num_key_value_heads"]) == (1e-5, 500000.0, 2)
    assert config["tie_word_embeddings"] is (variant == "tied")

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(hub, output_loading_info=True)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys, no errors

    # The weights in the folder are the live model's, byte for byte.
    weights = load_file(hub / "model.safetensors")
    full = load_file(llama_runs[variant] / "full.safetensors")
    assert sorted(weights) == sorted(full)
    for key in full:
        assert_same_bytes(weights[key], full[key], key)

    ours = trainer_model(*VARIANTS[variant])
    ours.load_state_dict(weights, strict=True)
    tokens = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        expected = ours.eval()(tokens)
        actual = loaded.eval()(input_ids=tokens).logits
    assert actual.dtype == expected.dtype == torch.float32
    assert_same_bytes(actual, expected, "logits")


def test_imported_llama_resumes_at_world_3_with_a_fresh_optimizer(llama_runs, tmp_path):
    hub = llama_runs["untied"] / "hub"
    ckpttool("import", hub, tmp_path / "imported", "--world", "3")
    # lr 0: the one step leaves the weights as they were, so the resumed run's export shows
    # exactly what it loaded.
    run_trainer(tmp_path / "run", *LLAMA_FLAGS, "--resume", tmp_path / "imported", "--lr", "0",
                "--weight-decay", "0", "--export", tmp_path / "resumed.safetensors", nproc=3, steps=1)
    records = read_log(tmp_path / "run")
    assert [(record["step"], record["world_size"]) for record in records] == [(1, 3)]
    assert len(records[0]["param_bytes"]) == 3 and torch.tensor(records[0]["loss"]).isfinite()
    resumed, exported = load_file(tmp_path / "resumed.safetensors"), load_file(hub / "model.safetensors")
    assert sorted(resumed) == sorted(exported)
    for key in exported:
        assert_same_bytes(resumed[key], exported[key], key)
