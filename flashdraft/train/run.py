"""`flashdraft train`: compose target, data, drafter and the loop from command-line choices."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from flashdraft.distributed import init_distributed, load_dtype
from flashdraft.drafter.checkpoint import check_drafter_matches_target, load_drafter
from flashdraft.drafter.config import DEFAULT_BLOCK_SIZE
from flashdraft.drafter.init import DrafterChoices, new_drafter_for_target, with_rope_scaling
from flashdraft.drafter.model import DFlashDrafter
from flashdraft.drafter.rope import describe_scaling
from flashdraft.drafter.run_dir import latest_checkpoint, load_any_drafter, verify_checkpoint
from flashdraft.errors import FlashdraftError
from flashdraft.target.model import TargetModel
from flashdraft.target.weights import TargetHead
from flashdraft.train.config import TrainConfig
from flashdraft.train.data import OnlineRecords
from flashdraft.train.engine_feed import EngineFeedConfig, engine_fed
from flashdraft.train.loop import HeldOut, LoopOptions, train
from flashdraft.train.loss import recipe_decay_gamma
from flashdraft.train.recipe import recipe_for
from flashdraft.train.vocab import draft_vocabulary, with_draft_vocabulary


@dataclass
class SequenceRecord:
    """A completion as a training sequence (online mode computes its features on the fly)."""

    input_ids: torch.Tensor  # [T] prompt + completion
    # [T] True on the completion's tokens: the target's own, reasoning and answer; never a token the chat template
    # wrote (its generation prompt, the empty think block of a non-thinking mode: those end the prompt)
    loss_mask: torch.Tensor
    chat_template_kwargs: dict | None = None  # the record's chat mode (`data/chat_mode.py`)
    reasoning_end: int | str | None = None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# the target's top logits kept per position when it runs in the loop for a DSpark drafter's distribution terms
ONLINE_TARGET_TOPK = 256


def load_training_records(
    target: TargetModel,
    layer_ids: list[int],
    cached: str | None,
    completions: str | None,
    allow_foreign: bool = False,
    verify: bool = True,
    online_topk: int = 0,
):
    """Training records and a fingerprint of the data they come from (online: with the target's top-`online_topk`
    logits at every position when > 0)."""
    if cached:
        from flashdraft.data.cache import MANIFEST
        from flashdraft.data.cache_reader import HiddenStateCache

        cache = HiddenStateCache(cached, verify=verify)
        cache.check_compatible(target, layer_ids)
        return cache, _digest(Path(cached) / MANIFEST)
    from flashdraft.data.completions import load_completions

    comps = load_completions(completions, target, allow_foreign=allow_foreign)
    sequences = []
    for r in comps.records:
        ids = torch.tensor(r.prompt_ids + r.completion_ids)
        sequences.append(
            SequenceRecord(ids, torch.arange(len(ids)) >= len(r.prompt_ids), r.chat_template_kwargs, r.reasoning_end)
        )
    return OnlineRecords(sequences, target, layer_ids, min(online_topk, target.vocab_size)), _digest(Path(completions))


def _check_fp16_range(records, target, layer_ids: list[int], probes: int = 4) -> None:
    """An fp16 target training online: its states on the first `probes` records must stay within fp16's range,
    checked before any step (an overflow names the layer and the largest value; `flashdraft.target.overflow`)."""
    if not isinstance(records, OnlineRecords) or target.dtype != torch.float16:
        return
    from flashdraft.target.overflow import fp16_overflow

    target.set_context_layers(layer_ids)
    for k, record in enumerate(records.records[:probes]):
        features = target.forward(record.input_ids[None].to(target.device)).context_features[0]
        overflow = fp16_overflow(features, layer_ids, target.hidden_size)
        if overflow is not None:
            raise FlashdraftError(overflow.line(f"training record {k}", "float16"))


def data_mode_mix(records) -> dict | None:
    """The chat mode mix of training records (a cache's manifest rows or online sequences), `chat_mode.mode_mix`."""
    from flashdraft.data.chat_mode import mode_mix

    if isinstance(records, OnlineRecords):
        return mode_mix(
            [
                {
                    "chat_template_kwargs": r.chat_template_kwargs,
                    "reasoning_end": r.reasoning_end,
                    "completion_tokens": int(r.loss_mask.sum()),
                }
                for r in records.records
            ]
        )
    return mode_mix(
        [dict(r, completion_tokens=r["length"] - r["prompt_length"]) for r in records.manifest.get("records", [])]
    )


def _record_mode(drafter: DFlashDrafter, records, resumed: bool, main: bool) -> None:
    """The drafter's config records the chat mode mix it was trained on (`trained_chat_mode`; over the drafter it
    started from with --init; a resumed run's checkpoint holds it already)."""
    from flashdraft.data.chat_mode import combine_mixes, describe_mix
    from flashdraft.serving.chat_mode import TRAINED_MODE

    extra = drafter.config.extra
    if not resumed:
        mix = combine_mixes(extra.get(TRAINED_MODE), data_mode_mix(records))
        if mix is not None:
            extra[TRAINED_MODE] = mix
    if extra.get(TRAINED_MODE) and main:
        print(f"chat mode trained on: {describe_mix(extra[TRAINED_MODE])}", flush=True)


def eval_tau_records(
    cached: str | None, completions: str | None, target: TargetModel, allow_foreign: bool, verify: bool = True
) -> list:
    """Held-out records for the real τ (the offline evaluator)."""
    from flashdraft.evaluation.records import EvalRecord, records_from_cache

    if cached:
        from flashdraft.data.cache_reader import HiddenStateCache

        return records_from_cache(HiddenStateCache(cached, verify=verify))
    from flashdraft.data.completions import load_completions

    comps = load_completions(completions, target, allow_foreign=allow_foreign, quiet=True)
    return [EvalRecord(r.id, r.prompt_ids, r.completion_ids) for r in comps.records]


def _check_agrees(config, source: str, **given) -> None:
    """Options given with an existing drafter must say what its config says: a silently
    ignored --block-size would train (and report) something other than what was asked."""
    found = {
        "draft_layers": config.num_hidden_layers,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": config.target_layer_ids,
    }
    for name, value in given.items():
        if value is not None and value != found[name]:
            flag = "--" + name.replace("_", "-")
            raise FlashdraftError(
                f"{flag} {value} conflicts with {source}, whose config.json has {found[name]}; drop {flag} "
                f"(the drafter's config decides) or start a new run without it"
            )


def _starting_drafter(
    target: TargetModel,
    resume_from: Path | None,
    init: str | None,
    shape: dict,
    seed: int,
    verify: bool,
    rope_scaling: dict | None = None,
) -> DFlashDrafter:
    """The newest complete checkpoint of `resume_from`, else `init` (its weights only: the loop starts a fresh
    optimizer and schedule), else a fresh drafter of `shape` (draft_layers, block_size, mask_token_id,
    target_layer_ids; None: the default); under `rope_scaling` when given (None: the drafter's own)."""
    last = latest_checkpoint(resume_from) if resume_from is not None else None
    if last is not None:
        if verify:
            verify_checkpoint(last, only="drafter/")  # the loop verifies the rest with the optimizer state
        drafter = load_drafter(last / "drafter")  # weights are restored again by the loop, with the optimizer
        source = f"{last / 'drafter'} (--resume)"
    elif init:
        drafter, source = load_any_drafter(init, target, verify=verify).drafter, f"{init} (--init)"
    else:
        choices = DrafterChoices(
            num_layers=shape["draft_layers"] or 1,
            block_size=shape["block_size"] or DEFAULT_BLOCK_SIZE,
            mask_token_id=shape["mask_token_id"],
            target_layer_ids=shape["target_layer_ids"],
        )
        drafter = new_drafter_for_target(target, choices, seed)
        source = None
    if source is not None:
        check_drafter_matches_target(drafter.config, target, source)
        _check_agrees(drafter.config, source, **shape)
    return drafter if rope_scaling is None else with_rope_scaling(drafter, rope_scaling)


def _with_vocabulary(
    drafter: DFlashDrafter, size: int | None, records, target, cfg: TrainConfig, dist
) -> DFlashDrafter:
    """The drafter with the reduced vocabulary `--draft-vocab-size` asks for (chosen from the
    training records), or as it is; one it already has must agree."""
    have = drafter.config.draft_vocab_size
    if size is not None and have is not None and have != size:
        raise FlashdraftError(
            f"--draft-vocab-size {size}: the drafter already has its own vocabulary of {have} (field "
            f"'draft_vocab_size'); expected the same size or no flag"
        )
    if size is not None and have is None:
        ids = draft_vocabulary(records, size, target.vocab_size, [drafter.config.mask_token_id, *target.stop_token_ids])
        if dist.is_main:
            print(
                f"draft vocabulary: the {size} most frequent of the {target.vocab_size} target tokens in the "
                f"training completions (mask and stop tokens included)",
                flush=True,
            )
        drafter = with_draft_vocabulary(drafter, ids, target.lm_head_weight)
    have = drafter.config.draft_vocab_size
    if have is not None and (cfg.fsdp or cfg.kl_weight > 0):
        raise FlashdraftError(
            f"draft_vocab_size {have}: a drafter with its own LM head trains without --fsdp and --kl-weight "
            f"(its head runs outside the sharded forward; the stored top-k logits are over the full vocabulary)"
        )
    return drafter


def _held_out_records(
    target: TargetModel,
    layer_ids: list[int],
    cached: str | None,
    completions: str | None,
    allow_foreign: bool,
    verify: bool,
    online_topk: int,
) -> tuple:
    """The held-out set, if one is given: as training records (loss, estimated acceptance) and as evaluation records
    (the real offline τ); (None, None) without one."""
    if not (cached or completions):
        return None, None
    records, _ = load_training_records(
        target,
        layer_ids,
        cached,
        completions=completions,
        allow_foreign=allow_foreign,
        verify=verify,
        online_topk=online_topk,
    )
    return records, eval_tau_records(cached, completions, target, allow_foreign, verify)


def _refuse_without_target_distribution(cfg: TrainConfig, cached_hidden_states: str | None) -> None:
    """A DSpark drafter's distribution terms read the target's logits, which this cache does not hold."""
    raise FlashdraftError(
        f"{cached_hidden_states}: holds no target logits; a DSpark drafter's loss needs the target's "
        f"distribution at every label (--dspark-tv-weight {cfg.dspark_tv_weight}, --confidence-loss-weight "
        f"{cfg.confidence_loss_weight}); expected a cache made with flashdraft cache --with-target-logits K, "
        f"online training (--completions), or both weights 0 (hard CE only)"
    )


def _describe_run(target: TargetModel, drafter: DFlashDrafter, num_records: int, source: str) -> str:
    """The line a run starts with: target, drafter and data."""
    return (
        f"target {target.path}: {target.num_layers} layers, linear-attention backend {target.linear_backend}; "
        f"drafter {drafter.config.num_hidden_layers} layers, context layers {drafter.config.target_layer_ids}, block "
        f"size {drafter.config.block_size}, mask token {drafter.config.mask_token_id}, RoPE "
        f"{describe_scaling(drafter.config.rope_scaling)}, trained context so far "
        f"{drafter.config.trained_context_length or 'none recorded'}; {num_records} records "
        f"({source})"
    )


def _run_config(
    cfg: TrainConfig, target_model: str, drafter: DFlashDrafter, data_fingerprint: str, main: bool
) -> TrainConfig:
    """The configuration the run computes with: the options no flag set from the target's recipe (`recipe.py`,
    said in one line), a loss decay gamma of None made the recipe's for the block size (7 for 16; 0 = none), and the
    training data's fingerprint recorded."""
    recipe = recipe_for(target_model)
    cfg, chosen = cfg.with_recipe(recipe)
    if main and chosen:
        print(f"defaults: {recipe.describe()} for {', '.join(chosen)} (set by no flag)", flush=True)
    gamma = cfg.loss_decay_gamma
    if gamma is None:
        gamma = recipe_decay_gamma(drafter.config.block_size, drafter.config.family)
    return replace(cfg, loss_decay_gamma=gamma).recording(data_fingerprint=data_fingerprint)


def _loss_reads_target(cfg: TrainConfig, drafter: DFlashDrafter) -> bool:
    """Whether the loss reads the target's distribution: a DSpark drafter's TV or confidence terms."""
    dspark = drafter.config.family == "dspark"
    return dspark and (cfg.dspark_tv_weight > 0 or cfg.confidence_loss_weight > 0)


def _check_loss_inputs(cfg: TrainConfig, records, needs_target: bool, source: str) -> None:
    """The target's logits there where the loss reads them (DSpark's terms, --kl-weight)."""
    if needs_target and not getattr(records, "topk", 0):
        _refuse_without_target_distribution(cfg, source)
    if cfg.kl_weight > 0 and not getattr(records, "topk", 0):
        raise FlashdraftError(
            f"--kl-weight {cfg.kl_weight}: {source} holds no target logits; "
            f"expected a cache made with flashdraft cache --with-target-logits K (or --kl-weight 0, the recipe)"
        )


def _drop_frame_locals(error: BaseException) -> None:
    """The traceback keeps the loop's frame, and with it DDP and its buffers, alive past the process group's end;
    their destructors then wait on a group that is gone (a rank that stopped on SIGTERM hung at exit): drop the
    frames' locals first (the trace stays)."""
    traceback.clear_frames(error.__traceback__)
    gc.collect()


@dataclass(frozen=True)
class TrainRun:
    """Where a training run reads and writes, and the drafter it starts from: `flashdraft train`'s flags beside
    `TrainConfig`'s (which decide what it computes)."""

    target_model: str
    out: str  # the run directory
    cached_hidden_states: str | None = None  # offline: a hidden-state cache
    completions: str | None = None  # online: the target runs in the loop
    init: str | None = None  # a drafter to start from (`flashdraft init`'s, or any drafter)
    # a fresh drafter's shape (None: 1 layer, block 16, the target's mask token, the reference spread)
    draft_layers: int | None = None
    block_size: int | None = None
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    eval_cached_hidden_states: str | None = None
    eval_completions: str | None = None
    resume: bool = False
    report_to: tuple[str, ...] = ()
    allow_foreign: bool = False
    device: str | None = None
    verify: bool = True  # check the sha256 of caches and of the checkpoint resumed from
    target_dtype: str | None = None  # fp32 on CPU, bf16 on GPU
    draft_vocab_size: int | None = None
    engine_feed: EngineFeedConfig | None = None  # with completions: the serving engine computes the states


def run_training(cfg: TrainConfig, run: TrainRun) -> Path:
    """`flashdraft train`. The drafter is the newest complete checkpoint (`run.resume`), else `run.init`, else a
    fresh one of the run's shape (which must agree with a given one's config). The target loads whole only when it
    runs in the loop (completions), else only its head (`TargetHead`)."""
    if bool(run.cached_hidden_states) == bool(run.completions):
        raise FlashdraftError("give exactly one of --cached-hidden-states (offline) or --completions (online)")
    if run.engine_feed and not run.completions:
        raise FlashdraftError("--engine vllm feeds training from --completions; expected --completions FILE")
    dist = init_distributed(run.device, collectives=True)
    try:
        # the target computes features in the loop (not when the engine does)
        online = bool((run.completions and not run.engine_feed) or run.eval_completions)
        dtype = load_dtype(dist.device, run.target_dtype)
        target = (TargetModel if online else TargetHead).load(run.target_model, device=dist.device, dtype=dtype)
        run_dir = Path(run.out)
        shape = dict(
            draft_layers=run.draft_layers,
            block_size=run.block_size,
            mask_token_id=run.mask_token_id,
            target_layer_ids=run.target_layer_ids,
        )
        drafter = _starting_drafter(
            target, run_dir if run.resume else None, run.init, shape, cfg.seed, run.verify, cfg.rope_scaling
        )
        layer_ids = drafter.config.target_layer_ids
        needs_target = _loss_reads_target(cfg, drafter)
        online_topk = ONLINE_TARGET_TOPK if needs_target else 0
        records, data_fingerprint = load_training_records(
            target, layer_ids, run.cached_hidden_states, run.completions, run.allow_foreign, run.verify, online_topk
        )
        _check_loss_inputs(cfg, records, needs_target, run.cached_hidden_states or run.completions)
        _check_fp16_range(records, target, layer_ids)
        drafter = _with_vocabulary(drafter, run.draft_vocab_size, records, target, cfg, dist)
        _record_mode(drafter, records, resumed=run.resume and latest_checkpoint(run_dir) is not None, main=dist.is_main)
        eval_records, tau_records = _held_out_records(
            target,
            layer_ids,
            run.eval_cached_hidden_states,
            run.eval_completions,
            run.allow_foreign,
            run.verify,
            online_topk,
        )
        if dist.is_main:
            source = "offline cache" if run.cached_hidden_states else "online target features"
            source = "states from the serving engine" if run.engine_feed else source
            print(_describe_run(target, drafter, len(records), source), flush=True)
        cfg = _run_config(cfg, run.target_model, drafter, data_fingerprint, dist.is_main)
        with contextlib.ExitStack() as stack:
            if run.engine_feed:
                records = stack.enter_context(
                    engine_fed(run.engine_feed, records, run.target_model, layer_ids, run_dir, dtype, dist.is_main)
                )
            train(
                cfg,
                drafter,
                target,
                records,
                run_dir,
                held_out=HeldOut(records=eval_records, tau_records=tau_records),
                options=LoopOptions(resume=run.resume, report_to=run.report_to, verify=run.verify),
                dist=dist,
            )
        final = latest_checkpoint(run_dir)
        if dist.is_main:
            print(f"done: drafter in {final / 'drafter'}", flush=True)
        return final
    except BaseException as e:
        _drop_frame_locals(e)
        raise
    finally:
        dist.close()
