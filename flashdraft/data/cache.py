"""The hidden-state cache a drafter trains on: its on-disk format and its builder (`flashdraft cache`'s run is
`data/cache_run.py`).

The target runs once over prompt + completion of every record; per token the cache keeps
the input id, the loss mask (True on completion tokens) and the context features of
exactly the requested layers: the outputs of decoder layers `layer_ids` (the
`hidden_states[l + 1]` convention), concatenated in listed order, cast to the cache dtype:
by default (`auto`) the dtype the target computed them in, so offline features are exactly
the ones live decoding feeds the drafter and offline τ equals live τ step for step.
Optionally the target's top-k final-layer logits, in files of their own.

Layout of DIR (field by field in docs/data-formats.md):

    manifest.json                 written last: settings, shards with sha256, records
    shard-00000.safetensors       input_ids [N] int32, loss_mask [N] bool, context_features [N, n * H]
    topk-00000.safetensors        values [N, k] float32, indices [N, k] int32 (--with-target-logits k)
    .progress/                    while building: settings.json, shard-00000.json per finished shard
    .lock                         while a run writes: its pid and host (`flashdraft.files.OutputLock`)

Shard k holds records [k * R, (k + 1) * R) concatenated on the token axis. A shard is
written to a temporary file and renamed, then its `.progress` entry is written: a killed
run leaves either a finished shard or nothing, and a re-run redoes only unfinished
shards. Under torchrun rank r builds the shards k with k % world == r; rank 0 writes the
manifest. Results do not depend on the number of ranks: shard contents are fixed by R.

The format's facts (names, dtypes, tolerances) live here, with the writer; the reader
(`cache_reader.HiddenStateCache`) and the checks (`cache_doctor.doctor_cache`) import them.
"""

from __future__ import annotations

import hashlib
import json
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashdraft.data.completions import CompletionRecord, Completions
from flashdraft.distributed import Dist, any_rank, on_main
from flashdraft.errors import FlashdraftError, Interrupted
from flashdraft.files import (
    DiskFullError,
    format_bytes,
    free_bytes,
    nbytes,
    sha256_file,
    write_atomic,
    write_json_atomic,
)
from flashdraft.progress import Progress
from flashdraft.stop import StopRequests
from flashdraft.target.image_files import record_images
from flashdraft.target.model import TargetModel
from flashdraft.target.overflow import fp16_overflow
from flashdraft.target.quantisation import quantisation_record
from flashdraft.target.vision import placeholder_free, position_runs

FORMAT = "flashdraft.hidden-state-cache"
VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = ".progress"
LOCK = ".lock"  # while a cache run writes the directory (`flashdraft.files.OutputLock`)
CAPTURE_DIR = "engine-capture"  # states captured by the serving engine while the cache is built (`engine_capture`)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AUTO = "auto"  # --dtype auto: store features in the dtype the target computes them in
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# relative error ||cached - fresh|| / ||fresh|| a stored layer may show from storage rounding
# alone (bf16 keeps 8 bits of mantissa, fp16 11); doctor --tolerance overrides
DEFAULT_TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}
FeaturesOf = Callable[[CompletionRecord], torch.Tensor]  # a record's context features [T, n * H], computed elsewhere


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def topk_name(k: int) -> str:
    return f"topk-{k:05d}.safetensors"


def resolve_dtype_flag(dtype: str, target_dtype: torch.dtype) -> str:
    """--dtype as a DTYPES key: `auto` is the target's own compute dtype (nothing rounded)."""
    if dtype == AUTO:
        by_dtype = {d: flag for flag, d in DTYPES.items()}
        if target_dtype not in by_dtype:
            raise FlashdraftError(
                f"--dtype auto: the target computes in {target_dtype}; expected one of "
                f"{', '.join(DTYPE_NAMES.values())} (give --dtype {'/'.join(DTYPES)})"
            )
        return by_dtype[target_dtype]
    if dtype not in DTYPES:
        raise FlashdraftError(f"--dtype {dtype}: expected {AUTO} or one of {', '.join(DTYPES)}")
    return dtype


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: how far stored features `a` are from fresh ones `b` (compared with DEFAULT_TOLERANCE)."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path, what: str = "") -> None:
    """Write a safetensors file whole or not at all. No metadata: safetensors writes a
    multi-key metadata dict in varying order, and shards must be byte-reproducible."""

    # write_atomic gives the file the umask's mode (safetensors creates it 0600)
    write_atomic(
        path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp)), what, nbytes(tensors)
    )


