"""Conversion of pretrained checkpoints into NHA hybrids.

`nha_retrofit.convert` is both this subpackage and the documented function `nha_retrofit.convert(...)`: the
module is made callable (it forwards to `converter.convert`), so `import nha_retrofit.convert.shards` and
`nha_retrofit.convert(model, output)` both work without one name shadowing the other.
"""

import sys
import types

from .converter import convert
from .resolve import resolve_model

__all__ = ["convert", "resolve_model"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
