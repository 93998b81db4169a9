"""The executor hands small operations to its thread pool in batches, large ones alone."""

from __future__ import annotations

from ckpttool.run.execute import BATCH_OPERATIONS, SMALL_OPERATION, batches
from ckpttool.plan.operations import Copy


def copy(length: int, at: int = 0) -> Copy:
    return Copy("__0_0.distcp", at, "m.safetensors", at, length)


def test_small_operations_are_batched_in_order_and_a_large_one_runs_alone():
    small, large = copy(256), copy(SMALL_OPERATION)
    operations = [small] * (BATCH_OPERATIONS + 44) + [large, small]
    found = list(batches(operations))
    assert [len(batch) for batch in found] == [BATCH_OPERATIONS, 44, 1, 1]
    assert [op for batch in found for op in batch] == operations
    assert found[2] == [large]


def test_a_batch_closes_once_it_holds_about_batch_bytes():
    operations = [copy(SMALL_OPERATION - 1)] * 9
    assert [len(batch) for batch in batches(operations)] == [5, 4]
