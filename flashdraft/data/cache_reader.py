"""The reader of a finished hidden-state cache (`flashdraft.data.cache` writes it): the manifest checked, every
shard's size and (with `verify`) sha256, the records' layout against the shards' headers; then records one at a
time through memory-mapped shards."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from flashdraft.data.cache import DTYPE_NAMES, FORMAT, MANIFEST, PROGRESS, VERSION
from flashdraft.data.completions import meta_problem
from flashdraft.errors import FlashdraftError
from flashdraft.files import sha256_file
from flashdraft.target.model import TargetModel
from flashdraft.target.quantisation import Quantisation, mismatch


@dataclass
class CachedRecord:
    id: str
    input_ids: torch.Tensor  # [T] long, prompt + completion
    loss_mask: torch.Tensor  # [T] bool, True on completion tokens
    context_features: torch.Tensor  # [T, len(layer_ids) * hidden], as stored
    prompt_length: int
    target_topk: tuple[torch.Tensor, torch.Tensor] | None  # (values [T, k], indices [T, k] long)


def _require(manifest: dict, key: str, kind: type | tuple, where: Path) -> Any:
    value = manifest.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FlashdraftError(f"{where}: field '{key}' is {value!r}; expected {getattr(kind, '__name__', kind)}")
    return value


class HiddenStateCache:
    """A finished cache directory, read one record at a time through memory-mapped shards."""

    def __init__(self, directory: str | Path, verify: bool = True) -> None:
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        if not path.is_file():
            hint = " (an unfinished run: re-run flashdraft cache)" if (self.directory / PROGRESS).is_dir() else ""
            raise FlashdraftError(f"{self.directory}: no {MANIFEST}; not a finished hidden-state cache{hint}")
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise FlashdraftError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise FlashdraftError(f"{path}: field 'format' is {manifest.get('format')!r}; expected {FORMAT!r}")
        if manifest.get("version") != VERSION:
            raise FlashdraftError(f"{path}: field 'version' is {manifest.get('version')!r}; expected {VERSION}")
        self.manifest = manifest
        self.layer_ids: list[int] = _require(manifest, "layer_ids", list, path)
        self.hidden_size: int = _require(manifest, "hidden_size", int, path)
        self.target_fingerprint: str = _require(manifest, "target", dict, path).get("fingerprint")
        # the target's quantisation the states were captured under; None in a cache written before it was recorded
        self.target_quantisation = Quantisation.from_record(manifest["target"].get("quantisation"))
        dtype_name = _require(manifest, "dtype", str, path)
        by_name = {v: k for k, v in DTYPE_NAMES.items()}
        if dtype_name not in by_name:
            raise FlashdraftError(f"{path}: field 'dtype' is {dtype_name!r}; expected one of {', '.join(by_name)}")
        self.dtype: torch.dtype = by_name[dtype_name]
        self.topk: int = (manifest.get("target_topk") or {}).get("k", 0)
        self.shards: list[dict] = _require(manifest, "shards", list, path)
        self._records: list[dict] = _require(manifest, "records", list, path)
        for s in self.shards:
            self._check_file(s["file"], s["bytes"], s["sha256"] if verify else None)
            if self.topk:
                self._check_file(s["topk_file"], s["topk_bytes"], s["topk_sha256"] if verify else None)
        self._check_layout()

    def _check_file(self, name: str, size: int, sha256: str | None) -> None:
        path = self.directory / name
        if not path.is_file():
            raise FlashdraftError(f"{path}: missing; {MANIFEST} lists it (re-run flashdraft cache to rebuild it)")
        found = path.stat().st_size
        if found != size:
            raise FlashdraftError(
                f"{path}: {found} bytes, {MANIFEST} says {size} (truncated or replaced); "
                f"re-run flashdraft cache to rebuild it"
            )
        if sha256 is not None and sha256_file(path) != sha256:
            raise FlashdraftError(
                f"{path}: sha256 differs from {MANIFEST} (corrupted or replaced); re-run flashdraft cache to rebuild it"
            )

    def _check_layout(self) -> None:
        """Records tile each shard exactly, and each shard's tensors (their safetensors headers:
        nothing is read) hold as many tokens as its records, so no read can run past a record
        or miss tokens the manifest does not describe."""
        where = self.directory / MANIFEST
        width = len(self.layer_ids) * self.hidden_size
        ends = [0] * len(self.shards)
        for r in self._records:
            k, name = r.get("shard"), r.get("id")
            if not isinstance(k, int) or not 0 <= k < len(self.shards):
                raise FlashdraftError(f"{where}: record {name!r} has shard {k!r}; expected 0..{len(self.shards) - 1}")
            length, prompt = r.get("length"), r.get("prompt_length")
            if (
                r.get("offset") != ends[k]
                or not isinstance(length, int)
                or not isinstance(prompt, int)
                or not (0 < prompt < length)
            ):
                raise FlashdraftError(
                    f"{where}: record {name!r} has offset {r.get('offset')!r}, length {length!r}, prompt_length "
                    f"{prompt!r}; expected offset {ends[k]} (right after the previous record of "
                    f"{self.shards[k]['file']}) and 0 < prompt_length < length"
                )
            ends[k] += length
            problem = meta_problem(r["meta"]) if r.get("meta") is not None else None
            if problem:
                raise FlashdraftError(f"{where}: record {name!r}: {problem}")
        for k, s in enumerate(self.shards):
            if ends[k] != s["num_tokens"]:
                raise FlashdraftError(
                    f"{where}: the records of {s['file']} hold {ends[k]} tokens, the shard entry says "
                    f"{s['num_tokens']}; the manifest does not describe this shard (rebuild the cache)"
                )
            expected = {"input_ids": [ends[k]], "loss_mask": [ends[k]], "context_features": [ends[k], width]}
            if self.topk:
                expected_topk = {"values": [ends[k], self.topk], "indices": [ends[k], self.topk]}
            for name, want in [(s["file"], expected)] + ([(s["topk_file"], expected_topk)] if self.topk else []):
                with self.open_shard(name) as f:
                    for key, shape in want.items():
                        found = f.get_slice(key).get_shape() if key in f.keys() else None
                        if found != shape:
                            raise FlashdraftError(
                                f"{self.directory / name}: tensor '{key}' has shape {found}; expected {shape} "
                                f"(the tokens {MANIFEST} lists for it); rebuild the cache"
                            )

    # -- facts --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._records)

    @property
    def ids(self) -> list[str]:
        return [r["id"] for r in self._records]

    @property
    def lengths(self) -> list[int]:
        """Token count of every record (for length-aware batching without reading shards)."""
        return [r["length"] for r in self._records]

    @property
    def prompt_lengths(self) -> list[int]:
        return [r["prompt_length"] for r in self._records]

    @property
    def metas(self) -> list[dict | None]:
        """Each record's benchmark labels (category, split, question_id, turn; `data.completions.request_meta`),
        None where its completion had none (or the cache predates them)."""
        return [r.get("meta") for r in self._records]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    # -- records ------------------------------------------------------------------------

    def open_shard(self, name: str):
        """A shard, memory-mapped for one read. Not kept open: pages a kept mapping touched
        would stay in this process's resident memory, which would then grow with every record read."""
        try:
            return safe_open(str(self.directory / name), framework="pt")
        except (SafetensorError, OSError) as e:
            raise FlashdraftError(f"{self.directory / name}: unreadable safetensors file ({e})") from None

    def _span(self, i: int) -> tuple[dict, dict, int, int]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"record {i} of a cache with {len(self)} records")
        r = self._records[i]
        shard = self.shards[r["shard"]]
        return r, shard, r["offset"], r["offset"] + r["length"]

    def token_ids(self, i: int) -> torch.Tensor:
        """Record i's prompt + completion ids [T] (long), without reading its features."""
        _, shard, lo, hi = self._span(i)
        with self.open_shard(shard["file"]) as f:
            return f.get_slice("input_ids")[lo:hi].long()

    def features(self, i: int) -> torch.Tensor:
        """Record i's context features [T, n * H], refused when any is NaN/Inf (naming where)."""
        r, shard, lo, hi = self._span(i)
        with self.open_shard(shard["file"]) as f:
            features = f.get_slice("context_features")[lo:hi]
        bad = ~torch.isfinite(features)
        if bad.any():
            token, column = (int(x) for x in bad.nonzero()[0])
            raise FlashdraftError(
                f"{self.directory / shard['file']}: record {r['id']!r} has NaN/Inf context features at token {token} "
                f"of layer {self.layer_ids[column // self.hidden_size]}; expected finite values (a damaged or "
                f"foreign cache: rebuild it with flashdraft cache)"
            )
        return features

    def loss_masks(self) -> list[torch.Tensor]:
        """Every record's loss mask [T] bool, one read per shard, without its features (what packing sizes by)."""
        masks: list[torch.Tensor | None] = [None] * len(self)
        by_shard: dict[int, list[int]] = {}
        for i, r in enumerate(self._records):
            by_shard.setdefault(r["shard"], []).append(i)
        for shard, indices in by_shard.items():
            with self.open_shard(self.shards[shard]["file"]) as f:
                whole = f.get_tensor("loss_mask")
            for i in indices:
                r = self._records[i]
                masks[i] = whole[r["offset"] : r["offset"] + r["length"]].bool()
        return masks

    def __getitem__(self, i: int) -> CachedRecord:
        r, shard, lo, hi = self._span(i)
        topk = None
        if self.topk:
            with self.open_shard(shard["topk_file"]) as t:
                topk = (t.get_slice("values")[lo:hi], t.get_slice("indices")[lo:hi].long())
        with self.open_shard(shard["file"]) as f:
            return CachedRecord(
                id=r["id"],
                input_ids=f.get_slice("input_ids")[lo:hi].long(),
                loss_mask=f.get_slice("loss_mask")[lo:hi],
                context_features=f.get_slice("context_features")[lo:hi],
                prompt_length=r["prompt_length"],
                target_topk=topk,
            )

    # -- compatibility --------------------------------------------------------------------

    def check_compatible(self, target: TargetModel | None = None, layer_ids: list[int] | None = None) -> None:
        """Raise naming the cause if this cache cannot feed a drafter for `target` with
        context layers `layer_ids`."""
        where = self.directory / MANIFEST
        if layer_ids is not None and list(layer_ids) != list(self.layer_ids):
            raise FlashdraftError(
                f"{where}: cache holds layer ids {self.layer_ids}, the drafter's target_layer_ids are "
                f"{list(layer_ids)}; rebuild the cache with flashdraft cache --layers {','.join(map(str, layer_ids))}"
            )
        if target is not None:
            if target.hidden_size != self.hidden_size:
                raise FlashdraftError(
                    f"{where}: cache hidden size is {self.hidden_size}, the target's is {target.hidden_size}; "
                    f"the cache was made for another target"
                )
            fingerprint = target.fingerprint()
            if fingerprint != self.target_fingerprint:
                quantised = mismatch(self.target_quantisation, getattr(target, "quantisation", None))
                raise FlashdraftError(
                    f"{where}: cache made by target fingerprint {self.target_fingerprint}, this target "
                    f"({target.path}) has fingerprint {fingerprint}; the features come from another target"
                    + (f" ({quantised})" if quantised else "")
                )
            bad = [i for i in self.layer_ids if not 0 <= i < target.num_layers]
            if bad:
                raise FlashdraftError(f"{where}: layer ids {bad} outside the target's {target.num_layers} layers")
