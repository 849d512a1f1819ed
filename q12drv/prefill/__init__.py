"""The pass: one batched prefill pass over an arena (:class:`Q12Pass`) and its CUDA-graph form (:mod:`.graphs`)."""

from .q12pass import EXPANDS, MODES, AttentionShape, GdnConfig, GdnShape, GdnTensors, Q12Pass

__all__ = ["AttentionShape", "EXPANDS", "GdnConfig", "GdnShape", "GdnTensors", "MODES", "Q12Pass"]
