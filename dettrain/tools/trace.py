"""Name the op that diverged: replay one step of a run with per-module and per-op fingerprints.

    dettrain trace RUN --step K [--out FILE] [--ops] [--keep-values] [--repeat N] [key=value ...]
    dettrain trace RUN_A RUN_B --step K [--out DIR] [--ops] ...     trace both runs' step K, then compare
    dettrain diff TRACE_A TRACE_B                                    compare two trace files (tools/diff.py)
    torchrun --nproc-per-node=N -m dettrain.trace RUN --step K      one trace per rank (FILE.rank<r>)

``dettrain diff`` says *when* two runs part and *what* (data, loss, gradients ...); this tool says *where in the
model*.  It builds the run as training built it (``build_run``, loop/build.py: compiled when the run was), restores
the run's newest checkpoint at or before step K (``<RUN>/checkpoints/step_XXXXXXXX`` holds the state at the start of
step XXXXXXXX), replays the steps in between with the Trainer (loop/trainer.py), and runs
step K with hooks: the fingerprint (dettrain.record.fingerprint, the ledger's) of every module's forward output and of
the gradient arriving at it in backward, and with ``--ops`` of every aten op's outputs (a TorchDispatchMode), each
with its module path and call index.  The config is the run's resolved ``config.yaml``; ``key=value`` overrides
replay the same step under another tier, thread count, engine or machine.

**Faithful or it says so.**  The traced step's own fingerprints (those of record/schema.py: batch, loss_bits, grad,
param, opt; and val_loss_bits on evaluating steps) are compared with the run's ledger line for step K; the header of
the trace records ``faithful`` and the fields that differ, and the command prints them.

**Comparing.**  Records are matched by (kind, phase, module path, op, call index, output index) and walked in
execution order (micro-batch by micro-batch, forward then backward): the report names the first module and the
first op whose output differs, with shapes and, where both traces kept the values (``--keep-values``: every output
in execution order up to ``--values-mb``, in ``FILE.values.pt``), the max abs and ULP difference.  ``--repeat N``
replays step K N times in one process and compares each replay with the first: an op that differs there is not
deterministic under the run's settings, and the report adds the fix the determinism docs know for it.

**Cost.**  Nothing here runs in training: the hooks and the dispatch mode exist only inside this command, around
the traced step (the replayed steps before it run as in training).  Tracing hashes every output on the host's
schedule (one sync per output on CUDA).

**Compiled runs** (``train.compile``, on by default on CUDA) replay compiled, with the graphs training ran, so the
traced step is faithful.  The modules inside a compiled unit (a transformer block) run inside its graph, so their
outputs are recorded per unit (the block's output and gradient).  ``--ops`` needs every op: the traced step then
runs eager (``torch.compiler.set_stance("force_eager")``; the steps before it still run compiled), and the output
says so; compiled and eager may differ by an ulp, which the faithfulness check reports.  A run trained with CUDA
graphs (``train.cuda_graphs``) replays without them: the same compiled kernels, so the same bits, launched one by one
(the recorded outputs outlive the next call, which a replay would overwrite).

The trace goes into the run it traces (``RUN/trace_step<K>.jsonl``) unless ``--out`` names another place.

Exit status: 0 trace written / traces identical, 1 traces (or repeats) differ, 2 bad input (one line).

Contents:
    load_run_config     RUN/config.yaml + overrides -> Config
    pick_checkpoint     the newest checkpoint at or before step K
    Recorder            module hooks + TraceMode (TorchDispatchMode): the records of one step
    trace_run           build the Trainer, resume, replay, trace step K (``repeat`` times)
    write_trace         JSONL: a header line, then one line per record (+ FILE.values.pt)
    read_trace          one trace, or the rank files of one
    compare_traces      first differing module and op, value differences, suggestion
    render, main
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["Recorder", "compare_main", "compare_traces", "is_trace_arg", "load_run_config", "main", "pick_checkpoint",
           "read_trace", "render", "suggestion", "trace_run", "value_difference", "write_trace"]

TRACE_FORMAT = "dettrain-trace/1"
PHASES_SKIPPED = ("fp_grad", "fp_param_opt", "combine")  # the ledger's own hashing inside train_step: not traced
# ops whose output is uninitialised memory until a later op writes it: nothing to compare
UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
                 "resize_"}

# what the determinism docs (docs/determinism.md, dettrain/detops.py) know about ops that vary
ATOMIC_OPS = {"scatter_add", "scatter_add_", "index_add", "index_add_", "index_put", "index_put_",
              "_index_put_impl_", "put_", "bincount", "histc", "scatter_reduce", "scatter_reduce_",
              "_embedding_bag_backward", "embedding_bag"}
RANDOM_OPS = {"randn", "rand", "randint", "randperm", "normal", "normal_", "uniform_", "bernoulli", "bernoulli_",
              "native_dropout", "multinomial", "exponential_", "random_", "rand_like", "randn_like",
              "randint_like", "cauchy_", "geometric_", "log_normal_"}
REDUCTION_OPS = {"sum", "mean", "mm", "addmm", "bmm", "baddbmm", "matmul", "var", "std", "var_mean", "norm",
                 "linalg_vector_norm", "cumsum", "_softmax", "_log_softmax", "native_layer_norm", "prod", "dot",
                 "mv", "addmv", "_fused_rms_norm", "nll_loss_forward", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "convolution", "linear"}


def suggestion(op: str | None, header_a: dict, header_b: dict) -> str | None:
    """The known fix for ``op`` (an aten op name) varying between two traces, or None."""
    if not op:
        return None
    base = op.split(".")[0]
    dev = str(header_a.get("device", ""))
    tier = header_a.get("tier")
    if base in RANDOM_OPS:
        return ("a random draw that replays differently: a generator dettrain does not seed (an unseeded or "
                "clock-seeded torch.Generator). Draw from torch's default generator, which dettrain seeds per "
                "micro-batch from (seed, step, global micro-batch index) at det.tier>=1, or seed yours from it")
    if base in ATOMIC_OPS:
        return ("an atomic-add kernel (colliding sums in arrival order on CUDA): det.tier>=2 turns on torch's "
                "deterministic algorithms, and dettrain.detops (scatter_add, index_add, bincount, index_select) "
                "gives fixed-order substitutes for counting and routing code (docs/determinism.md)")
    if base in REDUCTION_OPS:
        ta, tb = header_a.get("threads"), header_b.get("threads")
        if ta != tb:
            return (f"a CPU reduction whose summation order follows the thread count (A {ta} threads, B {tb}): "
                    "pin det.threads to one value (tier >= 2 pins it; the ledger header records it)")
        from dettrain.tiers import is_tier, policy

        if dev.startswith("cuda") and is_tier(tier) and not policy(tier).deterministic_ops:
            return (f"a reduction kernel at det.tier={tier}: TF32, cudnn.benchmark and non-deterministic "
                    "backends are allowed below tier 2; det.tier>=2 fixes the kernels (docs/determinism.md)")
    return None


# ---- config and checkpoint ----------------------------------------------------------------------------------
def load_run_config(run: Path, overrides: list[str]):
    """(Config, cfg_dict as recorded, applied override strings) of ``run`` with ``key=value`` overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from dettrain.config import Config, to_config
    from dettrain.errors import UserError

    if not run.is_dir():
        raise UserError(f"{run}: no such run dir; pass the run dir that training wrote (it holds config.yaml)")
    path = run / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run}: no config.yaml (not a dettrain run dir); pass the run dir that training wrote")
    dotlist = []
    for o in overrides:
        key, sep, _ = o.partition("=")
        if not sep or not key.lstrip("+"):
            raise UserError(f"override {o!r} is not key=value")
        dotlist.append(o.lstrip("+"))
    try:
        recorded = OmegaConf.load(path)
        root = OmegaConf.structured(Config)
        root.model = "???"  # open, as in the registered schema: dettrain's LLaMA or model=custom (typed below)
        dcfg = OmegaConf.merge(root, recorded, OmegaConf.from_dotlist(dotlist))
        cfg = to_config(dcfg)
    except OmegaConfBaseException as e:
        raise UserError(f"{path} with overrides {overrides}: {str(e).splitlines()[0]}") from None
    return cfg, OmegaConf.to_container(recorded, resolve=True), dotlist


