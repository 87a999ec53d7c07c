"""nha-retrofit: turn pretrained Transformer LLMs into Native Hybrid Attention hybrids.

Every CLI verb is a thin layer over a function here, e.g. `nha_retrofit.convert(...)`.
"""

__version__ = "0.1.0"
__all__ = ["convert"]


def __getattr__(name):  # keep `import nha_retrofit` (and the CLI's --help) free of torch/transformers imports
    if name == "convert":
        from .convert.converter import convert

        return convert
    raise AttributeError(name)
