"""Native Hybrid Attention (docs/design.md): a gated-slot memory and a sliding window read under one softmax.

Forms of the operator, each in its own file:
- `naive.py`: `nha_reference`, the dense definition (tests, reading);
- `chunk_torch.py`: `nha_chunked`, plain PyTorch in chunks (training and prefill off CUDA; checkpoints ship it);
- `recurrent_torch.py`: `nha_recurrent_step`, plain PyTorch, one token with a carried `NHAState` (decoding);
- `chunk.py`: the Triton chunked form, training (autograd) and prefill, on the kernels in `kernels/`;
- `fused_recurrent.py`: the Triton decode step; `decode_op.py` makes it a torch custom op, which torch.compile traces;
- `dispatch.py`: the one place that picks Triton or PyTorch.
"""

from .chunk_torch import nha_chunked
from .dispatch import KERNELS_AVAILABLE, nha_attention, nha_operator
from .gates import gate_log_alpha
from .naive import nha_reference
from .recurrent_torch import nha_recurrent_step
from .state import NHAState

__all__ = [
    "KERNELS_AVAILABLE", "NHAState", "gate_log_alpha", "nha_attention", "nha_chunked", "nha_operator",
    "nha_recurrent_step", "nha_reference",
]
