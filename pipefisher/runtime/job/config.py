"""Run configuration read from YAML: model shape, pipeline layout, data, optimizer and K-FAC settings.

Plain dataclasses (no torch), so the CLI can check a config before any worker starts.
``--set SECTION.KEY=VALUE`` overrides (:func:`apply_overrides`) go through the same checks as the file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from pipefisher.errors import InputError, renamed_notice
from pipefisher.kfac import DEFAULT_IGNORE
from pipefisher.kfac.defaults import factor_decay_of, step_decay_of
from pipefisher.pipeline_orders import V_ORDERS, default_chunks, order_names
from pipefisher.runtime.job.options import FLAGS, OptionError, section_class

DEFAULT_MUON_EXCLUDE = ("embed", "embeddings", "embed_tokens", "wte", "wpe", "cls", "head", "lm_head")
"""Parameter-name parts ``optim.name: muon`` leaves to AdamW although their tensors are 2-D: input
embeddings and output heads, as the built-in BERT (``embeddings``, ``cls``), transformers' BERT, GPT-2
(``wte``, ``wpe``, ``lm_head``) and LLaMA-style models (``embed_tokens``) and plain ones (``embed``,
``head``) name them. Muon is meant for the hidden layers' matrices (Jordan et al. 2024)."""


DEFAULT_BUILDER = "pipefisher.runtime.models.bert:build_stage"
"""The built-in BERT-style model's stage builder (``model.builder``)."""

MOVED_BUILDERS = {"pipefisher.runtime.model:build_stage": DEFAULT_BUILDER,
                  "pipefisher.runtime.hf:bert_mlm": "pipefisher.runtime.models.hf:bert_mlm",
                  "pipefisher.runtime.hf:gpt2_clm": "pipefisher.runtime.models.hf:gpt2_clm"}
"""The built-in builders' names before the runtime was split into layers: configs, checkpoint manifests
and schedule metadata that name them mean the same builders (:func:`current_builder`)."""


def current_builder(spec: Any) -> Any:
    """``spec`` under its current name where it names a built-in builder by its old one; else itself."""
    return MOVED_BUILDERS.get(spec, spec) if isinstance(spec, str) else spec


class Options(dict):
    """``model.options``: builder-specific settings, passed to the builder untouched.

    A dict (YAML and JSON read and write it as one) that hashes by content, so a :class:`ModelConfig`
    holding it can still key a cache. Treat it as read-only.
    """

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True, default=str))


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model, and which stage builder makes it.

    ``builder`` (``"package.module:function"``) builds one pipeline stage; the default is the built-in
    BERT-style masked-language model. ``options`` is for the builder's own settings (the config checks
    nothing in it), so a user's builder needs no new config keys. ``pretrained`` starts from weights
    in a local folder instead of a random init: one ``save_pretrained`` wrote (Hugging Face builders) or
    one ``pipefisher export`` wrote (the built-in model too).
    """

    vocab_size: int = 100
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 64
    max_position: int = 64
    dropout: float = 0.0
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02
    builder: str = DEFAULT_BUILDER
    options: Options = field(default_factory=Options)
    pretrained: str = ""  # a local folder to start from (save_pretrained, or pipefisher export); "": random init

    def __post_init__(self) -> None:
        if not isinstance(self.options, Options) and isinstance(self.options, Mapping):
            object.__setattr__(self, "options", Options(self.options))  # replace(model={"options": {...}})


SYNTHETIC = "synthetic"
STDLIB = "stdlib"
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""The run vocabulary's special tokens, in id order (``data.PAD, UNK, CLS, SEP, MASK``): the corpus's
tokenizer gives them these ids, and exported transformers configs name them (pad, bos, eos)."""
TOKENIZERS = ("bpe", "wordpiece", "bpe-whitespace")
"""``data.tokenizer``'s kinds: byte-level BPE (text comes back exactly), BERT's WordPiece, and the
whitespace-split BPE that ``bpe`` meant before byte-level BPE (what runs from then resume with)."""


@dataclass(frozen=True)
class DataConfig:
    """Where batches come from.

    ``text`` is a text corpus: ``stdlib`` (the Python standard library's own source files, present on
    every machine with Python, so runs need no download), a file, a folder (its text files, recursively)
    or a glob. It is split by file into training and held-out text (``val_fraction`` of the files,
    chosen by a hash of their paths) and tokenized by a subword tokenizer trained on the training files
    (``tokenizer``: one of :data:`TOKENIZERS`, ``model.vocab_size`` tokens). ``synthetic`` gives seeded
    synthetic tokens instead: for unit tests only, there is little in them to learn.

    Other sources: ``builder`` names a function (``"package.module:function"``, like ``model.builder``)
    that returns the documents, strings or lists of token ids; ``dataset`` (``text``, ``json`` or
    ``parquet``) reads the local files ``text`` names with Hugging Face ``datasets`` (``column`` holds
    the text). Either way the held-out split and the batches are made as for text files.
    """

    seq_len: int = 16
    micro_batch_size: int = 4
    num_micro_batches: int = 4
    mask_prob: float = 0.15
    seed: int = 0
    text: str = STDLIB
    tokenizer: str = "bpe"
    val_fraction: float = 0.05
    val_batches: int = 8
    objective: str = "mlm"  # one of OBJECTIVES
    builder: str = ""  # "package.module:function" giving the documents instead of ``text``
    dataset: str = ""  # one of DATASET_FORMATS: ``text`` names local files read by Hugging Face datasets
    column: str = "text"  # the column of a ``json`` / ``parquet`` dataset that holds the text


OBJECTIVES = ("mlm", "clm")
"""``data.objective``: masked-LM (BERT masking) or causal-LM (labels are the next tokens) batches."""

DATASET_FORMATS = ("text", "json", "parquet")
"""``data.dataset``: the Hugging Face ``datasets`` builders for local files that a run may read."""

