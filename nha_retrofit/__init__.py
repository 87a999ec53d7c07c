"""nha-retrofit: turn pretrained Transformer LLMs into Native Hybrid Attention hybrids.

Every CLI verb is a thin layer over a function here, e.g. `nha_retrofit.convert(model, output, PlanSpec(...))`
(`nha_retrofit.conversion.convert`; `PlanSpec` is `nha_retrofit.plan.PlanSpec`).
"""

from .plan import PlanSpec

__version__ = "0.1.0"
__all__ = ["PlanSpec", "convert"]


def __getattr__(name):
    """`convert` is imported on first use, which keeps `import nha_retrofit` (and the CLI's --help) free of torch
    and transformers."""
    if name == "convert":
        from .conversion.converter import convert

        globals()["convert"] = convert
        return convert
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})
