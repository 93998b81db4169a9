"""All human text and --json documents, one module per command family, so a command imports
only its own: `inspect` (with `chunk_tables`, a ChunkTable's columns as text and JSON),
`validate`, `manifest`, `diff`, `convert` (consolidate and reshard), `hub` (export, push,
import), `lora` (adapters), `html` (the shard-map page); `text` holds what they share
(terminal-safe text, sizes, tables, problems, the JSON writer). Only the cli package imports them.

This package imports nothing itself: `ckpttool --help` and `inspect` pay only for what they use.
"""
