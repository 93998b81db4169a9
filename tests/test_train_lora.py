"""The trainer's LoRA runs (`python -m train_minimal --arch llama --lora-rank R ...`): PEFT's
names and init, a frozen base, optimizer state for the adapters only, PEFT's
adapter_config.json in every step directory, an exact resume, and the round trip into PEFT.

Two adapter configurations, each a real 2-rank FSDP2 job (gloo on CPU) run once per session:

- `attention`: q_proj,v_proj, r 4, alpha 8, LoRA dropout 0.05 (so the resume must restore each
  rank's RNG), untied embeddings; run 4 steps straight and 2 + `--resume` 2.
- `mlp_rslora_tied`: all seven projections, r 4, alpha 16, rsLoRA, tied embeddings; 2 steps.

The round trip runs without `ckpttool export --adapter`: `ckpttool consolidate` writes the
checkpoint's model as one safetensors file, its keys are renamed to PEFT's
(`X` -> `base_model.model.X`) and loaded into `get_peft_model(LlamaForCausalLM(config),
LoraConfig.from_pretrained(step_dir))`. Its logits are compared, bit for bit, with a
single-process forward of the trainer's own model module (train_minimal.model.build_model)
holding the same consolidated weights: the trainer's LoRA layer performs PEFT's float32
operations in the same order (train_minimal/lora.py), and its Llama transformers' (model.py);
that the consolidated weights are the live run's is checked separately, byte for byte, against
the trainer's own `--export` gathered from the FSDP2 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_same_bytes, flatten
from trainer_runs import latest_step, losses, run_trainer, run_trainer_expecting_failure

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LLAMA_FLAGS = ("--arch", "llama", "--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
               "--vocab", "64", "--seq-len", "16", "--rope-theta", "500000", "--norm-eps", "1e-5")
# The LlamaConfig of LLAMA_FLAGS (intermediate 96: 8/3 x 32 rounded up to a multiple of 16).
LLAMA_CONFIG = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 8, "intermediate_size": 96, "vocab_size": 64, "max_position_embeddings": 16,
                "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False}
ALL_PROJECTIONS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
VARIANTS = {
    "attention": {"flags": ("--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "v_proj,q_proj",
                            "--lora-dropout", "0.05"),
                  "peft": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_rslora": False,
                           "lora_dropout": 0.05},
                  "tied": False},
    "mlp_rslora_tied": {"flags": ("--lora-rank", "4", "--lora-alpha", "16", "--rslora", "--tie-embeddings",
                                  "--lora-targets", ",".join(ALL_PROJECTIONS)),
                        "peft": {"r": 4, "lora_alpha": 16, "target_modules": ALL_PROJECTIONS, "use_rslora": True,
                                 "lora_dropout": 0.0},
                        "tied": True},
}
STEPS = 4
HALF = 2
INPUT_IDS = [[1, 5, 9, 2, 33, 63, 0, 17, 4, 4, 50, 12, 13, 8, 61, 3],
             [40, 3, 3, 8, 21, 60, 11, 4, 9, 9, 9, 1, 2, 0, 0, 7]]


def ckpttool(*args) -> None:
    from click.testing import CliRunner

    from ckpttool.cli import main

    result = CliRunner().invoke(main, [*map(str, args), "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory) -> dict[str, Path]:
    """variant -> run directory holding ckpt/ and full.safetensors (the trainer's --export of
    the live model); `attention` also has resumed/ (stopped at step 2, resumed to 4)."""
    runs = {}
    for variant, spec in VARIANTS.items():
        directory = tmp_path_factory.mktemp(f"lora_{variant}")
        flags = (*LLAMA_FLAGS, *spec["flags"], "--save-every", "1")
        steps = STEPS if variant == "attention" else HALF
        run_trainer(directory, *flags, "--export", directory / "full.safetensors", steps=steps)
        if variant == "attention":
            resumed = directory / "resumed"
            run_trainer(resumed, *flags, "--stop-at", str(HALF), steps=STEPS)
            run_trainer(resumed, *flags, "--resume", "--export", resumed / "full.safetensors", steps=STEPS)
        ckpttool("consolidate", latest_step(directory / "ckpt"), directory / "consolidated.safetensors")
        runs[variant] = directory
    return runs


def trainer_config(variant: str):
    from train_minimal.config import parse_args

    return parse_args([*LLAMA_FLAGS, *VARIANTS[variant]["flags"]])


def initial_model(variant: str) -> torch.nn.Module:
    """Return the trainer's model before step 1, built as every rank builds it (seed 0)."""
    from train_minimal.model import build_model

    torch.manual_seed(trainer_config(variant).seed)
    return build_model(trainer_config(variant))


