"""The loader's fast paths for what makes up nearly all of a large `.metadata` (see the
comment above `_Light` in nodes.py)."""

from __future__ import annotations

import functools
import re
from typing import Any

from ckpttool.core.checkpoint import Blob
from ckpttool.safepickle.allowlist import _CHUNK, _METADATA_INDEX, _STORAGE_INFO, _TENSOR_PROPERTIES, _TENSOR_STORAGE
from ckpttool.safepickle.nodes import (_GLOBAL, _SHORT_TUPLE, _TUPLE, _UNKEPT, _UNKEPTS, PickleRefused, _ChunkBox, _IndexKey,
                                       _InfoBox, _new_tuple, _Node, _TensorBox)
from ckpttool.safepickle.opcodes import (_APPEND, _APPENDS, _BINGET, _BININT, _BININT1, _BININT2, _BINPUT, _BINUNICODE,
                                        _LONG1, _LONG_BINGET, _LONG_BINPUT, _MARK, _MEMOIZE, _PROTO, _SHORT_BINUNICODE,
                                        _TUPLE1, _TUPLE_OP)
from ckpttool.safepickle.standins import _DType, _Shape, _layout, _memory_format_encoding

_ANY_STR, _ANY_INT, _ANY_DTYPE = object(), object(), object()  # what `holds` may expect of a slot
# what the memo slots a chunk, a storage key and a storage entry fetch must hold
_CHUNK_EXPECTED = (_CHUNK, "offsets", _Shape, "sizes", _Shape)
_KEY_EXPECTED = (_METADATA_INDEX, "fqn", "index", "offset", _Shape)
_ENTRY_EXPECTED = (_STORAGE_INFO, "relative_path", "offset", "length")


@functools.cache
def _record_patterns(memoize: bytes) -> tuple[re.Pattern, ...]:
    """Return the patterns of a chunk, a storage key (MetadataIndex) followed by its entry
    (_StorageInfo), a lone key, a lone entry and the head of a tensor entry
    (TensorStorageMetadata up to its list of chunks), with `memoize` after each object
    (MEMOIZE for torch, nothing for our writer). Groups hold memo slots fetched (`(h.|j....)`),
    a shape's opcodes, a string fetched or literal, ints; see `_Records.read`."""
    m = re.escape(memoize)
    get = rb"(?:h.|j....)"
    long1 = b"|".join(bytes([n]) + b"." * n for n in range(9))
    int_ = rb"(?:K.|M..|J....|\x8a(?:" + long1 + rb"))"
    # a SHORT_BINUNICODE's length byte and text: the shortest that lets the rest match, so the
    # reader checks the length (a longer text can contain what looks like the rest)
    text = rb".{1,256}?"
    shape = (rb"(?:(?:" + int_ + rb"\x85|" + int_ + rb"{2}\x86|" + int_ + rb"{3}\x87)" + m + rb"|\))"
             rb"\x85" + m + b"R" + m)
    head = get + rb"\)\x81" + m + rb"\}" + m + rb"\(" + get
    string = rb"(?:(" + get + rb")|\x8c(" + text + rb")" + m + b")"
    chunk = rb"(" + head + get + rb")(" + shape + rb")(" + get + get + rb")(" + shape + rb")ub"
    index = rb"(" + head + rb")" + string + rb"(" + get + rb")(?:N|" + int_ + rb")(" + get + get + rb")(" + shape + rb")ub"
    info = rb"(" + head + rb")" + string + rb"(" + get + rb")(" + int_ + rb")(" + get + rb")(" + int_ + rb")ub"
    if memoize:  # torch: layout and memory format fetched, as torch memoized their first REDUCE
        properties = rb"(" + get + rb")(" + get + rb")[\x88\x89](" + get + rb")[\x88\x89]t\x94b"
    else:  # our writer: `_get_layout("torch.strided")` and `_MEM_FORMAT_ENCODING(0)` each time
        properties = rb"(" + get + rb")(" + get + get + rb")\x85R[\x88\x89](" + get + rb")K.\x85R[\x88\x89]tb"
    tensor = (rb"(" + head + get + rb"\)\x81" + m + rb"\()" + properties +
              rb"(" + get + get + rb")(" + shape + rb")(" + get + rb")\]" + m)
    return tuple(re.compile(p, re.DOTALL) for p in (chunk, index + info, index, info, tensor))