def pick_checkpoint(run: Path, step: int) -> Path | None:
    """The newest complete checkpoint of ``run`` that holds the state at the start of a step <= ``step``."""
    from dettrain.checkpoint import ckpt_dir, list_checkpoints

    for p in list_checkpoints(ckpt_dir(run)):  # newest first
        if int(p.name[len("step_"):]) <= step:
            return p
    return None


def ledger_line(run: Path, step: int) -> dict:
    from dettrain.errors import UserError
    from dettrain.record.ledger import read_ledger

    _, steps = read_ledger(run)
    by_step = {s["step"]: s for s in steps}
    if step not in by_step:
        span = f"steps {min(by_step)}..{max(by_step)}" if by_step else "no steps"
        raise UserError(f"--step {step}: the ledger of {run} holds {span}; pick a step it holds")
    return by_step[step]


# ---- recording one step -------------------------------------------------------------------------------------
def _tensors(obj: Any) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor (FSDP2): this rank's shard


def inside_compiled(model) -> set[int]:
    """Ids of the modules strictly inside a unit that loop/compile.py compiled (its ``forward`` is a graph): hooks
    there would be traced into the graph or break it."""
    units = [u for u in model.modules() if getattr(u, "_dettrain_compiled", False)]
    return {id(m) for u in units for m in u.modules() if m is not u}


