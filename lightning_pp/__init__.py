"""lightning_pp: pipeline-parallel training for PyTorch Lightning."""

__version__ = "0.1.0"
