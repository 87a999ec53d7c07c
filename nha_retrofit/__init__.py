"""nha-retrofit: turn pretrained Transformer LLMs into Native Hybrid Attention hybrids.

Every CLI verb is a thin layer over a function here, e.g. `nha_retrofit.convert(model, output, ...)`
(the `convert` subpackage is callable: see its docstring).
"""

__version__ = "0.1.0"
__all__ = ["convert"]


def __getattr__(name):  # keeps `import nha_retrofit` (and the CLI's --help) free of torch and transformers
    if name == "convert":
        import importlib

        return importlib.import_module(".convert", __name__)
    raise AttributeError(name)