def estimate_bytes(records: list[CompletionRecord], width: int, dtype: torch.dtype, topk: int) -> int:
    """Bytes the shards of `records` take: per token the features (width = layers x hidden, in
    `dtype`), the int32 id and the bool mask, and with top-k logits k float32 values and int32
    indices; safetensors' headers are a few hundred bytes a file."""
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in records)
    return tokens * (width * dtype.itemsize + 4 + 1 + topk * 8)


def _check_space(
    directory: Path,
    records: list[CompletionRecord],
    width: int,
    layers: int,
    dtype: torch.dtype,
    topk: int,
    force: bool,
) -> int:
    """Refuse a cache that its filesystem cannot hold, before hours of target forwards (unless
    `force`); returns the estimate in bytes."""
    needed, free = estimate_bytes(records, width, dtype, topk), free_bytes(directory)
    if free is not None and needed > free and not force:
        tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in records)
        logits = f", plus top-{topk} logits" if topk else ""
        raise FlashdraftError(
            f"{directory}: the cache still to write needs about {format_bytes(needed)} ({tokens} tokens of "
            f"{len(records)} records x {layers} layers x {width // layers} hidden x {dtype.itemsize} bytes "
            f"({DTYPE_NAMES[dtype]}){logits}), its filesystem has {format_bytes(free)} free; free space, choose "
            f"another --out, or give --force to try anyway"
        )
    return needed


# -- building ----------------------------------------------------------------------------


# a record's fields each cache entry carries for train and eval: its chat mode, and with images how many and the
# drafter's positions as served (`flashdraft.target.vision`)
CARRIED_FIELDS = ("chat_template_kwargs", "reasoning_end", "meta", "position_runs")


def check_record_positions(target: TargetModel, record: CompletionRecord) -> None:
    """A record's drafter positions must be the ones its target serves (recomputed from the bound images)."""
    if not getattr(record, "images", None):
        return
    served = position_runs(target.drafter_positions(torch.arange(len(record.prompt_ids), device=target.device)).cpu())
    recorded = record.position_runs or [[0, 0, 1]]
    if served != recorded:
        raise FlashdraftError(
            f"record {record.id!r}: position_runs {str(recorded)[:60]} differ from the positions the target serves "
            f"its drafter at ({target.position_scheme}: {str(served)[:60]}); expected the record generated by this "
            f"target with these images"
        )


def _tokens_digest(records: list[CompletionRecord]) -> str:
    """Identifies a shard's input: ids and tokens of its records, in order."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r.id, r.prompt_ids, r.completion_ids]).encode())
    return h.hexdigest()


@torch.no_grad()
def _cache_record(
    target: TargetModel,
    record: CompletionRecord,
    dtype: torch.dtype,
    layer_ids: list[int],
    topk: int,
    features_of: FeaturesOf | None = None,
) -> dict[str, torch.Tensor]:
    tokens = record.prompt_ids + record.completion_ids
    if features_of is not None:  # captured elsewhere (the serving engine) and verified there
        out, features = None, features_of(record).to(dtype)  # [T, n * H]
    else:
        with record_images(target, record):  # a vision-language target's images, bound to this sequence
            check_record_positions(target, record)
            out = target.forward(torch.tensor([tokens], device=target.device))
        computed = out.context_features[0]  # [T, n * H] in the target's dtype
        if torch.float16 in (dtype, computed.dtype):  # fp16 storage or an fp16 target: its range checked first
            overflow = fp16_overflow(computed, layer_ids, target.hidden_size)
            if overflow is not None:
                raise FlashdraftError(overflow.line(f"record {record.id!r}", DTYPE_NAMES[computed.dtype]))
        features = computed.to(dtype).cpu()  # [T, n * H]
    bad = ~torch.isfinite(features)
    if bad.any():
        token, column = (int(x) for x in bad.nonzero()[0])
        layer = layer_ids[column // target.hidden_size]
        raise FlashdraftError(
            f"record {record.id!r}: context features of layer {layer} are NaN/Inf at token {token} (stored as "
            f"{DTYPE_NAMES[dtype]}); refusing to cache them (overflow in fp16? try --dtype bf16)"
        )
    item = {
        "input_ids": torch.tensor(tokens, dtype=torch.int32),  # [T]
        # [T] True on completion tokens, never on an image placeholder
        "loss_mask": (torch.arange(len(tokens)) >= len(record.prompt_ids))
        & placeholder_free(target, torch.tensor(tokens)),
        "context_features": features,
    }
    if topk:
        values, indices = out.logits[0].float().topk(topk, dim=-1)  # [T, k]
        item["topk_values"], item["topk_indices"] = values.cpu(), indices.to(torch.int32).cpu()
    return item


@dataclass
class _ShardRun:
    """What every shard of a rank's run shares: where and how it writes, its progress bar and stop requests."""

    target: TargetModel
    directory: Path
    settings: dict
    dist: Dist
    bar: Progress
    stop: StopRequests | None = None
    features_of: FeaturesOf | None = None
    verbose: bool = False


