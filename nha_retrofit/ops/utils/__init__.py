"""Triton helpers that belong to no one operator: the fast launch path and fp32 products at a chosen precision."""
