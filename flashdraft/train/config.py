"""The configuration of a training run: every option that decides what it computes (`flashdraft train`'s flags,
`--config` keys, the API's `TrainConfig`), written to RUN/run_config.json."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from flashdraft.train.recipe import Recipe


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides what a run computes; written to RUN/run_config.json. Never changed once built: a run
    computes with `with_recipe(...)` and `recording(...)`'s copies, the caller's stays as given."""

    # None: the recipe's (`with_recipe`, `recipe.py`): the published one, or the tiny target's on `tiny`
    epochs: int | None = None  # whole epochs, when no --max-steps is given
    max_steps: int | None = None  # the steps run, over as many epochs as they take
    lr: float | None = None
    warmup_fraction: float = 0.04
    min_lr_fraction: float = 0.0
    weight_decay: float = 0.0
    # "muon": Muon on the layers' and fc's matrices, AdamW on the rest (with D-PACE 1.11x / 1.09x the held-out
    # tau of AdamW at equal steps, docs/benchmarks.md); "adamw": AdamW for all (the published recipe; --fsdp)
    optimizer: str = "muon"
    muon_lr: float | None = None  # Muon's lr (None: lr; its update is scaled to AdamW's RMS)
    grad_clip: float = 1.0
    batch_size: int = 4  # sequences per micro-batch per rank
    grad_accum: int = 1
    num_anchors: int | None = None  # anchors (blocks) sampled per sequence
    max_length: int | None = None
    # packed training: records packed into rows of exactly this many context tokens (`train.packing`); None: one
    # record per row, padded to a length bucket. Off by default: it changes what --batch-size counts (rows) and how
    # many steps an epoch has, so a recipe's settings would mean something else
    pack_length: int | None = None
    # per-position weights: "dpace" (dpace_alpha; measured 1.10-1.13x the held-out tau of "decay" at equal
    # steps, docs/benchmarks.md) or "decay" (loss_decay_gamma, the published recipe)
    loss_weighting: str = "dpace"
    loss_decay_gamma: float | None = None  # None or 0: no decay (run_training fills in the recipe's for None)
    dpace_alpha: float = 0.5  # D-PACE smoothing: q~ = (1 - alpha) q + alpha
    kl_weight: float = 0.0  # opt-in soft-label KL to the stored top-k target logits
    # DFlash2: weight of the candidate selector's cross-entropy, and what to do with a label outside the
    # unary top-K ("inject" it into the candidates, or "skip" the position; docs/benchmarks.md compares them)
    selector_loss_weight: float = 0.3  # measured best of 0.1 / 0.3 / 1 / 3 from scratch and from a DFlash drafter
    selector_missing_label: str = "inject"
    # DSpark: the paper's loss terms (0.1 CE + 0.9 |p_draft - p_target|_1 + 1.0 confidence BCE; `loss.DSparkLoss`)
    dspark_ce_weight: float = 0.1
    dspark_tv_weight: float = 0.9
    confidence_loss_weight: float = 1.0
    noise_std: float = 0.0  # Gaussian noise on context features (never on labels)
    seed: int = 0
    save_every: int = 200
    keep_checkpoints: int = 3
    log_every: int = 10
    eval_every: int = 0
    eval_max_blocks: int = 32  # speculative steps per held-out record for the real (offline) τ
    keep_best: bool = False  # also keep RUN/best/: the drafter of the best held-out τ (held-out loss without τ)
    fsdp: bool = False
    # the step's forward and loss chunks under torch.compile, one graph per batch shape (`train.compiled`); None:
    # where it pays (CUDA; on CPU the compile outweighs the gain at the sizes trained there)
    compile: bool | None = None
    # the drafter's RoPE scaling for this run (stage 2 of the long-context recipe: YaRN on a warm start); None: the
    # drafter's own; {"rope_type": "default"}: native RoPE
    rope_scaling: dict | None = None
    # filled in at start (`recording`), for the record (not options)
    target_layer_ids: list[int] = field(default_factory=list, metadata={"recorded": True})
    mask_token_id: int = field(default=-1, metadata={"recorded": True})
    block_size: int = field(default=0, metadata={"recorded": True})
    first_draft_position: int = field(default=1, metadata={"recorded": True})  # the layout: 0 anchor-first (DSpark)
    data_fingerprint: str = field(default="", metadata={"recorded": True})
    target_fingerprint: str = field(default="", metadata={"recorded": True})
    # the target's quantisation (flashdraft.target.quantisation): the scheme whose states the drafter learnt from
    target_quantisation: dict | None = field(default=None, metadata={"recorded": True})

    @classmethod
    def option_names(cls) -> list[str]:
        """The fields a user chooses (`flashdraft train` has an option for each)."""
        return [f.name for f in fields(cls) if not f.metadata.get("recorded")]

    def with_recipe(self, recipe: Recipe) -> tuple[TrainConfig, list[str]]:
        """This configuration with the fields left None taken from `recipe`, and their names. The step budget is
        the recipe's only where neither --epochs nor --max-steps was given."""
        filled = {name: getattr(recipe, name) for name in ("lr", "num_anchors") if getattr(self, name) is None}
        if self.epochs is None and self.max_steps is None:
            filled |= {"epochs": recipe.epochs, "max_steps": recipe.max_steps}
        named = [name for name in ("lr", "num_anchors") if name in filled]
        if "max_steps" in filled:
            named.append("max_steps" if recipe.max_steps is not None else "epochs")
        return replace(self, **filled), named

    def recording(self, **recorded) -> TrainConfig:
        """This configuration with its recorded fields (the drafter's layout, the fingerprints) set."""
        options = set(recorded) & set(self.option_names())
        if options:
            raise ValueError(f"recording: {sorted(options)} are options, not recorded fields")
        return replace(self, **recorded)


# settings a resumed run may change: they decide how long it runs and what it writes, not what it computes
RESUMABLE_CHANGES = (
    "max_steps",
    "epochs",
    "save_every",
    "log_every",
    "eval_every",
    "keep_checkpoints",
    "keep_best",
    "compile",  # the same step, compiled or not: equal to float rounding
)
