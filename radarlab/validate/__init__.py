"""Validation against real references: transformers (hf.py) and vLLM (vllm.py)."""
