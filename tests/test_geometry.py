"""Chunk geometry, tested on plain tuples: no files, no torch."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from ckpttool.core.geometry import classify, coverage, find_overlaps, intersect, row_major_runs, split_dim0


@pytest.mark.parametrize("length,world", [(7, 3), (2, 3), (8, 4), (13, 8), (0, 2), (1, 1), (5, 8)])
def test_split_dim0_matches_torch_chunk_with_empty_tail_shards(length, world):
    import torch

    pieces = torch.arange(length).chunk(world) if length else ()
    expected = [(int(p[0]), len(p)) for p in pieces]
    expected += [(length, 0)] * (world - len(expected))
    assert split_dim0(length, world) == expected


def test_overlaps_are_found_among_many_dim0_chunks_quickly():
    boxes = [((i * 10, 0), (10, 4)) for i in range(100_000)]
    assert find_overlaps(boxes) == []
    boxes[500] = ((4995, 0), (20, 4))
    assert find_overlaps(boxes) == [(499, 500), (500, 501)]


def test_block_sharded_overlap_and_coverage():
    blocks = [((r, c), (2, 3)) for r, c in itertools.product((0, 2), (0, 3))]
    assert find_overlaps(blocks) == [] and coverage(blocks, (4, 6)).complete
    assert find_overlaps(blocks + [((1, 2), (2, 2))]) != []
    partial = coverage(blocks[:3], (4, 6))
    assert (partial.covered, partial.total) == (18, 24)


def test_coverage_names_missing_rows():
    found = coverage([((0, 0), (3, 5)), ((6, 0), (1, 5))], (7, 5))
    assert not found.complete and found.missing_rows == ((3, 6),)


def test_classify_names_the_split():
    assert classify([((0,), (5,))], (5,)).kind == "replicated"
    assert classify([((), ())], ()).kind == "replicated"
    uneven = classify([((0, 0), (3, 5)), ((3, 0), (3, 5)), ((6, 0), (1, 5))], (7, 5))
    assert (uneven.kind, uneven.uneven) == ("dim0", True)
    empty = classify([((0,), (1,)), ((1,), (1,)), ((2,), (0,))], (2,))
    assert (empty.kind, empty.empty_chunks) == ("dim0", 1)
    assert classify([((0, 0), (4, 3)), ((0, 3), (4, 3))], (4, 6)).kind == "dim1"
    assert classify([((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)], (4, 6)).kind == "block"


def test_intersect():
    assert intersect(((0, 0), (4, 4)), ((2, 3), (5, 5))) == ((2, 3), (2, 1))
    assert intersect(((0,), (2,)), ((2,), (2,))) is None


def test_row_major_runs_reassemble_any_sub_box():
    import numpy as np

    rng = random.Random(0)
    for _ in range(300):
        dims = rng.randint(1, 4)
        sizes = [rng.randint(1, 5) for _ in range(dims)]
        offsets = [rng.randint(0, 3) for _ in range(dims)]
        r_offsets = [o + rng.randint(0, s - 1) for o, s in zip(offsets, sizes)]
        r_sizes = [rng.randint(1, o + s - r) for o, s, r in zip(offsets, sizes, r_offsets)]
        chunk = np.arange(np.prod(sizes), dtype=np.int32).reshape(sizes)
        region = chunk[tuple(slice(r - o, r - o + s) for r, o, s in zip(r_offsets, offsets, r_sizes))]
        raw = chunk.tobytes()
        runs = row_major_runs((tuple(offsets), tuple(sizes)), (tuple(r_offsets), tuple(r_sizes)), 4)
        assert b"".join(raw[a:a + n] for a, n in runs) == region.tobytes()
    assert row_major_runs(((0, 0), (4, 5)), ((1, 0), (2, 5)), 4) == [(20, 40)]


def test_flat_boxes_cover_a_flat_range_with_contiguous_boxes_in_order():
    """Every element of [start, stop) once, in row-major order, each box one contiguous run
    starting at its flat_start; at most 2 * ndim - 1 boxes (a flat partition's piece)."""
    from ckpttool.core.geometry import flat_boxes

    generator = random.Random(0)
    for _ in range(2000):
        shape = tuple(generator.randint(1, 4) for _ in range(generator.randint(0, 4)))
        numel = math.prod(shape)
        start = generator.randint(0, numel)
        stop = generator.randint(start, numel)
        seen = []
        boxes = flat_boxes(shape, start, stop)
        for offsets, sizes, flat in boxes:
            indices = [sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(point))
                       for point in itertools.product(*[range(o, o + s) for o, s in zip(offsets, sizes)])]
            assert indices == list(range(flat, flat + len(indices))), (shape, start, stop)
            seen += indices
        assert seen == list(range(start, stop)) and len(boxes) <= max(1, 2 * len(shape) - 1), (shape, start, stop)