OPTIMIZERS = ("adamw", "lamb", "sgd", "adam", "muon")
LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    """The first-order optimizer: every parameter K-FAC does not precondition, or all of them without K-FAC.

    ``lr`` is the peak learning rate: it rises linearly over ``warmup_steps``, then follows ``lr_schedule``
    down to ``min_lr_ratio * lr`` at step ``decay_steps`` (0: the run's last step). ``weight_decay`` is
    decoupled (AdamW, LAMB, Muon) and never applies to biases and LayerNorm weights. ``clip_norm`` > 0
    clips the global gradient norm (over every stage) before K-FAC and the optimizer see the gradients.

    ``muon``: torch's Muon (momentum ``muon_momentum``, Nesterov, its learning rate scaled to match
    AdamW's update size) on the 2-D parameters that ``muon_include`` (empty: every one) and not
    ``muon_exclude`` name, AdamW (``betas``, ``eps``) on all others; one peak ``lr`` for both
    (:func:`pipefisher.runtime.train.optim.muon_split` is the rule).
    """

    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, ...] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.9
    weight_decay: float = 0.01
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # one of LR_SCHEDULES
    decay_steps: int = 0
    min_lr_ratio: float = 0.0
    clip_norm: float = 0.0
    muon_momentum: float = 0.95  # torch.optim.Muon's default
    muon_include: tuple[str, ...] = ()  # parameter-name parts Muon may take (empty: any 2-D parameter)
    muon_exclude: tuple[str, ...] = DEFAULT_MUON_EXCLUDE


FISHERS = ("empirical", "true")
UPDATES = ("base", "momentum", "soap")
INVERSES = ("cholesky", "eigen")
ON_BAD_FACTOR = ("stop", "skip")
SAVE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class KfacConfig:
    """K-FAC for the ``nn.Linear`` layers not matched by ``ignore``.

    Curvature: factors refreshed every ``interval`` steps (in ``scheduled`` mode: once per cycle), kept
    as running averages (``factor_decay``: the weight of the old factor per refresh; 0 keeps only the
    newest; unset: 0 for inverses, and under ``update: soap`` ``factor_decay_per_step`` (unset: SOAP's
    0.95) to the power k for a refresh every k steps, :func:`pipefisher.kfac.defaults.factor_decay_of`),
    inverted with damping ``damping`` (decayed by ``damping_decay`` per refresh down to
    ``damping_min``; 0: ``damping`` itself), split between the factors by the pi rule, in ``inverse_dtype`` by ``inverse``.
    Update: the preconditioned gradient is scaled so the step's predicted KL change stays under
    ``kl_clip`` (0: off), then ``update`` decides who takes it: ``momentum`` (heavy-ball momentum
    ``momentum`` with its own peak learning rate ``lr``, on the same warm-up and schedule as the
    optimizer) or ``base`` (the first-order optimizer, like every other parameter). ``soap`` keeps
    only the factors' eigenbases from a refresh (no damping, no inverse) and the K-FAC layers take
    Adam's step in them (:mod:`pipefisher.kfac.eigenbasis`) with the optimizer's learning rate,
    betas, eps and weight decay.
    ``fisher``: ``empirical`` (the training labels' gradients) or ``true`` (labels sampled from the
    model's own output distribution, one extra backward). ``on_bad_factor``: a factor that is not
    finite, or not positive definite after damping, ``stop``s the run or ``skip``s that refresh.
    ``save_dtype``: the dtype saved inputs and output gradients wait in until their covariance piece.
    ``cov_stride``: every how many token rows of a micro-batch one feeds the covariance factors (1: all);
    a stride s saves s times less and makes every covariance piece about s times cheaper.
    ``refresh_pieces``: how many pieces (inverse labels) a factor's refresh runs in, so that it fits
    bubbles shorter than the whole refresh (:mod:`pipefisher.kfac.refresh`): an integer, or ``auto``
    (one piece per 512 columns of the factor), or ``best`` (``pipefisher run`` only: it profiles and packs
    1, 2 and 4 pieces and trains with the count :func:`pipefisher.cost.objective.best_pieces` keeps: the
    shorter cycle among the planned steps within 2 % of the least, :data:`BEST_PIECES`); more than 1
    needs ``inverse: cholesky`` or ``update: soap``.
    Default 1 (the whole refresh); on CPU the Cholesky pieces cost 0.7-1.1x the whole inverse in all from
    about 500 columns on (docs/benchmarks.md).
    ``cov_micro_batches``: how many micro-batches of a refresh's iteration feed its factors, the first M
    of each pipe (or model chunk), or ``all``: fewer save less and place fewer covariance pieces; the
    factor stays a mean over them, so its scale does not change (:func:`pipefisher.schedule.problem.cov_pieces`).
    ``basis_block`` (``update: soap`` only): a factor wider than this many columns is cut into diagonal
    blocks of at most that width, and its covariance, its eigenbasis and the rotations into it go block by
    block (:func:`pipefisher.kfac.factors.diagonal_blocks`); 0 keeps every factor whole.
    ``rotation_dtype`` (``update: soap`` only): ``float32`` or ``bfloat16``, the dtype of the four products
    of each step's update (:class:`pipefisher.kfac.eigenbasis.EigenbasisAdam`).
    ``nesterov`` (``update: soap`` only): Adam's first moment in the eigenbasis looks one step ahead, as
    Nesterov's momentum does (:class:`pipefisher.kfac.eigenbasis.EigenbasisAdam`); off by default (SOAP's
    plain Adam, as published: one benchmark's win does not decide another job's update); the race's
    benchmark turns it on (docs/benchmarks.md).
    ``factor_decay_per_step`` (``update: soap`` only, with ``factor_decay`` unset): the old factor's weight
    per training step, in [0, 1); unset: SOAP's 0.95 (:data:`pipefisher.kfac.defaults.EIGENBASIS_STEP_DECAY`).
    """

    damping: float = 1e-3
    damping_min: float = 0.0  # 0: no decay below ``damping``
    damping_decay: float = 1.0
    interval: int = 1
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    factor_decay: float | None = None  # None: the update's own (factor_decay_of)
    kl_clip: float = 0.0
    update: str = "base"
    lr: float = 0.1
    momentum: float = 0.9
    fisher: str = "empirical"
    inverse: str = "cholesky"
    inverse_dtype: str = "float32"
    on_bad_factor: str = "stop"
    save_dtype: str = "float32"
    cov_stride: int = 1
    refresh_pieces: int | str = 1
    cov_micro_batches: int | str = "all"
    basis_block: int = 0
    rotation_dtype: str = "float32"
    nesterov: bool = False
    factor_decay_per_step: float | None = None  # None: SOAP's (step_decay_of)


