"""Megatron's vocabulary padding, cut on export: the embedding and output layer hold
`padded_vocab_size` rows (the tokenizer's vocabulary rounded up to make_vocab_size_divisible_by x TP),
transformers wants the tokenizer's. The legacy fixture (fixtures/frameworks/megatron_legacy: Megatron-LM's
own save at TP 2 x PP 2, NullTokenizer --vocab-size 99) holds 128 rows for 100 tokens.

The reference (megatron_legacy/vocab_expected.json, fixtures/frameworks/generate_megatron_vocab.py):
Megatron-LM's own `build_tokenizer` on the save's pickled args gives 100 tokens, and the first 100 rows
of the rank files' shards (joined, equal to Megatron's own load) are hashed, as NeMo's exporters cut
them (`TransformFns.prune_padding`). Megatron-Bridge 0.3.1 does not cut (its export yields the rows the
model holds). The logits are Megatron's own forward over all 128 columns (megatron_legacy/logits.safetensors).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, tensor_bytes
from megatron_rank_files import resave

from ckpttool.core.errors import CorruptMetadata

LEGACY = FIXTURES / "frameworks" / "megatron_legacy"
RUN_DIR = LEGACY / "checkpoints"
ITERATION = RUN_DIR / "iter_0000002"
REFERENCE = json.loads((LEGACY / "vocab_expected.json").read_text())
INPUT_IDS = json.loads((LEGACY / "expected.json").read_text())["input_ids"]
TOKENS, ROWS = REFERENCE["tokens"], REFERENCE["padded"]  # 100, 128
# Megatron's forward and transformers' eager one add float32 in other orders: the megatron gpt family's tolerance
LOGIT_TOLERANCE = 1e-4
PADDED = ("model.embed_tokens.weight", "lm_head.weight")


def sha256(tensor) -> str:
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def describe(tensor) -> dict:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."), "sha256": sha256(tensor)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, run) -> tuple[Path, str]:
    """The legacy save exported with nothing but its own files (the vocabulary from its args), and export's output."""
    out = tmp_path_factory.mktemp("vocab") / "hf"
    result = run("export", RUN_DIR, out)
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.fixture(scope="module")
def padded_run(tmp_path_factory, run) -> tuple[Path, str]:
    """The same save exported with every row (--assets hf/config.json states the 128 rows), and export's output."""
    out = tmp_path_factory.mktemp("vocab") / "padded"
    result = run("export", RUN_DIR, out, "--assets", LEGACY / "hf")
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.fixture(scope="module")
def padded_export(padded_run) -> dict:
    from safetensors.torch import load_file

    return load_file(padded_run[0] / "model.safetensors")


def copy_iteration(tmp_path: Path, tokenizer: str | None = None) -> Path:
    """A copy of the legacy iteration folder, its first rank's args naming another `tokenizer`."""
    folder = tmp_path / "iter_0000002"
    shutil.copytree(ITERATION, folder)
    if tokenizer is not None:
        def edit(state):
            state["args"].tokenizer_type = tokenizer

        resave(folder / "mp_rank_00_000" / "model_optim_rng.pt", edit)
    return folder


# -- the rows cut, byte for byte ------------------------------------------------------------------

def test_export_writes_the_tokenizers_rows_equal_to_megatrons_own_bytes(exported, padded_export):
    from safetensors.torch import load_file

    out, _ = exported
    written = load_file(out / "model.safetensors")
    assert {key: describe(written[key]) for key in PADDED} == \
        {key: {k: v for k, v in REFERENCE["tensors"][key].items() if k != "source"} for key in PADDED}
    assert written[PADDED[0]].shape == (TOKENS, 32)
    # every other tensor as it was, the padded rows' first TOKENS rows too
    assert {k: describe(v) for k, v in written.items() if k not in PADDED} == \
        {k: describe(v) for k, v in padded_export.items() if k not in PADDED}
    for key in PADDED:
        assert tensor_bytes(written[key]) == tensor_bytes(padded_export[key][:TOKENS])


def test_config_json_states_the_tokenizers_vocabulary_and_the_output_says_what_was_cut(exported):
    out, output = exported
    assert json.loads((out / "config.json").read_text())["vocab_size"] == TOKENS == 100
    assert f"wrote the first {TOKENS} of the {ROWS} vocabulary rows (the vocabulary: tokenizer_type NullTokenizer, " \
           f"vocab_size 99" in output
    assert f"the other {ROWS - TOKENS} rows (Megatron's padding) are left out" in output


