"""Triton kernels (batch-invariant ops, attention, fingerprint, norm, fused optimizer ops) behind one guard.

    _triton.py          the guard (``HAVE_TRITON``, ``unavailable_reason``) and the custom-op helpers
    batch_invariant.py  det.batch_invariant: matmul/linear, RMSNorm, cross-entropy, and the mode switch
    attention.py        causal flash attention, forward and backward, deterministic (batch-invariant in that mode;
                        outside it the forward may be cuDNN's, ``cudnn_forward``)
    fingerprint.py      the single-pass fingerprint kernel behind ``dettrain.record.fingerprint`` on CUDA
    norm.py             the exact sum-of-squares limbs of the canonical gradient norm (``collectives.exact_sumsq``),
                        and ``finish_``: the reduced shards' sign, 1/M scale and max in one pass
    blocks.py           the bit views and block tables the fingerprint and norm kernels walk (plain torch/numpy)
    rowsum.py           the canonical reduce-scatter's tree sum, eight rows per pass (``collectives.tree_sum_rows``),
                        fp32 or bf16 rows, fp32 sums
    optim.py            the fused AdamW update of the flat engines (``adamw_``)
    rowwise.py          det.batch_invariant on CPU: row-wise linear, RMSNorm, silu, attention, log-softmax as
                        fixed trees of elementwise operations (no Triton: plain torch)

Every module imports without Triton (CPU installs, CI) and keeps a torch path there.  Importing this package loads
only the guard; the kernel modules register their torch custom ops when imported.
"""

from dettrain.kernels._triton import HAVE_TRITON, unavailable_reason

__all__ = ["HAVE_TRITON", "unavailable_reason"]