def peft_model(variant: str, step_dir: Path, transformers):
    """Return PEFT's model of this variant with its LoraConfig read from the step directory."""
    config = transformers.LlamaConfig(**LLAMA_CONFIG, tie_word_embeddings=VARIANTS[variant]["tied"])
    torch.manual_seed(1)
    return peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig.from_pretrained(step_dir))


@pytest.fixture(scope="module")
def transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def checkpoint_keys(step_dir: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lora_checkpoint_model_keys_are_peft_keys_without_its_wrapper(variant, lora_runs, transformers):
    step_dir = latest_step(lora_runs[variant] / "ckpt")
    model_keys = {key[len("model."):] for key in checkpoint_keys(step_dir) if key.startswith("model.")}
    peft_keys = {key[len("base_model.model."):] for key in peft_model(variant, step_dir, transformers).state_dict()}
    if VARIANTS[variant]["tied"]:
        peft_keys.discard("lm_head.weight")  # one copy of a tied pair, as save_pretrained writes it
    assert model_keys == peft_keys
    assert model_keys == set(initial_model(variant).state_dict())
    assert "model.layers.1.self_attn.q_proj.lora_B.default.weight" in model_keys


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lora_run_leaves_the_base_bit_identical_and_trains_the_adapters(variant, lora_runs):
    initial = initial_model(variant).state_dict()
    trained = load_file(lora_runs[variant] / "consolidated.safetensors")
    assert sorted(trained) == sorted(initial)
    adapters = [key for key in initial if ".lora_" in key]
    assert len(adapters) == 2 * 2 * len(VARIANTS[variant]["peft"]["target_modules"])  # A and B, 2 layers
    for key, value in initial.items():
        if key in adapters:
            continue
        assert_same_bytes(trained[key], value, key)
    for key in adapters:
        if ".lora_B." in key:
            assert not initial[key].any(), f"{key}: PEFT's init is zeros"
            assert trained[key].any(), f"{key}: did not train"
        else:
            assert not torch.equal(trained[key], initial[key]), f"{key}: did not train"
            # kaiming_uniform_(a=sqrt(5)) on (r, in): bound 1/sqrt(in), as nn.Linear's init
            assert initial[key].abs().max() <= 1 / initial[key].shape[1] ** 0.5


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lora_optimizer_state_covers_the_adapter_weights_only(variant, lora_runs):
    keys = checkpoint_keys(latest_step(lora_runs[variant] / "ckpt"))
    state = {key[len("optim.state."):].rsplit(".", 1)[0] for key in keys if key.startswith("optim.state.")}
    adapters = {key for key in initial_model(variant).state_dict() if ".lora_" in key}
    assert state == adapters
    assert all(f"optim.state.{key}.{name}" in keys for key in adapters for name in ("exp_avg", "exp_avg_sq", "step"))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_adapter_config_in_the_step_directory_is_what_peft_writes(variant, lora_runs, tmp_path):
    spec = VARIANTS[variant]["peft"]
    expected = peft.LoraConfig(**spec, bias="none", task_type="CAUSAL_LM", base_model_name_or_path=None)
    expected.save_pretrained(tmp_path)
    for step_dir in sorted((lora_runs[variant] / "ckpt").glob("step-*")):
        assert sorted(path.name for path in step_dir.iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "adapter_config.json"]
        assert peft.LoraConfig.from_pretrained(step_dir) == expected
        ours = json.loads((step_dir / "adapter_config.json").read_text())
        theirs = json.loads((tmp_path / "adapter_config.json").read_text())
        theirs["target_modules"] = sorted(theirs["target_modules"])  # PEFT writes its set in hash order
        assert ours == theirs
        assert (step_dir / "adapter_config.json").read_text() == json.dumps(theirs, indent=2, sort_keys=True)


def test_lora_resume_repeats_the_straight_run_bit_for_bit(lora_runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = lora_runs["attention"]
    straight, resumed = losses(directory), losses(directory / "resumed")
    assert sorted(straight) == sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == straight
    assert (directory / "resumed" / "full.safetensors").read_bytes() == (directory / "full.safetensors").read_bytes()
    # The resumed run's last checkpoint: model, adapter optimizer state, scheduler, progress, RNG.
    states = []
    for name, step_dir in (("straight", directory / "ckpt"), ("resumed", directory / "resumed" / "ckpt")):
        dcp_to_torch_save(latest_step(step_dir), tmp_path / f"{name}.pt")
        states.append(flatten(torch.load(tmp_path / f"{name}.pt", weights_only=False)))  # written a line above
    straight_state, resumed_state = states
    assert sorted(straight_state) == sorted(resumed_state)
    for key, value in straight_state.items():
        if key == "train.config":  # --stop-at and --resume differ; the LoRA settings do not
            saved = json.loads(resumed_state[key])
            assert all(saved[name] == json.loads(value)[name] for name in
                       ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "rslora"))
        elif isinstance(value, torch.Tensor):
            assert_same_bytes(resumed_state[key], value, key)
        else:
            assert resumed_state[key] == value, key
    assert (latest_step(directory / "resumed" / "ckpt") / "adapter_config.json").read_bytes() == \
        (latest_step(directory / "ckpt") / "adapter_config.json").read_bytes()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_peft_model_with_the_consolidated_weights_gives_the_trainers_logits(variant, lora_runs, transformers):
    directory = lora_runs[variant]
    weights = load_file(directory / "consolidated.safetensors")
    full = load_file(directory / "full.safetensors")  # gathered from the live FSDP2 model by the trainer
    assert sorted(weights) == sorted(full)
    for key in full:
        assert_same_bytes(weights[key], full[key], key)

    model = peft_model(variant, latest_step(directory / "ckpt"), transformers)
    incompatible = model.load_state_dict({"base_model.model." + key: value for key, value in weights.items()},
                                         strict=False)
    tied_head = ["base_model.model.lm_head.weight"] if VARIANTS[variant]["tied"] else []
    assert (incompatible.missing_keys, incompatible.unexpected_keys) == (tied_head, [])

    ours = initial_model(variant)
    ours.load_state_dict(weights, strict=True)
    tokens = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        expected = ours.eval()(tokens)
        actual = model.eval()(input_ids=tokens).logits
    assert actual.dtype == expected.dtype == torch.float32
    assert_same_bytes(actual, expected, "logits")
    # The adapters matter: without them PEFT's logits differ.
    with torch.no_grad(), model.disable_adapter():
        assert not torch.equal(model(input_ids=tokens).logits, expected)


def test_ckpttool_validates_and_inspects_a_lora_checkpoint(lora_runs):
    from click.testing import CliRunner

    from ckpttool.cli import main

    step_dir = latest_step(lora_runs["attention"] / "ckpt")
    runner = CliRunner()
    validated = runner.invoke(main, ["validate", str(step_dir), "--deep", "--json"], catch_exceptions=False)
    assert validated.exit_code == 0, validated.output
    assert json.loads(validated.output)["valid"] is True
    assert json.loads(validated.output)["problems"] == []  # adapter_config.json is a known file
    inspected = runner.invoke(main, ["inspect", str(step_dir), "--json"], catch_exceptions=False)
    assert inspected.exit_code == 0, inspected.output
    fqns = {tensor["fqn"] for tensor in json.loads(inspected.output)["tensors"]}
    assert "model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in fqns


@pytest.mark.parametrize("how", ["init_from", "import_and_resume"])
def test_plain_llama_weights_load_into_the_base_layers_of_a_lora_run(how, tmp_path):
    """A LlamaForCausalLM-keyed Hub folder into a LoRA run, by `--init-from` (world 1) or by
    `ckpttool import` + `--resume` (world 2): the base weights are the folder's, the adapters
    their fresh init (lr 0 and no weight decay, so the one step moves nothing)."""
    from train_minimal.config import parse_args
    from train_minimal.model import build_model

    torch.manual_seed(7)
    plain = build_model(parse_args(list(LLAMA_FLAGS))).state_dict()
    hub = tmp_path / "hub"
    hub.mkdir()
    save_file(plain, hub / "model.safetensors", metadata={"format": "pt"})
    (hub / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                 **LLAMA_CONFIG, "tie_word_embeddings": False}))
    flags = (*LLAMA_FLAGS, *VARIANTS["attention"]["flags"], "--lr", "0", "--weight-decay", "0",
             "--export", tmp_path / "out.safetensors")
    if how == "init_from":
        run_trainer(tmp_path, *flags, "--init-from", hub, nproc=1, steps=1)
    else:
        ckpttool("import", hub, tmp_path / "imported", "--world", "2")
        run_trainer(tmp_path, *flags, "--resume", tmp_path / "imported", nproc=2, steps=1)
    out = load_file(tmp_path / "out.safetensors")
    fresh = initial_model("attention").state_dict()
    assert sorted(out) == sorted(fresh)
    for key, value in out.items():
        expected = fresh[key] if ".lora_" in key else plain[key.replace(".base_layer.", ".")]
        assert_same_bytes(value, expected, key)


