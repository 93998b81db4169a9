"""`inspect --html` and `validate --html`: the shard-map page, its data, and what a real browser draws.

The geometry is checked against torch's own reading of each `.metadata` (FileSystemReader), in
headless Chromium (Debian's `chromium` package, driven over the DevTools pipe: tests/browser.py):
for an FSDP2 checkpoint (the bundled `fsdp2_world3_uneven`) and for HSDP and TP x FSDP
checkpoints that one spawned gloo world of 4 saves with `dcp.save` once per session.

Without a browser the browser tests skip, unless CKPTTOOL_REQUIRE_BROWSER is set (CI sets it):
then they fail. Screenshots go to the test's tmp dir and, when set, to $CKPTTOOL_ARTEFACTS.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from browser import Browser, find_chromium  # noqa: E402
from conftest import FIXTURES  # noqa: E402

CKPTTOOL = Path(sys.executable).with_name("ckpttool")
UNEVEN = FIXTURES / "fsdp2_world3_uneven"
ARTEFACTS = os.environ.get("CKPTTOOL_ARTEFACTS")


# ---------------------------------------------------------------------------------------------
# HSDP and TP x FSDP checkpoints, saved by torch's own dcp.save on a 2x2 gloo mesh


def _save_meshes(rank: int, port: int, root: str) -> None:
    """World 4 on a 2x2 mesh, two saves: HSDP ([Replicate, Shard(0)] over replicate x shard:
    each box held by two ranks, written once) and TP x FSDP ([Shard(0), Shard(1)] over dp x tp:
    2-D blocks; [Shard(0), Shard(0)]: dim 0 split by both)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fsdp_loads import exit_spawned_rank

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    generator = torch.Generator().manual_seed(3)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    state = {
        "tok_emb.weight": distribute_tensor(torch.randn(11, 6, generator=generator), hsdp, [Replicate(), Shard(0)]),
        "layers.0.attn.wq.weight": distribute_tensor(torch.randn(8, 6, generator=generator), hsdp, [Replicate(), Shard(0)]),
        "layers.0.norm.weight": distribute_tensor(torch.ones(6), hsdp, [Replicate(), Shard(0)]),
        "layers.1.attn.wq.weight": distribute_tensor(torch.randn(8, 6, generator=generator), hsdp, [Replicate(), Shard(0)]),
    }
    dcp.save({"model": state}, checkpoint_id=os.path.join(root, "hsdp_2x2"))
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state = {
        "layers.0.attn.wq.weight": distribute_tensor(torch.randn(9, 10, generator=generator), tp, [Shard(0), Shard(1)]),
        "layers.0.attn.wo.weight": distribute_tensor(torch.randn(10, 7, generator=generator), tp, [Shard(1), Shard(0)]),
        "layers.0.mlp.w1.weight": distribute_tensor(torch.randn(12, 5, generator=generator), tp, [Shard(0), Shard(0)]),
        "layers.0.norm.weight": distribute_tensor(torch.ones(10), tp, [Replicate(), Replicate()]),
        "output.weight": distribute_tensor(torch.randn(6, 10, generator=generator), tp, [Replicate(), Shard(1)]),
    }
    dcp.save({"model": state}, checkpoint_id=os.path.join(root, "tp2_fsdp2"))
    dist.barrier()
    dist.destroy_process_group()
    exit_spawned_rank()


def _main(root: str) -> None:
    import torch.multiprocessing as mp

    from ports import free_port

    mp.start_processes(_save_meshes, args=(free_port(), root), nprocs=4, start_method="fork")


@pytest.fixture(scope="session")
def meshes(tmp_path_factory) -> dict[str, Path]:
    """name -> checkpoint: the FSDP2 fixture, and the HSDP and TP x FSDP saves (written once)."""
    root = tmp_path_factory.mktemp("meshes")
    subprocess.run([sys.executable, __file__, str(root)], check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)})
    return {"fsdp2_world3_uneven": UNEVEN, "hsdp_2x2": root / "hsdp_2x2", "tp2_fsdp2": root / "tp2_fsdp2"}


