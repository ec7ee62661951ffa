"""KV-cache quantization: the table of KV formats and their codecs.

formats.py (every kv_cache_dtype and its bytes), fp8.py, int4.py, kivi.py, rotation.py (the codecs, pure
tensor functions), kv_codec.py (encode / decode K or V in any format; QuantizedPool). Nothing here
imports from kvcache, attention, engine or above.
"""