class Recorder:
    """The records of one traced step: module outputs (forward hooks), the gradients reaching them (tensor hooks)
    and, with ``ops``, every aten op's outputs (``TraceMode``).  Hooks exist only between ``start`` and ``stop``."""

    def __init__(self, model, ops: bool, keep_bytes: int = 0, *, eager: bool = True) -> None:
        self.model, self.ops, self.keep_bytes = model, ops, keep_bytes
        self.records: list[dict] = []
        self.values: dict[int, Any] = {}
        self.kept = 0
        self.values_complete = True
        self.paths = {m: name for name, m in model.named_modules()}
        # a compiled step (``eager=False``): the modules inside a compiled unit run in its graph and are recorded as
        # part of the unit (loop/compile.py compiles a unit's forward; the hooks around it run eagerly)
        skip = set() if eager else inside_compiled(model)
        self.hooked = [m for m in self.paths if id(m) not in skip]
        self.fwd_stack: list[str] = []
        self.bwd_stack: list[str] = []
        self.calls: Counter = Counter()
        self.op_calls: Counter = Counter()
        self.phase_stack: list[str] = []
        self.paused = False
        self._handles: list = []
        self._mode = None

    # -- one record
    def add(self, kind: str, phase: str, module: str, call: int, t, out: int, op: str | None = None) -> None:
        from dettrain.record.fingerprint import fingerprint, format_fp

        self.paused = True  # hashing runs ops: they are not the model's
        try:
            t = _local(t).detach()
            try:
                fp = format_fp(fingerprint(t.reshape(-1)))
            except TypeError:  # a dtype the fingerprint does not cover (complex, fp8 ...)
                fp = None
            rec = {"kind": kind, "phase": phase, "module": module, "call": call, "out": out,
                   "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "fp": fp}
            if op is not None:
                rec["op"] = op
            seq = len(self.records)
            rec["seq"] = seq
            if self.keep_bytes and t.dtype.is_floating_point:
                nbytes = t.numel() * t.element_size()
                if self.kept + nbytes <= self.keep_bytes:
                    self.values[seq] = t.to("cpu", copy=True)
                    self.kept += nbytes
                else:
                    self.values_complete = False
            self.records.append(rec)
        finally:
            self.paused = False

    def phase(self) -> str:
        """The innermost of train_step's ranges (forward, loss, backward, reduce, clip_step ...), else "step"."""
        return next((p for p in reversed(self.phase_stack) if p is not None), "step")

    def module(self) -> str:
        import torch

        in_backward = torch._C._current_graph_task_id() != -1
        stack = self.bwd_stack if in_backward else self.fwd_stack
        return stack[-1] if stack else ""

    # -- module hooks
    def _pre(self, mod, args) -> None:
        self.fwd_stack.append(self.paths[mod])

    def _post(self, mod, args, output) -> None:
        from torch.autograd.graph import register_multi_grad_hook

        path = self.paths[mod]
        if self.fwd_stack and self.fwd_stack[-1] == path:
            self.fwd_stack.pop()
        call = self.calls[("forward", path)]
        self.calls[("forward", path)] += 1
        outs = _tensors(output)
        for j, t in enumerate(outs):
            self.add("module", "forward", path, call, t, j)
        entered: list[bool] = [False]
        for j, t in enumerate(outs):
            if t.requires_grad:
                self._handles.append(t.register_hook(self._grad_hook(path, call, j, entered)))
        ins = [a for a in _tensors(args) if a.requires_grad]
        if ins and any(t.requires_grad for t in outs):
            # the gradients of the inputs are done: this module's backward is over
            self._handles.append(register_multi_grad_hook(ins, lambda grads, p=path: self._leave(p)))

    def _grad_hook(self, path: str, call: int, j: int, entered: list[bool]):
        def hook(grad):
            if not entered[0]:
                entered[0] = True
                # the gradient reached this module: its backward runs now.  A module whose output is also its
                # child's (``return self.w2(x)``) hears of it after the child: it goes below the child
                i = len(self.bwd_stack)
                while i and self.bwd_stack[i - 1].startswith(path + "." if path else ""):
                    i -= 1
                self.bwd_stack.insert(i, path)
            self.add("module", "backward", path, call, grad, j)
            return None  # the gradient is not changed
        return hook

    def _leave(self, path: str) -> None:
        if path in self.bwd_stack:
            i = len(self.bwd_stack) - 1 - self.bwd_stack[::-1].index(path)
            del self.bwd_stack[i]

    # -- ops
    def on_op(self, func, args, kwargs, out) -> None:
        ns = func.namespace
        if ns == "profiler":  # record_function ranges of train_step ("dettrain.forward" ...): the phase
            name = func.__name__
            if "enter" in name and args and isinstance(args[0], str):
                # train_step's own ranges name the phase; others (DDP's, FSDP2's) nest inside them
                rng = args[0]
                self.phase_stack.append(rng.removeprefix("dettrain.") if rng.startswith("dettrain.") else None)
            elif "exit" in name and self.phase_stack:
                self.phase_stack.pop()
            return
        if self.paused or ns != "aten" or func.is_view or func.__name__.split(".")[0] in UNINITIALISED:
            return
        phase = self.phase()
        if phase in PHASES_SKIPPED:
            return
        outs = _tensors(out)
        if not outs:  # in-place ops that return nothing (_foreach_*_): what they wrote
            outs = _tensors([args[i] if i < len(args) else kwargs.get(a.name)
                             for i, a in enumerate(func._schema.arguments)
                             if a.alias_info is not None and a.alias_info.is_write])
        name = f"{func.__name__}"  # e.g. "randn.generator", "sum.default"
        module = self.module()
        call = self.op_calls[(phase, module, name)]
        self.op_calls[(phase, module, name)] += 1
        for j, t in enumerate(outs):
            self.add("op", phase, module, call, t, j, op=name)

    def start(self) -> None:
        for m in self.hooked:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        if self.ops:
            self._mode = _trace_mode(self)
            self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _trace_mode(rec: Recorder):
    from torch.utils._python_dispatch import TorchDispatchMode

    class TraceMode(TorchDispatchMode):
        """Every op of the traced step passes here (inside, this mode is off: hashing is not traced)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            rec.on_op(func, args, kwargs, out)
            return out

    return TraceMode()


# ---- replay -------------------------------------------------------------------------------------------------
def _step_fields() -> tuple[str, ...]:
    """The step line's fingerprints (record/schema.py) and the validation loss's bits, compared with the ledger."""
    from dettrain.record import schema

    return (*schema.keys(), "val_loss_bits")


def _step_record(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "tensors"}


def trace_run(run: Path, step: int, overrides: list[str], *, info, ops: bool, repeat: int = 1, keep_bytes: int = 0,
              from_start: bool = False) -> list[tuple[dict, Recorder]]:
    """Replay step ``step`` of ``run`` ``repeat`` times in this process: [(trace header, recorder)] per replay.
    ``info``: this process's ``dettrain.dist.DistInfo`` (``dist.init`` already ran); a collective on every rank.
    Each replay builds a fresh Trainer and loads the checkpoint again (or seeds a fresh model, ``from_start``)."""
    import torch

    from dettrain import checkpoint as ckpt
    from dettrain.config import to_container, validate
    from dettrain.determinism import apply_tier, seed_process, versions
    from dettrain.errors import UserError
    from dettrain.loop.build import build_run
    from dettrain.loop.trainer import Trainer
    from dettrain.progress import Progress
    from dettrain.record.ledger import f32_bits

    run = Path(run)
    cfg, recorded, dotlist = load_run_config(run, overrides)
    line = ledger_line(run, step)
    path = pick_checkpoint(run, step)
    if path is None and not from_start:
        raise UserError(f"{run}: no checkpoint at or before step {step} (checkpoints/step_XXXXXXXX holds the start "
                        f"of step XXXXXXXX); train with ckpt.every=N, or pass --from-start to replay from step 0")
    notes: list[str] = []
    start = 0 if path is None else int(path.name[len("step_"):])
    # the replay resumes through the Trainer's own path (ckpt.resume); overridden keys are accepted changes
    cfg.ckpt.resume = "none" if path is None else str(path)
    cfg.ckpt.allow_config_change = [*{o.partition("=")[0] for o in dotlist}, "world_size"]
    cfg.det.reference = None
    # the hooks keep each unit's outputs past the next call, which a CUDA graph replay would overwrite; the graphs
    # change no bit (train.cuda_graphs), so the replay launches the same compiled kernels one by one
    cfg.train.cuda_graphs = "false"
    validate(cfg, info.world)
    cfg_dict = to_container(cfg)
    out = []
    prog = Progress("trace: replay", total=(step - start + 1) * repeat, unit="step", quiet=not info.is_main)
    for r in range(repeat):
        apply_tier(cfg.det)
        seed_process(cfg.seed, info.rank)
        # the run training built (loop/build.py), compiled as it was: the replayed steps run the same graphs
        tr = Trainer(cfg, info, run, built=build_run(cfg, info))
        try:
            if path is not None:
                ckpt.resume(tr, cfg_dict)
            it = iter(tr.sampler)
            while tr.step < step:  # the steps between the checkpoint and K, as fit runs them
                tr.train_step(next(it))
                if tr.eval_due(tr.step):
                    tr.evaluate()
                tr.step += 1
                prog.update(1)
            micro = next(it)
            eager = ops or not tr.compiled.enabled  # --ops: op by op, which compiled graphs hide
            recorder = Recorder(tr.model, ops, keep_bytes, eager=eager)
            if r == 0 and tr.compiled.enabled:
                notes.append(_compiled_note(tr.compiled.units, eager))
            tr.model.train()
            recorder.start()
            try:
                with _eager(eager and tr.compiled.enabled):
                    rec = tr.train_step(micro)
            finally:
                recorder.stop()
            prog.update(1, f"traced step {step}")
            if tr.eval_due(tr.step):
                val = tr.evaluate()
                rec.update(val_loss=val, val_loss_bits=f"{f32_bits(val):08x}")
        finally:
            tr.close()
        fields = _step_fields()
        differs = [f for f in fields if (f in line or f in rec) and line.get(f) != rec.get(f)]
        header = {"kind": "trace_header", "format": TRACE_FORMAT, "run": str(run), "step": step,
                  "rank": info.rank, "world": info.world, "repeat": r, "ops": ops, "overrides": dotlist,
                  "checkpoint": None if path is None else str(path), "replayed": list(range(start, step)),
                  "faithful": not differs, "differs": differs, "step_record": _step_record(rec),
                  "ledger": {f: line.get(f) for f in fields if f in line}, "notes": notes,
                  "tier": cfg.det.tier, "threads": torch.get_num_threads(), "device": str(info.device),
                  "engine": tr.engine_name, "backend": info.backend, "versions": versions(),
                  "config": cfg_dict, "recorded_config": recorded, "n_records": len(recorder.records),
                  "values_complete": recorder.values_complete if keep_bytes else None}
        out.append((header, recorder))
    prog.close()
    return out


def _compiled_note(units: list[str], eager: bool) -> str:
    """What the trace of a compiled run holds, for its header and output."""
    if eager:
        return ("--ops: the traced step runs eager (an op-by-op trace cannot see inside compiled graphs); the steps "
                "replayed before it ran compiled, as in training. Compiled and eager may differ by an ulp, which the "
                "faithfulness check reports: trace without --ops to replay the step compiled")
    shown = ", ".join(units[:3]) + (" ..." if len(units) > 3 else "")
    return (f"the step runs compiled, as in training (the same graphs); the modules inside the compiled units "
            f"({shown}) run inside the graphs, so their outputs are recorded per unit (--ops: the step eager, op "
            "by op)")


def _eager(on: bool):
    """Every torch.compile'd function runs eagerly inside (``torch.compiler.set_stance``), when ``on``."""
    import contextlib

    import torch

    return torch.compiler.set_stance("force_eager") if on else contextlib.nullcontext()


# ---- files --------------------------------------------------------------------------------------------------
def trace_path(base: Path, rank: int, world: int, repeat: int = 0) -> Path:
    """FILE for one rank's first replay; FILE.rank<r> under torchrun; .repeat<i> for later replays."""
    name = base.name + (f".rank{rank}" if world > 1 else "") + (f".repeat{repeat}" if repeat else "")
    return base.with_name(name)


def _is_trace(p: Path) -> bool:
    try:
        with open(p, encoding="utf-8") as f:
            return json.loads(f.readline()).get("kind") == "trace_header"
    except (OSError, ValueError, AttributeError):
        return False


def check_out(path: Path) -> None:
    """A trace may replace only an earlier trace (and its values file): never a file this tool did not write."""
    from dettrain.errors import UserError

    for p in (path, path.with_name(path.name + ".values.pt")):
        if p.exists() and not (p.is_file() and _is_trace(path)):
            raise UserError(f"{p} exists and is not a trace this tool wrote; pass another --out")


def write_trace(path: Path, header: dict, rec: Recorder) -> Path:
    """Write one trace (JSONL) atomically: tmp file, fsync, rename; values beside it in FILE.values.pt."""
    import torch

    from dettrain.errors import write_error

    check_out(path)
    values = path.with_name(path.name + ".values.pt")
    tmps = [values.with_name(values.name + ".tmp"), path.with_name(path.name + ".tmp")]
    target = path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if rec.values:
            target = values
            torch.save({str(k): v for k, v in rec.values.items()}, tmps[0])
            os.replace(tmps[0], values)
            header = {**header, "values": values.name}
        elif values.exists():
            values.unlink()  # an older trace's values at this path: not this trace's
        target = path
        with open(tmps[1], "w", encoding="utf-8") as f:
            f.write(json.dumps(header, separators=(",", ":")) + "\n")
            for r in rec.records:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmps[1], path)
    except (OSError, RuntimeError) as e:  # a full disk: torch.save says RuntimeError; nothing half-written is left
        for t in tmps:
            t.unlink(missing_ok=True)
        raise write_error(target, e) from None
    return path


