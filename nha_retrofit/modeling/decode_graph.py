"""A model's one-token decode step on one static cache, captured once as a CUDA graph and replayed.

An eager decode step at batch 1 is bound by the host: a 32-layer model launches several hundred small kernels per
token, and Python takes longer to issue them than the GPU takes to run them. Replayed from a graph, the step costs
one launch. Everything the step changes lives in the static cache's buffers and is updated in place on the device
(`nha_cache.NHAStaticCache`), so replaying the captured kernels is the step.

The first step runs eagerly on a side stream: it compiles the Triton kernels and makes the allocations (cuBLAS
workspaces, the decode kernel's counters) that the capture then finds. The capture itself runs no kernel, so the
cache moves on by exactly one token per call.
"""

import torch


class DecodeGraph:
    """Replays `step(input_ids, position_ids, token_mask)`, a one-token forward of `batch_size` sequences on one static
    cache, from static input buffers [B, 1] (ids, positions, the token's attention-mask column)."""

    def __init__(self, batch_size: int, device):
        self.input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.token_mask = torch.ones(batch_size, 1, dtype=torch.long, device=device)
        self.graph = None
        self.logits = None  # the captured step's logits, rewritten by every replay
        self.output_type = None

    def __call__(self, step, input_ids, position_ids, token_mask=None):
        """The step's output for these inputs, holding only its logits (a copy, safe to keep across steps): the
        caller adds what else it returns (the graph keeps no reference to the cache, which holds the graph)."""
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        self.token_mask.copy_(token_mask[:, -1:] if token_mask is not None else torch.ones_like(self.token_mask))
        if self.graph is None:
            current = torch.cuda.current_stream(self.input_ids.device)
            side = torch.cuda.Stream(self.input_ids.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                first = step(self.input_ids, self.position_ids, self.token_mask)
            current.wait_stream(side)
            self.output_type, logits = type(first), first.logits.clone()  # copied on the current stream
            del first
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                self.logits = step(self.input_ids, self.position_ids, self.token_mask).logits
            self.graph = graph
            return self.output_type(logits=logits)
        self.graph.replay()
        return self.output_type(logits=self.logits.clone())
