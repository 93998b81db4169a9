"""The checking unpickler every reader uses: nothing from a file is executed, and nothing
is built past a budget.

torch writes `.metadata` with `pickle.dump(Metadata)`, and each torch.save record holds a
`data.pkl`; torch reads them back with plain `pickle.load`, which would run any code a hostile
checkpoint carries. We unpickle through an allowlist that maps each admitted class to a small
stand-in of our own, so this package never imports torch and never executes anything from
the file.

An allowlist alone does not make a crafted pickle harmless: a few bytes can ask the C
unpickler for gigabytes (a memo slot of 2**31), build structures whose hash or repr recurses
until the process segfaults or runs for ever, or make dict building quadratic with colliding
keys. So every pickle goes through `_Loader`, which walks the opcodes once, iteratively, with a
model of the unpickler's stack and memo, and refuses the pickle before anything is built as
soon as it would exceed one of these budgets:

- the file (readers/dcp.py): `.metadata` must be a regular file of at most `MAX_METADATA_BYTES`
  (2 GiB, about 15M chunks; a 100k-chunk checkpoint has 14 MB), read in pieces of `READ_CHUNK_BYTES`.
- memo: a PUT may only fill the next free slot or overwrite a filled one, a GET only read a
  filled one, so the memo never outgrows the objects made.
- nesting: containers (tuples, lists, dicts, sets, objects) nest at most `MAX_NESTING` (16)
  deep; DCP metadata nests 9.
- size: every value, unfolded as a tree (a shared part counted each time it is used), and the
  work of all calls, BUILDs and hashed keys, stay under `TREE_NODES_PER_BYTE` (4) per pickle
  byte plus `TREE_NODES_SLACK`; torch's metadata needs 0.7 per byte.
- objects: at most one new object per `BYTES_PER_OBJECT` (3) pickle bytes plus `OBJECTS_SLACK`;
  torch's metadata makes one per 8 bytes.
- hashing: dict keys and set items are strings, our records (hashed by identity), or at most
  `MAX_UNSALTED_KEYS` ints, floats and flat tuples of ints (their hashes are not salted, so
  colliding ones could make dict building quadratic); torch.Size takes a flat tuple of ints.
- opcodes: protocol 0 text opcodes, DUP, INST/OBJ, NEWOBJ_EX, EXT and out-of-band buffers (which
  torch and pickle.dump at protocol 2+ never write) are refused.

For `.metadata` the loader also builds the objects itself, reading the records torch repeats
100k times (chunks, storage entries, tensor entries) with fast paths; other pickles
(`RestrictedUnpickler`: torch.save records, object blobs) are built by the C unpickler once
the loader accepted them. Every refusal is a one-line `CorruptMetadata` naming the file.

    standins.py   our stand-ins for the classes and functions DCP metadata names
    allowlist.py  what `.metadata` may name, and the stand-in each name maps to
    opcodes.py    the pickle opcodes the loader reads, and those it refuses
    nodes.py      what the loader knows of each value: `_Node`, the fast path's light records
    calls.py      what a call of each allowed callable gives, checked on its arguments
    loader.py     `_Loader`: one pass over the opcodes against the budgets; `scan_pickle`
    records.py    `_Records`: the loader's fast paths for the records torch repeats 100k times
    unpickler.py  `RestrictedUnpickler` (torch.save records, object blobs), `unpickle_metadata`

Example:
    >>> RestrictedUnpickler(io.BytesIO(data), {("collections", "OrderedDict"): dict}, "x").load()
    >>> unpickle_metadata(raw, "ckpt/.metadata")     # the stand-ins readers/dcp.py converts
"""

from ckpttool.safepickle.loader import scan_pickle
from ckpttool.safepickle.nodes import PickleRefused
from ckpttool.safepickle.unpickler import RestrictedUnpickler, unpickle_metadata

__all__ = ["PickleRefused", "RestrictedUnpickler", "scan_pickle", "unpickle_metadata"]