_TENSOR_HEAD = 4


def _memo_slots(encoded: bytes) -> list[int]:
    """Return the memo slots the GET opcodes in `encoded` fetch (other opcodes are skipped)."""
    slots, at = [], 0
    while at < len(encoded):
        op = encoded[at]
        if op == _BINGET:
            slots.append(encoded[at + 1])
            at += 2
        elif op == _LONG_BINGET:
            slots.append(int.from_bytes(encoded[at + 1:at + 5], "little"))
            at += 5
        else:
            at += 1
    return slots


def _slot(data: bytes, at: int) -> tuple[int, int]:
    """Return (memo slot, position after) of the BINGET or BINPUT (1-byte slot) or LONG_BINGET
    or LONG_BINPUT (4 bytes) at `at`."""
    if data[at] in (_BINGET, _BINPUT):
        return data[at + 1], at + 2
    return int.from_bytes(data[at + 1:at + 5], "little"), at + 5


def _int_opcode(encoded: bytes) -> int:
    op = encoded[0]
    if op == _BININT:
        return int.from_bytes(encoded[1:5], "little", signed=True)
    if op == _BININT2:
        return encoded[1] | encoded[2] << 8
    if op == _BININT1:
        return encoded[1]
    return int.from_bytes(encoded[2:], "little", signed=True)  # LONG1


