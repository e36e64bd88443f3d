"""`flashdraft cache`'s run: the layers to store resolved (from the flags or a drafter's config), the target loaded,
the cache built (`cache.build_cache`) or, with `--engine vllm`, captured by the engine and checked
(`engine_capture`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.data.cache import AUTO, LOCK, CacheSpec, build_cache
from flashdraft.drafter.config import LAYER_ORDER_RULE, strictly_increasing
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel

DSPARK_TARGET_LOGITS = 64  # a DSpark drafter's default loss (TV to the target's distribution) reads these


def drafter_layer_ids(path: str | Path) -> tuple[list[int], Any]:
    """target_layer_ids (and the config itself) of a drafter directory or a shipped drafter's
    name (`tiny-drafter`), a training run or checkpoint, or a config.json."""
    from flashdraft.drafter.config import DrafterConfig
    from flashdraft.drafter.run_dir import drafter_config_path

    config = DrafterConfig.load(drafter_config_path(path))
    return list(config.target_layer_ids), config


def resolve_layer_ids(target: TargetModel, layers: list[int] | None, draft_config: str | None) -> list[int]:
    """--layers, or a drafter's target_layer_ids (checked against the target), or the
    reference default for a drafter of up to 5 layers."""
    from flashdraft.drafter.config import default_target_layer_ids

    if layers is not None and draft_config is not None:
        raise FlashdraftError("give --layers or --draft-config, not both")
    if layers is not None:
        target.set_context_layers(layers)  # validates the range
        if not layers or not strictly_increasing(list(layers)):
            # a cache stores layers in the order a drafter (and a server) reads them
            raise FlashdraftError(f"--layers {','.join(map(str, layers))}: expected {LAYER_ORDER_RULE}")
        return list(layers)
    if draft_config is not None:
        ids, config = drafter_layer_ids(draft_config)
        if config.num_target_layers != target.num_layers or config.hidden_size != target.hidden_size:
            raise FlashdraftError(
                f"{draft_config}: drafter made for a target with {config.num_target_layers} layers and hidden size "
                f"{config.hidden_size}; this target has {target.num_layers} and {target.hidden_size}"
            )
        return ids
    # the reference default for the deepest drafter, up to the usual 5 layers, whose ids stay distinct
    for n in range(min(5, target.num_layers), 0, -1):
        try:
            ids = default_target_layer_ids(target.num_layers, n)
        except FlashdraftError:
            continue
        print(f"layers {ids}: the reference default for a {n}-layer drafter (choose with --layers or --draft-config)")
        return ids
    raise AssertionError("n = 1 always has a default")


@dataclass(frozen=True)
class CacheConfig:
    """The inputs of `flashdraft cache` (its flags; the API's keyword arguments), built once."""

    target_model: str
    completions: str
    out: str
    layers: list[int] | None = None  # the target layers to store; None: those of draft_config
    draft_config: str | None = None  # a drafter (init's output) whose layers the cache holds
    num_prompts: int | None = None
    dtype: str = AUTO
    # the target's top-k logits; None: none, unless draft_config is a DSpark drafter (DSPARK_TARGET_LOGITS)
    with_target_logits: int | None = None
    records_per_shard: int = 64
    allow_foreign: bool = False
    device: str | None = None
    target_dtype: str | None = None
    verbose: bool = False
    force: bool = False  # write even when the estimate says the filesystem cannot hold the cache
    # "vllm": the states captured by the serving engine (`engine_capture`) and checked against the target
    engine: str | None = None
    engine_python: str | None = None
    verify_share: float = 0.05  # with an engine: the share of samples recomputed with the target
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = False

    def check_engine_options(self) -> None:
        """The engine's options mean nothing without it: refused by name."""
        if self.engine not in (None, "vllm"):
            raise FlashdraftError(f"--engine {self.engine}: expected vllm")
        engine_only = {"engine_python": None, "tensor_parallel_size": 1, "enable_prefix_caching": False}
        for name, default in engine_only.items():
            if self.engine is None and getattr(self, name) != default:
                raise FlashdraftError(
                    f"--{name.replace('_', '-')} is an option of --engine vllm; this run caches with "
                    f"the transformers forward"
                )


def run_cache(config: CacheConfig) -> Path:
    """`flashdraft cache` without an engine, one rank of it under torchrun: the target's forward over every record."""
    from flashdraft.data.completions import load_completions
    from flashdraft.distributed import init_distributed, load_dtype, lock_on_main, pick_device

    c = config
    c.check_engine_options()
    dist = init_distributed()
    lock = None
    try:
        # before the target loads (minutes for a large one): a second writer of OUT is refused at once
        lock = lock_on_main(dist, Path(c.out) / LOCK, Path(c.out), "flashdraft cache")
        dev = pick_device(dist, c.device)
        target = TargetModel.load(c.target_model, dev, load_dtype(dev, c.target_dtype))
        layer_ids = resolve_layer_ids(target, c.layers, c.draft_config)
        topk = _target_logits(c, dist.is_main)
        loaded = load_completions(c.completions, target, allow_foreign=c.allow_foreign, quiet=not dist.is_main)
        spec = CacheSpec(layer_ids, c.dtype, c.records_per_shard, topk, c.num_prompts)
        return build_cache(target, loaded, c.out, spec, dist, c.force, verbose=c.verbose)
    finally:
        if lock is not None:
            lock.release()
        dist.close()


def _target_logits(config: CacheConfig, say: bool) -> int:
    """How many of the target's top logits to store: --with-target-logits, else a DSpark drafter's default."""
    if config.with_target_logits is not None:
        return config.with_target_logits
    if config.draft_config is not None and drafter_layer_ids(config.draft_config)[1].family == "dspark":
        if say:
            print(
                f"{config.draft_config} is a DSpark drafter: storing the target's top {DSPARK_TARGET_LOGITS} "
                f"logits its loss reads (--with-target-logits 0 to leave them out)"
            )
        return DSPARK_TARGET_LOGITS
    return 0