def read_one(path: Path) -> tuple[dict, list[dict]]:
    """(header, records) of one trace file; ValueError naming the file on bad input (a torn last line is dropped)."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(lines[0])
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("kind") != "trace_header":
        raise ValueError(f"{path}: not a dettrain trace (no trace header on line 1)")
    recs = []
    for n, ln in enumerate(lines[1:], start=2):
        if not ln.strip():
            continue
        try:
            recs.append(json.loads(ln))
        except ValueError:
            if n < len(lines) - 1 or lines[-1] != "":  # only a torn last line is tolerated
                if any(x.strip() for x in lines[n:]):
                    raise ValueError(f"{path}: line {n} is not JSON; the trace is damaged") from None
    want = header.get("n_records")
    if isinstance(want, int) and len(recs) != want:  # written whole and renamed: fewer records is a cut file
        raise ValueError(f"{path}: holds {len(recs)} of the {want} records its header counts (cut short or "
                         "damaged); trace the step again")
    return header, recs


def read_trace(arg: str) -> list[tuple[Path, dict, list[dict]]]:
    """A trace file, or the base name of rank files (FILE.rank0 ...): [(path, header, records)] by rank."""
    p = Path(arg)
    if p.is_file():
        return [(p, *read_one(p))]
    ranks = sorted(p.parent.glob(p.name + ".rank*"), key=lambda q: q.name)
    ranks = [q for q in ranks if q.name[len(p.name) + 5:].isdigit()]
    if not ranks:
        raise ValueError(f"{arg}: no trace file (nor {p.name}.rank0 ...); pass a file dettrain trace wrote")
    out = [(q, *read_one(q)) for q in ranks]
    out.sort(key=lambda x: x[1].get("rank", 0))
    return out


def is_trace_arg(arg: str) -> bool:
    """Whether ``arg`` names a trace file or the rank files of one (what tools/diff.py asks)."""
    p = Path(arg)
    if p.is_file():
        return _is_trace(p)
    return not p.exists() and (p.parent / (p.name + ".rank0")).is_file() and _is_trace(p.parent / (p.name + ".rank0"))


# ---- comparison ---------------------------------------------------------------------------------------------
def _key(r: dict) -> tuple:
    return (r.get("kind"), r.get("phase"), r.get("module"), r.get("op"), r.get("call"), r.get("out"))


def _differs(a: dict, b: dict) -> bool:
    return a.get("fp") != b.get("fp") or a.get("shape") != b.get("shape") or a.get("dtype") != b.get("dtype")


def value_difference(x, y) -> dict | None:
    """max |x - y|, the largest distance in units in the last place and how many elements differ."""
    import torch

    if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype or not x.dtype.is_floating_point:
        return None
    view = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}.get(x.dtype)
    diff = (x.double() - y.double()).abs()
    out = {"max_abs": float(diff.max()) if diff.numel() else 0.0, "n_differ": int((x != y).sum()),
           "numel": x.numel()}
    if view is not None and x.numel():
        def ordered(t):
            b = t.contiguous().view(view).to(torch.int64)
            lo = torch.iinfo(view).min
            return torch.where(b < 0, lo - b, b)  # monotone in the float's value (as ledger.ulps does for one)
        out["max_ulps"] = int((ordered(x) - ordered(y)).abs().max())
    return out


def _values(path: Path, header: dict) -> dict:
    import torch

    name = header.get("values")
    if not name or not (path.parent / name).is_file():
        return {}
    return torch.load(path.parent / name, weights_only=True)


def _first(kind: str, ra: list[dict], by_b: dict) -> tuple[dict, dict] | None:
    for r in ra:
        if r.get("kind") == kind:
            s = by_b.get(_key(r))
            if s is not None and _differs(r, s):
                return r, s
    return None


def compare_pair(pa: Path, ha: dict, ra: list[dict], pb: Path, hb: dict, rb: list[dict]) -> dict:
    """One rank's comparison: the first module and first op whose output differs, in A's execution order."""
    by_a, by_b = {_key(r): r for r in ra}, {_key(r): r for r in rb}
    res: dict[str, Any] = {"rank": ha.get("rank", 0), "a": str(pa), "b": str(pb), "records_a": len(ra),
                           "records_b": len(rb)}
    only_a = [r for r in ra if _key(r) not in by_b]
    only_b = [r for r in rb if _key(r) not in by_a]
    res["only_a"], res["only_b"] = len(only_a), len(only_b)
    res["first_only_a"] = only_a[0] if only_a else None
    res["first_only_b"] = only_b[0] if only_b else None
    sa, sb = ha.get("step_record") or {}, hb.get("step_record") or {}
    res["step_fields"] = [f for f in _step_fields() if sa.get(f) != sb.get(f)]
    va = vb = None
    for kind in ("module", "op"):
        hit = _first(kind, ra, by_b)
        if hit is None:
            res[f"first_{kind}"] = None
            continue
        a, b = hit
        entry = {"a": a, "b": b, "differing": sum(_differs(r, by_b[_key(r)]) for r in ra
                                                  if r.get("kind") == kind and _key(r) in by_b)}
        if va is None:
            va, vb = _values(pa, ha), _values(pb, hb)
        entry["values"] = value_difference(va.get(str(a["seq"])), vb.get(str(b["seq"])))
        if kind == "op":
            entry["suggestion"] = suggestion(a.get("op"), ha, hb)
        res[f"first_{kind}"] = entry
    res["identical"] = res["first_module"] is None and res["first_op"] is None and not only_a and not only_b \
        and not res["step_fields"]
    return res


def compare_traces(a: list[tuple[Path, dict, list[dict]]], b: list[tuple[Path, dict, list[dict]]]) -> dict:
    """Rank by rank; ValueError when the two do not trace the same number of ranks."""
    if len(a) != len(b):
        raise ValueError(f"A has {len(a)} rank traces and B {len(b)}: compare traces of the same world size")
    ha, hb = a[0][1], b[0][1]
    env = [(k, ha.get(k), hb.get(k)) for k in ("run", "step", "tier", "threads", "device", "engine", "world",
                                               "overrides", "ops") if ha.get(k) != hb.get(k)]
    ranks = [compare_pair(pa, xa, ra, pb, xb, rb) for (pa, xa, ra), (pb, xb, rb) in zip(a, b)]
    return {"differences": env, "ranks": ranks, "identical": all(r["identical"] for r in ranks),
            "faithful": {"a": [x.get("faithful") for _, x, _ in a], "b": [x.get("faithful") for _, x, _ in b]}}


# ---- text ---------------------------------------------------------------------------------------------------
def _where(r: dict) -> str:
    mod = r.get("module") or ("<model>" if r.get("kind") == "module" else "<outside any module>")
    what = f"aten.{r['op']}" if r.get("kind") == "op" else "output"
    out = f"[{r['out']}]" if r.get("out") else ""
    return f"{mod} (call {r.get('call')}) {r.get('phase')} {what}{out}"


def _shape(r: dict) -> str:
    return f"{r.get('dtype')}[{','.join(map(str, r.get('shape') or []))}]"


def render(res: dict, label_a: str = "A", label_b: str = "B") -> str:
    out = []
    for k, va, vb in res["differences"]:
        out.append(f"{k}: {label_a} {va} | {label_b} {vb}")
    for r in res["ranks"]:
        pre = f"rank {r['rank']}: " if len(res["ranks"]) > 1 else ""
        if r["identical"]:
            out.append(f"{pre}IDENTICAL: {r['records_a']} records, every module and op output equal")
            continue
        if r["step_fields"]:
            out.append(f"{pre}step fingerprints differ: {', '.join(r['step_fields'])}")
        for kind, title in (("module", "first module"), ("op", "first op")):
            e = r.get(f"first_{kind}")
            if e is None:
                continue
            a, b = e["a"], e["b"]
            shapes = _shape(a) if _shape(a) == _shape(b) else f"{_shape(a)} vs {_shape(b)}"
            out.append(f"{pre}{title} that differs: {_where(a)}  {shapes}  fp {a.get('fp')} vs {b.get('fp')}"
                       f"  ({e['differing']} {kind} records differ)")
            v = e.get("values")
            if v is not None:
                ulp = f", max {v['max_ulps']} ULP" if "max_ulps" in v else ""
                out.append(f"{pre}  values: max |diff| {v['max_abs']:.3g}{ulp}, {v['n_differ']} of {v['numel']} "
                           "elements differ")
            if e.get("suggestion"):
                out.append(f"{pre}  suggestion: {e['suggestion']}")
        for side, key in ((label_a, "first_only_a"), (label_b, "first_only_b")):
            n = r["only_a" if key == "first_only_a" else "only_b"]
            if n:
                out.append(f"{pre}{n} records only in {side}, first: {_where(r[key])}")
    out.append("IDENTICAL" if res["identical"] else "DIFFER")
    return "\n".join(out)


def render_header(h: dict) -> str:
    ck = h.get("checkpoint") or "none (from step 0)"
    rep = f", replayed {len(h['replayed'])} steps" if h.get("replayed") else ""
    verdict = ("faithful: step fingerprints equal the ledger's" if h["faithful"] else
               f"NOT faithful: {', '.join(h['differs'])} differ{'s' * (len(h['differs']) == 1)} from the ledger's line"
               + (f" (overrides: {' '.join(h['overrides'])})" if h.get("overrides") else ""))
    lines = [f"step {h['step']} of {h['run']} (rank {h['rank']}/{h['world']}, engine {h['engine']}, tier "
             f"{h['tier']}, {h['threads']} threads): checkpoint {ck}{rep}; {h['n_records']} records; {verdict}"]
    lines += [f"note: {n}" for n in h.get("notes", [])]
    return "\n".join(lines)


# ---- CLI ----------------------------------------------------------------------------------------------------
def _split(items: list[str]) -> tuple[list[str], list[str]]:
    runs, overrides = [], []
    for x in items:
        (overrides if "=" in x and not Path(x).exists() else runs).append(x)
    return runs, overrides


def compare_main(arg_a: str, arg_b: str, as_json: bool = False) -> int:
    """``dettrain diff TRACE_A TRACE_B``: exit 0 identical, 1 differ, 2 bad input."""
    try:
        res = compare_traces(read_trace(arg_a), read_trace(arg_b))
    except ValueError as e:
        print(f"dettrain.diff: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1) if as_json else f"A: {arg_a}\nB: {arg_b}\n" + render(res))
    return 0 if res["identical"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.trace", description=__doc__.split("\n\n")[0],
                                 epilog="exit status: 0 written / identical, 1 traces or repeats differ, 2 bad input")
    ap.add_argument("items", nargs="+", metavar="RUN | key=value",
                    help="one run dir (trace it), or two (trace both and compare); key=value overrides the config")
    ap.add_argument("--step", type=int, required=True, help="the step to trace (0-based, as in the ledger)")
    ap.add_argument("--out", help="trace file (default RUN/trace_step<K>.jsonl, in the run it traces; with two runs "
                    "a directory holding A.jsonl and B.jsonl, default each run's own RUN/trace_step<K>.jsonl)")
    ap.add_argument("--ops", action="store_true", help="also record every aten op's outputs (TorchDispatchMode)")
    ap.add_argument("--repeat", type=int, default=1, help="replay the step N times in this process and name the "
                    "first op whose outputs differ between replays")
    ap.add_argument("--keep-values", action="store_true", help="keep the values of the outputs (in execution "
                    "order, up to --values-mb) in FILE.values.pt, for max abs / ULP differences")
    ap.add_argument("--values-mb", type=float, default=256.0, help="byte budget of --keep-values (MiB, 256)")
    ap.add_argument("--from-start", action="store_true", help="no checkpoint at or before the step: replay from "
                    "step 0 (a fresh model from the seed)")
    ap.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = ap.parse_intermixed_args(argv)  # overrides may come before, between or after the options
    runs, overrides = _split(args.items)
    if not 1 <= len(runs) <= 2 or args.step < 0 or args.repeat < 1:
        print("dettrain.trace: error: give one or two run dirs, --step K >= 0 and --repeat N >= 1 (a path that "
              "does not exist is taken for a key=value override only when it holds '=')", file=sys.stderr)
        return 2
    if not args.values_mb > 0 or args.values_mb == float("inf"):  # nan and inf too: no values file would be kept
        print(f"dettrain.trace: error: --values-mb {args.values_mb:g}: give the byte budget of --keep-values in MiB, "
              "a number > 0 (default 256)", file=sys.stderr)
        return 2
    from dettrain import dist as D
    from dettrain.errors import UserError

    keep = int(args.values_mb * 2**20) if args.keep_values else 0
    if len(runs) == 2 and args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"dettrain.trace: error: --out {args.out} is a file; with two runs --out names a directory (it holds "
              "A.jsonl and B.jsonl): pass a new or existing directory", file=sys.stderr)
        return 2
    info = None
    try:
        cfg0, _, _ = load_run_config(Path(runs[0]), overrides)
        info = D.init(cfg0.dist)
        labels = ["A", "B"] if len(runs) == 2 else [""]
        written: list[list[Path]] = []  # [run][repeat] -> this rank's file
        for label, run in zip(labels, runs):
            base = out_path(args.out, Path(run), args.step, label, runs)
            for r in range(args.repeat):
                check_out(trace_path(base, info.rank, info.world, r))  # before the work, not after it
            reps = trace_run(Path(run), args.step, overrides, ops=args.ops, repeat=args.repeat, keep_bytes=keep,
                             from_start=args.from_start, info=info)
            files = []
            for header, rec in reps:
                p = write_trace(trace_path(base, info.rank, info.world, header["repeat"]), header, rec)
                files.append(p)
                if info.is_main and header["repeat"] == 0:
                    print((f"{label}: " if label else "") + render_header(header) + f"\ntrace: {p}")
            written.append(files)
        D.barrier(info)  # every rank's files are written before rank 0 reads them
        rc = 0
        if info.is_main:
            pairs = []  # rank 0's file of each side; _ranked finds the other ranks' files
            if len(runs) == 2:
                pairs.append((written[0][0], written[1][0], "A", "B"))
            for files in written:
                pairs += [(files[0], files[i], "replay 0", f"replay {i}") for i in range(1, len(files))]
            for pa, pb, la, lb in pairs:
                res = compare_traces(_ranked(pa, info.world), _ranked(pb, info.world))
                print(f"{la} vs {lb}:")
                print(json.dumps(res, indent=1) if args.json else render(res, la, lb))
                rc = max(rc, 0 if res["identical"] else 1)
            sys.stdout.flush()  # before the other ranks learn rc and exit: torchrun ends the rest at a failure
        return D.broadcast_object(rc, info) if info.world > 1 else rc
    except UserError as e:
        print(f"dettrain.trace: error: {e}", file=sys.stderr)
        return 2
    finally:
        if info is not None:
            D.shutdown()


def out_path(out: str | None, run: Path, step: int, label: str, runs: list[str]) -> Path:
    """This run's trace file: in ``--out`` (a file; with two runs a directory holding A.jsonl and B.jsonl), by
    default in the run it traces (``RUN/trace_step<K>.jsonl``; ``.A``/``.B`` before ``.jsonl`` when both runs are
    the same dir), never in the current directory."""
    if out is not None:
        return Path(out) / f"{label}.jsonl" if len(runs) == 2 else Path(out)
    same = len(runs) == 2 and Path(runs[0]).resolve() == Path(runs[1]).resolve()
    return run / (f"trace_step{step}" + (f".{label}" if same else "") + ".jsonl")


def _ranked(p: Path, world: int) -> list[tuple[Path, dict, list[dict]]]:
    """Every rank's file of the replay whose rank-0 file is ``p``."""
    if world == 1:
        return [(p, *read_one(p))]
    files = [p.with_name(p.name.replace(".rank0", f".rank{r}", 1)) for r in range(world)]
    return [(q, *read_one(q)) for q in files]


if __name__ == "__main__":
    sys.exit(main())
