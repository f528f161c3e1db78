"""The structured config: typed dataclasses registered in Hydra's ConfigStore are the schema.

Merge order: dataclass defaults -> conf/config.yaml (+ the ``model`` group) -> ``+exp=NAME`` (conf/exp/NAME.yaml,
``# @package _global_``) -> command-line ``key=value`` overrides.  ``validate`` runs at start-up and names the key and
the fix for every bad value.  The module-level dataclasses live beside the code they configure (models/llama.py,
models/custom.py, data/__init__.py, dist.py, determinism.py, sync/optim.py); this file holds the rest and the root.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from dettrain.data import DataConfig
from dettrain.determinism import DetConfig
from dettrain.dist import DistConfig
from dettrain.errors import UserError
from dettrain.models.custom import CustomModelConfig, from_node, is_custom
from dettrain.models.llama import ModelConfig
from dettrain.record.identity import NON_NUMERIC, config_hash  # noqa: F401 - part of the config's interface
from dettrain.sync.optim import OptimConfig
from dettrain.tiers import policy


@dataclass
class TrainConfig:
    """The training loop (``train.*``)."""

    steps: int = 300
    """Optimizer steps of the schedule."""
    global_batch: int = 16
    """Samples per optimizer step over all ranks."""
    micro_batch: int = 8
    """Samples per forward/backward; global_batch / (micro_batch * world) is the gradient accumulation."""
    lr: float = 3e-3
    """Peak learning rate (warm-up and cosine decay: optim.*)."""
    precision: str = "auto"
    """auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16; parameters and optimizer state stay fp32."""
    compile: bool | str = "auto"
    """torch.compile each transformer block and the loss (dettrain/loop/compile.py): auto (on for CUDA with Triton, off
    for CPU; a block, or a model without blocks, that Dynamo cannot trace as one graph is compiled with graph
    breaks or run eagerly, with one warning line), true (strict: such a module is refused at start-up, exit 2) or
    false.  The choice per module is in the ledger header (docs/custom_models.md).  Every tier keeps its promise
    compiled (Inductor runs in its deterministic mode at det.tier>=2), but compiled and eager runs may differ from
    each other by an ulp (FMA contraction, fused reductions), so compare runs with the same setting; the ledger
    header records the resolved value.  The first step includes the compile (the progress line says so and reports
    its time).  Part of the config hash: resuming with another value needs ckpt.allow_config_change=[train.compile]."""
    cuda_graphs: bool | str = "auto"
    """Replay each compiled module's forward and backward as CUDA graphs (torch.compile's reduce-overhead mode), so
    the host launches one graph per module instead of one kernel at a time and small micro-batches stop waiting on
    the host: auto (on when train.compile compiles on CUDA and the engine keeps its gradients in place: ddp and flat;
    fsdp2's gathered parameters move between calls), true (refused where it cannot run) or false.  A replay runs the
    same kernels on the same inputs, so it never changes a bit (docs/engines.md); left out of the config hash."""
    overlap_steps: bool | str = "auto"
    """Queue the next step's first micro-batch before reading a step's line (the step's one host sync: its
    fingerprints and loss), so the device runs it while the host writes the ledger, logs and draws the next batch,
    instead of waiting for the host between steps: auto (the default: on for CUDA, where it ran at 1.004-1.013x
    serial steps: BENCHMARKS.md), true or false.  Only between two plain steps: never before an evaluation, a
    scheduled checkpoint or the run's end, nor with det.reference; a preemption signal agreed while the next step is
    in flight checkpoints after that step.  Each step's data and seeds follow from its number, so it never changes a
    bit (docs/guide.md); left out of the config hash."""
    stop_after: int | None = None
    """End the run cleanly after this step (with a checkpoint), as a preemption would; the schedule still runs to
    train.steps."""


@dataclass
class EvalConfig:
    """The validation loss (``eval.*``) on the held-out split (data.val_fraction or data.val_path)."""

    every: int = 0
    """Evaluate after step k when (k+1) % eval.every == 0, and after the last step of the schedule (train.steps);
    0: never.  The loss goes into that step's ledger line (val_loss, val_loss_bits), the progress line and wandb."""
    batches: int = 8
    """Validation micro-batches of train.micro_batch samples per evaluation: the first eval.batches x
    train.micro_batch held-out samples, the same every time and on any world size.  A multiple of the world size;
    a power of two at det.tier=4 (the canonical mean's tree, so the same bits on 1, 2, 4 ... ranks)."""


@dataclass
class WandbConfig:
    """wandb mirror of the ledger (``log.wandb.*``)."""

    mode: str | None = None
    """offline (files under the run dir), online (needs a key) or disabled; None: WANDB_MODE, else offline."""
    project: str | None = None
    """wandb project; None: WANDB_PROJECT, else dettrain."""
    entity: str | None = None
    """wandb entity (team or user); None: WANDB_ENTITY, else the key's default."""
    group: str | None = None
    """Run group; None: WANDB_RUN_GROUP, else ``<exp_name>-<first 8 hex digits of the config hash>``, so reruns of
    one config overlay in one group (``dettrain panel --group``) and a changed config gets its own."""
    name: str | None = None
    """Display name of the wandb run; None: WANDB_NAME, else the run dir's name."""
    tags: list[str] | None = None
    """Tags of the wandb run, e.g. log.wandb.tags=[ablation,lr3e-4]; None: WANDB_TAGS (comma-separated), else none.
    dettrain adds tier<N> and world<N> to them."""
    notes: str | None = None
    """Notes (description) of the wandb run; None: WANDB_NOTES, else none."""
    verbose: bool = False
    """Let wandb print its banner, sync hints and run summary (false: wandb is silent; dettrain's lines stay)."""
    timeout_s: float = 120.0
    """Longest wait for wandb.init, and for run.finish's upload with the wait until the run's .wandb file holds its
    last record; past it the mirror gives up (with a warning), never the run."""


@dataclass
class LogConfig:
    """Logging (``log.*``)."""

    every: int = 10
    """Print a progress line on rank 0 every N steps."""
    tensor_every: int = 0
    """Write per-tensor fingerprints every N steps (0: never, except at a live-check divergence)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CkptConfig:
    """Checkpoints (``ckpt.*``)."""

    every: int = 0
    """Save every N steps (0: only at train.stop_after and on preemption, SIGUSR1/SIGTERM). See docs/checkpoint.md."""
    resume: str = "none"
    """none, auto (the newest good checkpoint in <run_dir>/checkpoints, falling back past damaged ones; step 0 if
    there is none) or a path: a checkpoint dir (step_XXXXXXXX) or a run dir."""
    final: bool = True
    """A run that completes train.steps writes a final checkpoint of its trained model (unless ckpt.every already
    saved that step), so every finished run can be exported (``dettrain.export``, ``dettrain checkpoint to-torch``)."""
    keep: int = 2
    """Checkpoints kept in the run dir (older ones are deleted after a successful save); at least 1."""
    overwrite: bool = False
    """A fresh run (ckpt.resume=none) into a run dir that already holds a run (a ledger with steps, or checkpoints)
    is refused unless this is true; then the old files are moved into <run_dir>/overwritten/<time>/, never
    deleted (dettrain/record/rundir.py)."""
    allow_config_change: list[str] = field(default_factory=list)
    """Keys allowed to differ between save and resume, which otherwise refuses any change to a key of the config
    hash: exact keys or groups (['train.lr'], ['optim']), 'world_size' below tier 4, and 'data' for data files whose
    content changed since the ledger was started (their fingerprints, ledger header ``data_files``).  Recorded in
    the ledger."""


@dataclass
class Config:
    """Root of the schema."""

    exp_name: str = "default"
    """Experiment name: outputs/<exp_name>/<run_id>/ and the first part of the default wandb group."""
    seed: int = 0
    """The one seed every random stream is derived from (determinism.derive_seed)."""
    run_dir: str | None = None
    """Run directory; None: outputs/<exp_name>/<run_id> with run_id from DETTRAIN_RUN_ID, torchrun's rendezvous id,
    or a timestamp agreed across ranks."""
    model: Any = field(default_factory=ModelConfig)
    """The model: dettrain's LLaMA (ModelConfig, ``model=tiny|125m|1b|7b``) or your own (CustomModelConfig,
    ``model=custom`` with ``model._target_``; docs/custom_models.md)."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    det: DetConfig = field(default_factory=DetConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def register() -> None:
    """The root schema, and the schema of dettrain's LLaMA presets (``defaults: [llama_schema, _self_]`` in
    conf/model/*.yaml).  The root's ``model`` node is left open so that a preset brings its own type: LLaMA
    presets the typed ModelConfig, ``model=custom`` an untyped node of any keys (typed by ``to_config``)."""
    cs = ConfigStore.instance()
    root = OmegaConf.structured(Config)
    root.model = "???"  # filled by the model group (conf/config.yaml's default: model=tiny)
    cs.store(name="dettrain_schema", node=root)
    cs.store(group="model", name="llama_schema", node=ModelConfig)