ROTATION_DTYPES = ("float32", "bfloat16")
"""``kfac.rotation_dtype``'s values."""


def _eigenbasis_problems(k: KfacConfig) -> list[str]:
    """What :func:`check_config` says of the settings of ``kfac.update: soap``'s eigenbases alone."""
    problems = []
    if isinstance(k.basis_block, bool) or not isinstance(k.basis_block, int) or k.basis_block < 0:
        problems.append(f"kfac.basis_block must be an integer >= 0 (0: whole factors), not {k.basis_block!r}")
    elif k.basis_block and k.update != "soap":
        problems.append(f"kfac.basis_block cuts the eigenbases of kfac.update: soap into diagonal blocks; "
                        f"kfac.update: {k.update} keeps damped inverses of whole factors: set basis_block 0")
    if k.rotation_dtype not in ROTATION_DTYPES:
        problems.append(f"kfac.rotation_dtype must be one of {', '.join(ROTATION_DTYPES)}, not {k.rotation_dtype!r}")
    elif k.rotation_dtype != KfacConfig.rotation_dtype and k.update != "soap":
        problems.append(f"kfac.rotation_dtype is the dtype of kfac.update: soap's rotations; kfac.update: "
                        f"{k.update} has none: leave it unset")
    if not isinstance(k.nesterov, bool):
        problems.append(f"kfac.nesterov must be true or false, not {k.nesterov!r}")
    elif k.nesterov != KfacConfig.nesterov and k.update != "soap":
        problems.append(f"kfac.nesterov is the look-ahead of kfac.update: soap's first moment; kfac.update: "
                        f"{k.update} has none: leave it unset")
    per_step = k.factor_decay_per_step
    if per_step is not None and (isinstance(per_step, bool) or not isinstance(per_step, (int, float))
                                 or not 0.0 <= per_step < 1.0):
        problems.append(f"kfac.factor_decay_per_step must be in [0, 1), not {per_step!r}")
    elif per_step is not None and k.update != "soap":
        problems.append(f"kfac.factor_decay_per_step weighs the factors of kfac.update: soap's eigenbases; "
                        f"kfac.update: {k.update} keeps 0 unless kfac.factor_decay says otherwise: leave it unset")
    elif per_step is not None and k.factor_decay is not None:
        problems.append("kfac.factor_decay (per refresh) and kfac.factor_decay_per_step both set: keep one")
    return problems


def cov_limit(value: int | str) -> int | None:
    """``kfac.cov_micro_batches`` as K-FAC and the timelines take it: a count, None for ``all``."""
    return None if value == "all" else int(value)


PIPELINE_ORDERS = tuple(order_names())
"""Pipeline orders the trainer runs: every one :mod:`pipefisher.pipeline_orders` generates."""


ENGINES = ("pipefisher", "torch")
"""``pipeline.engine``: pipefisher's own pipeline engine, or torch's ``torch.distributed.pipelining``
(:mod:`pipefisher.runtime.pipeline.torch_engine`)."""
TORCH_ENGINE_ORDERS = ("1f1b", "interleaved", "zb-v", "zb-h1", "dualpipev")
"""The pipeline orders the torch engine runs: those torch has a schedule class for, with pipefisher's order."""


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline layout. ``stages`` x data-parallel replicas = world size; replicas are inferred."""

    stages: int = 2
    order: str = "1f1b"  # one of PIPELINE_ORDERS
    timeout_s: float = 60.0
    chunks: int = 2  # interleaved: model chunks per device (virtual stage s on device s % stages); zb-v, dualpipev: 2
    grad_bucket_mb: float = 25.0  # the most MiB of gradients one bucket's all-reduce carries
    engine: str = "pipefisher"  # one of ENGINES: who runs the pipeline (torch: torch.distributed.pipelining)

    @property
    def chunked(self) -> bool:
        """Whether each device holds several model chunks: ``pipeline.chunks`` of them interleaved, two
        in ZB-V's V (the orders :func:`pipefisher.pipeline_orders.default_chunks` gives more than one)."""
        return self.order in PIPELINE_ORDERS and default_chunks(self.order) > 1

    @property
    def virtual_stages(self) -> int:
        """Stage copies in the whole pipeline: ``stages * chunks`` with model chunks, else ``stages``."""
        return self.stages * (self.chunks if self.chunked else 1)


PRECISIONS = ("fp32", "bf16", "fp16")
"""``train.precision``: the compute dtype of forwards and backwards (autocast); weights, optimizer
state and K-FAC factors stay float32. ``fp16`` also scales the loss (``train.loss_scale`` to start)."""
RECOMPUTE = ("none", "layer")
"""``train.recompute``: keep every activation, or recompute each transformer block's in its backward."""


