"""The pickle opcodes the loader reads, by their byte, and those it refuses."""

from __future__ import annotations

import pickle

(_MARK, _STOP, _POP, _POP_MARK, _NONE, _BININT, _BININT1, _BININT2, _LONG1, _LONG4,
 _BINFLOAT, _SHORT_BINBYTES, _BINBYTES, _BINBYTES8, _SHORT_BINSTRING, _BINSTRING,
 _SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8, _EMPTY_TUPLE_OP, _TUPLE1, _TUPLE2, _TUPLE3,
 _TUPLE_OP, _EMPTY_LIST, _LIST_OP, _EMPTY_DICT, _DICT_OP, _EMPTY_SET, _ADDITEMS, _FROZENSET_OP,
 _NEWOBJ, _GLOBAL_OP, _STACK_GLOBAL, _APPEND, _APPENDS, _BUILD, _BINGET, _LONG_BINGET, _BINPUT,
 _LONG_BINPUT, _MEMOIZE, _SETITEM, _SETITEMS, _BINPERSID, _REDUCE, _PROTO, _FRAME, _NEWTRUE,
 _NEWFALSE) = (op[0] for op in (
    pickle.MARK, pickle.STOP, pickle.POP, pickle.POP_MARK, pickle.NONE, pickle.BININT,
    pickle.BININT1, pickle.BININT2, pickle.LONG1, pickle.LONG4, pickle.BINFLOAT,
    pickle.SHORT_BINBYTES, pickle.BINBYTES, pickle.BINBYTES8, pickle.SHORT_BINSTRING,
    pickle.BINSTRING, pickle.SHORT_BINUNICODE, pickle.BINUNICODE, pickle.BINUNICODE8,
    pickle.EMPTY_TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.TUPLE,
    pickle.EMPTY_LIST, pickle.LIST, pickle.EMPTY_DICT, pickle.DICT, pickle.EMPTY_SET,
    pickle.ADDITEMS, pickle.FROZENSET, pickle.NEWOBJ, pickle.GLOBAL, pickle.STACK_GLOBAL,
    pickle.APPEND, pickle.APPENDS, pickle.BUILD, pickle.BINGET, pickle.LONG_BINGET,
    pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE, pickle.SETITEM, pickle.SETITEMS,
    pickle.BINPERSID, pickle.REDUCE, pickle.PROTO, pickle.FRAME, pickle.NEWTRUE,
    pickle.NEWFALSE))

_OPCODE_NAMES = {
    value[0]: name for name, value in vars(pickle).items()
    if name.isupper() and isinstance(value, bytes) and len(value) == 1
}
# Opcodes torch and pickle.dump (protocol 2+) never write.
_REFUSED_OPCODES = frozenset(op[0] for op in (
    pickle.DUP, pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.EXT1, pickle.EXT2, pickle.EXT4,
    pickle.PERSID, pickle.GET, pickle.PUT, pickle.INT, pickle.LONG, pickle.FLOAT, pickle.STRING,
    pickle.UNICODE, pickle.BYTEARRAY8, pickle.NEXT_BUFFER, pickle.READONLY_BUFFER,
))


def _opcode_name(op: int) -> str:
    return _OPCODE_NAMES.get(op, f"opcode 0x{op:02x}")


# what may follow a planner_data fqn fetched from the memo (records.py `_Records.paths`)
_PATH_ITEM_OPCODES = frozenset((_SHORT_BINUNICODE, _BINUNICODE, _BINGET, _LONG_BINGET, _MARK, _BININT1))
