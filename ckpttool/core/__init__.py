"""Our own types and pure rules, importing nothing else of ckpttool: the checkpoint types
(checkpoint: Checkpoint, Tensor, Chunk, Blob, ChunkTable), the error hierarchy (errors), dtype
names and sizes (dtypes), boxes and splits (geometry), elements from their raw bits (numerics),
and the environment hooks tests set (testpoints)."""
