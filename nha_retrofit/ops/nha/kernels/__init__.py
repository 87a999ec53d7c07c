"""The Triton internals of the NHA operator's chunked form (`chunk.py` above): the fused forward, the slot states and
their scans, the window and slot backward, the helpers they share and their launch settings."""
