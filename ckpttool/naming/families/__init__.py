"""The model families ckpttool converts, one file each, and the one list of them.

A family's file (`torchtitan_llama3.py`, ...) holds everything about it as data, in one
`FAMILY`: its signature (the source name patterns every checkpoint of it holds), its rules
(transformers' names <- the framework's, each by a transform of engine.py), the keys it leaves
out, and the transformers architectures it converts to, with what it states about each (its
config mapping, its fused-expert layout, the logit tolerance its fixture is tested to).

The list of them is `ckpttool.naming.REGISTRY` (naming/__init__.py): each family's name, its
module here and its signature again, so that `inspect` matches signatures without importing any
table (a family's module, with the engine, is imported only when its signature matches).

Adding a family: write its file (copy the nearest one), add its line to the registry, and a
fixture written by the framework itself with the framework's own conversion as the oracle
(docs/export.md, "Adding a family").
"""
