"""Example models written against the pipeline model-author API
(:mod:`lightning_pp.strategy.model`)."""

from .decoder import DecoderLM
from .gpt import GPT

__all__ = ["GPT", "DecoderLM"]