class _Records:
    """The loader's fast paths (see the comment above `_Light`): `read` takes runs of records
    (chunks, storage keys with their entries, tensor entries with their chunks), `paths` runs
    of planner_data entries (an fqn and the tuple of keys it nests under)."""

    def __init__(self, loader: Any):  # the _Loader (loader.py) whose fast paths these are
        self.loader = loader
        self.memo = loader.memo
        self.checked: dict[tuple, bool] = {}  # memo slots fetched -> do they hold what is assumed
        self.shapes: dict[bytes, tuple] = {}  # a shape's opcodes -> (shape, memo slots, objects, ndim)
        self.lengths: dict[bytes, int] = {}  # an int's opcode -> its value (blob lengths repeat)
        # torch pickles with protocol 4+, a MEMOIZE after each object; our writer with 2, none
        data = loader.data
        self.style = b"\x94" if len(data) > 1 and data[0] == _PROTO and data[1] >= 4 else b""
        self.patterns = _record_patterns(self.style)
        self.next = 0  # which pattern to try first
        self.tensor_expected: tuple
        if self.style:
            self.tensor_expected = (_TENSOR_STORAGE, "properties", _TENSOR_PROPERTIES, _ANY_STR, _ANY_INT,
                                    "size", _Shape, "chunks")
        else:
            self.tensor_expected = (_TENSOR_STORAGE, "properties", _TENSOR_PROPERTIES, _layout, _ANY_STR,
                                    _memory_format_encoding, "size", _Shape, "chunks")
        # the memo slots `read` last found to hold what each record assumes
        self.tensor_slots: tuple | None
        self.chunk_head = self.chunk_tail = self.key_head = self.key_key = self.key_keys = None
        self.entry_head = self.entry_key = self.entry_keys = self.tensor_slots = self.dtype_slot = None

    def forget(self) -> None:
        self.checked.clear()

    def paths(self, pos: int, stack: list) -> int:
        """Push the planner_data entries from `pos` on (an fqn fetched from the memo, then the
        tuple of keys it nests under) and return the position after them, or 0."""
        loader, memo, data = self.loader, self.memo, self.loader.data
        start, objects = pos, 0
        while True:
            op = data[pos]
            if op == _BINGET:
                index, at = data[pos + 1], pos + 2
            elif op == _LONG_BINGET:
                index, at = int.from_bytes(data[pos + 1:pos + 5], "little"), pos + 5
            else:
                break
            fqn = memo[index] if index < len(memo) else None
            if type(fqn) is not str:
                break
            marked = data[at] == _MARK
            at += marked
            items: list[str | int] | None  # None: not a run of planner_data entries after all
            items, saved, made = [], len(memo), 0
            while True:  # the keys: strings (literal or fetched) and ints (list indices)
                op = data[at]
                if op == _SHORT_BINUNICODE or op == _BINUNICODE:
                    start_at = at + 2 if op == _SHORT_BINUNICODE else at + 5
                    end = start_at + (data[at + 1] if op == _SHORT_BINUNICODE else
                                      int.from_bytes(data[at + 1:at + 5], "little"))
                    try:
                        item = data[start_at:end].decode("utf-8", "surrogatepass")
                    except UnicodeDecodeError:
                        items = None
                        break
                    if end >= len(data):
                        items = None
                        break
                    made += 1
                    at = end
                elif op == _BINGET or op == _LONG_BINGET:
                    index, at = _slot(data, at)
                    item = memo[index] if index < len(memo) else None
                    if type(item) is not str and type(item) is not int:
                        items = None
                        break
                    items.append(item)
                    continue
                elif op == _BININT1:
                    item, at = data[at + 1], at + 2
                    items.append(item)
                    continue
                else:
                    break
                items.append(item)
                at = self.memoize(at, item)
                if at < 0:
                    items = None
                    break
            count = len(items) if items is not None else 0
            if items is None or not count or count > 255 or (
                    data[at] != _TUPLE_OP if marked else data[at] != _TUPLE1 + count - 1 or count > 3):
                del memo[saved:]
                break
            ints = all(type(item) is int for item in items)
            node = _Node(_TUPLE, 1, 1 + count, False, 2 if ints else 0, ints, True,
                         tuple(items) if count <= _SHORT_TUPLE else None, tuple(items))
            at = self.memoize(at + 1, node)
            if at < 0:
                del memo[saved:]
                break
            stack.append(fqn)
            stack.append(node)
            objects += made + 1
            pos = at
        loader.objects += objects
        if loader.objects > loader.max_objects:
            raise PickleRefused(f"more than {loader.max_objects} objects", exhausts=True)
        return pos if pos != start else 0

    def memoize(self, at: int, value: Any) -> int:
        """Memoize `value` if the opcode at `at` says so (MEMOIZE, or a PUT of the next slot);
        return the position after it, or -1 for a PUT elsewhere."""
        data, memo = self.loader.data, self.memo
        op = data[at]
        if op == _MEMOIZE:
            memo.append(value)
            return at + 1
        if op == _BINPUT or op == _LONG_BINPUT:
            index, after = _slot(data, at)
            if index != len(memo):
                return -1
            memo.append(value)
            return after
        return at

    def holds(self, slots: tuple, expected: tuple) -> bool:
        """True when the memo slots in `slots` (opcode bytes holding GETs) hold what
        `expected` says: a string, a global's object, or any str, int or dtype; cached."""
        known = self.checked.get(slots)
        if known is None:
            memo = self.memo
            indices = [index for encoded in slots for index in _memo_slots(encoded)]
            known = len(indices) == len(expected)
            for index, want in zip(indices, expected):
                value = memo[index] if index < len(memo) else None
                if type(want) is str:
                    known = known and type(value) is str and value == want
                elif want is _ANY_STR or want is _ANY_INT:
                    known = known and type(value) is (str if want is _ANY_STR else int)
                elif want is _ANY_DTYPE:
                    known = known and type(value) is _Node and value.kind == _GLOBAL and type(value.value) is _DType
                else:
                    known = known and type(value) is _Node and value.kind == _GLOBAL and value.value is want
            self.checked[slots] = known
        return known

    def shape(self, encoded: bytes) -> tuple:
        values, at = [], 0
        while encoded[at] in (_BININT1, _BININT2, _BININT, _LONG1):
            width = {_BININT1: 2, _BININT2: 3, _BININT: 5}.get(encoded[at]) or 2 + encoded[at + 1]
            values.append(_int_opcode(encoded[at:at + width]))
            at += width
        count = len(values)
        # memo slots a shape takes: its inner tuple (none for a scalar), the argument tuple,
        # the torch.Size; objects: the same, as the scalar's inner tuple is the empty one
        slots = 0 if not encoded.endswith(b"\x94") else 3 if count else 2
        found = self.shapes[encoded] = (_Shape(values), slots, 3 if count else 2, count)
        return found

    def first(self, pos: int) -> int | None:
        """Return which pattern matches at `pos` (trying the likely one first), or None."""
        data, patterns = self.loader.data, self.patterns
        for which in dict.fromkeys((self.next, 0, 1, 2, 3, 4)):
            if patterns[which].match(data, pos) is not None:
                return which
        return None

    def key(self, pos: int) -> tuple[str, int, bool] | None:
        """Read the string at `pos` (a state_dict_metadata key): return (it, the position after
        it and its memo opcode, whether that memoizes it), or None."""
        data, memo = self.loader.data, self.memo
        op = data[pos]
        if op == _SHORT_BINUNICODE:
            start = pos + 2
            end = start + data[pos + 1]
        elif op == _BINUNICODE:
            start = pos + 5
            end = start + int.from_bytes(data[pos + 1:start], "little")
        elif op == _BINGET or op == _LONG_BINGET:
            index, end = _slot(data, pos)
            value = memo[index] if index < len(memo) else None
            return (value, end, False) if type(value) is str else None
        else:
            return None
        if end >= len(data):
            return None
        try:
            text = data[start:end].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return None
        op = data[end]
        if op == _MEMOIZE:
            return text, end + 1, True
        if op == _BINPUT or op == _LONG_BINPUT:
            index, after = _slot(data, end)
            return (text, after, True) if index == len(memo) and after <= len(data) else None
        return text, end, False

    def read(self, pos: int, stack: list) -> int:
        """Push the records from `pos` on (as many as follow each other) and return the
        position after them, or 0 when the opcode-by-opcode path must read the next one.

        `which` is the pattern expected next (`_record_patterns`' order; 5: a state_dict_metadata
        key, then a tensor entry); each run method takes consecutive records of one kind."""
        which = self.first(pos)
        if which is None:
            return 0
        loader, data, patterns = self.loader, self.loader.data, self.patterns
        start = pos
        # the memo slots last found to hold what each record assumes (checked when they change)
        self.chunk_head = self.chunk_tail = self.key_head = self.key_key = self.key_keys = None
        self.entry_head = self.entry_key = self.entry_keys = self.tensor_slots = self.dtype_slot = None
        while True:
            if which == 5:
                after = self.tensor_key(pos, stack)
                if after < 0:
                    break
                pos, which = after, _TENSOR_HEAD
            match = patterns[which].match(data, pos)
            if match is None:
                which = self.first(pos)
                if which is None:
                    break
                continue
            if which == 0:
                pos, stopped = self.chunks(match, stack)
            elif which == _TENSOR_HEAD:
                pos, stopped = self.tensor(match, stack)
                if not stopped:
                    which = 5
            else:
                pos, which, stopped = self.storage(match, which, stack)
            if stopped:
                break
        self.next = min(which, _TENSOR_HEAD) if which is not None else 0
        if loader.objects > loader.max_objects or loader.work > loader.budget:
            raise PickleRefused(f"more than {loader.max_objects} objects or {loader.budget} units of work", exhausts=True)
        return pos if pos != start else 0

    def tensor_key(self, pos: int, stack: list) -> int:
        """Push the state_dict_metadata key at `pos` if a tensor entry follows it; return the
        position after it, or -1."""
        data = self.loader.data
        key = self.key(pos)
        if key is None or self.patterns[_TENSOR_HEAD].match(data, key[1]) is None:
            return -1
        text, after, memoized = key
        if memoized:
            self.memo.append(text)
        self.loader.objects += data[pos] in (_SHORT_BINUNICODE, _BINUNICODE)
        stack.append(text)
        return after

    def chunks(self, found: re.Match, stack: list) -> tuple[int, bool]:
        """Push the chunks (ChunkStorageMetadata) from `found` on; return the position after
        them and whether one failed its checks."""
        match: re.Match | None = found
        loader, data, memo, style, shapes, shape = self.loader, self.loader.data, self.memo, self.style, self.shapes, self.shape
        pattern, push, new = self.patterns[0], stack.append, _new_tuple
        chunk_head, chunk_tail = self.chunk_head, self.chunk_tail
        pos, objects, work, stopped = found.start(), 0, 0, False
        while match is not None:
            head, first, tail, second = match.groups()
            if head != chunk_head or tail != chunk_tail:
                if not self.holds((head, tail), _CHUNK_EXPECTED):
                    stopped = True
                    break
                chunk_head, chunk_tail = head, tail
            offsets = shapes.get(first) or shape(first)
            sizes = shapes.get(second) or shape(second)
            count = offsets[3] + sizes[3]
            push(new(_ChunkBox, (offsets[0], sizes[0], 3, 9 + count)))
            objects += 2 + offsets[2] + sizes[2]
            work += 12 + 2 * count
            if style:
                memo += _UNKEPTS[2 + offsets[1] + sizes[1]]
            pos = match.end()
            match = pattern.match(data, pos)
        self.chunk_head, self.chunk_tail = chunk_head, chunk_tail
        loader.objects += objects
        loader.work += work
        return pos, stopped

    def tensor(self, match: re.Match, stack: list) -> tuple[int, bool]:
        """Push the tensor entry (TensorStorageMetadata with its chunks) `match` starts; return
        the position after it and whether it failed its checks."""
        loader, data, memo, style = self.loader, self.loader.data, self.memo, self.style
        classes, dtype, layout, memory_format, sized, encoded, listed = match.groups()
        slots = (classes, layout, memory_format, sized, listed)
        if slots != self.tensor_slots:
            if not self.holds(slots, self.tensor_expected):
                return match.start(), True
            self.tensor_slots = slots
        if dtype != self.dtype_slot:
            if not self.holds((dtype,), (_ANY_DTYPE,)):
                return match.start(), True
            self.dtype_slot = dtype
        index = dtype[1] if len(dtype) == 2 else int.from_bytes(dtype[1:], "little")
        size_of = self.shapes.get(encoded) or self.shape(encoded)
        chunks, end, chunk_objects, chunk_work, chunk_size, chunk_slots = self.chunk_list(match.end())
        if chunks is None or data[end:end + 2] != b"ub":
            return match.start(), True
        count = size_of[3]
        state = 15 + count + chunk_size  # the state dict: keys, properties, shape, list
        stack.append(_new_tuple(_TensorBox, (memo[index].value, size_of[0], chunks, 6 if chunks else 4, 2 + state)))
        loader.objects += (8 if style else 10) - (3 - size_of[2]) + chunk_objects
        loader.work += (10 if style else 14) + count + state + chunk_work
        if style:
            memo += _UNKEPTS[5 + size_of[1]]
            memo += (_UNKEPT,) * chunk_slots
        return end + 2, False

    def chunk_list(self, end: int) -> tuple[list | None, int, int, int, int, int]:
        """Read a tensor entry's list of chunks at `end`: none, one and APPEND, or batches of
        MARK ... APPENDS. Return (chunk boxes or None, the position after the list, objects,
        work, tree size and memo slots they take)."""
        data, shapes, shape = self.loader.data, self.shapes, self.shape
        chunk_pattern, new = self.patterns[0], _new_tuple
        chunk_head, chunk_tail = self.chunk_head, self.chunk_tail
        chunks: list[_ChunkBox] | None  # None: the list does not end as expected
        chunks, chunk_objects, chunk_work, chunk_slots, chunk_size = [], 0, 0, 0, 0
        batched = data[end] == _MARK
        while True:
            if batched:
                if data[end] != _MARK:
                    break
                end += 1
            chunk = chunk_pattern.match(data, end)
            while chunk is not None:
                head, first, tail, second = chunk.groups()
                if head != chunk_head or tail != chunk_tail:
                    if not self.holds((head, tail), _CHUNK_EXPECTED):
                        break
                    chunk_head, chunk_tail = head, tail
                offsets = shapes.get(first) or shape(first)
                sizes = shapes.get(second) or shape(second)
                count = offsets[3] + sizes[3]
                chunks.append(new(_ChunkBox, (offsets[0], sizes[0], 3, 9 + count)))
                chunk_objects += 2 + offsets[2] + sizes[2]
                chunk_work += 12 + 2 * count
                chunk_size += 9 + count
                chunk_slots += 2 + offsets[1] + sizes[1]
                end = chunk.end()
                chunk = chunk_pattern.match(data, end) if batched else None
            if not batched:
                if chunks:
                    if data[end] != _APPEND:
                        chunks = None
                    end += 1
                break
            if data[end] != _APPENDS:
                chunks = None
                break
            end += 1
        self.chunk_head, self.chunk_tail = chunk_head, chunk_tail
        return chunks, end, chunk_objects, chunk_work, chunk_size, chunk_slots

    def storage(self, found: re.Match, which: int, stack: list) -> tuple[int, int, bool]:
        """Push the storage keys (MetadataIndex, patterns 1 and 2) and entries (_StorageInfo,
        1 and 3) from `found` on; return the position after them, the pattern expected next
        and whether one failed its checks. A pair is checked whole before anything is pushed,
        so one that fails halfway leaves no trace."""
        loader, data, memo, style, patterns = self.loader, self.loader.data, self.memo, self.style, self.patterns
        shapes, shape, lengths = self.shapes, self.shape, self.lengths
        push, new, unkept, from_bytes = stack.append, _new_tuple, _UNKEPT, int.from_bytes
        key_head, key_key, key_keys = self.key_head, self.key_key, self.key_keys
        entry_head, entry_key, entry_keys = self.entry_head, self.entry_key, self.entry_keys
        match: re.Match | None = found
        pos, objects, work = found.start(), 0, 0
        while match is not None:
            if which == 1:
                head, get, literal, key, keys, encoded, head2, get2, literal2, key2, offset, keys2, length = match.groups()
            elif which == 2:
                head, get, literal, key, keys, encoded = match.groups()
            else:
                head2, get2, literal2, key2, offset, keys2, length = match.groups()
            if which != 3:
                if head != key_head or key != key_key or keys != key_keys:
                    if not self.holds((head, key, keys), _KEY_EXPECTED):
                        break
                    key_head, key_key, key_keys = head, key, keys
                if get is not None:
                    index = get[1] if len(get) == 2 else from_bytes(get[1:], "little")
                    key_text = memo[index] if index < len(memo) else None
                else:
                    key_text = _literal_text(literal)
                if type(key_text) is not str:
                    break
                offsets = shapes.get(encoded) or shape(encoded)
            if which != 2:
                if head2 != entry_head or key2 != entry_key or keys2 != entry_keys:
                    if not self.holds((head2, key2, keys2), _ENTRY_EXPECTED):
                        break
                    entry_head, entry_key, entry_keys = head2, key2, keys2
                if get2 is not None:
                    index = get2[1] if len(get2) == 2 else from_bytes(get2[1:], "little")
                    entry_text = memo[index] if index < len(memo) else None
                else:
                    entry_text = _literal_text(literal2)
                if type(entry_text) is not str:
                    break
                size = lengths.get(length)
                if size is None:
                    size = lengths[length] = _int_opcode(length)
                start_at = from_bytes(offset[1:], "little", signed=True) if offset[0] == _BININT else _int_opcode(offset)
            if which != 3:
                count = offsets[3]
                push(new(_IndexKey, (key_text, offsets[0], 3, 10 + count)))
                objects += 2 + (get is None) + offsets[2]
                work += 11 + 2 * count
                if style:
                    if get is None:
                        memo += (unkept, unkept, key_text)
                        memo += _UNKEPTS[offsets[1]]
                    else:
                        memo += _UNKEPTS[2 + offsets[1]]
            if which != 2:
                push(new(_InfoBox, (new(Blob, (entry_text, start_at, size, ())), 2, 9)))
                objects += 2 + (get2 is None)
                work += 8
                if style:
                    memo += (unkept, unkept, entry_text) if get2 is None else _UNKEPTS[2]
            which = (0, 1, 3, 2)[which]
            pos = match.end()
            match = patterns[which].match(data, pos)
        self.key_head, self.key_key, self.key_keys = key_head, key_key, key_keys
        self.entry_head, self.entry_key, self.entry_keys = entry_head, entry_key, entry_keys
        loader.objects += objects
        loader.work += work
        return pos, which, match is not None


def _literal_text(encoded: bytes) -> str | None:
    """Return the text of a SHORT_BINUNICODE's length byte and text, or None when the length
    disagrees or the text is not UTF-8."""
    if len(encoded) != encoded[0] + 1:
        return None
    try:
        return encoded[1:].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
