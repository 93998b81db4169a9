"""`--force` over a directory output replaces what ckpttool writes there and keeps the rest.

A Hub folder, an export or a DCP checkpoint directory is often where the user also keeps a
`config.json`, tokenizer files or notes. Writing over it with `--force` (consolidate to a
folder, export, reshard, import; local and s3://):

- replaces the files the command writes now, byte-identical to a fresh run;
- removes ckpttool's own files of an earlier run (weights `model*.safetensors`, their index,
  `.metadata`, `*.distcp`): the shards of a larger run do not linger;
- keeps everything else byte for byte (the user's config.json, notes.txt);
- names on stderr, in one line, a file it replaced that was not one of its weight, index or
  metadata files (export's config.json over the user's);
- stays atomic: a signal before the swap leaves the folder as it was, user files included.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from conftest import FIXTURES
from test_interrupts import one_line_for, run_until, stop
from test_remote import BUCKET, remote_files, run_cli, s3  # noqa: F401 - s3: the moto S3 server fixture

SOURCE = FIXTURES / "fsdp2_world2"
LLAMA = FIXTURES / "llama_world2"  # transformers' tiny LlamaForCausalLM, with config/config.json
USER_FILES = {
    "config.json": b'{"model_type": "mine", "note": "written by hand"}\n',
    "notes.txt": b"trained on the March data; do not delete\n",
}


def files_of(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path -> bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def place_user_files(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, data in USER_FILES.items():
        (out / name).write_bytes(data)


def run(cli, *args):
    result = cli(*args, "--quiet")
    assert result.exit_code == 0, result.output
    return result


def fresh_run(cli, out: Path, *args) -> dict[str, bytes]:
    """The files a run writes at `out` when nothing is there; `out` removed again."""
    run(cli, *args)
    written = files_of(out)
    shutil.rmtree(out)
    return written


def replaced_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("replaced ")]


# ---------------------------------------------------------------------------------------------
# consolidate to a Hub folder


def test_consolidate_force_keeps_the_users_config_and_notes_and_drops_the_old_shards(cli, tmp_path):
    out, fresh = tmp_path / "hub", tmp_path / "fresh"
    run(cli, "consolidate", SOURCE, out, "--max-shard-size", "1kB")  # an earlier run: 5 shards and an index
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    place_user_files(out)

    result = run(cli, "consolidate", SOURCE, out, "--force")  # now one model.safetensors, no index
    run(cli, "consolidate", SOURCE, fresh)

    assert files_of(out) == {**files_of(fresh), **USER_FILES}
    assert sorted(files_of(fresh)) == ["model.safetensors"]  # the shards and the index are gone
    assert replaced_lines(result) == []  # consolidate writes no config.json: nothing of the user's replaced


def test_without_force_an_existing_folder_is_still_refused_and_left_alone(cli, tmp_path):
    out = tmp_path / "hub"
    place_user_files(out)
    result = cli("consolidate", SOURCE, out, "--quiet")
    assert result.exit_code == 2 and "--force" in result.stderr
    assert files_of(out) == USER_FILES


# ---------------------------------------------------------------------------------------------
# export


def test_export_force_without_a_config_of_its_own_keeps_the_users_config(cli, tmp_path):
    out, fresh = tmp_path / "hub", tmp_path / "fresh"
    place_user_files(out)
    result = run(cli, "export", LLAMA / "checkpoint", out, "--force")
    run(cli, "export", LLAMA / "checkpoint", fresh)

    assert "config.json" not in files_of(fresh)  # no --assets, no trainer config: export writes none
    assert files_of(out) == {**files_of(fresh), **USER_FILES}
    assert replaced_lines(result) == []


def test_export_force_replaces_config_json_with_its_own_says_so_and_keeps_notes(cli, tmp_path):
    out, fresh = tmp_path / "hub", tmp_path / "fresh"
    run(cli, "export", LLAMA / "checkpoint", out, "--max-shard-size", "30kB")  # an earlier export, sharded
    place_user_files(out)

    result = run(cli, "export", LLAMA / "checkpoint", out, "--assets", LLAMA / "config", "--force")
    run(cli, "export", LLAMA / "checkpoint", fresh, "--assets", LLAMA / "config")

    assert files_of(out) == {**files_of(fresh), "notes.txt": USER_FILES["notes.txt"]}
    assert not list(out.glob("model-*-of-*.safetensors")) and not (out / "model.safetensors.index.json").exists()
    # README.md (the card) was ckpttool's own from the earlier export; config.json was the user's
    assert replaced_lines(result) == [f"replaced {out}/README.md, {out}/config.json, which were there before (--force)"]


# ---------------------------------------------------------------------------------------------
# reshard and import: DCP checkpoint directories


def test_reshard_force_keeps_the_users_files_and_drops_the_ranks_of_a_larger_world(cli, tmp_path):
    out = tmp_path / "out"
    expected = fresh_run(cli, out, "reshard", SOURCE, out, "--world", "2")  # .metadata names its directory
    run(cli, "reshard", SOURCE, out, "--world", "3")
    assert (out / "__2_0.distcp").exists()
    place_user_files(out)

    result = run(cli, "reshard", SOURCE, out, "--world", "2", "--force")

    assert files_of(out) == {**expected, **USER_FILES}  # __2_0.distcp of world 3 is gone
    assert replaced_lines(result) == []
    assert cli("validate", out, "--deep").exit_code == 0


def test_import_force_keeps_the_users_files(cli, tmp_path):
    weights, out = tmp_path / "model.safetensors", tmp_path / "out"
    run(cli, "consolidate", SOURCE, weights)
    expected = fresh_run(cli, out, "import", weights, out, "--world", "2")
    run(cli, "import", weights, out, "--world", "3")
    place_user_files(out)

    run(cli, "import", weights, out, "--world", "2", "--force")

    assert files_of(out) == {**expected, **USER_FILES}


# ---------------------------------------------------------------------------------------------
# Still atomic: a signal before the swap leaves the folder as it was


def test_a_sigterm_just_before_the_swap_leaves_the_folder_and_the_users_files_as_they_were(tmp_path):
    out = tmp_path / "hub"
    place_user_files(out)
    before = files_of(out)
    process = run_until("commit", "consolidate", SOURCE, out, "--max-shard-size", "1kB", "--force")
    returncode, stderr = stop(process, signal.SIGTERM)
    assert (returncode, stderr) == (128 + signal.SIGTERM, one_line_for(signal.SIGTERM))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hub"]  # no temporary left beside it
    assert files_of(out) == before


# ---------------------------------------------------------------------------------------------
# Object storage: the same rule for keys under an s3:// prefix


@pytest.fixture(scope="module")
def clean_moto():
    """test_remote's `s3` fixture expects to start the only S3 server of the process: moto keeps
    its buckets per process and s3fs its filesystems (with the endpoint of their day), so this
    module starts and leaves with neither."""
    import s3fs
    from moto.moto_api._internal.models import moto_api_backend

    moto_api_backend.reset()
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    moto_api_backend.reset()
    s3fs.S3FileSystem.clear_instance_cache()


def test_consolidate_force_to_s3_keeps_the_users_keys_and_drops_the_old_shards(clean_moto, s3, tmp_path):  # noqa: F811
    key = f"{BUCKET}/keeps-user-files"
    assert run_cli("consolidate", SOURCE, f"s3://{key}", "--max-shard-size", "1kB")[0] == 0
    for name, data in USER_FILES.items():
        s3.pipe_file(f"{key}/{name}", data)

    code, out, err = run_cli("consolidate", SOURCE, f"s3://{key}", "--force")
    assert code == 0, out + err
    assert run_cli("consolidate", SOURCE, tmp_path / "fresh")[0] == 0

    assert remote_files(s3, key) == {**files_of(tmp_path / "fresh"), **USER_FILES}
