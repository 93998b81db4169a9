"""The budget loader: what a pickle builds, checked opcode by opcode before anything is built
(the budgets are described in the package docstring)."""

from __future__ import annotations

import pickle
import struct
from typing import Any, Callable, cast

from ckpttool.core.checkpoint import paused_gc
from ckpttool.core.errors import clip
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


class _Refusal(Exception):
    """A budget or rule broken by the opcode being read; `execute` raises it as PickleRefused
    with the opcode's position (and, when `named`, its name first)."""

    def __init__(self, message: str, exhausts: bool = False, named: bool = False):
        super().__init__(message)
        self.message, self.exhausts, self.named = message, exhausts, named


_STOPPED = 1 << 62  # the position STOP returns: past any pickle's end


class _Loader:
    """One pass over a pickle's opcodes with a model of the unpickler's stack and memo.

    It refuses the pickle as soon as a budget would be exceeded. With `build` it also builds
    the objects, calling the allowlisted functions as the C unpickler would (used for
    `.metadata`, with fast paths for the records torch repeats 100k times); without, the C
    unpickler builds them afterwards.

    Each opcode has a method `op(pos) -> position after it`, found through `_OPCODES` by the
    opcode's byte; `stack`, `marks` and `fence` (the stack length at the last MARK, which
    items below may not be taken) are the unpickler's.
    """

    def __init__(self, data: bytes | bytearray, find_class: Callable[[str, str], Any], persistent: bool = False,
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
        self.stack: list = []
        self.marks: list[int] = []
        self.fence = 0

    def load(self) -> Any:
        """Return the object built (None unless building)."""
        with paused_gc():
            return _unwrap(self.execute())

    def execute(self) -> Any:
        """Read every opcode; return what STOP finds on the stack (a _Node while not building)."""
        data, opcodes = self.data, _OPCODES
        end = len(data)
        pos = start = 0
        try:
            while pos < end:
                start = pos
                pos = opcodes[data[pos]](self, pos)
            if pos == _STOPPED:
                return self.stack[-1]
            raise _Refusal("the pickle ends without STOP (truncated)")
        except _Refusal as refusal:
            message = f"{_opcode_name(data[start])} {refusal.message}" if refusal.named else refusal.message
            raise PickleRefused(f"{message} (at byte {start})", refusal.exhausts) from None
        except IndexError:
            raise PickleRefused(f"the pickle ends in the middle of an opcode (truncated) (at byte {start})") from None
        finally:
            # dropped now, not when the collector finds the loader (it and its _Records refer
            # to each other): a refused pickle may have left a stack of millions of items
            self.stack, self.marks = [], []

    # -- the budgets, and the values they are checked on

    def underflow(self) -> _Refusal:
        return _Refusal("finds too few items on the unpickling stack", named=True)

    def pop_mark(self) -> int:
        marks = self.marks
        if not marks:
            raise _Refusal("without a MARK", named=True)
        mark = marks.pop()
        self.fence = marks[-1] if marks else 0
        return mark

    def new_object(self) -> None:
        self.objects += 1
        if self.objects > self.max_objects:
            raise _Refusal(f"builds more than {self.max_objects} objects ({BYTES_PER_OBJECT} bytes per object allowed)",
                           exhausts=True)

    def spend(self, amount: int) -> None:
        self.work += amount
        if self.work > self.budget:
            raise _Refusal(f"calls, BUILDs and hashed keys take more than {self.budget} objects of work in all",
                           exhausts=True)

    def nested(self, depth: int, size: int, kind: str) -> None:
        if depth > MAX_NESTING:
            raise _Refusal(f"containers nest deeper than {MAX_NESTING} levels", exhausts=True)
        if size > self.budget:
            raise _Refusal(f"a {kind} unfolds to more than {self.budget} objects (shared parts counted each time)",
                           exhausts=True)

    def container(self, kind: str, items: list, fresh: bool = False) -> _Node:
        depth, size, ints, keys = _measure(items)
        self.nested(depth, size, kind)
        self.new_object()
        key = 2 if kind == _TUPLE and ints else 0
        node = _Node(kind, depth, size, fresh, key, ints, keys, tuple(items) if len(items) <= _SHORT_TUPLE else None)
        if self.build:
            values = [_unwrap(v) for v in items]
            node.value = tuple(values) if kind == _TUPLE else values if kind == _LIST else None
        return node

    def unsalted(self, count: int) -> None:
        self.unsalted_keys -= count
        if self.unsalted_keys < 0:
            raise _Refusal(f"more than {MAX_UNSALTED_KEYS} int, float or tuple dict keys or set items", exhausts=True)

    def hash_keys(self, kind: str, keys: list | tuple) -> None:
        if len(keys) > _SHORT_TUPLE and set(map(type, keys)) <= _SALTED_KEYS:
            return
        for key in keys:
            if type(key) is not str and type(key) not in _LIGHT_TYPES:
                grade = _key_class(key)
                if grade != 1:
                    if not grade:
                        raise _Refusal(f"a {kind} key that is a {_describe(key)}")
                    if type(key) is _Node and not key.ints:
                        raise _Refusal(f"a {kind} key that is a tuple of something other than ints")
                    self.unsalted(1)
                    self.spend(key.size if type(key) is _Node else 1)

    def fill(self, target: Any, kind: str, items: list) -> None:
        if type(target) is not _Node or target.kind != kind or not target.fresh:
            raise _Refusal(f"into a {_describe(target)} that is not a new {kind}", named=True)
        pairs = kind == _DICT
        self.hash_keys(kind, items[0::2] if pairs else items if kind == _SET else ())
        depth, size, ints, keys = _measure(items)
        if depth > target.depth:
            target.depth = depth
        target.size += size - 1
        target.ints = target.ints and ints
        target.keys = target.keys and keys
        self.nested(target.depth, target.size, kind)
        if self.build:
            value = target.value
            if _Node in set(map(type, items)):
                items = [v.value if type(v) is _Node else v for v in items]
            if pairs:
                value.update(zip(items[0::2], items[1::2]))
            else:
                (value.extend if kind == _LIST else value.update)(items)

    def text(self, start: int, count: int, encoding: str = "utf-8") -> str:
        try:
            return self.data[start:start + count].decode(encoding, "surrogatepass" if encoding == "utf-8" else "strict")
        except UnicodeDecodeError:
            raise _Refusal(f"a string that is not {encoding}") from None

    def length(self, pos: int, width: int, signed: bool = False) -> int:
        """Return the length field of `width` bytes after the opcode at `pos`, checked to fit."""
        data = self.data
        count = int.from_bytes(data[pos + 1:pos + 1 + width], "little", signed=signed)
        if count < 0 or pos + 1 + width + count > len(data):
            raise _Refusal(f"of {count} bytes runs past the end of the pickle", named=True)
        return count

    def take(self, count: int, keep: int = 0) -> list:
        """Pop the top `count` items off the stack, leaving `keep` more above the fence."""
        stack = self.stack
        if len(stack) - count - keep < self.fence:
            raise self.underflow()
        items = stack[-count:]
        del stack[-count:]
        return items

    def take_marked(self) -> tuple[int, list]:
        """Pop the items above the last MARK, which must leave one item (what they go into)
        above the fence; return where the mark was and the items."""
        stack = self.stack
        mark = self.pop_mark()
        if mark <= self.fence or mark > len(stack):
            raise self.underflow()
        items = stack[mark:]
        del stack[mark:]
        return mark, items

    # -- one method per opcode (or family): `pos` is the opcode's, the return the next one's

    def op_memoize(self, pos: int) -> int:
        if len(self.stack) <= self.fence:
            raise self.underflow()
        self.memo.append(self.stack[-1])
        return pos + 1

    def op_get(self, pos: int) -> int:
        data, memo, records = self.data, self.memo, self.records
        op = data[pos]
        if records is not None:
            following = data[pos + (2 if op == _BINGET else 5)]
            if following == 0x29:  # `)`: a record's class, then NEWOBJ?
                taken = records.read(pos, self.stack)
            elif following in _PATH_ITEM_OPCODES:  # a planner_data fqn, then its path?
                taken = records.paths(pos, self.stack)
            else:
                taken = 0
            if taken:
                return taken
        if op == _BINGET:
            index, pos = data[pos + 1], pos + 2
        else:
            index, pos = int.from_bytes(data[pos + 1:pos + 5], "little"), pos + 5
        if index >= len(memo):
            raise _Refusal(f"GET of memo slot {index}, but only {len(memo)} are filled")
        value = memo[index]
        if type(value) is _Node:
            value.fresh = False
        elif value is _UNKEPT:
            raise _Fallback()
        self.stack.append(value)
        return pos

    def op_put(self, pos: int) -> int:
        data, memo, stack = self.data, self.memo, self.stack
        op = data[pos]
        if op == _BINPUT:
            index, pos = data[pos + 1], pos + 2
        else:
            index, pos = int.from_bytes(data[pos + 1:pos + 5], "little"), pos + 5
        if pos > len(data):
            return pos  # past the end: "ends without STOP"
        if len(stack) <= self.fence:
            raise self.underflow()
        if index < len(memo):
            memo[index] = stack[-1]
            if self.records is not None:
                self.records.forget()  # what was checked of the memo may have changed
        elif index == len(memo):
            memo.append(stack[-1])
        else:
            raise _Refusal(f"{_opcode_name(op)} to memo slot {index}, but only {len(memo)} are filled", exhausts=True)
        return pos

    def op_mark(self, pos: int) -> int:
        self.fence = len(self.stack)
        self.marks.append(self.fence)
        return pos + 1

    def op_pop(self, pos: int) -> int:
        marks, stack = self.marks, self.stack
        if marks and marks[-1] == len(stack):
            raise _Refusal("POP of a MARK")
        if len(stack) <= self.fence:
            raise self.underflow()
        stack.pop()
        return pos + 1

    def op_pop_mark(self, pos: int) -> int:
        del self.stack[self.pop_mark():]
        return pos + 1

    def op_empty_tuple(self, pos: int) -> int:
        self.stack.append(_EMPTY_TUPLE)
        return pos + 1

    def op_small_tuple(self, pos: int) -> int:  # TUPLE1, TUPLE2, TUPLE3
        items = self.take(self.data[pos] - _TUPLE1 + 1)
        self.stack.append(self.container(_TUPLE, items))
        return pos + 1

    def op_empty_container(self, pos: int) -> int:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
        op = self.data[pos]
        self.new_object()
        kind = _DICT if op == _EMPTY_DICT else _LIST if op == _EMPTY_LIST else _SET
        value: dict | list | set | None
        value = ({} if op == _EMPTY_DICT else [] if op == _EMPTY_LIST else set()) if self.build else None
        self.stack.append(_Node(kind, fresh=True, ints=True, value=value))
        return pos + 1

    def op_marked_container(self, pos: int) -> int:  # TUPLE, LIST, DICT, FROZENSET
        op, stack = self.data[pos], self.stack
        mark = self.pop_mark()
        if mark < self.fence:
            raise self.underflow()
        items = stack[mark:]
        del stack[mark:]
        if op == _TUPLE_OP:
            stack.append(self.container(_TUPLE, items) if items else _EMPTY_TUPLE)
        elif op == _LIST_OP:
            stack.append(self.container(_LIST, items, fresh=True))
        else:
            if op == _DICT_OP and len(items) % 2:
                raise _Refusal("DICT with an odd number of items")
            kind = _DICT if op == _DICT_OP else _SET
            self.new_object()
            node = _Node(kind, fresh=True, value=({} if kind == _DICT else set()) if self.build else None)
            self.fill(node, kind, items)
            if op == _FROZENSET_OP:
                node.kind, node.fresh = _FROZENSET, False
                node.value = frozenset(node.value) if self.build else None
            stack.append(node)
        return pos + 1

    def op_add_items(self, pos: int) -> int:  # SETITEMS, APPENDS, ADDITEMS
        op = self.data[pos]
        mark, items = self.take_marked()
        if op == _SETITEMS and len(items) % 2:
            raise _Refusal("SETITEMS with an odd number of items")
        self.fill(self.stack[mark - 1], _DICT if op == _SETITEMS else _LIST if op == _APPENDS else _SET, items)
        return pos + 1

    def op_add_item(self, pos: int) -> int:  # SETITEM, APPEND
        op = self.data[pos]
        items = self.take(2 if op == _SETITEM else 1, keep=1)
        self.fill(self.stack[-1], _DICT if op == _SETITEM else _LIST, items)
        return pos + 1

    def op_call(self, pos: int) -> int:  # NEWOBJ, REDUCE
        op, stack = self.data[pos], self.stack
        if len(stack) - 2 < self.fence:
            raise self.underflow()
        args = stack.pop()
        function = stack.pop()
        if type(args) is not _Node or args.kind != _TUPLE:
            raise _Refusal(f"{_opcode_name(op)} with arguments that are a {_describe(args)}, not a tuple")
        if type(function) is not _Node or function.kind != _GLOBAL:
            raise _Refusal(f"{_opcode_name(op)} of a {_describe(function)}, not of an allowed global")
        target = function.value
        self.spend(args.size)
        call = _known_call(target) if op == _REDUCE else None
        if call is not None:
            stack.append(self.known_call(call, target, args))
        elif op == _NEWOBJ and not _plain_new(target):
            raise _Refusal(f"NEWOBJ of {clip(repr(target), 80)}, which is not a plain class")
        elif not callable(target):
            raise _Refusal(f"REDUCE of {clip(repr(target), 80)}, which is not callable")
        else:
            node = self.container(_OBJECT if isinstance(target, type) else _RESULT, [args], fresh=True)
            node.key = 1 if _identity_hashed(target) else 0
            node.items = (target,)  # the class: how BUILD may fill it
            if self.build:
                node.value = target.__new__(target, *args.value) if op == _NEWOBJ else target(*args.value)
            stack.append(node)
        return pos + 1

    def known_call(self, call: Callable[[_Node], Any], target: Any, args: _Node) -> Any:
        """Return what REDUCE of one of our known callables pushes (see calls.py)."""
        result = call(args)
        if type(result) is _Node and result.kind in (_SET, _FROZENSET) and args.items:
            self.spend(args.size)  # every item hashed
            self.unsalted(args.size)
        if type(result) is _Node:
            self.new_object()
            if self.build:
                result.value = target(*args.value)
            return result
        return target(*args.value) if self.build else _SAMPLE[result]  # an atom of type `result`

    def op_build(self, pos: int) -> int:
        stack = self.stack
        if len(stack) - 2 < self.fence:
            raise self.underflow()
        state = stack.pop()
        target = stack[-1]
        if type(target) is not _Node or target.kind not in (_OBJECT, _RESULT) or not target.fresh:
            raise _Refusal(f"BUILD of a {_describe(target)} that is not a new object")
        # an object's node keeps its class in `items` (op_reduce)
        plain = target.kind == _OBJECT and getattr(cast(tuple, target.items)[0], "__setstate__", None) is None
        if plain and state is not None and (type(state) is not _Node or state.kind != _DICT):
            raise _Refusal(f"BUILD of an object from a {_describe(state)}, not a dict")
        target.fresh = False
        if type(state) is _Node:
            self.spend(state.size)
            target.size += state.size
            if state.depth >= target.depth:
                target.depth = state.depth + 1
            self.nested(target.depth, target.size, "object")
        if self.build:
            _build(target.value, _unwrap(state))
        return pos + 1

    def op_global(self, pos: int) -> int:  # STACK_GLOBAL, GLOBAL
        data, stack = self.data, self.stack
        if data[pos] == _STACK_GLOBAL:
            if len(stack) - 2 < self.fence:
                raise self.underflow()
            name, module = stack.pop(), stack.pop()
            if type(name) is not str or type(module) is not str:
                raise _Refusal("STACK_GLOBAL of names that are not strings")
            pos += 1
        else:
            end = len(data)
            first = data.find(b"\n", pos + 1, end)
            second = data.find(b"\n", first + 1, end) if first >= 0 else -1
            if second < 0:
                raise _Refusal("GLOBAL runs past the end of the pickle")
            module, name = self.text(pos + 1, first - pos - 1), self.text(first + 1, second - first - 1)
            pos = second + 1
        self.new_object()
        stack.append(_Node(_GLOBAL, 0, 1, key=1, value=self.find_class(module, name)))
        return pos

    def op_persistent_id(self, pos: int) -> int:  # BINPERSID
        if not self.persistent:
            raise _Refusal("a persistent id, but this pickle may not have any")
        if len(self.stack) <= self.fence:
            raise self.underflow()
        pid = self.stack.pop()
        self.spend(pid.size if type(pid) is _Node else 1)
        node = self.container(_RESULT, [pid])
        if self.build:
            assert self.persistent_load is not None  # given to every building loader that admits persistent ids
            node.value = self.persistent_load(_unwrap(pid))
        self.stack.append(node)
        return pos + 1

    # -- atoms: ints, floats, strings, bytes, None, booleans

    def op_binint1(self, pos: int) -> int:
        self.stack.append(self.data[pos + 1])
        return pos + 2

    def op_binint2(self, pos: int) -> int:
        data = self.data
        self.stack.append(data[pos + 1] | data[pos + 2] << 8)
        return pos + 3

    def op_binint(self, pos: int) -> int:
        self.stack.append(int.from_bytes(self.data[pos + 1:pos + 5], "little", signed=True))
        return pos + 5

    def op_long(self, pos: int) -> int:  # LONG1, LONG4
        op = self.data[pos]
        width = 1 if op == _LONG1 else 4
        count = self.length(pos, width, signed=op == _LONG4)
        self.stack.append(int.from_bytes(self.data[pos + 1 + width:pos + 1 + width + count], "little", signed=True))
        return pos + 1 + width + count

    def op_binfloat(self, pos: int) -> int:
        if pos + 9 > len(self.data):
            raise _Refusal("BINFLOAT runs past the end of the pickle")
        self.stack.append(struct.unpack(">d", self.data[pos + 1:pos + 9])[0])
        return pos + 9

    def op_short_binunicode(self, pos: int) -> int:
        count = self.data[pos + 1]
        if pos + 2 + count > len(self.data):
            raise _Refusal("SHORT_BINUNICODE runs past the end of the pickle")
        self.new_object()
        self.stack.append(self.text(pos + 2, count))
        return pos + 2 + count

    def op_binunicode(self, pos: int) -> int:  # BINUNICODE, BINUNICODE8
        width = 4 if self.data[pos] == _BINUNICODE else 8
        count = self.length(pos, width)
        self.new_object()
        self.stack.append(self.text(pos + 1 + width, count))
        return pos + 1 + width + count

    def op_binstring(self, pos: int) -> int:  # SHORT_BINSTRING, BINSTRING
        width = 1 if self.data[pos] == _SHORT_BINSTRING else 4
        count = self.length(pos, width)
        self.new_object()
        self.stack.append(self.text(pos + 1 + width, count, "ascii"))  # the unpickler's default encoding
        return pos + 1 + width + count

    def op_binbytes(self, pos: int) -> int:  # SHORT_BINBYTES, BINBYTES, BINBYTES8
        op = self.data[pos]
        width = 1 if op == _SHORT_BINBYTES else 4 if op == _BINBYTES else 8
        count = self.length(pos, width)
        self.new_object()
        self.stack.append(bytes(self.data[pos + 1 + width:pos + 1 + width + count]))
        return pos + 1 + width + count

    def op_none(self, pos: int) -> int:
        self.stack.append(None)
        return pos + 1

    def op_bool(self, pos: int) -> int:  # NEWTRUE, NEWFALSE
        self.stack.append(self.data[pos] == _NEWTRUE)
        return pos + 1

    # -- framing and the end

    def op_frame(self, pos: int) -> int:
        count = int.from_bytes(self.data[pos + 1:pos + 9], "little")
        if pos + 9 + count > len(self.data):
            raise _Refusal(f"FRAME of {count} bytes runs past the end of the pickle")
        return pos + 9

    def op_proto(self, pos: int) -> int:
        if self.data[pos + 1] > pickle.HIGHEST_PROTOCOL:
            raise _Refusal(f"unknown pickle protocol {self.data[pos + 1]}")
        return pos + 2

    def op_stop(self, pos: int) -> int:
        if len(self.stack) <= self.fence:
            raise self.underflow()
        return _STOPPED

    def op_refused(self, pos: int) -> int:
        op = self.data[pos]
        if op in _REFUSED_OPCODES:
            raise _Refusal(f"opcode {_opcode_name(op)}, which torch never writes")
        raise _Refusal(f"invalid opcode byte 0x{op:02x}")


def _opcode_table() -> list[Callable[[_Loader, int], int]]:
    """Return the method of `_Loader` that reads each opcode byte (op_refused for the others)."""
    table: list[Callable[[_Loader, int], int]] = [_Loader.op_refused] * 256
    for ops, method in (
        ((_MEMOIZE,), _Loader.op_memoize), ((_BINGET, _LONG_BINGET), _Loader.op_get),
        ((_BINPUT, _LONG_BINPUT), _Loader.op_put), ((_MARK,), _Loader.op_mark), ((_POP,), _Loader.op_pop),
        ((_POP_MARK,), _Loader.op_pop_mark), ((_EMPTY_TUPLE_OP,), _Loader.op_empty_tuple),
        ((_TUPLE1, _TUPLE2, _TUPLE3), _Loader.op_small_tuple),
        ((_EMPTY_DICT, _EMPTY_LIST, _EMPTY_SET), _Loader.op_empty_container),
        ((_TUPLE_OP, _LIST_OP, _DICT_OP, _FROZENSET_OP), _Loader.op_marked_container),
        ((_SETITEMS, _APPENDS, _ADDITEMS), _Loader.op_add_items), ((_SETITEM, _APPEND), _Loader.op_add_item),
        ((_NEWOBJ, _REDUCE), _Loader.op_call), ((_BUILD,), _Loader.op_build),
        ((_STACK_GLOBAL, _GLOBAL_OP), _Loader.op_global), ((_BINPERSID,), _Loader.op_persistent_id),
        ((_BININT1,), _Loader.op_binint1), ((_BININT2,), _Loader.op_binint2), ((_BININT,), _Loader.op_binint),
        ((_LONG1, _LONG4), _Loader.op_long), ((_BINFLOAT,), _Loader.op_binfloat),
        ((_SHORT_BINUNICODE,), _Loader.op_short_binunicode), ((_BINUNICODE, _BINUNICODE8), _Loader.op_binunicode),
        ((_SHORT_BINSTRING, _BINSTRING), _Loader.op_binstring),
        ((_SHORT_BINBYTES, _BINBYTES, _BINBYTES8), _Loader.op_binbytes), ((_NONE,), _Loader.op_none),
        ((_NEWTRUE, _NEWFALSE), _Loader.op_bool), ((_FRAME,), _Loader.op_frame), ((_PROTO,), _Loader.op_proto),
        ((_STOP,), _Loader.op_stop),
    ):
        for op in ops:
            table[op] = method
    return table


_OPCODES = _opcode_table()


def _build(instance: Any, state: Any) -> None:
    """Apply BUILD as the C unpickler does: __setstate__ if the object has one, else update
    its __dict__ (the loader allows only a dict or None then)."""
    setstate = getattr(instance, "__setstate__", None)
    if setstate is not None:
        setstate(state)
    elif state is not None:
        instance.__dict__.update(state)
