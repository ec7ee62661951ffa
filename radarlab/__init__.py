"""radarlab: a hands-on course in LLM inference acceleration.

Importing radarlab first sets TRITON_INTERPRET=1 on machines without a GPU, so that the course's
Triton kernels run under the interpreter there and compile on CUDA.
"""
from radarlab.device import configure_triton as _configure_triton

_configure_triton()

__version__ = "0.1.0"
