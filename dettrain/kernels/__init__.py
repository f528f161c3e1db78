"""Triton kernels (batch-invariant ops, attention, fingerprint, fused optimizer ops) behind one availability guard."""
