"""The budget loader: what a pickle builds, checked opcode by opcode before anything is built
(the budgets are described in the package docstring)."""

from __future__ import annotations

import pickle
import struct
from typing import Any, Callable

from ckpttool.checkpoint import paused_gc
from ckpttool.errors import clip
from ckpttool.safepickle.calls import _SAMPLE, _identity_hashed, _known_call, _plain_new
from ckpttool.safepickle.nodes import (_DICT, _EMPTY_TUPLE, _FROZENSET, _GLOBAL, _LIGHT_TYPES, _LIST, _OBJECT, _RESULT,
                                       _SALTED_KEYS, _SET, _SHORT_TUPLE, _TUPLE, _UNKEPT, PickleRefused, _describe,
                                       _Fallback, _key_class, _measure, _Node, _unwrap)
from ckpttool.safepickle.opcodes import (_ADDITEMS, _APPEND, _APPENDS, _BINBYTES, _BINBYTES8, _BINFLOAT, _BINGET,
                                        _BININT, _BININT1, _BININT2, _BINPERSID, _BINPUT, _BINSTRING, _BINUNICODE,
                                        _BINUNICODE8, _BUILD, _DICT_OP, _EMPTY_DICT, _EMPTY_LIST, _EMPTY_SET,
                                        _EMPTY_TUPLE_OP, _FRAME, _FROZENSET_OP, _GLOBAL_OP, _LIST_OP, _LONG1, _LONG4,
                                        _LONG_BINGET, _LONG_BINPUT, _MARK, _MEMOIZE, _NEWFALSE, _NEWOBJ, _NEWTRUE,
                                        _NONE, _opcode_name, _PATH_ITEM_OPCODES, _POP, _POP_MARK, _PROTO, _REDUCE,
                                        _REFUSED_OPCODES, _SETITEM, _SETITEMS, _SHORT_BINBYTES, _SHORT_BINSTRING,
                                        _SHORT_BINUNICODE, _STACK_GLOBAL, _STOP, _TUPLE1, _TUPLE2, _TUPLE3, _TUPLE_OP)
from ckpttool.safepickle.records import _Records

# Budgets of `scan_pickle` (see the module docstring).
MAX_NESTING = 16
TREE_NODES_PER_BYTE = 4
TREE_NODES_SLACK = 1 << 16
BYTES_PER_OBJECT = 3
OBJECTS_SLACK = 1 << 12
MAX_UNSALTED_KEYS = 4096


def scan_pickle(data: bytes, find_class: Callable[[str, str], Any], persistent: bool = False) -> None:
    """Check a pickle against the budgets (see the module docstring) without building it.

    Calls `find_class` for each global, as the unpickler will (so a refused name raises its
    error first). Raises `PickleRefused` naming the first budget exceeded.

    Example:
        >>> scan_pickle(b"\\x80\\x02N\\x94r\\xff\\xff\\xff\\x7f.", find_class)
        PickleRefused: LONG_BINPUT to memo slot 2147483647, but only 1 are filled (at byte 4)
    """
    _Loader(data, find_class, persistent=persistent).load()