def torch_chunks(checkpoint: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str]]]:
    """fqn -> (offsets, sizes, data file) of each chunk, as torch's own reader sees the metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    chunks = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunks[fqn] = sorted(
                (tuple(c.offsets), tuple(c.sizes),
                 metadata.storage_data[MetadataIndex(fqn, c.offsets, index)].relative_path)
                for index, c in enumerate(entry.chunks))
    return chunks


# ---------------------------------------------------------------------------------------------
# The data: no browser needed


def test_bytes_are_counted_per_layer_and_group():
    from ckpttool.commands.inspect import inspect
    from ckpttool.render.shard_map import build, module_of

    assert module_of("model.layers.3.attn.wq.weight") == "model.layers.3"
    assert module_of("optim.state.model.layers.12.mlp.experts.7.w1.exp_avg") == "optim.state.model.layers.12"
    assert module_of("model.tok_emb.weight") == "model.tok_emb"
    assert module_of("step") == "step"
    report = inspect(FIXTURES / "fsdp2_world2_adamw")
    shard_map = build(report)
    for group in ("model", "optimizer", "other"):
        assert sum(m.nbytes for m in shard_map.modules if m.group == group) == report.groups[group].nbytes
    assert {m.module for m in shard_map.modules if m.group == "model"} >= {"model.layers.0", "model.layers.1"}
    assert shard_map.duplicate_bytes == 0 and shard_map.stored_bytes == report.summary.tensor_bytes


@pytest.mark.parametrize("tables", [False, True], ids=["chunks", "tables"])
def test_chunk_rows_are_the_metadata_chunks_and_their_files(tables):
    from ckpttool import readers
    from ckpttool.core.checkpoint import with_tables
    from ckpttool.commands.inspect import build_report
    from ckpttool.render.shard_map import build

    checkpoint = readers.open_checkpoint(UNEVEN)
    shard_map = build(build_report(with_tables(checkpoint) if tables else checkpoint))
    expected = torch_chunks(UNEVEN)
    assert sorted(t.fqn for t in shard_map.tensors) == sorted(expected)
    for tensor in shard_map.tensors:
        ndim = len(tensor.shape)
        ours = sorted((tuple(r[:ndim]), tuple(r[ndim:2 * ndim]), shard_map.files[r[-1]].file)
                      for r in tensor.chunks.tolist())
        assert ours == expected[tensor.fqn], tensor.fqn
        assert tensor.axes == ((0,) if ndim else ()) and tensor.copies == 1


def test_boxes_stored_twice_count_as_copies_and_their_bytes_once():
    from ckpttool import readers
    from ckpttool.commands.inspect import build_report
    from ckpttool.render.shard_map import build

    checkpoint = readers.open_checkpoint(UNEVEN)
    fqn = "model.layers.0.fc1.weight"
    tensor = checkpoint.tensors[fqn]
    twice = tuple(sorted(tensor.chunks + tensor.chunks, key=lambda chunk: chunk.offsets))  # each box by two replicas
    checkpoint = dataclasses.replace(checkpoint, tensors={**checkpoint.tensors, fqn: dataclasses.replace(tensor, chunks=twice)})
    row = next(t for t in build(build_report(checkpoint)).tensors if t.fqn == fqn)
    assert row.copies == 2
    assert row.stored_bytes == 2 * tensor.nbytes and row.duplicate_bytes == tensor.nbytes


def test_validate_problems_are_attached_to_the_tensors_they_name():
    from ckpttool.commands.inspect import inspect
    from ckpttool.check.integrity import Problem
    from ckpttool.render.shard_map import build

    problems = [Problem("error", "checksum", "bytes changed", "__1_0.distcp", "model.layers.0.fc1.weight"),
                Problem("warning", "unreferenced-file", "left over", "stray.distcp")]
    shard_map = build(inspect(UNEVEN), problems, validated=True)
    marked = {t.fqn: t.problems for t in shard_map.tensors if t.problems}
    assert marked == {"model.layers.0.fc1.weight": (0,)}
    assert build(None, problems, path="gone", validated=True).problems == tuple(problems)


def test_page_is_self_contained_deterministic_and_names_are_inert(tmp_path):
    from ckpttool import readers
    from ckpttool.commands.inspect import build_report
    from ckpttool.render.html import page
    from ckpttool.render.shard_map import build

    checkpoint = readers.open_checkpoint(UNEVEN)
    hostile = "model.</script><img src=x onerror=alert(1)>.w"
    tensors = {**checkpoint.tensors, hostile: dataclasses.replace(checkpoint.tensors["model.layers.0.fc1.weight"], fqn=hostile)}
    text = page(build(build_report(dataclasses.replace(checkpoint, tensors=tensors))))
    assert text == page(build(build_report(dataclasses.replace(checkpoint, tensors=tensors))))
    assert text.isascii() and text.count("</script>") == 2 and "<img" not in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # nothing fetched: no URL to fetch
    assert "Content-Security-Policy" in text


def test_inspect_html_writes_the_page_and_never_replaces_one_without_force(tmp_path):
    out = tmp_path / "report.html"
    first = subprocess.run([str(CKPTTOOL), "inspect", str(UNEVEN), "--html", str(out)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "wrote" in first.stderr and "tensors" in first.stdout  # the page, and inspect's text as always
    data = _embedded(out)
    assert data["schema"] == "ckpttool.shard-map/1" and len(data["tensors"]) == len(torch_chunks(UNEVEN))
    again = subprocess.run([str(CKPTTOOL), "inspect", str(UNEVEN), "--html", str(out)], capture_output=True, text=True)
    assert again.returncode == 2 and "--force" in again.stderr
    assert subprocess.run([str(CKPTTOOL), "inspect", str(UNEVEN), "--html", str(out), "--force"]).returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary left beside it


def test_validate_html_marks_the_problems_and_keeps_the_exit_code(tmp_path):
    from click.testing import CliRunner

    from ckpttool.cli import main

    damaged = tmp_path / "damaged"
    shutil.copytree(UNEVEN, damaged)
    with open(damaged / "__1_0.distcp", "r+b") as handle:
        handle.truncate(100)
    result = CliRunner().invoke(main, ["validate", str(damaged), "--html", str(tmp_path / "v.html")])
    assert result.exit_code == 1, result.output
    data = _embedded(tmp_path / "v.html")
    assert data["validated"] and any(p[3] == "__1_0.distcp" for p in data["problems"])
    clean = CliRunner().invoke(main, ["validate", str(UNEVEN), "--html", str(tmp_path / "ok.html")])
    assert clean.exit_code == 0 and _embedded(tmp_path / "ok.html")["problems"] == []


def _embedded(path: Path) -> dict:
    text = path.read_text()
    start = text.index('<script type="application/json" id="shard-map-data">') + len('<script type="application/json" id="shard-map-data">')
    return json.loads(text[start:text.index("</script>", start)])


# ---------------------------------------------------------------------------------------------
# In a real browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    executable = find_chromium()
    if executable is None:
        if os.environ.get("CKPTTOOL_REQUIRE_BROWSER"):
            pytest.fail("CKPTTOOL_REQUIRE_BROWSER is set but no chromium is installed (apt-get install chromium)")
        pytest.skip("no chromium (apt-get install chromium; CI sets CKPTTOOL_REQUIRE_BROWSER)")
    with Browser.launch(tmp_path_factory.mktemp("chromium-profile"), executable) as launched:
        yield launched


def write_page(path: Path, checkpoint_dir: Path | None = None, *, checkpoint=None, problems=(), validated=False) -> Path:
    from ckpttool import readers
    from ckpttool.commands.inspect import build_report
    from ckpttool.render.html import write_page as write
    from ckpttool.render.shard_map import build

    checkpoint = checkpoint or readers.open_checkpoint(checkpoint_dir)
    write(build(build_report(checkpoint), problems, validated=validated), path, force=True)
    return path


def drawn_boxes(browser: Browser, fqn: str) -> list[dict]:
    """Open the tensor's row with a click; return each box drawn for it: its data attributes,
    its rect in the SVG's (tensor) coordinates and its pixels relative to its SVG."""
    browser.evaluate(f"(() => {{ const f = document.getElementById('filter'); f.value = {json.dumps(fqn)};"
                     " f.dispatchEvent(new Event('input')); })()")
    selector = f"tr.tensor[data-fqn={json.dumps(fqn)}]"
    browser.click(selector)
    browser.wait_for(f"document.querySelector({json.dumps(selector)}).nextElementSibling?.classList.contains('detail')")
    return browser.evaluate(
        "(() => { const files = JSON.parse(document.getElementById('shard-map-data').textContent).files;"
        " return [...document.querySelectorAll('tr.detail rect.chunk')].map(r => { const s = r.ownerSVGElement;"
        " const a = r.getBoundingClientRect(), b = s.getBoundingClientRect(), v = s.viewBox.baseVal; return {"
        " offsets: r.dataset.offsets ? r.dataset.offsets.split(',').map(Number) : [],"
        " sizes: r.dataset.sizes ? r.dataset.sizes.split(',').map(Number) : [],"
        " file: Number(r.dataset.file) >= 0 ? files[Number(r.dataset.file)][0] : null,"
        " copy: Number(r.dataset.copy), axes: s.dataset.axes ? s.dataset.axes.split(',').map(Number) : [],"
        " x: r.x.baseVal.value, y: r.y.baseVal.value, width: r.width.baseVal.value, height: r.height.baseVal.value,"
        " view: [v.width, v.height], pixels: [a.left - b.left, a.top - b.top, a.width, a.height], svg: [b.width, b.height] }; }); })()")


