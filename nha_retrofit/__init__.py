"""nha-retrofit: turn pretrained Transformer LLMs into Native Hybrid Attention hybrids.

Every CLI verb is a thin layer over a function here, e.g. `nha_retrofit.convert(...)`.
"""

from .convert.converter import convert  # rebinds the name `convert` from the subpackage to the function

__version__ = "0.1.0"
__all__ = ["convert"]
