"""Attention: the math (reference.py), and attention over paged caches (torch_paged.py, triton_paged.py)."""
from radarlab.attention.metadata import AttentionMetadata
from radarlab.attention.reference import attention_reference

__all__ = ["AttentionMetadata", "attention_reference"]