class _Loader:
    """One pass over a pickle's opcodes with a model of the unpickler's stack and memo.

    It refuses the pickle as soon as a budget would be exceeded. With `build` it also builds
    the objects, calling the allowlisted functions as the C unpickler would (used for
    `.metadata`, with fast paths for the records torch repeats 100k times); without, the C
    unpickler builds them afterwards.
    """

    def __init__(self, data: bytes, find_class: Callable[[str, str], Any], persistent: bool = False,
                 persistent_load: Callable[[Any], Any] | None = None, build: bool = False):
        self.data = data
        self.find_class = find_class
        self.persistent = persistent
        self.persistent_load = persistent_load
        self.build = build
        self.memo: list = []
        self.budget = TREE_NODES_PER_BYTE * len(data) + TREE_NODES_SLACK
        self.max_objects = len(data) // BYTES_PER_OBJECT + OBJECTS_SLACK
        self.objects = 0
        self.work = 0
        self.unsalted_keys = MAX_UNSALTED_KEYS
        self.records = _Records(self) if build else None

    def load(self) -> Any:
        """Return the object built (None unless building)."""
        with paused_gc():
            return _unwrap(self.execute())

    def execute(self) -> Any:
        data, memo, budget, build = self.data, self.memo, self.budget, self.build
        end = len(data)
        max_objects = self.max_objects
        stack: list = []
        marks: list = []
        fence = 0
        push, pop = stack.append, stack.pop
        records = self.records
        pos = op = start = 0

        def refuse(message: str, exhausts: bool = False) -> PickleRefused:
            return PickleRefused(f"{message} (at byte {start})", exhausts)

        def underflow() -> PickleRefused:
            return refuse(f"{_opcode_name(op)} finds too few items on the unpickling stack")

        def pop_mark() -> int:
            nonlocal fence
            if not marks:
                raise refuse(f"{_opcode_name(op)} without a MARK")
            mark = marks.pop()
            fence = marks[-1] if marks else 0
            return mark

        def new_object() -> None:
            self.objects += 1
            if self.objects > max_objects:
                raise refuse(f"builds more than {max_objects} objects ({BYTES_PER_OBJECT} bytes per object allowed)",
                             exhausts=True)

        def spend(amount: int) -> None:
            self.work += amount
            if self.work > budget:
                raise refuse(f"calls, BUILDs and hashed keys take more than {budget} objects of work in all",
                             exhausts=True)

        def nested(depth: int, size: int, kind: str) -> None:
            if depth > MAX_NESTING:
                raise refuse(f"containers nest deeper than {MAX_NESTING} levels", exhausts=True)
            if size > budget:
                raise refuse(f"a {kind} unfolds to more than {budget} objects (shared parts counted each time)",
                             exhausts=True)

        def container(kind: str, items: list, fresh: bool = False) -> _Node:
            depth, size, ints, keys = _measure(items)
            nested(depth, size, kind)
            new_object()
            key = 2 if kind == _TUPLE and ints else 0
            node = _Node(kind, depth, size, fresh, key, ints, keys, tuple(items) if len(items) <= _SHORT_TUPLE else None)
            if build:
                values = [_unwrap(v) for v in items]
                node.value = tuple(values) if kind == _TUPLE else values if kind == _LIST else None
            return node

        def hash_keys(kind: str, keys: list) -> None:
            if len(keys) > _SHORT_TUPLE and set(map(type, keys)) <= _SALTED_KEYS:
                return
            for key in keys:
                if type(key) is not str and type(key) not in _LIGHT_TYPES:
                    grade = _key_class(key)
                    if grade != 1:
                        if not grade:
                            raise refuse(f"a {kind} key that is a {_describe(key)}")
                        if type(key) is _Node and not key.ints:
                            raise refuse(f"a {kind} key that is a tuple of something other than ints")
                        self.unsalted_keys -= 1
                        if self.unsalted_keys < 0:
                            raise refuse(f"more than {MAX_UNSALTED_KEYS} int, float or tuple dict keys or set items",
                                         exhausts=True)
                        spend(key.size if type(key) is _Node else 1)

        def fill(target: Any, kind: str, items: list) -> None:
            if type(target) is not _Node or target.kind != kind or not target.fresh:
                raise refuse(f"{_opcode_name(op)} into a {_describe(target)} that is not a new {kind}")
            pairs = kind == _DICT
            hash_keys(kind, items[0::2] if pairs else items if kind == _SET else ())
            depth, size, ints, keys = _measure(items)
            if depth > target.depth:
                target.depth = depth
            target.size += size - 1
            target.ints = target.ints and ints
            target.keys = target.keys and keys
            nested(target.depth, target.size, kind)
            if build:
                value = target.value
                if _Node in set(map(type, items)):
                    items = [v.value if type(v) is _Node else v for v in items]
                if pairs:
                    value.update(zip(items[0::2], items[1::2]))
                else:
                    (value.extend if kind == _LIST else value.update)(items)

        def text(start: int, count: int, encoding: str = "utf-8") -> str:
            try:
                return data[start:start + count].decode(encoding, "surrogatepass" if encoding == "utf-8" else "strict")
            except UnicodeDecodeError:
                raise refuse(f"a string that is not {encoding}") from None

        def length(width: int, signed: bool = False) -> int:
            count = int.from_bytes(data[pos + 1:pos + 1 + width], "little", signed=signed)
            if count < 0 or pos + 1 + width + count > end:
                raise refuse(f"{_opcode_name(op)} of {count} bytes runs past the end of the pickle")
            return count

        try:
            while pos < end:
                op, start = data[pos], pos
                if op == _MEMOIZE:
                    if len(stack) <= fence:
                        raise underflow()
                    memo.append(stack[-1])
                    pos += 1
                elif op == _BINGET or op == _LONG_BINGET:
                    if records is not None:
                        following = data[pos + (2 if op == _BINGET else 5)]
                        if following == 0x29:  # `)`: a record's class, then NEWOBJ?
                            taken = records.read(pos, stack)
                        elif following in _PATH_ITEM_OPCODES:  # a planner_data fqn, then its path?
                            taken = records.paths(pos, stack)
                        else:
                            taken = 0
                        if taken:
                            pos = taken
                            continue
                    if op == _BINGET:
                        index, pos = data[pos + 1], pos + 2
                    else:
                        index, pos = int.from_bytes(data[pos + 1:pos + 5], "little"), pos + 5
                    if index >= len(memo):
                        raise refuse(f"GET of memo slot {index}, but only {len(memo)} are filled")
                    value = memo[index]
                    if type(value) is _Node:
                        value.fresh = False
                    elif value is _UNKEPT:
                        raise _Fallback()
                    push(value)
                elif op == _BININT1:
                    push(data[pos + 1])
                    pos += 2
                elif op == _MARK:
                    fence = len(stack)
                    marks.append(fence)
                    pos += 1
                elif op == _EMPTY_TUPLE_OP:
                    push(_EMPTY_TUPLE)
                    pos += 1
                elif op == _TUPLE1 or op == _TUPLE2 or op == _TUPLE3:
                    count = op - _TUPLE1 + 1
                    if len(stack) - count < fence:
                        raise underflow()
                    items = stack[-count:]
                    del stack[-count:]
                    push(container(_TUPLE, items))
                    pos += 1
                elif op == _EMPTY_DICT or op == _EMPTY_LIST or op == _EMPTY_SET:
                    new_object()
                    kind = _DICT if op == _EMPTY_DICT else _LIST if op == _EMPTY_LIST else _SET
                    value = ({} if op == _EMPTY_DICT else [] if op == _EMPTY_LIST else set()) if build else None
                    push(_Node(kind, fresh=True, ints=True, value=value))
                    pos += 1
                elif op == _SETITEMS or op == _APPENDS or op == _ADDITEMS:
                    mark = pop_mark()
                    if mark <= fence or mark > len(stack):
                        raise underflow()
                    items = stack[mark:]
                    del stack[mark:]
                    if op == _SETITEMS and len(items) % 2:
                        raise refuse("SETITEMS with an odd number of items")
                    fill(stack[mark - 1], _DICT if op == _SETITEMS else _LIST if op == _APPENDS else _SET, items)
                    pos += 1
                elif op == _SETITEM or op == _APPEND:
                    count = 2 if op == _SETITEM else 1
                    if len(stack) - count <= fence:
                        raise underflow()
                    items = stack[-count:]
                    del stack[-count:]
                    fill(stack[-1], _DICT if op == _SETITEM else _LIST, items)
                    pos += 1
                elif op == _NEWOBJ or op == _REDUCE:
                    if len(stack) - 2 < fence:
                        raise underflow()
                    args = pop()
                    function = pop()
                    if type(args) is not _Node or args.kind != _TUPLE:
                        raise refuse(f"{_opcode_name(op)} with arguments that are a {_describe(args)}, not a tuple")
                    if type(function) is not _Node or function.kind != _GLOBAL:
                        raise refuse(f"{_opcode_name(op)} of a {_describe(function)}, not of an allowed global")
                    target = function.value
                    spend(args.size)
                    call = _known_call(target) if op == _REDUCE else None
                    if call is not None:
                        result = call(args)
                        if type(result) is _Node and result.kind in (_SET, _FROZENSET) and args.items:
                            spend(args.size)  # every item hashed
                            self.unsalted_keys -= args.size
                            if self.unsalted_keys < 0:
                                raise refuse(f"more than {MAX_UNSALTED_KEYS} int, float or tuple dict keys or set items",
                                             exhausts=True)
                        if type(result) is _Node:
                            new_object()
                            if build:
                                result.value = target(*args.value)
                            push(result)
                        else:  # an atom of type `result`
                            push(target(*args.value) if build else _SAMPLE[result])
                    elif op == _NEWOBJ and not _plain_new(target):
                        raise refuse(f"NEWOBJ of {clip(repr(target), 80)}, which is not a plain class")
                    elif not callable(target):
                        raise refuse(f"REDUCE of {clip(repr(target), 80)}, which is not callable")
                    else:
                        node = container(_OBJECT if isinstance(target, type) else _RESULT, [args], fresh=True)
                        node.key = 1 if _identity_hashed(target) else 0
                        node.items = (target,)  # the class: how BUILD may fill it
                        if build:
                            node.value = target.__new__(target, *args.value) if op == _NEWOBJ else target(*args.value)
                        push(node)
                    pos += 1
                elif op == _BUILD:
                    if len(stack) - 2 < fence:
                        raise underflow()
                    state = pop()
                    target = stack[-1]
                    if type(target) is not _Node or target.kind not in (_OBJECT, _RESULT) or not target.fresh:
                        raise refuse(f"BUILD of a {_describe(target)} that is not a new object")
                    plain = target.kind == _OBJECT and getattr(target.items[0], "__setstate__", None) is None
                    if plain and state is not None and (type(state) is not _Node or state.kind != _DICT):
                        raise refuse(f"BUILD of an object from a {_describe(state)}, not a dict")
                    target.fresh = False
                    if type(state) is _Node:
                        spend(state.size)
                        target.size += state.size
                        if state.depth >= target.depth:
                            target.depth = state.depth + 1
                        nested(target.depth, target.size, "object")
                    if build:
                        _build(target.value, _unwrap(state))
                    pos += 1
                elif op == _BININT2:
                    push(data[pos + 1] | data[pos + 2] << 8)
                    pos += 3
                elif op == _SHORT_BINUNICODE:
                    count = data[pos + 1]
                    if pos + 2 + count > end:
                        raise refuse("SHORT_BINUNICODE runs past the end of the pickle")
                    new_object()
                    push(text(pos + 2, count))
                    pos += 2 + count
                elif op == _BINUNICODE or op == _BINUNICODE8:
                    width = 4 if op == _BINUNICODE else 8
                    count = length(width)
                    new_object()
                    push(text(pos + 1 + width, count))
                    pos += 1 + width + count
                elif op == _SHORT_BINSTRING or op == _BINSTRING:
                    width = 1 if op == _SHORT_BINSTRING else 4
                    count = length(width)
                    new_object()
                    push(text(pos + 1 + width, count, "ascii"))  # the unpickler's default encoding
                    pos += 1 + width + count
                elif op == _SHORT_BINBYTES or op == _BINBYTES or op == _BINBYTES8:
                    width = 1 if op == _SHORT_BINBYTES else 4 if op == _BINBYTES else 8
                    count = length(width)
                    new_object()
                    push(bytes(data[pos + 1 + width:pos + 1 + width + count]))
                    pos += 1 + width + count
                elif op == _NONE:
                    push(None)
                    pos += 1
                elif op == _BININT:
                    push(int.from_bytes(data[pos + 1:pos + 5], "little", signed=True))
                    pos += 5
                elif op == _LONG1 or op == _LONG4:
                    width = 1 if op == _LONG1 else 4
                    count = length(width, signed=op == _LONG4)
                    push(int.from_bytes(data[pos + 1 + width:pos + 1 + width + count], "little", signed=True))
                    pos += 1 + width + count
                elif op == _NEWTRUE or op == _NEWFALSE:
                    push(op == _NEWTRUE)
                    pos += 1
                elif op == _BINFLOAT:
                    if pos + 9 > end:
                        raise refuse("BINFLOAT runs past the end of the pickle")
                    push(struct.unpack(">d", data[pos + 1:pos + 9])[0])
                    pos += 9
                elif op == _TUPLE_OP or op == _LIST_OP or op == _DICT_OP or op == _FROZENSET_OP:
                    mark = pop_mark()
                    if mark < fence:
                        raise underflow()
                    items = stack[mark:]
                    del stack[mark:]
                    if op == _TUPLE_OP:
                        push(container(_TUPLE, items) if items else _EMPTY_TUPLE)
                    elif op == _LIST_OP:
                        push(container(_LIST, items, fresh=True))
                    else:
                        if op == _DICT_OP and len(items) % 2:
                            raise refuse("DICT with an odd number of items")
                        kind = _DICT if op == _DICT_OP else _SET
                        new_object()
                        node = _Node(kind, fresh=True, value=({} if kind == _DICT else set()) if build else None)
                        fill(node, kind, items)
                        if op == _FROZENSET_OP:
                            node.kind, node.fresh = _FROZENSET, False
                            node.value = frozenset(node.value) if build else None
                        push(node)
                    pos += 1
                elif op == _BINPUT or op == _LONG_BINPUT:
                    if op == _BINPUT:
                        index, pos = data[pos + 1], pos + 2
                    else:
                        index, pos = int.from_bytes(data[pos + 1:pos + 5], "little"), pos + 5
                    if pos > end:
                        break
                    if len(stack) <= fence:
                        raise underflow()
                    if index < len(memo):
                        memo[index] = stack[-1]
                        if records is not None:
                            records.forget()  # what was checked of the memo may have changed
                    elif index == len(memo):
                        memo.append(stack[-1])
                    else:
                        raise refuse(f"{_opcode_name(op)} to memo slot {index}, but only {len(memo)} are filled",
                                     exhausts=True)
                elif op == _STACK_GLOBAL or op == _GLOBAL_OP:
                    if op == _STACK_GLOBAL:
                        if len(stack) - 2 < fence:
                            raise underflow()
                        name, module = pop(), pop()
                        if type(name) is not str or type(module) is not str:
                            raise refuse("STACK_GLOBAL of names that are not strings")
                        pos += 1
                    else:
                        first = data.find(b"\n", pos + 1, end)
                        second = data.find(b"\n", first + 1, end) if first >= 0 else -1
                        if second < 0:
                            raise refuse("GLOBAL runs past the end of the pickle")
                        module, name = text(pos + 1, first - pos - 1), text(first + 1, second - first - 1)
                        pos = second + 1
                    new_object()
                    push(_Node(_GLOBAL, 0, 1, key=1, value=self.find_class(module, name)))
                elif op == _POP:
                    if marks and marks[-1] == len(stack):
                        raise refuse("POP of a MARK")
                    if len(stack) <= fence:
                        raise underflow()
                    pop()
                    pos += 1
                elif op == _POP_MARK:
                    del stack[pop_mark():]
                    pos += 1
                elif op == _BINPERSID:
                    if not self.persistent:
                        raise refuse("a persistent id, but this pickle may not have any")
                    if len(stack) <= fence:
                        raise underflow()
                    pid = pop()
                    spend(pid.size if type(pid) is _Node else 1)
                    node = container(_RESULT, [pid])
                    if build:
                        node.value = self.persistent_load(_unwrap(pid))
                    push(node)
                    pos += 1
                elif op == _FRAME:
                    count = int.from_bytes(data[pos + 1:pos + 9], "little")
                    if pos + 9 + count > end:
                        raise refuse(f"FRAME of {count} bytes runs past the end of the pickle")
                    pos += 9
                elif op == _PROTO:
                    if data[pos + 1] > pickle.HIGHEST_PROTOCOL:
                        raise refuse(f"unknown pickle protocol {data[pos + 1]}")
                    pos += 2
                elif op == _STOP:
                    if len(stack) <= fence:
                        raise underflow()
                    return stack[-1]
                elif op in _REFUSED_OPCODES:
                    raise refuse(f"opcode {_opcode_name(op)}, which torch never writes")
                else:
                    raise refuse(f"invalid opcode byte 0x{op:02x}")
            raise refuse("the pickle ends without STOP (truncated)")
        except IndexError:
            raise refuse("the pickle ends in the middle of an opcode (truncated)") from None


def _build(instance: Any, state: Any) -> None:
    """Apply BUILD as the C unpickler does: __setstate__ if the object has one, else update
    its __dict__ (the loader allows only a dict or None then)."""
    setstate = getattr(instance, "__setstate__", None)
    if setstate is not None:
        setstate(state)
    elif state is not None:
        instance.__dict__.update(state)