@dataclass(frozen=True)
class TrainConfig:
    """How each step computes: ``precision`` (one of :data:`PRECISIONS`), activation ``recompute``
    (one of :data:`RECOMPUTE`) and, for fp16, the loss scale to start from (halved on every overflow,
    doubled after 2000 finite steps). None of them changes the model or its schedule's labels."""

    precision: str = "fp32"
    recompute: str = "none"
    loss_scale: float = 65536.0


@dataclass(frozen=True)
class CheckpointConfig:
    """What a run's checkpoint folder keeps: the newest ``keep`` checkpoints (1: only the latest; older
    ones are removed as each new one is complete); ``on_interrupt``: whether Ctrl-C or SIGTERM (what a
    cluster sends before preemption) makes a run with a checkpoint folder stop at the next step boundary,
    on every worker at the same step, and write a checkpoint there. Both may change when a run is resumed."""

    keep: int = 1
    on_interrupt: bool = True


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    kfac: KfacConfig = field(default_factory=KfacConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def replace(self, **sections: Mapping[str, Any]) -> "RunConfig":
        """A copy with some fields of some sections changed, e.g. ``replace(pipeline={"stages": 4})``."""
        changes = {}
        for name, values in renamed_sections(sections, "RunConfig.replace").items():
            if name == "name":
                changes[name] = values
                continue
            changes[name] = dataclasses.replace(getattr(self, name), **values)
        out = dataclasses.replace(self, **changes)
        check_config(out, None)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self, layout: bool = True) -> str:
        """Short hash of the config: the one digest of a config's identity. Every worker compares it at
        start-up, so stages never run different setups. ``layout=False`` leaves out the name and the
        pipeline section (stages, order, chunks, timeout), which change how a step runs but not what the
        model learns: the identity a staleness curve is measured for and checked against."""
        raw = recorded_sections(self.to_dict())
        if not layout:
            raw = {k: v for k, v in raw.items() if k not in ("name", "pipeline")}
        blob = json.dumps(raw, sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


RENAMED_KEYS = {"pipeline.schedule": "pipeline.order", "optim.schedule": "optim.lr_schedule"}
"""Config keys under their old names, which still read as the new ones: "schedule" names only the packed
K-FAC schedule. Records (a checkpoint's manifest, a schedule's metadata) written with the old names
read silently; a config file or ``--set`` with one also says the new name on stderr."""


def renamed_sections(raw: Mapping[str, Any], where: str | os.PathLike[str] | None = None,
                     notice: bool = True) -> dict[str, Any]:
    """``raw`` (a config's sections) with every :data:`RENAMED_KEYS` key under its new name; an old key
    beside its new one is an :class:`InputError`. ``notice``: say each old name found, naming ``where``."""
    out = dict(raw)
    for old, new in RENAMED_KEYS.items():
        section, _, key = old.partition(".")
        values = out.get(section)
        if not isinstance(values, Mapping) or key not in values:
            continue
        new_key = new.partition(".")[2]
        if new_key in values:
            raise InputError(where, f"has both {old} and {new} (the same key, under its old and new name): keep {new}")
        out[section] = {(new_key if k == key else k): v for k, v in values.items()}
        if notice:
            renamed_notice(old, new, None if where is None else os.fspath(where))
    return out


LATER_KEYS = {"kfac.cov_micro_batches": "all", "kfac.basis_block": 0, "kfac.rotation_dtype": "float32",
              "kfac.nesterov": False}
"""Settings added after fingerprints were first recorded, with their defaults: at its default such a
setting is left out of the fingerprint, so a config that does not use it keeps the digest it had."""


def recorded_sections(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A config's sections (``RunConfig.to_dict``) under the names records had before :data:`RENAMED_KEYS`,
    without :data:`LATER_KEYS` at their defaults, an unset ``kfac.factor_decay`` outside soap as the 0 it
    stands for, ``kfac.factor_decay_per_step`` only where it applies (soap, ``factor_decay`` unset) and
    then as the weight it stands for: what the fingerprint hashes, so the digests that
    checkpoints, schedules and staleness curves recorded still name the same configs."""
    out = dict(raw)
    kfac = out.get("kfac")
    if isinstance(kfac, Mapping):
        kfac = {k: v for k, v in kfac.items() if k != "factor_decay_per_step"}
        if kfac.get("factor_decay") is None and kfac.get("update") != "soap":
            # unset became possible later: without soap it stands for the 0 every record before wrote
            kfac["factor_decay"] = factor_decay_of(None, eigenbasis=False)
        elif kfac.get("factor_decay") is None:  # soap's per-step weight, set or SOAP's, is part of the config
            kfac["factor_decay_per_step"] = step_decay_of(raw["kfac"].get("factor_decay_per_step"))
        out["kfac"] = kfac
    for dotted, default in LATER_KEYS.items():
        section, _, key = dotted.partition(".")
        if isinstance(out.get(section), Mapping) and out[section].get(key, default) == default:
            out[section] = {k: v for k, v in out[section].items() if k != key}
    for old, new in RENAMED_KEYS.items():
        section, _, key = new.partition(".")
        old_key = old.partition(".")[2]
        if isinstance(out.get(section), Mapping):
            out[section] = {(old_key if k == key else k): v for k, v in out[section].items()}
    return out


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "kfac": KfacConfig,
             "pipeline": PipelineConfig, "train": TrainConfig, "checkpoint": CheckpointConfig}


def is_run_config(raw: Any) -> bool:
    """Whether parsed YAML is a run config: only its keys (``name`` and sections), and a section a cost
    model has no key for (both have ``kfac``). For commands that read another kind of YAML, to say
    what they were given instead of listing its sections as unknown keys."""
    keys = set(map(str, raw)) if isinstance(raw, Mapping) else set()
    return bool(keys - {"name", "kfac"}) and keys <= {"name", *_SECTIONS, *SETTING_SECTIONS}


SETTINGS = {(section or "run", key): flag for flag, (section, key) in FLAGS.items()}
"""The run settings a config file may hold, by (section, key) in the file: the flag they are
(:data:`~pipefisher.runtime.job.options.FLAGS`, whose sections they are; the options themselves are the
``run`` section). ``checkpoint`` holds the config's own keys (keep, on_interrupt) too."""

SETTING_SECTIONS = tuple(dict.fromkeys(section for section, _ in SETTINGS))


def setting_key(flag: str) -> str:
    """A setting's key in a config file (``log.every``), by its flag's name (``log_every``)."""
    section, key = FLAGS[flag]
    return f"{section or 'run'}.{key}"


def split_settings(raw: Any, path: str | os.PathLike[str] | None = None) -> tuple[Any, dict[str, Any]]:
    """A config file's parsed YAML as (the config's own sections, its run settings by flag name), every
    setting checked by its section's dataclass: a wrong type or value is one :class:`InputError` naming
    the file and the key. How the settings go together with the flags given (``--schedule`` for
    ``run.mode: scheduled``, ...) is the command's one check, once they are merged."""
    if not isinstance(raw, Mapping):
        return raw, {}
    config = {name: values for name, values in raw.items() if name not in SETTING_SECTIONS or name in _SECTIONS}
    settings: dict[str, Any] = {}
    for name in SETTING_SECTIONS:
        values = raw.get(name) or {}
        if not isinstance(values, Mapping):
            raise InputError(path, f"section '{name}' must be a mapping")
        own = [f.name for f in dataclasses.fields(_SECTIONS[name])] if name in _SECTIONS else []
        bad = set(values) - {key for section, key in SETTINGS if section == name} - set(own)
        if bad:
            known = own + [key for section, key in SETTINGS if section == name]
            raise InputError(path, f"unknown key(s) in '{name}': {', '.join(sorted(map(str, bad)))} "
                                   f"(one of {', '.join(known)})")
        if own:
            config[name] = {key: value for key, value in values.items() if key in own}
        cls = section_class(None if name == "run" else name)
        kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        found = {key: _setting_value(f"{name}.{key}", kinds[key], value, path)
                 for key, value in values.items() if (name, key) in SETTINGS}
        try:
            cls(**found)
        except OptionError:
            pass  # a combination: the flags given may complete it (checked once merged)
        except ValueError as err:
            raise InputError(path, str(err)) from None
        settings.update({SETTINGS[name, key]: value for key, value in found.items()})
    return config, settings


def _setting_value(key: str, kind: str, value: Any, path: str | os.PathLike[str] | None) -> Any:
    """``value`` as a setting of type ``kind`` (its field's annotation), or an :class:`InputError` naming
    ``key``. A ``dict`` setting (``adapt.staleness``) is a file in the config, as its flag takes."""
    optional = kind.endswith("| None")
    base = kind.split(" | ")[0]
    if value is None and optional:
        return None
    if base == "bool" and isinstance(value, bool) or base == "str" and isinstance(value, str):
        return value
    if base in ("int", "float") and isinstance(value, int) and not isinstance(value, bool):
        return float(value) if base == "float" else value
    if base == "float" and isinstance(value, float):
        return value
    if base.startswith("tuple") and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    if base.startswith("dict") and isinstance(value, str):
        return value
    want = {"tuple": "a list of strings", "dict": "a file"}.get(base.partition("[")[0], f"a{'n' if base == 'int' else ''} {base}")
    raise InputError(path, f"{key} must be {want}{' or null' if optional else ''}, not {value!r}")


def load_settings(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The run settings a config file holds, by flag name (:func:`split_settings`); none from a file
    that is not there (reading the config says so)."""
    from pipefisher.safe_io import load_yaml

    return split_settings(load_yaml(path), path)[1] if os.path.isfile(path) else {}


def config_from_dict(raw: Any, path: str | os.PathLike[str] | None = None, notice: bool = True) -> RunConfig:
    """Build and check a :class:`RunConfig`; unknown keys and bad values are :class:`InputError`. Old key
    names read as their new ones (:func:`renamed_sections`; ``notice``: saying so on stderr). The run
    settings a file may hold beside the config (:func:`split_settings`) are checked and left out."""
    if not isinstance(raw, Mapping):
        raise InputError(path, "config must be a mapping of sections (" + ", ".join(_SECTIONS) + ")")
    raw = renamed_sections(split_settings(raw, path)[0], path, notice)
    unknown = set(raw) - set(_SECTIONS) - {"name"}
    if unknown:
        raise InputError(path, f"unknown config section(s): {', '.join(sorted(map(str, unknown)))} (one of name, "
                               f"{', '.join(dict.fromkeys([*_SECTIONS, *SETTING_SECTIONS]))})")
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        values = raw.get(name) or {}
        if not isinstance(values, Mapping):
            raise InputError(path, f"section '{name}' must be a mapping")
        known = {f.name: f for f in dataclasses.fields(cls)}
        bad = set(values) - set(known)
        if bad:
            raise InputError(path, f"unknown key(s) in '{name}': {', '.join(sorted(map(str, bad)))}")
        sections[name] = cls(**{key: _coerce(name, key, value, path) for key, value in values.items()})
    cfg = RunConfig(name=str(raw.get("name", "run")), **sections)
    check_config(cfg, path)
    return cfg


BEST_PIECES = "best"
"""``kfac.refresh_pieces: best``: ``pipefisher run`` profiles and packs each of a few piece counts and keeps
the best (:func:`pipefisher.cost.objective.best_pieces`), and trains with that number; nothing else resolves
it (:func:`check_pieces_resolved`), and K-FAC itself never sees it."""


def check_pieces_resolved(k: KfacConfig, path: str | os.PathLike[str] | None, where: str) -> None:
    """Refuse ``kfac.refresh_pieces: best`` in ``where`` (a command, or the workers), which has no profiles to
    choose among: only ``pipefisher run`` resolves it, before its workers start."""
    if k.refresh_pieces == BEST_PIECES:
        raise InputError(path, f"kfac.refresh_pieces: best is chosen by pipefisher run (it profiles and packs "
                               f"each piece count and keeps the shorter cycle among the shortest planned steps); {where} takes a number or "
                               f"auto (the count of the profile a schedule was packed from)")


NUMBER_OR_WORD = (("kfac", "refresh_pieces"), ("kfac", "cov_micro_batches"))
"""Settings that take a whole number or a word (``auto``, ``all``): kept as read, :func:`check_config` checks them."""


def _coerce(section: str, key: str, value: Any, path: str | os.PathLike[str] | None) -> Any:
    """``value`` as the type of ``section.key``'s default, or an :class:`InputError` naming the key."""
    default = getattr(_SECTIONS[section](), key)
    if (section, key) in NUMBER_OR_WORD:  # check_config says which are right
        return value
    if isinstance(default, dict):
        if not isinstance(value, Mapping):
            raise InputError(path, f"{section}.{key} must be a mapping, not {value!r}")
        return Options(value)
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)):
            raise InputError(path, f"{section}.{key} must be a list")
        if default and isinstance(default[0], float):
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                raise InputError(path, f"{section}.{key} must be a list of numbers, not {value!r}")
            return tuple(float(v) for v in value)
        return tuple(str(v) for v in value)
    if isinstance(default, str):
        if not isinstance(value, str):  # a number here would crash later checks with a traceback
            raise InputError(path, f"{section}.{key} must be a str, not {value!r}")
        return current_builder(value) if (section, key) == ("model", "builder") else value
    if isinstance(default, bool) or default is None:
        return value
    if isinstance(default, int) and not isinstance(value, bool) and isinstance(value, int):
        return value
    if isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise InputError(path, f"{section}.{key} must be a {type(default).__name__}, not {value!r}")


_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def parse_override(text: str) -> tuple[str, Any]:
    """``SECTION.KEY=VALUE`` (``--set``) as (``SECTION.KEY``, value); VALUE is read as YAML.

    YAML 1.1 reads ``1e-3`` as a string; it is taken as the number a user means. A key the config
    does not have, or a value of the wrong type, is an :class:`InputError` naming the option.
    """
    import yaml

    from pipefisher.safe_io import yaml_problem

    where = f"--set {text}"
    dotted, sep, raw = text.partition("=")
    dotted = dotted.strip()
    if not sep or not dotted:
        raise InputError(where, "expected SECTION.KEY=VALUE, e.g. optim.lr=0.01")
    if dotted == "name":
        return dotted, raw.strip()
    if dotted in RENAMED_KEYS:
        renamed_notice(f"--set {dotted}", f"--set {RENAMED_KEYS[dotted]}")
        dotted = RENAMED_KEYS[dotted]
    section, dot, key = dotted.partition(".")
    if (section, key) in SETTINGS:
        raise InputError(where, f"{dotted} is a run setting, not the config's: its flag sets it for one run "
                                f"(docs/config.md, Run settings in the file)")
    if section not in _SECTIONS:
        raise InputError(where, f"unknown config section '{section}' (one of name, {', '.join(_SECTIONS)})")
    known = [f.name for f in dataclasses.fields(_SECTIONS[section])]
    if not dot or key not in known:
        raise InputError(where, f"unknown key '{key}' in '{section}' (one of {', '.join(known)})")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise InputError(where, f"the value is not valid YAML ({yaml_problem(err)})") from None
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        value = float(value)
    if isinstance(getattr(_SECTIONS[section](), key), str) and not isinstance(value, str) \
            and (section, key) not in NUMBER_OR_WORD:
        value = raw.strip()  # a str field takes what was typed: name=123, data.text=2024
    _coerce(section, key, value, where)
    return dotted, value


def apply_overrides(cfg: RunConfig, overrides: "list[str] | tuple[str, ...]",
                    path: str | os.PathLike[str] | None = None) -> RunConfig:
    """``cfg`` with ``--set SECTION.KEY=VALUE`` overrides applied (later ones win), checked like a file.

    A combination the checks refuse is reported against the config file and the overrides together.
    """
    if not overrides:
        return cfg
    raw = json.loads(json.dumps(cfg.to_dict(), default=list))
    for text in overrides:
        dotted, value = parse_override(text)
        if dotted == "name":
            raw["name"] = value
        else:
            section, _, key = dotted.partition(".")
            raw[section][key] = value
    where = f"{path if path is not None else 'config'} with {' '.join('--set ' + o for o in overrides)}"
    return config_from_dict(raw, where)


def check_config(cfg: RunConfig, path: str | os.PathLike[str] | None) -> None:
    m, d, p = cfg.model, cfg.data, cfg.pipeline
    problems = []
    if m.hidden_size % m.num_heads:
        problems.append("model.hidden_size must be a multiple of model.num_heads")
    if min(m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size) < 1:
        problems.append("model sizes must be positive")
    if m.vocab_size < 8:
        problems.append("model.vocab_size must be at least 8 (special tokens)")
    if d.seq_len > m.max_position:
        problems.append("data.seq_len must not exceed model.max_position")
    if min(d.seq_len, d.micro_batch_size, d.num_micro_batches) < 1:
        problems.append("data sizes must be positive")
    if not 0.0 < d.mask_prob <= 1.0:
        problems.append("data.mask_prob must be in (0, 1]")
    if p.order not in PIPELINE_ORDERS:
        problems.append(f"pipeline.order must be one of {', '.join(PIPELINE_ORDERS)}")
    if p.order == "chimera" and (p.stages % 2 or d.num_micro_batches % 2):
        problems.append("pipeline.order chimera needs an even number of stages and of "
                        "data.num_micro_batches (half of them run on each pipe)")
    if p.order == "interleaved":
        if isinstance(p.chunks, bool) or not isinstance(p.chunks, int) or p.chunks < 2:
            problems.append("pipeline.chunks must be an integer >= 2 (model chunks per device) with "
                            "pipeline.order interleaved")
        elif p.stages < 2:
            problems.append("pipeline.order interleaved needs pipeline.stages >= 2")
        elif refusal := _order_refusal(p.order, p.stages, d.num_micro_batches, p.chunks):
            problems.append(refusal)
        elif m.num_layers < p.stages * p.chunks:
            problems.append(f"pipeline.order interleaved needs model.num_layers >= pipeline.stages x "
                            f"pipeline.chunks ({p.stages} x {p.chunks} = {p.stages * p.chunks} model chunks)")
    if p.order in V_ORDERS:
        if p.chunks != 2 or isinstance(p.chunks, bool):
            problems.append(f"pipeline.order {p.order} has exactly 2 model chunks per device (its V): "
                            "pipeline.chunks must be 2")
        elif m.num_layers < 2 * p.stages:
            problems.append(f"pipeline.order {p.order} needs model.num_layers >= 2 x pipeline.stages "
                            f"({2 * p.stages} model chunks)")
        elif refusal := _order_refusal(p.order, p.stages, d.num_micro_batches, 2):
            problems.append(refusal)
    if not 1 <= p.stages <= m.num_layers:
        problems.append("pipeline.stages must be between 1 and model.num_layers")
    if p.timeout_s <= 0:
        problems.append("pipeline.timeout_s must be positive")
    if not 0 < p.grad_bucket_mb < float("inf"):
        problems.append("pipeline.grad_bucket_mb must be positive and finite")
    problems += _torch_engine_refusals(cfg)
    if d.text.strip() == "":
        problems.append("data.text must name a corpus ('stdlib', a file, a folder or a glob) or 'synthetic'")
    if d.objective not in OBJECTIVES:
        problems.append(f"data.objective must be one of {', '.join(OBJECTIVES)}")
    if d.objective == "clm" and d.seq_len < 2:
        problems.append("data.objective clm needs data.seq_len >= 2 (a next token to predict)")
    for key, spec in (("model.builder", m.builder), ("data.builder", d.builder)):
        if spec == "" and key == "data.builder":
            continue
        module, colon, func = spec.partition(":")
        if not colon or not module.strip() or not func.strip() or ":" in func:
            problems.append(f"{key} must be 'package.module:function', not {spec!r}")
    if d.dataset and d.dataset not in DATASET_FORMATS:
        problems.append(f"data.dataset must be one of {', '.join(DATASET_FORMATS)} (or empty: plain text files)")
    if d.dataset and d.builder:
        problems.append("data.builder and data.dataset are two sources of documents: set one")
    if d.builder and d.text == SYNTHETIC:
        problems.append("data.builder gives the documents, but data.text synthetic gives synthetic tokens "
                        "instead: set data.text to stdlib (the default), or leave data.builder empty")
    if d.dataset and d.text in (STDLIB, SYNTHETIC):
        problems.append(f"data.dataset {d.dataset} reads the local files data.text names, not {d.text!r}")
    if not d.column.strip():
        problems.append("data.column must name a column")
    t = cfg.train
    if t.precision not in PRECISIONS:
        problems.append(f"train.precision must be one of {', '.join(PRECISIONS)}")
    if not 0 < t.loss_scale < float("inf"):
        problems.append("train.loss_scale must be positive and finite")
    if t.recompute not in RECOMPUTE:
        problems.append(f"train.recompute must be one of {', '.join(RECOMPUTE)}")
    keep = cfg.checkpoint.keep
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        problems.append("checkpoint.keep must be an integer >= 1 (the newest checkpoints a run keeps)")
    if not isinstance(cfg.checkpoint.on_interrupt, bool):
        problems.append("checkpoint.on_interrupt must be true or false (checkpoint at the next step on Ctrl-C/SIGTERM)")
    if d.tokenizer not in TOKENIZERS:
        problems.append(f"data.tokenizer must be one of {', '.join(TOKENIZERS)}")
    if not 0.0 < d.val_fraction < 1.0:
        problems.append("data.val_fraction must be in (0, 1)")
    if d.val_batches < 0:
        problems.append("data.val_batches must be >= 0")
    o = cfg.optim
    if o.name not in OPTIMIZERS:
        problems.append(f"optim.name must be one of {', '.join(OPTIMIZERS)}")
    if o.lr_schedule not in LR_SCHEDULES:
        problems.append(f"optim.lr_schedule must be one of {', '.join(LR_SCHEDULES)}")
    if o.lr <= 0 or o.eps <= 0 or o.weight_decay < 0 or o.clip_norm < 0:
        problems.append("optim.lr and optim.eps must be > 0, optim.weight_decay and optim.clip_norm >= 0")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        problems.append("optim.betas must be two numbers in [0, 1)")
    if not 0.0 <= o.momentum < 1.0 or not 0.0 <= o.min_lr_ratio <= 1.0:
        problems.append("optim.momentum must be in [0, 1) and optim.min_lr_ratio in [0, 1]")
    if o.warmup_steps < 0 or o.decay_steps < 0:
        problems.append("optim.warmup_steps and optim.decay_steps must be >= 0")
    if not 0.0 <= o.muon_momentum < 1.0:
        problems.append("optim.muon_momentum must be in [0, 1)")
    for key in ("muon_include", "muon_exclude"):
        if any(not part.strip() or part != part.strip() for part in getattr(o, key)):
            problems.append(f"optim.{key} must list parameter-name parts (e.g. embeddings, lm_head, "
                            f"encoder.layer.0), not {list(getattr(o, key))!r}")
    k = cfg.kfac
    if k.interval < 1 or not k.damping > 0 or not 0 <= k.damping_min <= k.damping:
        problems.append("kfac.interval must be >= 1, kfac.damping > 0 and kfac.damping_min in [0, damping]")
    decay = k.factor_decay
    if not 0.0 < k.damping_decay <= 1.0 or decay is not None and (
            isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0):
        problems.append("kfac.damping_decay must be in (0, 1] and kfac.factor_decay in [0, 1)")
    if k.kl_clip < 0 or k.lr <= 0 or not 0.0 <= k.momentum < 1.0:
        problems.append("kfac.kl_clip must be >= 0, kfac.lr > 0 and kfac.momentum in [0, 1)")
    if not isinstance(k.cov_stride, int) or k.cov_stride < 1:
        problems.append("kfac.cov_stride must be an integer >= 1")
    m = k.cov_micro_batches
    if m != "all" and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        problems.append(f"kfac.cov_micro_batches must be an integer >= 1 or all, not {m!r}")
    elif m != "all" and m > cfg.data.num_micro_batches:
        problems.append(f"kfac.cov_micro_batches {m} is more than the step's {cfg.data.num_micro_batches} "
                        "micro-batches (data.num_micro_batches); all takes every one")
    pieces = k.refresh_pieces
    if pieces not in ("auto", BEST_PIECES) and (isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1):
        problems.append(f"kfac.refresh_pieces must be an integer >= 1, auto or best, not {pieces!r}")
    elif pieces == BEST_PIECES and k.update != "soap" and k.inverse != "cholesky":
        problems.append(f"kfac.refresh_pieces: best tries refreshes in more than 1 piece, which need kfac.inverse "
                        f"cholesky (or kfac.update soap): an {k.inverse} refresh is one eigh, not split into pieces")
    elif pieces not in (1, "auto", BEST_PIECES) and k.update != "soap" and k.inverse != "cholesky":
        problems.append(f"kfac.refresh_pieces > 1 needs kfac.inverse cholesky (or kfac.update soap): an "
                        f"{k.inverse} refresh is one eigh, not split into pieces")
    problems += _eigenbasis_problems(k)
    if k.update == "soap" and k.kl_clip > 0:
        problems.append("kfac.kl_clip bounds a preconditioned step; kfac.update: soap takes Adam's step in "
                        "the factors' eigenbasis, which it does not apply to: set kl_clip 0")
    if k.update == "soap" and k.inverse != KfacConfig.inverse:
        problems.append(f"kfac.inverse: {k.inverse} chooses how a damped inverse is formed; kfac.update: soap "
                        f"forms none (a refresh keeps the factors' eigenbasis): leave kfac.inverse unset")
    for key, allowed in (("update", UPDATES), ("fisher", FISHERS), ("inverse", INVERSES),
                         ("inverse_dtype", ("float32", "float64")), ("on_bad_factor", ON_BAD_FACTOR),
                         ("save_dtype", SAVE_DTYPES)):
        if getattr(k, key) not in allowed:
            problems.append(f"kfac.{key} must be one of {', '.join(allowed)}")
    if problems:
        raise InputError(path, "; ".join(problems))


def load_config(path: str | os.PathLike[str]) -> RunConfig:
    """Read a YAML config file."""
    from pipefisher.safe_io import load_yaml

    return config_from_dict(load_yaml(path), path)


def torch_rounds(micro_batches: int, stages: int) -> int:
    """The rounds torch's interleaved and zero-bubble H1 schedule classes split a step's micro-batches
    into: ``max(1, m // stages)``; torch refuses a micro-batch count they do not divide."""
    return max(1, micro_batches // stages)


def _torch_engine_refusals(cfg: RunConfig) -> list[str]:
    """What ``pipeline.engine`` refuses: an unknown engine, or what the torch engine cannot run (orders
    torch has no schedule class for, the true Fisher's extra backward, one stage, and
    micro-batch counts torch's zero-bubble H1 does not split into rounds)."""
    p = cfg.pipeline
    if p.engine not in ENGINES:
        return [f"pipeline.engine must be one of {', '.join(ENGINES)}"]
    if p.engine != "torch":
        return []
    out = []
    if p.order not in TORCH_ENGINE_ORDERS:
        out.append(f"pipeline.engine torch runs pipeline.order {', '.join(TORCH_ENGINE_ORDERS)}, not {p.order}")
    elif p.order == "zb-h1" and cfg.data.num_micro_batches % torch_rounds(cfg.data.num_micro_batches, p.stages):
        m = cfg.data.num_micro_batches
        out.append(f"pipeline.engine torch with zb-h1 needs data.num_micro_batches a multiple of "
                   f"max(1, num_micro_batches // pipeline.stages) = {torch_rounds(m, p.stages)} (torch's rounds), not {m}")
    if cfg.kfac.fisher != "empirical":
        out.append("pipeline.engine torch needs kfac.fisher empirical (the true Fisher's sampled backward "
                   "runs in pipefisher's engine only)")
    if p.stages < 2:
        out.append("pipeline.engine torch needs pipeline.stages >= 2 (torch pipelines across processes)")
    return out


def _order_refusal(schedule: str, stages: int, micro_batches: int, chunks: int) -> str | None:
    """Why the order's generator (the one source of the order) refuses this shape, or None: interleaved
    takes the micro-batch counts torch's ScheduleInterleaved1F1B takes, multiples of the stages or not;
    dualpipev needs at least 2 per stage, as torch's ScheduleDualPipeV."""
    from pipefisher.pipeline_orders import generate

    try:
        generate(schedule, stages, micro_batches, chunks)
    except InputError as err:
        return f"pipeline.order {schedule} with data.num_micro_batches {micro_batches}: {err.problem}"
    return None