def test_lora_checkpoint_resumes_at_world_3(lora_runs, tmp_path):
    """The rsLoRA run's step-1 checkpoint (world 2) resumed at world 3 for one step. The
    tolerance is test_train_minimal's for a resume at another world size: the same weights see
    the same samples, but the loss is a mean of per-rank means summed in another order and the
    matmuls see other batch shapes (float32 epsilon is 1.2e-7); no dropout in this variant."""
    directory = lora_runs["mlp_rslora_tied"]
    run_trainer(tmp_path, *LLAMA_FLAGS, *VARIANTS["mlp_rslora_tied"]["flags"],
                "--resume", directory / "ckpt" / "step-00000001", nproc=3, steps=HALF)
    resumed, straight = losses(tmp_path), losses(directory)
    assert sorted(resumed) == [HALF]
    assert abs(resumed[HALF] - straight[HALF]) <= 1e-5 * abs(straight[HALF]), (resumed, straight)


def test_resume_with_other_lora_settings_is_refused(lora_runs, tmp_path):
    flags = [*LLAMA_FLAGS, *VARIANTS["attention"]["flags"]]
    flags[flags.index("--lora-rank") + 1] = "8"
    result = run_trainer_expecting_failure(tmp_path, *flags, "--resume", latest_step(lora_runs["attention"] / "ckpt"),
                                           nproc=1, steps=STEPS)
    assert result.returncode == 2, result.stderr
    assert "cannot resume from" in result.stderr and "lora_rank: 4 in the checkpoint, 8 now" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (("--lora-rank", "4"), "LoRA layers exist for --arch llama only"),
    ((*LLAMA_FLAGS, "--lora-rank", "4", "--lora-targets", "q_proj,lm_head"), "lm_head is not one"),
    ((*LLAMA_FLAGS, "--lora-alpha", "16"), "--lora-alpha: LoRA settings, add --lora-rank R"),
    ((*LLAMA_FLAGS, "--lora-rank", "4", "--fsdp", "1"), "FSDP1 is not supported for LoRA runs"),
    ((*LLAMA_FLAGS, "--lora-rank", "0"), "--lora-rank must be a positive integer"),
])
def test_lora_usage_errors(flags, message, capsys):
    from train_minimal.config import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(list(flags))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The same runs through `ckpttool export --adapter` and `--merge-adapter` (tests/test_lora.py
# holds the PEFT-trained cases): the step directory's adapter_config.json supplies what the
# weights cannot tell, so neither needs a flag.

def base_folder(directory: Path, variant: str, out: Path, transformers) -> Path:
    """Save the run's frozen base (its `base_layer` weights, adapters left out) as a folder."""
    weights = load_file(directory / "consolidated.safetensors")
    base = {key.replace(".base_layer.", "."): value for key, value in weights.items() if ".lora_" not in key}
    config = transformers.LlamaConfig(**LLAMA_CONFIG, tie_word_embeddings=VARIANTS[variant]["tied"])
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(base, strict=not VARIANTS[variant]["tied"])
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_export_adapter_of_a_trainer_run_needs_no_flags_and_peft_gives_the_trainers_logits(
        variant, lora_runs, transformers, tmp_path):
    directory = lora_runs[variant]
    step_dir = latest_step(directory / "ckpt")
    ckpttool("export", step_dir, tmp_path / "adapter", "--adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written == json.loads((step_dir / "adapter_config.json").read_text())
    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder(directory, variant, tmp_path / "base",
                                                                         transformers))
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ours = initial_model(variant)
    ours.load_state_dict(load_file(directory / "consolidated.safetensors"), strict=True)
    tokens = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        assert_same_bytes(model(input_ids=tokens).logits, ours.eval()(tokens), "logits")


def test_a_resharded_lora_checkpoint_keeps_its_adapter_config_and_exports_the_same_adapter(lora_runs, tmp_path):
    step_dir = latest_step(lora_runs["attention"] / "ckpt")
    ckpttool("reshard", step_dir, tmp_path / "world3", "--world", "3")
    assert (tmp_path / "world3" / "adapter_config.json").read_bytes() == (step_dir / "adapter_config.json").read_bytes()
    ckpttool("export", step_dir, tmp_path / "from-2", "--adapter")
    ckpttool("export", tmp_path / "world3", tmp_path / "from-3", "--adapter")  # no flags: the carried config
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "from-3" / name).read_bytes() == (tmp_path / "from-2" / name).read_bytes()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_merge_adapter_of_a_trainer_run_equals_peft_merge_and_unload_and_loads_in_transformers(
        variant, lora_runs, transformers, tmp_path):
    directory = lora_runs[variant]
    step_dir = latest_step(directory / "ckpt")
    ckpttool("export", step_dir, tmp_path / "merged", "--merge-adapter")  # config.json from the run's train.config
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder(directory, variant, tmp_path / "base",
                                                                         transformers))
    ckpttool("export", step_dir, tmp_path / "adapter", "--adapter")
    expected = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    if VARIANTS[variant]["tied"]:
        del expected["lm_head.weight"]
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(expected)
    for key, value in expected.items():
        assert_same_bytes(merged[key], value, key)
