"""Builds the optional C reader of DCP `.metadata` (ckpttool/readers/_dcpscan.c); everything
else is in pyproject.toml. Without a compiler the install still succeeds and ckpttool reads
`.metadata` with its Python loader only (slower on checkpoints with 100k+ chunks)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckpttool.readers._dcpscan", ["ckpttool/readers/_dcpscan.c"], optional=True)])
