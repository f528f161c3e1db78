"""`python -m dettrain` that appends to $FUSED_FP_LOG one line per FSDP2 ``partials`` call: the rank, and whether
it took the last step's fused partials (``DETTRAIN_FP_FUSED=1``).  tests/test_fused_fp.py reads it to check that the
fused path ran where it should, and only there."""

from __future__ import annotations

import os
import runpy
import sys

from dettrain.sync.engines import fsdp2

_log = open(os.environ["FUSED_FP_LOG"], "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run
_partials = fsdp2.FSDP2Engine.partials


def partials(self, keys, per_tensor):
    took = self._fused is not None and not per_tensor and set(keys) == {"param", "opt"}
    _log.write(f"{self.info.rank} {'fused' if took else 'hashed'} {'+'.join(keys)}\n")
    _log.flush()
    return _partials(self, keys, per_tensor)


fsdp2.FSDP2Engine.partials = partials
sys.argv = ["dettrain", *sys.argv[1:]]
runpy.run_module("dettrain", run_name="__main__", alter_sys=True)