def model_config(node: Any) -> ModelConfig | CustomModelConfig:
    """The typed model config of a composed ``model`` node: a CustomModelConfig when it has ``_target_``, else
    a ModelConfig (a node of a user's own preset YAML without the schema line is typed here, its keys checked)."""
    if isinstance(node, (ModelConfig, CustomModelConfig)):
        return node
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    if is_custom(plain):
        return from_node(plain)
    from omegaconf.errors import OmegaConfBaseException

    from dettrain.errors import UserError

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), plain))
    except OmegaConfBaseException as e:
        raise UserError(f"model.{getattr(e, 'key', None) or ''}: {str(e).splitlines()[0]} (dettrain's LLaMA keys: "
                        f"{', '.join(ModelConfig.__dataclass_fields__)}; for your own model use model=custom with "
                        "model._target_)") from None


def _unknown_keys(node: Any, cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of a composed node that the dataclass ``cls`` has no field for (a custom model's node is open:
    its keys are the factory's)."""
    import dataclasses

    if not isinstance(node, DictConfig):
        return []
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for k in node.keys():
        key = f"{prefix}{k}"
        if k not in fields:
            out.append(key)
            continue
        sub = node._get_node(k)
        if cls is Config and k == "model":
            if isinstance(sub, DictConfig) and "_target_" not in sub.keys():
                out += _unknown_keys(sub, ModelConfig, "model.")
            continue
        default = fields[k].default_factory if fields[k].default_factory is not dataclasses.MISSING else None
        if isinstance(sub, DictConfig) and isinstance(default, type) and dataclasses.is_dataclass(default):
            out += _unknown_keys(sub, default, key + ".")
    return out


def to_config(dcfg: DictConfig) -> Config:
    """The typed Config of a composed Hydra config (every tool calls this instead of ``OmegaConf.to_object``)."""
    from dettrain.errors import UserError

    model = dcfg.get("model")
    if isinstance(model, DictConfig) and "_target_" in model.keys() and OmegaConf.is_missing(model, "_target_"):
        raise UserError("model._target_ is not set: model=custom needs model._target_=pkg.module.factory (in your "
                        "experiment YAML or on the command line)")
    extra = _unknown_keys(dcfg, Config)
    if extra:  # `+train.foo=1` adds a key Hydra accepts and the typed schema would silently drop
        raise UserError(f"{extra[0]} is not a config key (added with +{extra[0]}=... or in a YAML); dettrain train "
                        "--help lists every key" + (f" (also unknown: {', '.join(extra[1:4])})" if extra[1:] else ""))
    cfg = OmegaConf.to_object(dcfg)
    cfg.model = model_config(cfg.model)
    if isinstance(cfg.model, CustomModelConfig) and cfg.model.kwargs.get("pretrained"):
        from dettrain.models.hf import pretrained_vocab_size  # model.pretrained: the checkpoint's vocabulary

        cfg.model.vocab_size = pretrained_vocab_size(str(cfg.model.kwargs["pretrained"]))
    elif cfg.model.vocab_size == 0:  # model.vocab_size=0: the token file's own vocabulary, recorded resolved
        from dettrain.data import sidecar_vocab_size

        cfg.model.vocab_size = sidecar_vocab_size(cfg.data)
    return cfg


def conf_dir() -> Path:
    """The YAML config directory beside this file: the package ``dettrain.conf`` when installed (a ``conf``
    folder inside the installed package), the repository's ``conf`` folder in a checkout.  The tree this module
    was imported from wins over what an editable install maps ``dettrain.conf`` to, so a second checkout (a git
    worktree) on PYTHONPATH reads its own YAML."""
    here = Path(__file__).resolve().parent
    for p in (here / "conf", here.parent / "conf"):
        if (p / "config.yaml").is_file():
            return p
    import importlib.util

    try:
        spec = importlib.util.find_spec("dettrain.conf")
    except ModuleNotFoundError:
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / "config.yaml").is_file():
            return Path(loc)
    raise RuntimeError("cannot find dettrain's conf/ directory; reinstall with 'pip install -e .'")


def to_container(cfg: DictConfig | Config) -> dict:
    if isinstance(cfg, Config):
        if isinstance(cfg.model, CustomModelConfig):  # recorded flat, as written
            cfg = replace(cfg, model=cfg.model.as_dict())
        cfg = OmegaConf.structured(cfg)
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


@functools.lru_cache(maxsize=8)
def corpus_bytes_for(n_tokens: int) -> int | None:
    """The least data.max_bytes for which the embedded corpus (data.stdlib_corpus: the standard library's .py
    files, whole, in sorted order of their relative paths) holds ``n_tokens`` bytes; None if it never does (then
    the sampler's own check names the shortfall).  Only file sizes are read."""
    from dettrain.data import stdlib_sources

    files = stdlib_sources()
    total = 0
    for q in files:
        try:
            total += q.stat().st_size
        except OSError:  # stdlib_corpus skips an unreadable file too
            continue
        if total >= n_tokens:
            return total
    return None


def validate(cfg: Config, world: int) -> None:
    """Start-up checks; each error names the key and the fix."""
    t, d = cfg.train, cfg.det
    policy(d.tier)  # a UserError naming the valid tiers (tiers.not_a_tier)
    if d.on_divergence not in ("warn", "stop"):
        raise UserError(f"det.on_divergence={d.on_divergence!r} must be warn or stop")
    if d.attention not in ("auto", "dettrain", "torch"):
        raise UserError(f"det.attention={d.attention!r} must be auto, dettrain or torch (docs/determinism.md)")
    pol = policy(d.tier)
    if d.threads < 0:  # torch.set_num_threads refuses it, and the header would record a count torch never used
        raise UserError(f"det.threads={d.threads} must be >= 0: a thread count, or 0 for torch's default (tiers 0-1 "
                        "only), e.g. det.threads=1")
    if pol.pin_threads and d.threads <= 0:
        raise UserError(f"det.threads={d.threads}: det.tier={d.tier} pins the CPU thread count (CPU reductions "
                         "depend on it); set det.threads to a positive number, e.g. det.threads=1")
    for key in ("steps", "global_batch", "micro_batch"):
        if getattr(t, key) <= 0:
            raise UserError(f"train.{key} must be positive, got {getattr(t, key)}")
    if not t.lr > 0:  # `not >` also refuses nan
        raise UserError(f"train.lr must be positive, got {t.lr}")
    if t.global_batch % (t.micro_batch * world):
        raise UserError(f"train.global_batch={t.global_batch} is not divisible by train.micro_batch="
                         f"{t.micro_batch} x world size {world}; pick a global batch that is a multiple of "
                         f"{t.micro_batch * world}")
    if t.precision not in ("auto", "fp32", "bf16"):
        raise UserError(f"train.precision={t.precision!r} must be auto, fp32 or bf16")
    if not (isinstance(t.compile, bool) or str(t.compile).lower() in ("auto", "true", "false")):
        raise UserError(f"train.compile={t.compile!r} must be auto, true or false")
    r = cfg.dist.reshard_after_forward
    if not (isinstance(r, bool) or str(r).lower() in ("auto", "true", "false")):
        raise UserError(f"dist.reshard_after_forward={r!r} must be auto, true or false")
    if t.stop_after is not None and not 0 <= t.stop_after < t.steps:
        raise UserError(f"train.stop_after={t.stop_after} must lie in [0, train.steps={t.steps})")
    if pol.world_invariant:
        if world & (world - 1):
            raise UserError(f"det.tier=4 needs a power-of-two world size, got {world} ranks; launch 1, 2, 4, 8 ... "
                             "processes (or use det.tier=3, identical on a fixed world size)")
        M = t.global_batch // t.micro_batch
        if M & (M - 1):
            raise UserError(f"det.tier=4 needs a power-of-two number of micro-batches per step, got "
                             f"train.global_batch/train.micro_batch={M}; change train.global_batch or "
                             "train.micro_batch (or use det.tier=3)")
    o = cfg.optim
    if not o.eps > 0:
        raise UserError(f"optim.eps={o.eps} must be positive (AdamW divides by sqrt(v) + eps), e.g. optim.eps=1e-8")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(o, key) < 1:
            raise UserError(f"optim.{key}={getattr(o, key)} must lie in [0, 1), e.g. optim.beta1=0.9 "
                            "optim.beta2=0.95")
    if not o.clip_grad_norm >= 0:
        raise UserError(f"optim.clip_grad_norm={o.clip_grad_norm} must be >= 0 (0 disables clipping)")
    if not o.weight_decay >= 0:
        raise UserError(f"optim.weight_decay={o.weight_decay} must be >= 0")
    if any(not isinstance(p, str) or not p for p in o.no_decay):
        raise UserError(f"optim.no_decay={o.no_decay!r}: every entry must be a non-empty name pattern, e.g. "
                        "optim.no_decay=[norm,bias,tok_emb]")
    if o.warmup_steps < 0:
        raise UserError(f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    if not 0 <= o.min_lr_ratio <= 1:
        raise UserError(f"optim.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1]")
    if cfg.dist.timeout_s <= 0:
        raise UserError(f"dist.timeout_s={cfg.dist.timeout_s} must be positive (seconds a collective may wait)")
    if cfg.data.max_bytes <= 0:
        raise UserError(f"data.max_bytes={cfg.data.max_bytes} must be positive (size cap of the embedded corpus)")
    if cfg.data.path is None:  # the embedded corpus: whole files up to the cap, which must hold one global batch
        need = t.global_batch * cfg.model.seq_len + 1
        least = corpus_bytes_for(need)
        if least is not None and cfg.data.max_bytes < least:
            raise UserError(f"data.max_bytes={cfg.data.max_bytes} is too small: the embedded corpus takes whole "
                            f"files, and one global batch (train.global_batch={t.global_batch} samples of "
                            f"model.seq_len+1={cfg.model.seq_len + 1} tokens) needs data.max_bytes >= {least}")
    if cfg.data.num_workers < 0:
        raise UserError(f"data.num_workers={cfg.data.num_workers} must be >= 0")
    dc, ev = cfg.data, cfg.eval
    if not 0 <= dc.val_fraction < 1:  # `not` also refuses nan
        raise UserError(f"data.val_fraction={dc.val_fraction} must lie in [0, 1) (e.g. 0.05 holds out the last 5 % "
                        "of the samples; 0: no held-out split)")
    if dc.val_path is not None and dc.val_fraction > 0:
        raise UserError(f"data.val_path={dc.val_path!r} and data.val_fraction={dc.val_fraction} both name a "
                        "held-out split; set only one of them")
    if dc.val_path is not None and not Path(dc.val_path).is_file():
        raise UserError(f"data.val_path={dc.val_path!r} does not exist; create it with 'python -m dettrain.data "
                        f"prepare FILES --out {dc.val_path}' or unset data.val_path")
    if ev.every < 0:
        raise UserError(f"eval.every={ev.every} must be >= 0 (0: never evaluate)")
    if ev.every > 0 and dc.val_path is None and dc.val_fraction == 0:
        raise UserError(f"eval.every={ev.every} needs a held-out split: set data.val_fraction (e.g. 0.05) or "
                        "data.val_path, or eval.every=0")
    if ev.every > 0 and (ev.batches <= 0 or ev.batches % world):  # unchecked while eval is off
        raise UserError(f"eval.batches={ev.batches} must be a positive multiple of the world size {world} (every "
                        "rank evaluates the same number of validation micro-batches)")
    if ev.every > 0 and pol.world_invariant and ev.batches & (ev.batches - 1):
        raise UserError(f"eval.batches={ev.batches}: det.tier=4 needs a power of two (the validation loss is one "
                        "binary tree over the micro-batch losses, the same on any world size); e.g. eval.batches=8")
    from dettrain.dist import resolve_backend

    resolve_backend(cfg.dist.backend)
    if not cfg.dist.bucket_mb > 0:
        raise UserError(f"dist.bucket_mb must be positive, got {cfg.dist.bucket_mb}")
    from dettrain.sync.engines import check_engine

    check_engine(cfg)
    from dettrain.record.wandb_io import resolve_wandb

    resolve_wandb(cfg)  # log.wandb.* and WANDB_* (UserError naming the bad one)
    if cfg.ckpt.every < 0:
        raise UserError(f"ckpt.every={cfg.ckpt.every} must be >= 0 (0: checkpoint only at train.stop_after and "
                        "on preemption)")
    if cfg.log.every <= 0:
        raise UserError(f"log.every={cfg.log.every} must be positive (a progress line every N steps)")
    if not cfg.log.wandb.timeout_s > 0:  # `not >` also refuses nan
        raise UserError(f"log.wandb.timeout_s={cfg.log.wandb.timeout_s} must be positive (seconds to wait for "
                        "wandb before the mirror gives up), e.g. log.wandb.timeout_s=120")
    if cfg.log.tensor_every < 0:
        raise UserError(f"log.tensor_every={cfg.log.tensor_every} must be >= 0 (0: never)")
    if cfg.ckpt.keep < 1:
        raise UserError(f"ckpt.keep={cfg.ckpt.keep}: keep at least the newest checkpoint (ckpt.keep>=1)")
    if cfg.ckpt.overwrite and cfg.ckpt.resume != "none":
        raise UserError(f"ckpt.overwrite=true starts afresh and cannot be combined with ckpt.resume="
                        f"{cfg.ckpt.resume}; drop one of them")
    if not cfg.ckpt.resume:
        raise UserError("ckpt.resume is empty; use none, auto or the path of a checkpoint or run dir")
    if cfg.data.path is not None and not Path(cfg.data.path).is_file():
        raise UserError(f"data.path={cfg.data.path!r} does not exist; create it with "
                         f"'python -m dettrain.data prepare FILES --out {cfg.data.path}' or unset data.path")
    if cfg.data.path is not None:  # a prepared file knows its vocabulary: refuse a smaller model up front
        side = Path(cfg.data.path).with_name(Path(cfg.data.path).name + ".json")
        try:
            v = json.loads(side.read_text()).get("vocab_size")
        except (OSError, ValueError, AttributeError):
            v = None
        if isinstance(v, int) and v > cfg.model.vocab_size:
            raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of data.path "
                            f"({v}, from {side}; byte-level files with end-of-text tokens have 257); set "
                            f"model.vocab_size=0 to take it from the sidecar, or model.vocab_size={v}")
    if cfg.det.reference is not None:
        ref = Path(cfg.det.reference)
        if not (ref.is_file() or (ref / "ledger.jsonl").is_file()):
            raise UserError(f"det.reference={cfg.det.reference!r} is neither a ledger file nor a run dir with "
                             "ledger.jsonl; point it at an earlier run")
    if isinstance(cfg.model, CustomModelConfig):
        from dettrain.models.custom import validate_custom

        validate_custom(cfg.model)
    else:
        from dettrain.models.llama import validate_model

        validate_model(cfg.model)
