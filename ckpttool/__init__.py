"""ckpttool: see inside, validate, reshard and consolidate PyTorch Distributed Checkpoints."""

__version__ = "0.1.0"
