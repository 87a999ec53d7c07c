"""The NHA gate (docs/design.md section 2): log(alpha) = logsigmoid(f) / tau from the gate projection's logits f."""

import torch.nn.functional as F


def gate_log_alpha(gate_logits, gate_normalizer):
    """log(alpha) [..., H, M] in float32 from the gate logits f [..., H, M] and tau = `gate_normalizer`."""
    return F.logsigmoid(gate_logits.float()) / gate_normalizer