def _build_shard(run: _ShardRun, k: int, records: list[CompletionRecord]) -> dict | None:
    """Compute and write shard k; None when a stop was requested first (after the record in
    flight: nothing of the shard is written, a re-run computes it again)."""
    target, directory, settings, dist, bar, stop = run.target, run.directory, run.settings, run.dist, run.bar, run.stop
    features_of, verbose = run.features_of, run.verbose
    dtype = DTYPES[settings["dtype_flag"]]
    # the shard's tensors, allocated once and filled record by record: one shard of features in
    # memory at a time (not the per-record pieces plus their concatenation)
    total, topk = sum(len(r.prompt_ids) + len(r.completion_ids) for r in records), settings["topk"]
    width = len(settings["layer_ids"]) * target.hidden_size
    shard = {
        "input_ids": torch.empty(total, dtype=torch.int32),
        "loss_mask": torch.empty(total, dtype=torch.bool),
        "context_features": torch.empty(total, width, dtype=dtype),
    }
    logits = {"values": torch.empty(total, topk), "indices": torch.empty(total, topk, dtype=torch.int32)}
    entries, offset = [], 0
    for r in records:
        item = _cache_record(target, r, dtype, settings["layer_ids"], topk, features_of)
        n = len(item["input_ids"])
        for name in shard:
            shard[name][offset : offset + n] = item[name]
        if topk:
            logits["values"][offset : offset + n] = item["topk_values"]
            logits["indices"][offset : offset + n] = item["topk_indices"]
        if verbose:
            features = item["context_features"].float()
            bar.write(
                f"{dist.prefix()}{r.id}: {n} tokens ({len(r.completion_ids)} supervised), "
                f"features mean {features.mean():+.4f} std {features.std():.4f}"
            )
        bar.update(1)
        entries.append(
            {
                "id": r.id,
                "offset": offset,
                "length": n,
                "prompt_length": len(r.prompt_ids),
                **{k: getattr(r, k) for k in CARRIED_FIELDS if getattr(r, k) is not None},
                **({"images": r.images} if r.images else {}),  # its images' sources, for checks that re-run it
            }
        )  # the record's chat mode, for train and eval; its benchmark labels (by category), for eval
        offset += n
        del item
        if stop is not None and stop.requested:
            return None
    what = f"cache shard {k} (records {records[0].id} to {records[-1].id})"
    _save_atomic(shard, directory / shard_name(k), what)
    meta = {
        "index": k,
        "file": shard_name(k),
        "bytes": (directory / shard_name(k)).stat().st_size,
        "sha256": sha256_file(directory / shard_name(k)),
        "num_tokens": offset,
        "tokens_sha256": _tokens_digest(records),
        "records": entries,
    }
    if topk:
        _save_atomic(logits, directory / topk_name(k), f"the top-{topk} logits of {what}")
        meta |= {
            "topk_file": topk_name(k),
            "topk_bytes": (directory / topk_name(k)).stat().st_size,
            "topk_sha256": sha256_file(directory / topk_name(k)),
        }
    write_json_atomic(directory / PROGRESS / f"shard-{k:05d}.json", meta, indent=1)  # the shard's commit marker
    return meta


