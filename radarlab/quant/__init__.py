"""KV-cache quantization: the table of KV formats and their codecs (FP8, INT4 group-wise, KIVI, rotation).

Pure tensor code: nothing here imports from kvcache, attention, engine or above.
"""