def assert_boxes_are_the_chunks(boxes: list[dict], expected: list[tuple], shape: tuple[int, ...], fqn: str) -> None:
    """The drawn boxes are the chunks (offsets, sizes, file), and each is drawn where its
    offsets and sizes say, along the drawn axes: in SVG coordinates exactly, in pixels to a pixel."""
    assert sorted((tuple(b["offsets"]), tuple(b["sizes"]), b["file"]) for b in boxes) == expected, fqn
    for box in boxes:
        axes = box["axes"]
        if len(axes) == 2:  # a grid: rows down, columns across, in tensor coordinates
            rows, cols = axes
            assert (box["x"], box["y"], box["width"], box["height"]) == \
                (box["offsets"][cols], box["offsets"][rows], box["sizes"][cols], box["sizes"][rows]), fqn
            assert box["view"] == [max(1, shape[cols]), max(1, shape[rows])]
        elif len(axes) == 1:  # bars along one dimension, one lane per copy
            (axis,) = axes
            assert (box["x"], box["width"]) == (box["offsets"][axis], box["sizes"][axis]), fqn
            assert box["view"][0] == max(1, shape[axis]) and int(box["y"]) == box["copy"]
        scale_x, scale_y = box["svg"][0] / box["view"][0], box["svg"][1] / box["view"][1]
        assert abs(box["pixels"][0] - box["x"] * scale_x) <= 1.5 and abs(box["pixels"][2] - box["width"] * scale_x) <= 1.5, fqn
        assert abs(box["pixels"][1] - box["y"] * scale_y) <= 1.5 and abs(box["pixels"][3] - box["height"] * scale_y) <= 1.5, fqn