def test_the_export_loads_in_transformers_and_its_logits_are_megatrons_first_columns(exported):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, _ = exported
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(torch.tensor(INPUT_IDS)).logits
    megatron = load_file(LEGACY / "logits.safetensors")["logits"]
    assert megatron.shape == (1, 8, ROWS) and logits.shape == (1, 8, TOKENS)
    assert float((logits - megatron[..., :TOKENS]).abs().max()) < LOGIT_TOLERANCE


def test_inspect_and_diff_read_the_save_with_its_vocabulary_cut_as_export_does(run, exported):
    out, _ = exported
    for a, b in ((RUN_DIR, out), (out, RUN_DIR)):
        result = run("diff", a, b)
        assert result.exit_code == 0 and result.output.startswith(f"IDENTICAL: {a} and {b}"), result.output


# -- what states the vocabulary, in order -----------------------------------------------------------

def test_vocab_size_option_writes_the_first_n_rows_whatever_states_another(run, tmp_path, padded_export):
    from safetensors.torch import load_file

    for extra in ((), ("--assets", LEGACY / "hf")):  # over the args' 100, over the assets' 128
        out = tmp_path / f"n90-{len(extra)}"
        result = run("export", RUN_DIR, out, "--vocab-size", 90, *extra)
        assert result.exit_code == 0, result.output
        written = load_file(out / "model.safetensors")
        for key in PADDED:
            assert tensor_bytes(written[key]) == tensor_bytes(padded_export[key][:90])
        assert json.loads((out / "config.json").read_text())["vocab_size"] == 90
        assert "wrote the first 90 of the 128 vocabulary rows (the vocabulary: --vocab-size 90); the other 38 rows " \
               "are left out" in result.output


def test_an_assets_config_stating_the_rows_keeps_them_and_says_the_save_states_fewer(padded_run, padded_export):
    out, output = padded_run
    assert padded_export[PADDED[0]].shape == (ROWS, 32)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == ROWS
    assert f"kept all {ROWS} vocabulary rows of the embedding and output layer, as {LEGACY / 'hf' / 'config.json'} " \
           f"states (vocab_size {ROWS}), though the save states {TOKENS} tokens (tokenizer_type NullTokenizer, " \
           f"vocab_size 99" in output and f"--vocab-size {TOKENS} writes those" in output


def test_an_assets_config_with_the_tokenizers_vocabulary_cuts_the_rows_too(run, tmp_path, exported):
    assets = tmp_path / "assets"
    assets.mkdir()
    config = json.loads((LEGACY / "hf" / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**config, "vocab_size": TOKENS}))
    out = tmp_path / "hf"
    result = run("export", RUN_DIR, out, "--assets", assets)
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").read_bytes() == (exported[0] / "model.safetensors").read_bytes()