def _finished_shards(directory: Path) -> dict[int, dict]:
    """Shard metas of earlier runs: from the progress folder, or from a finished manifest."""
    metas: dict[int, dict] = {}
    manifest = directory / MANIFEST
    if manifest.exists():
        data = json.loads(manifest.read_text())
        by_shard: dict[int, list] = {}
        for r in data["records"]:
            by_shard.setdefault(r["shard"], []).append({k: v for k, v in r.items() if k != "shard"})
        for meta in data["shards"]:
            metas[meta["index"]] = dict(meta, records=by_shard.get(meta["index"], []))
    for path in sorted((directory / PROGRESS).glob("shard-*.json")):
        meta = json.loads(path.read_text())
        metas[meta["index"]] = meta
    return metas


def _is_finished(directory: Path, meta: dict | None, records: list[CompletionRecord], topk: int) -> bool:
    if meta is None or meta.get("tokens_sha256") != _tokens_digest(records):
        return False
    files = [(meta["file"], meta["bytes"])] + ([(meta.get("topk_file"), meta.get("topk_bytes"))] if topk else [])
    # the size catches a truncated or half-copied file; the doctor checks every sha256
    return all(
        name and (directory / name).is_file() and (directory / name).stat().st_size == size for name, size in files
    )


@dataclass(frozen=True)
class CacheSpec:
    """What a cache holds: the features of the layers `layer_ids` in `dtype` (bf16/fp16/fp32, or auto: the dtype the
    target computes in, for an exact offline τ), `records_per_shard` records a shard, the target's top-`topk`
    logits (0: none), the first `num_records` records (None: all)."""

    layer_ids: list[int]
    dtype: str = AUTO
    records_per_shard: int = 64
    topk: int = 0
    num_records: int | None = None


@dataclass(frozen=True)
class CapturedFeatures:
    """Features captured elsewhere (`engine_capture`), in place of the target's forward: each record's
    (`features_of`), and what captured them (`engine`, recorded in the manifest's computed_with)."""

    features_of: FeaturesOf
    engine: dict


def build_cache(
    target: TargetModel,
    completions: Completions,
    out: str | Path,
    spec: CacheSpec,
    dist: Dist | None = None,
    force: bool = False,
    captured: CapturedFeatures | None = None,
    verbose: bool = False,
) -> Path:
    """Build (or resume) the cache `spec` describes of `completions` in `out`; returns its directory. A cache its
    filesystem cannot hold is refused before any forward unless `force`. SIGTERM/SIGINT stop it after the record in
    flight (`Interrupted`), the finished shards kept for a re-run. `captured`: the features as captured elsewhere.
    `verbose`: a line per record (its tokens and feature statistics) above the progress bar."""
    layer_ids, records_per_shard, topk = spec.layer_ids, spec.records_per_shard, spec.topk
    features_of, engine = (captured.features_of, captured.engine) if captured is not None else (None, None)
    dist = dist or Dist()
    directory = Path(out)
    dtype = resolve_dtype_flag(spec.dtype, target.dtype)  # the settings hold the resolved dtype: a resume compares it
    target.set_context_layers(layer_ids)
    records = completions.records[: spec.num_records] if spec.num_records is not None else completions.records
    settings = {
        "target_fingerprint": target.fingerprint(),
        "layer_ids": list(layer_ids),
        "hidden_size": target.hidden_size,
        "dtype": DTYPE_NAMES[DTYPES[dtype]],
        "dtype_flag": dtype,
        "records_per_shard": records_per_shard,
        "topk": topk,
    }
    on_main(dist, lambda: _check_or_write_settings(directory, settings), f"{directory}: its settings check")

    shards = [records[i : i + records_per_shard] for i in range(0, len(records), records_per_shard)]
    finished = _finished_shards(directory)
    todo = [k for k, shard in enumerate(shards) if not _is_finished(directory, finished.get(k), shard, topk)]
    width, feature_dtype = len(layer_ids) * target.hidden_size, DTYPES[dtype]
    left = [r for k in todo for r in shards[k]]
    needed = on_main(
        dist,
        lambda: _check_space(
            directory, left, width, layers=len(layer_ids), dtype=feature_dtype, topk=topk, force=force
        ),
        f"{directory}: its free-space check",
    )
    if dist.is_main:
        print(
            f"caching {len(records)} records in {len(shards)} shards to {directory}: layers {layer_ids}, "
            f"{settings['dtype']}, {len(shards) - len(todo)} shards already done, about {format_bytes(needed)} "
            f"to write ({width * feature_dtype.itemsize} bytes per token: {len(layer_ids)} layers x "
            f"{target.hidden_size} x {feature_dtype.itemsize}; a 32k-token sequence "
            f"{format_bytes(32768 * width * feature_dtype.itemsize)})"
        )
    mine = [k for k in todo if k % dist.world == dist.rank]
    _build_shards(
        target, directory, shards, mine=mine, settings=settings, dist=dist, features_of=features_of, verbose=verbose
    )
    if dist.is_main:
        _finish(directory, target, completions, shards, settings, _computed_with(target, engine))
    dist.barrier()
    return directory