def save_screenshot(browser: Browser, tmp_path: Path, name: str) -> Path:
    path = browser.screenshot(tmp_path / name)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    if ARTEFACTS:
        shutil.copy(path, Path(ARTEFACTS).mkdir(parents=True, exist_ok=True) or Path(ARTEFACTS) / name)
    return path


@pytest.mark.parametrize("name", ["fsdp2_world3_uneven", "hsdp_2x2", "tp2_fsdp2"])
def test_browser_draws_each_tensors_boxes_where_the_metadata_puts_them(browser, meshes, tmp_path, name):
    from ckpttool import readers

    checkpoint = readers.open_checkpoint(meshes[name])
    page = write_page(tmp_path / f"{name}.html", checkpoint=checkpoint)
    browser.errors.clear()
    browser.open(page)
    assert browser.evaluate("document.querySelectorAll('rect.chunk').length") == 0  # drawn on demand only
    expected = torch_chunks(meshes[name])
    for fqn, chunks in expected.items():
        boxes = drawn_boxes(browser, fqn)
        assert_boxes_are_the_chunks(boxes, chunks, checkpoint.tensors[fqn].shape, fqn)
    if name == "tp2_fsdp2":  # TP x FSDP: dims 0 and 1 split, drawn as a grid of 4 blocks
        grid = drawn_boxes(browser, "model.layers.0.attn.wq.weight")
        assert {tuple(b["axes"]) for b in grid} == {(0, 1)} and len(grid) == 4
        assert len({b["file"] for b in grid}) == 4
    if name == "hsdp_2x2":  # dim 0 over the shard dim: bars, each box written once
        bars = drawn_boxes(browser, "model.tok_emb.weight")
        assert {tuple(b["axes"]) for b in bars} == {(0,)} and [b["sizes"][0] for b in sorted(bars, key=lambda b: b["offsets"])] == [6, 5]
    if name == "fsdp2_world3_uneven":  # dim 0 over 3 ranks, uneven: bars of 5, 5 and 3 rows, one per rank
        bars = drawn_boxes(browser, "model.embed.weight")
        assert {tuple(b["axes"]) for b in bars} == {(0,)} and len({b["file"] for b in bars}) == len(bars)
        assert [b["sizes"][0] for b in sorted(bars, key=lambda b: b["offsets"])] == [5, 5, 3]
    save_screenshot(browser, tmp_path, f"shard-map-{name}.png")
    assert browser.errors == []


