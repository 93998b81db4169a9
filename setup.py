"""Builds the optional C reader of DCP `.metadata` (ckpttool/readers/_dcpscan.c) and the optional
C builder of reshard's torch.save records (ckpttool/torchsave/_records.c, with zlib); everything
else is in pyproject.toml. Without a compiler the install still succeeds and ckpttool reads
`.metadata` with its Python loader only (slower on checkpoints with 100k+ chunks) and builds
records in Python (the same bytes, slower with 100k+ records)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckpttool.readers._dcpscan", ["ckpttool/readers/_dcpscan.c"], optional=True),
                   Extension("ckpttool.torchsave._records", ["ckpttool/torchsave/_records.c"], libraries=["z"],
                             optional=True)])
