"""`--json` on the writing commands: one documented, versioned document on stdout describing
what was (or, with --dry-run, would be) written; progress and warnings stay on stderr."""

from __future__ import annotations

import json

from conftest import FIXTURES
from safetensors import safe_open

SOURCE = FIXTURES / "fsdp2_world3_uneven"


def run_json(cli, *args) -> dict:
    result = cli(*args, "--json", "--quiet")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_consolidate_json_lists_each_written_file_and_tensor_as_on_disk(cli, tmp_path):
    out = tmp_path / "model.safetensors"
    document = run_json(cli, "consolidate", SOURCE, out)
    assert document["schema"] == "ckpttool.consolidate/1" and not document["dry_run"]
    assert document["files"] == [{"file": "model.safetensors", "path": str(out), "bytes": out.stat().st_size, "tensors": 16}]
    with safe_open(out, "pt") as handle:
        assert sorted(t["key"] for t in document["tensors"]) == sorted(handle.keys())
        for entry in document["tensors"]:
            assert list(handle.get_slice(entry["key"]).get_shape()) == entry["shape"]
    assert document["tensor_bytes"] == sum(t["bytes"] for t in document["tensors"])
    assert document["problems"] == []


def test_consolidate_json_of_a_sharded_dry_run_names_shards_and_index_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "hub"
    document = run_json(cli, "consolidate", SOURCE, out, "--max-shard-size", "1kB", "--dtype", "bf16", "--dry-run")
    assert document["dry_run"] and not out.exists()
    names = [f["file"] for f in document["files"]]
    assert names[-1] == "model.safetensors.index.json" and len(names) > 2
    assert all(f["path"] == str(out / f["file"]) for f in document["files"])
    assert {t["dtype"] for t in document["tensors"] if t["source_dtype"] == "float32"} == {"bfloat16"}


def test_consolidate_json_carries_the_gates_warnings(cli, tmp_path):
    import shutil

    source = tmp_path / "ckpt"
    shutil.copytree(SOURCE, source)
    (source / "stray.bin").write_bytes(b"left over")
    document = run_json(cli, "consolidate", source, tmp_path / "m.safetensors")
    assert [p["code"] for p in document["problems"]] == ["unreferenced-file"]


def test_reshard_json_names_the_rule_each_rank_file_and_tensor(cli, tmp_path):
    out = tmp_path / "w4"
    document = run_json(cli, "reshard", SOURCE, out, "--world", "4")
    assert document["schema"] == "ckpttool.reshard/1"
    assert document["world_size"] == 4 and document["mesh"] == {"replicas": 1, "shards": 4}
    assert document["rule"] == "source"
    assert [f["file"] for f in document["files"]] == [f"__{r}_0.distcp" for r in range(4)]
    assert document["file_bytes"] == sum((out / f["file"]).stat().st_size for f in document["files"])
    assert {t["fqn"]: t["sharded"] for t in document["tensors"]}["model.position_ids"] is False


def test_reshard_json_dry_run_shows_keep_whole_and_writes_nothing(cli, tmp_path):
    document = run_json(cli, "reshard", SOURCE, tmp_path / "out", "--world", "2", "--keep-whole", "model.embed.*", "--dry-run")
    assert document["dry_run"] and document["keep_whole"] == ["model.embed.*"]
    assert {t["fqn"]: t["sharded"] for t in document["tensors"]}["model.embed.weight"] is False
    assert not (tmp_path / "out").exists()