def test_browser_shows_boxes_stored_twice_in_two_lanes_and_the_copies(browser, meshes, tmp_path):
    from ckpttool import readers

    checkpoint = readers.open_checkpoint(meshes["hsdp_2x2"])
    tensors = {fqn: dataclasses.replace(t, chunks=tuple(sorted(t.chunks + t.chunks, key=lambda c: c.offsets)))
               for fqn, t in checkpoint.tensors.items()}  # as a save without deduplication would write them
    browser.errors.clear()
    browser.open(write_page(tmp_path / "copies.html", checkpoint=dataclasses.replace(checkpoint, tensors=tensors)))
    assert browser.evaluate("document.querySelectorAll('#duplicates li').length") == len(tensors)
    boxes = drawn_boxes(browser, "model.tok_emb.weight")
    doubled = sorted(c for c in torch_chunks(meshes["hsdp_2x2"])["model.tok_emb.weight"] for _ in range(2))
    assert_boxes_are_the_chunks(boxes, doubled, (11, 6), "model.tok_emb.weight")
    assert sorted(b["copy"] for b in boxes) == [0, 0, 1, 1]
    assert browser.errors == []


def test_browser_marks_validate_problems_on_their_tensors_and_chunks(browser, tmp_path):
    from ckpttool.commands.validate import validate

    damaged = tmp_path / "damaged"
    shutil.copytree(UNEVEN, damaged)
    with open(damaged / "__1_0.distcp", "r+b") as handle:
        handle.truncate(100)
    report = validate(damaged)
    assert not report.valid
    browser.errors.clear()
    browser.open(write_page(tmp_path / "validate.html", damaged, problems=report.problems, validated=True))
    assert browser.evaluate("document.querySelector('#problems .fail').textContent").startswith("invalid")
    boxes = browser.evaluate("document.querySelectorAll('rect.chunk').length")
    assert boxes == 0
    drawn_boxes(browser, "model.layers.0.fc1.weight")
    bad = browser.evaluate("[...document.querySelectorAll('tr.detail rect.chunk.bad')].map(r => r.dataset.file)")
    files = browser.evaluate("JSON.parse(document.getElementById('shard-map-data').textContent).files.map(f => f[0])")
    assert bad and {files[int(f)] for f in bad} == {"__1_0.distcp"}
    browser.evaluate("document.getElementById('filter').value = ''; document.getElementById('filter').dispatchEvent(new Event('input'))")
    browser.click("#with-problems")
    marked = browser.evaluate("[...document.querySelectorAll('tr.tensor')].map(r => r.dataset.fqn)")
    holding = {fqn for fqn, chunks in torch_chunks(damaged).items() if any(file == "__1_0.distcp" for *_, file in chunks)}
    named = {p.fqn for p in report.problems if p.fqn in torch_chunks(damaged)}  # (objects are in the list of problems)
    assert named and set(marked) == holding | named
    save_screenshot(browser, tmp_path, "shard-map-validate.png")
    assert browser.errors == []


def test_browser_opens_100k_chunks_with_the_detail_drawn_on_demand(browser, tmp_path):
    import numpy as np

    from ckpttool.core.checkpoint import Checkpoint, ChunkTable, Tensor

    tensors = {}
    for layer in range(1000):  # 1000 tensors of 100 dim-0 chunks, one per rank's file
        offsets = np.stack([np.arange(100, dtype=np.int64) * 4, np.zeros(100, dtype=np.int64)], axis=1)
        sizes = np.tile(np.array([[4, 64]], dtype=np.int64), (100, 1))
        table = ChunkTable(offsets, sizes, np.arange(100, dtype=np.int32), np.full(100, layer * 1024, dtype=np.int64),
                           np.full(100, 1024, dtype=np.int64), tuple(f"__{r}_0.distcp" for r in range(100)))
        fqn = f"model.layers.{layer}.w"
        tensors[fqn] = Tensor(fqn, "float32", (400, 64), table)
    checkpoint = Checkpoint(tmp_path / "big", ".metadata", "1.0.0", tensors, {})
    browser.errors.clear()
    browser.open(write_page(tmp_path / "big.html", checkpoint=checkpoint))
    assert browser.evaluate("document.querySelectorAll('rect.chunk').length") == 0
    assert browser.evaluate("document.getElementsByTagName('*').length") < 10_000  # aggregated: rows paged, no boxes
    boxes = drawn_boxes(browser, "model.layers.999.w")
    assert len(boxes) == 100 and {tuple(b["axes"]) for b in boxes} == {(0,)}
    assert browser.errors == []


if __name__ == "__main__":
    _main(sys.argv[1])