def _build_shards(
    target: TargetModel,
    directory: Path,
    shards: list[list[CompletionRecord]],
    mine: list[int],
    settings: dict,
    dist: Dist,
    features_of: FeaturesOf | None,
    verbose: bool,
) -> None:
    """This rank's shards `mine`, one after another; a stop (SIGTERM/SIGINT) on any rank stops all after the record
    in flight (`Interrupted`), and a full disk says how much the shards still to write need."""
    topk, feature_dtype = settings["topk"], DTYPES[settings["dtype_flag"]]
    width = len(settings["layer_ids"]) * target.hidden_size
    built = 0
    with StopRequests("record", dist.prefix()) as stop:
        with Progress(total=sum(len(shards[k]) for k in mine), desc=f"{dist.prefix()}cache", unit="record") as bar:
            for k in mine:
                try:
                    run = _ShardRun(target, directory, settings, dist, bar, stop, features_of, verbose)
                    meta = _build_shard(run, k, shards[k])
                except DiskFullError as e:
                    rest = [r for j in mine[built:] for r in shards[j]]
                    e.then = (
                        f"free about {format_bytes(estimate_bytes(rest, width, feature_dtype, topk))} for the "
                        f"{len(mine) - built} shards still to write and re-run the same command: the finished "
                        f"shards are kept"
                    )
                    raise
                if meta is None:
                    break
                built += 1
        # every shard is on disk before the manifest lists them; a stop on any rank stops all
        if any_rank(stop.requested):
            signum = stop.signum or signal.SIGTERM  # a rank that got no signal stops with its peers
            metas = _finished_shards(directory)
            done = sum(_is_finished(directory, metas.get(k), shard, topk) for k, shard in enumerate(shards))
            raise Interrupted(
                signum,
                f"{signal.Signals(signum).name}: {done} of {len(shards)} shards finished in "
                f"{directory} (the one in flight is computed again)"
                if dist.is_main
                else "",
            )


def _computed_with(target: TargetModel, engine: dict | None) -> dict:
    """The manifest's computed_with: the target's device, dtype and linear backend, or the engine that captured."""
    if engine is not None:
        return {"device": engine.get("device", "engine"), "target_dtype": engine["dtype"], "engine": engine}
    return {
        "device": target.device.type,
        "target_dtype": DTYPE_NAMES.get(target.model.dtype, str(target.model.dtype)),
        "linear_backend": target.linear_backend,
    }


