"""Executing plans: copies, casts and records (execute, record_writes, dequantizing), where each
chunk's bytes are (locating), LoRA merges (merge, adapter) and torchrun (distributed)."""