@pytest.mark.parametrize("tokenizer", ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"])
def test_a_tokenizer_read_from_a_file_keeps_every_row_and_says_so(run, tmp_path, padded_export, tokenizer):
    """GPT2BPETokenizer's vocabulary is len(encoder) of --vocab-file, the others' their --tokenizer-model:
    files the save does not hold, so nothing is guessed."""
    from safetensors.torch import load_file

    source = copy_iteration(tmp_path, tokenizer)
    out = tmp_path / "hf"
    result = run("export", source, out)
    assert result.exit_code == 0, result.output
    written = load_file(out / "model.safetensors")
    assert {key: describe(written[key]) for key in PADDED} == {key: describe(padded_export[key]) for key in PADDED}
    assert json.loads((out / "config.json").read_text())["vocab_size"] == ROWS
    notes = [line for line in result.output.splitlines() if "vocabulary rows" in line]
    assert notes == [f"kept all {ROWS} vocabulary rows of the embedding and output layer, Megatron's padding included "
                     f"(config.json vocab_size {ROWS}): the tokenizer ({tokenizer}) reads its vocabulary from a file "
                     "the save does not hold; --vocab-size N writes the first N (the tokenizer's vocabulary)"]
    trimmed = tmp_path / "trimmed"
    assert run("export", source, trimmed, "--vocab-size", TOKENS, "--quiet").exit_code == 0
    assert load_file(trimmed / "model.safetensors")[PADDED[0]].shape == (TOKENS, 32)


# -- refused: exit 1 in one line, nothing written -----------------------------------------------------

def _refused(run, tmp_path, *args) -> str:
    out = tmp_path / "refused"
    result = run("export", *args[:1], out, *args[1:])
    assert result.exit_code == 1, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    return result.output


def test_a_vocabulary_larger_than_the_rows_is_refused(run, tmp_path):
    output = _refused(run, tmp_path, RUN_DIR, "--vocab-size", ROWS + 1)
    assert output.startswith(f"error: [config-mismatch] --vocab-size {ROWS + 1}: ")
    assert f"model.embed_tokens.weight is made of embedding.word_embeddings.weight, which holds {ROWS} vocabulary " \
           "rows" in output


def test_an_assets_vocabulary_larger_than_the_rows_is_refused_naming_the_file(run, tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    config = json.loads((LEGACY / "hf" / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    output = _refused(run, tmp_path, RUN_DIR, "--assets", assets)
    assert f"{assets / 'config.json'}: vocab_size 200, but model.embed_tokens.weight is made of " \
           f"embedding.word_embeddings.weight, which holds {ROWS} vocabulary rows in the weights" in output


def test_a_vocabulary_below_a_special_token_id_of_the_config_is_refused(run, tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    config = json.loads((LEGACY / "hf" / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 99]}))
    output = _refused(run, tmp_path, RUN_DIR, "--assets", assets, "--vocab-size", 99)
    assert "--vocab-size 99: " in output and "names eos_token_id 99, which a vocabulary of 99 tokens does not hold" in output


def test_vocab_size_on_a_save_without_padded_rows_is_a_usage_error(run, tmp_path):
    torchtitan = FIXTURES / "frameworks" / "torchtitan"  # its table has no padded rows to cut
    result = run("export", torchtitan / "checkpoint" / "step-20", tmp_path / "out", "--assets", torchtitan / "hf_config",
                 "--vocab-size", 10)
    assert result.exit_code == 2 and "--vocab-size 10: " in result.output, result.output
    assert not (tmp_path / "out").exists()


# -- the rule, as data ---------------------------------------------------------------------------------

def test_the_tokenizers_whose_vocabulary_the_arguments_state():
    from ckpttool.naming.megatron_config import TOKENIZER_VOCAB, vocabulary

    assert sorted(TOKENIZER_VOCAB) == ["NullMultimodalTokenizer", "NullTokenizer"]
    found = vocabulary({"padded_vocab_size": 128, "tokenizer_type": "NullTokenizer", "vocab_size": 99}, "args")
    assert (found.rows, found.size, found.padded) == (128, 100, True)
    found = vocabulary({"padded_vocab_size": 64, "tokenizer_type": "NullTokenizer", "vocab_size": 63}, "args")
    assert (found.rows, found.size, found.padded) == (64, 64, False)  # megatron_families: no padding
    for kind in ("GPT2BPETokenizer", "Llama2Tokenizer", "TikTokenizer", None):
        found = vocabulary({"padded_vocab_size": 128, "tokenizer_type": kind, "vocab_size": 99}, "args")
        assert (found.rows, found.size) == (128, None)
    with pytest.raises(CorruptMetadata, match="gives 200 tokens, more than padded_vocab_size=128"):
        vocabulary({"padded_vocab_size": 128, "tokenizer_type": "NullTokenizer", "vocab_size": 199}, "args")


def test_nemos_byte_level_tokenizer_counts_its_special_tokens():
    from ckpttool.naming.nemo_config import vocabulary

    def model(vocab_size, special, config_vocab=None):
        return {"config": {"vocab_size": config_vocab, "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 2},
                "tokenizer": {"_target_": "nemo.collections.common.tokenizers.bytelevel_tokenizers.ByteLevelTokenizer",
                              "vocab_size": vocab_size, "special_tokens": special}}

    found = vocabulary(model(256, None), Path("model.yaml"))
    assert (found.rows, found.size) == (256, 256)
    found = vocabulary(model(300, ["<a>", "<b>"]), Path("model.yaml"))
    assert (found.rows, found.size, found.padded) == (512, 302, True)  # nemo/lightning/base.py get_vocab_size
    found = vocabulary(model(256, None, config_vocab=320), Path("model.yaml"))
    assert (found.rows, found.size, found.padded) == (320, 256, True)  # config.vocab_size: the rows as they are
    unknown = model(256, None)
    unknown["tokenizer"]["_target_"] = "nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer"
    unknown["config"]["vocab_size"] = 320
    found = vocabulary(unknown, Path("model.yaml"))
    assert (found.rows, found.size) == (320, None)


def test_the_megatron_tables_cut_the_embedding_and_head_and_import_writes_them_as_they_are():
    from ckpttool import naming
    from ckpttool.naming.engine import TRANSFORMS, VOCAB_ROWS

    assert TRANSFORMS[VOCAB_ROWS].inverse == "rename"
    for family in naming.FAMILIES:
        if family.name.startswith("megatron"):
            cut = sorted(rule.source.rsplit(".", 2)[-2] for rule in family.rules if rule.transform == VOCAB_ROWS)
            assert cut == ["output_layer", "word_embeddings"], family.name