def _finish(
    directory: Path, target: TargetModel, completions: Completions, shards: list, settings: dict, computed_with: dict
) -> None:
    """Rank 0, once every shard is on disk: write the manifest, drop the progress folder and
    any shard files the manifest does not list."""
    topk, progress = settings["topk"], directory / PROGRESS
    metas = _finished_shards(directory)
    manifest_shards, manifest_records = [], []
    for k, shard in enumerate(shards):
        meta = metas[k]
        if not _is_finished(directory, meta, shard, topk):
            raise FlashdraftError(f"{directory / shard_name(k)}: missing after every rank finished")
        manifest_shards.append({key: v for key, v in meta.items() if key != "records"})
        manifest_records += [dict(r, shard=k) for r in meta["records"]]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "target": {
            "fingerprint": settings["target_fingerprint"],
            "num_layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "path": str(target.path) if target.path is not None else None,
            # the scheme the states were captured under (quantisation.py): a cache used with a target quantised
            # otherwise is named by doctor and eval
            "quantisation": quantisation_record(target),
            # a vision-language target's image placeholder: never supervised (`target.vision.placeholder_free`)
            **({"image_token_id": target.vision.image_token_id} if target.vision is not None else {}),
        },
        "layer_ids": settings["layer_ids"],
        "feature_convention": "hidden_states[l + 1]: the output of decoder layer l",
        "hidden_size": target.hidden_size,
        "dtype": settings["dtype"],
        "records_per_shard": settings["records_per_shard"],
        "target_topk": {"k": topk, "values_dtype": "float32", "indices_dtype": "int32"} if topk else None,
        "computed_with": computed_with,
        "completions": {
            "file": completions.path.name,
            "target_fingerprint": completions.target_fingerprint,
            "generation": completions.header.get("generation"),
        },
        "num_records": len(manifest_records),
        "num_tokens": sum(s["num_tokens"] for s in manifest_shards),
        "shards": manifest_shards,
        "records": manifest_records,
    }
    write_json_atomic(directory / MANIFEST, manifest, indent=1)
    for path in sorted(progress.glob("*")):
        path.unlink()
    progress.rmdir()
    # shards left over from an earlier, larger run are not part of this cache
    listed = {s["file"] for s in manifest_shards} | {s.get("topk_file") for s in manifest_shards}
    stale = [p for p in sorted(directory.glob("*.safetensors")) if p.name not in listed]
    stale += sorted(directory.glob("*.safetensors.tmp"))  # a killed write
    for p in stale:
        p.unlink()
    print(
        f"wrote {directory / MANIFEST}: {len(manifest_records)} records, {manifest['num_tokens']} tokens"
        + (f" (removed {len(stale)} stale shard files)" if stale else "")
        + f"; `flashdraft doctor {directory}` checks it, --verbose prints a line per record"
    )


def check_new_cache_directory(directory: Path) -> None:
    """A directory with anything but a cache run's own entries is not written into."""
    if directory.is_dir() and any(p.name not in (LOCK, CAPTURE_DIR) for p in directory.iterdir()):
        if not ((directory / MANIFEST).exists() or (directory / PROGRESS).exists()):
            raise FlashdraftError(
                f"{directory}: exists and is not a flashdraft cache; expected an empty or new directory"
            )


def _check_or_write_settings(directory: Path, settings: dict) -> None:
    """A directory holding a cache with other settings is refused, never mixed."""
    directory.mkdir(parents=True, exist_ok=True)
    found = None
    if (directory / PROGRESS / "settings.json").exists():
        found = json.loads((directory / PROGRESS / "settings.json").read_text())
    elif (directory / MANIFEST).exists():
        m = json.loads((directory / MANIFEST).read_text())
        dtype_flag = next((f for f, d in DTYPES.items() if DTYPE_NAMES[d] == m.get("dtype")), None)
        found = {
            "target_fingerprint": m["target"]["fingerprint"],
            "layer_ids": m["layer_ids"],
            "hidden_size": m["hidden_size"],
            "dtype": m["dtype"],
            "dtype_flag": dtype_flag,
            "records_per_shard": m["records_per_shard"],
            "topk": (m.get("target_topk") or {}).get("k", 0),
        }
    else:
        check_new_cache_directory(directory)
    if found is not None:
        for key, value in settings.items():
            if found.get(key) != value:
                # --dtype auto follows the target's dtype (it was bf16 by default before): name the flag to resume
                hint = f" or give --dtype {found.get('dtype_flag')} to resume it" if key == "dtype" else ""
                raise FlashdraftError(
                    f"{directory}: holds a cache with {key} = {found.get(key)!r}, this run asks for {value!r}; "
                    f"use another --out (caches are never mixed){hint}"
                )
    (directory / PROGRESS).mkdir(exist_ok=True)
    write_json_atomic(directory / PROGRESS / "settings.json", settings, indent=1)
