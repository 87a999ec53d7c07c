"""The NHA operator (DESIGN.md section 2) in plain PyTorch.

- `nha_reference`: the readable dense definition (tests, small inputs).
- `nha_chunked`: the same function in O(T * (window + chunk)) memory, with a carried state (training, prefill).
- `nha_recurrent_step`: one token per sequence with an explicit `NHAState`, updated in place (decoding).

The chunked and recurrent forms live in `nha_retrofit.modeling` because converted checkpoints ship those files
as their remote code; they are re-exported here as the operator's public API.
"""

from ..modeling.nha_chunked import nha_chunked
from ..modeling.nha_recurrent import nha_recurrent_step
from ..modeling.nha_state import NHAState
from .reference import nha_reference

__all__ = ["NHAState", "nha_chunked", "nha_recurrent_step", "nha_reference"]
