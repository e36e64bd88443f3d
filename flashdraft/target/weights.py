"""What offline training and evaluation need of a target, read straight from its files.

From a hidden-state cache (`--cached-hidden-states`) the context features are stored, so
the target contributes only its tokenizer, its config, its input embeddings (to embed the
drafted blocks) and its LM head (to turn drafter outputs into tokens). `TargetHead` reads
exactly those from the target's safetensors (one `model.safetensors`, or the shards named
by `model.safetensors.index.json`) and never the decoder layers: for Qwen3.6-27B that is
2.5 GB of bf16 instead of 54 GB, and a checkpoint with decoder layers missing works too.

Tensors are read with positioned reads in chunks of `CHUNK_BYTES`, converted into their
final dtype and device as they arrive: a safetensors mmap would keep every page it touched
resident, so a bf16 file read into fp32 would cost file + copy instead of the copy alone
(measured: 3.0 GB of peak RSS against 2.1 GB for a 1 GB bf16 tensor read as fp32).

The fingerprint equals `TargetModel.fingerprint()` of the model loaded in the same dtype:
the same text config and vocabulary, and for every name of the loaded model's state dict
(taken from the model built on the meta device, so no memory) the same strided sample,
read element by element from the files and rounded to the load dtype as loading would.
Tensors absent from the files (a checkpoint written without its decoder layers) are left
out: such a target has no complete identity to compare anyway.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F

from flashdraft.errors import FlashdraftError
from flashdraft.safe_load import HF_LOCAL, hf_load_error
from flashdraft.target.layer_kinds import RECURRENT, TargetSupport, decoder_of, read_support
from flashdraft.target.model import (
    TargetModel,
    check_layer_ids,
    final_norm_of,
    fingerprint_of,
    norm_multiplier,
    resolve_target_path,
    sample_stride,
    stop_token_ids_of,
)
from flashdraft.target.per_layer import layer_value
from flashdraft.target.quantisation import (
    QUANTISATION_PARAMETERS,
    QUANTISED_DTYPES,
    SAFETENSORS_DTYPES,
    Quantisation,
    dequantised_sample,
    identity_of,
    is_quantisation_parameter,
    is_quantised_checkpoint,
    quantisation_config_of,
    read_quantisation,
    stored_format,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 64 << 20  # read size: bounds the transient memory of a conversion
SAMPLE_SCRATCH_BYTES = 1 << 20  # tensors up to this size are read whole (into one reused buffer) for their sample
# Qwen3.5/3.6 checkpoints (vision-language layout) keep the text model under this prefix;
# transformers loads it as `model.` (its PrefixChange for qwen3_5_text)
LANGUAGE_MODEL_PREFIX = "model.language_model."
# prefixes other checkpoints store `model.` under, that transformers renames on load (nemotron_h: "backbone.")
STORED_MODEL_PREFIXES = (LANGUAGE_MODEL_PREFIX, "backbone.")


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the first element in `file`

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header (8-byte little-endian length, then JSON)."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as e:
        raise FlashdraftError(f"{file}: not a readable safetensors file ({e})") from None
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise FlashdraftError(
                f"{file}: tensor '{name}' has dtype {entry['dtype']}; expected one of {', '.join(SAFETENSORS_DTYPES)}"
            )
        begin, end = entry["data_offsets"]
        tensor = StoredTensor(name, file, dtype, tuple(entry["shape"]), 8 + length + begin)
        if end - begin != tensor.numel * tensor.itemsize:
            raise FlashdraftError(
                f"{file}: tensor '{name}' {list(tensor.shape)} {entry['dtype']} spans "
                f"{end - begin} bytes; expected {tensor.numel * tensor.itemsize}"
            )
        tensors[name] = tensor
    return tensors


class SafetensorsFiles:
    """A checkpoint's tensors by name, read lazily: headers at construction, bytes on demand."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        single, index = directory / SINGLE_FILE, directory / INDEX_FILE
        self.missing_shards: dict[str, Path] = {}  # tensor -> shard the index names but that is absent
        self.tensors: dict[str, StoredTensor] = {}
        if index.is_file():
            self.source = index
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise FlashdraftError(f"{index}: expected a JSON object with a weight_map ({e})") from None
            for shard in sorted(set(weight_map.values())):
                if (directory / shard).is_file():
                    self.tensors |= read_header(directory / shard)
            self.missing_shards = {k: directory / v for k, v in weight_map.items() if not (directory / v).is_file()}
        elif single.is_file():
            self.source = single
            self.tensors = read_header(single)
        else:
            raise FlashdraftError(
                f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}; offline training and evaluation read the "
                f"target's embeddings and LM head from safetensors files (convert the weights to safetensors)"
            )

    @staticmethod
    def stored_names(name: str) -> list[str]:
        """Names a file may store the model's tensor `name` under (Qwen3.5/3.6: language_model prefix;
        Nemotron-H: backbone)."""
        if not name.startswith("model."):
            return [name]
        return [name] + [prefix + name[len("model.") :] for prefix in STORED_MODEL_PREFIXES]

    def find(self, name: str) -> StoredTensor | None:
        """The stored tensor the model calls `name`, or None."""
        return next((self.tensors[n] for n in self.stored_names(name) if n in self.tensors), None)

    def require(self, name: str, what: str) -> StoredTensor:
        stored = self.find(name)
        if stored is None:
            shard = next((self.missing_shards[n] for n in self.stored_names(name) if n in self.missing_shards), None)
            where = f"{shard} (named by {self.source}) is missing" if shard else f"{self.source} holds no tensor"
            raise FlashdraftError(f"{where} '{name}' ({what}); offline training and evaluation read it from there")
        return stored

    def read(self, stored: StoredTensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The whole tensor in `dtype` on `device`, read in chunks (no second copy of it)."""
        out = torch.empty(stored.shape, dtype=dtype, device=device)
        if stored.numel == 0:
            return out
        flat = out.view(-1)
        direct = dtype == stored.dtype and device.type == "cpu"  # the file's bytes are the result's
        per_chunk = max(1, CHUNK_BYTES // stored.itemsize)
        with open(stored.file, "rb") as f:
            f.seek(stored.offset)
            for start in range(0, stored.numel, per_chunk):
                n = min(per_chunk, stored.numel - start)
                # [n * itemsize] bytes: the output's own memory, or a chunk to convert from
                buffer = flat[start : start + n].view(torch.uint8).numpy() if direct else bytearray(n * stored.itemsize)
                if f.readinto(buffer) != n * stored.itemsize:
                    raise FlashdraftError(f"{stored.file}: truncated inside tensor '{stored.name}'")
                if not direct:
                    flat[start : start + n].copy_(torch.frombuffer(buffer, dtype=stored.dtype))
        return out

    def strided_sample(self, stored: StoredTensor, scratch: bytearray) -> torch.Tensor:
        """flat[::stride] in the stored dtype (the elements `target.strided_sample` takes). A small
        tensor is read whole into `scratch`; a larger one element by element (pages touched: about
        1,024), so neither the bytes read nor the memory grow with the tensor."""
        stride, size, nbytes = sample_stride(stored.numel), stored.itemsize, stored.numel * stored.itemsize
        with open(stored.file, "rb") as f:
            if 0 < nbytes <= len(scratch):
                f.seek(stored.offset)
                if f.readinto(memoryview(scratch)[:nbytes]) != nbytes:
                    raise FlashdraftError(f"{stored.file}: truncated inside tensor '{stored.name}'")
                return torch.frombuffer(scratch, dtype=stored.dtype, count=stored.numel)[::stride].clone()
            fd = f.fileno()
            parts = [os.pread(fd, size, stored.offset + i * size) for i in range(0, stored.numel, stride)]
        data = b"".join(parts)
        if len(data) != len(parts) * size:
            raise FlashdraftError(f"{stored.file}: truncated inside tensor '{stored.name}'")
        return torch.frombuffer(bytearray(data), dtype=stored.dtype)


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


@dataclass(frozen=True)
class _Layout:
    """Names the loaded model would use, from the model built on the meta device."""

    state_dict_names: list[str]
    embed_name: str  # the input embedding's weight
    lm_head_name: str  # the LM head's weight (the embedding's when tied)
    tied: bool
    norm_name: str | None  # the final norm's weight
    norm_class: str
    layer_prefixes: list[str]  # "model.layers.{i}." for each decoder layer
    norm_classes: dict[str, str]  # every norm's weight name -> its module class (Qwen3.5 norms store weight - 1)


class TargetHead:
    """The frozen pieces of a target that offline code borrows (tokenizer, config, input
    embeddings, LM head, fingerprint, stop ids), with the facts `TargetModel` states, read
    from the files without building the model. Weights are read on first use, so commands
    that need only shapes (doctor, export, init) read none.

    A forward (context features that a cache does not hold, e.g. an eval reference drafter
    with other layers) loads the whole target once, as `TargetModel`, and says so."""

    def __init__(
        self, path: Path, config, tokenizer, generation_config, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.path = path
        self.full_config = config  # as stored: Qwen3.5/3.6 nest the language model's in text_config
        self.config = config.get_text_config()
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.device = device
        self.dtype = dtype
        self.files = SafetensorsFiles(path)
        self._context_layer_ids: list[int] = []
        self._model: TargetModel | None = None

    @classmethod
    def load(
        cls, name_or_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> TargetHead:
        """Tokenizer, config and tensor headers of a local target; dtype None: fp32 on CPU, bf16 on GPU."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        path = resolve_target_path(name_or_path)
        device = torch.device(device)
        try:
            config = AutoConfig.from_pretrained(path, **HF_LOCAL)
            tokenizer = AutoTokenizer.from_pretrained(path, **HF_LOCAL)
        except (OSError, ValueError, KeyError) as e:
            raise hf_load_error(path, "the target's config or tokenizer", e) from None
        support = read_support(config, str(path))  # a layer kind without a rollback rule refused before any work
        try:  # as from_pretrained: the file if there is one, else derived from the model config
            generation = GenerationConfig.from_pretrained(path, local_files_only=True)
        except OSError:
            generation = GenerationConfig.from_model_config(config)
        head = cls(path, config, tokenizer, generation, device, dtype or default_dtype(device))
        head.support = support
        head._stored_matrix(head._layout.embed_name, "the input embedding")  # a missing piece fails here, not later
        head._stored_matrix(*head._lm_head_source)
        return head

    # -- facts (as TargetModel states them) ------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self._stored_matrix(*self._lm_head_source).shape[0]

    @property
    def context_length(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def layer_types(self) -> list[str]:
        return list(getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers)

    @cached_property
    def support(self) -> TargetSupport:
        """The layer kinds read from the model (`layer_kinds.py`), as `TargetModel.support`."""
        return read_support(self.full_config, str(self.path))

    @property
    def is_hybrid(self) -> bool:
        return any(kind in RECURRENT for kind in self.support.layer_kinds)

    @property
    def linear_backend(self) -> str:
        if self._model is not None:
            return self._model.linear_backend
        return "not run (offline)" if self.is_hybrid else "none"

    @property
    def stop_token_ids(self) -> list[int]:
        return stop_token_ids_of(self.generation_config, self.config, self.tokenizer)

    @cached_property
    def _meta_model(self):
        """The model built on the meta device (modules without memory: only names, classes and shapes are used)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.full_config)

    @cached_property
    def _layout(self) -> _Layout:
        model = self._meta_model
        names = {id(m): n for n, m in model.named_modules()}
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        norm = final_norm_of(decoder_of(model))
        has_norm = norm is not None and getattr(norm, "weight", None) is not None
        layers = decoder_of(model).layers
        return _Layout(
            state_dict_names=sorted(model.state_dict()),
            embed_name=names[id(embed)] + ".weight",
            lm_head_name=names[id(head)] + ".weight",
            tied=head.weight is embed.weight,
            norm_name=names[id(norm)] + ".weight" if has_norm else None,
            norm_class=type(norm).__name__,
            layer_prefixes=[names[id(layer)] + "." for layer in layers],
            norm_classes={
                n + ".weight": type(m).__name__ for n, m in model.named_modules() if "Norm" in type(m).__name__
            },
        )

    def _source(self, name: str) -> StoredTensor | None:
        """The stored tensor whose values the loaded model holds under `name` (under its checkpoint name where
        transformers renames it on load: Mixtral's `block_sparse_moe` is its `mlp`, Granite 4.0's router
        `router.layer` its `router`)."""
        name = self._lm_head_source[0] if name == self._layout.lm_head_name else name
        found = self.files.find(name)
        if found is None and name in self._stored_name_of:
            found = self.files.tensors[self._stored_name_of[name]]
        return found

    @cached_property
    def _stored_name_of(self) -> dict[str, str]:
        """Loaded name -> stored name of every stored tensor that loading renames without transforming, by
        transformers' own renaming (its `rename_source_key` with this model's `WeightRenaming`s: regular
        expressions, prefix changes). Tensors a converter transforms (routed experts fused into one) are left out:
        their values are not the stored ones."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        model = self._meta_model
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        loaded_names = set(self._layout.state_dict_names)
        meta = dict.fromkeys(loaded_names, True)
        stored_name_of = {}
        for stored in self.files.tensors:
            loaded, converted_by = rename_source_key(
                stored,
                renamings,
                converters,
                base_model_prefix=model.base_model_prefix,
                meta_state_dict=meta,
            )
            if converted_by is None and loaded != stored and loaded in loaded_names:
                stored_name_of.setdefault(loaded, stored)
        return stored_name_of

    def fingerprint(self) -> str:
        """`TargetModel.fingerprint()` of this target loaded in `self.dtype`, from samples of the files. A quantised
        target's weights are sampled as it computes with them, dequantised (`quantisation.dequantised_sample`); a
        stored layout that is not read sample by sample (packed int4, NVFP4) is fingerprinted by loading it."""
        samples, scratch = [], bytearray(SAMPLE_SCRATCH_BYTES)
        qc = quantisation_config_of(self.full_config)
        for name in self._layout.state_dict_names:
            stored = self._source(name)
            if stored is None:
                module = name.rsplit(".", 1)[0] + "."
                if qc is not None and any(
                    n.startswith(module) and is_quantisation_parameter(n) for n in self.files.tensors
                ):
                    return self._fingerprint_by_loading()  # a weight stored packed, under other names (int4, GPTQ)
                continue  # absent from the files (see the module docstring)
            sample = self.files.strided_sample(stored, scratch)
            if qc is not None and stored.dtype in QUANTISED_DTYPES:
                sample = self._dequantised(stored, sample, stored_format(qc))
                if sample is None:
                    return self._fingerprint_by_loading()
            if sample.is_floating_point():
                sample = sample.to(self.dtype)  # the rounding that loading in self.dtype does
            samples.append((name, sample.float()))
        return fingerprint_of(self.config, self.tokenizer, samples, identity_of(self.full_config))

    def _dequantised(
        self, stored: StoredTensor, values: torch.Tensor, fmt: str, stride: int = 0
    ) -> torch.Tensor | None:
        """A quantised weight's values at every `stride`-th element (0: the fingerprint's stride), as the loaded model
        holds them (fp32); None if its layout is not computed element by element."""
        module = stored.name.rsplit(".", 1)[0]
        parameters = {
            p: self.files.read(self.files.tensors[f"{module}.{p}"], torch.float32, torch.device("cpu"))
            for p in QUANTISATION_PARAMETERS
            if f"{module}.{p}" in self.files.tensors
        }
        indices = torch.arange(0, stored.numel, stride or sample_stride(stored.numel))
        return dequantised_sample(values, stored.shape, indices, parameters, fmt)

    def _fingerprint_by_loading(self) -> str:
        print(
            f"target {self.path}: {self.quantisation.scheme} weights are not read sample by sample; loading the "
            f"model for its fingerprint",
            flush=True,
        )
        if self._model is None:
            self._model = TargetModel.load(self.path, self.device, self.dtype)
        return self._model.fingerprint()

    @cached_property
    def quantisation(self) -> Quantisation:
        """The target's quantisation (scheme, quantised layers, LM head dtype), from its config and files."""
        dtypes = {n: t.dtype for n, t in self.files.tensors.items()}
        head = self.files.find(self._lm_head_source[0])
        return read_quantisation(self.full_config, dtypes, head.name if head is not None else self._lm_head_source[0])

    # -- the frozen pieces -------------------------------------------------------------------

    @property
    def _lm_head_source(self) -> tuple[str, str]:
        """(stored name, description) of the LM head's values. A tied LM head is the embedding
        unless the file stores one of its own: transformers then leaves it untied (its warning
        says so), and so does this."""
        layout = self._layout
        if layout.tied and self.files.find(layout.lm_head_name) is None:
            return layout.embed_name, "the input embedding, tied to the LM head"
        return layout.lm_head_name, "the LM head"

    @cached_property
    def embed_weight(self) -> torch.Tensor:  # [vocab, hidden]
        stored = self._stored_matrix(self._layout.embed_name, "the input embedding")
        return self._read_matrix(stored, "the input embedding")

    @cached_property
    def lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        name, what = self._lm_head_source
        if name == self._layout.embed_name:
            return self.embed_weight
        return self._read_matrix(self._stored_matrix(name, what), what)

    def _read_matrix(self, stored: StoredTensor, what: str) -> torch.Tensor:
        """A stored matrix as the loaded model holds it: dequantised where it is stored quantised (an LM head a
        scheme did not leave out)."""
        if stored.dtype not in QUANTISED_DTYPES or not is_quantised_checkpoint(self.full_config):
            return self.files.read(stored, self.dtype, self.device)
        values = self.files.read(stored, stored.dtype, torch.device("cpu")).reshape(-1)
        fmt = stored_format(quantisation_config_of(self.full_config))
        weight = self._dequantised(stored, values, fmt, stride=1)
        if weight is None:
            raise FlashdraftError(
                f"{stored.file}: tensor '{stored.name}' ({what}) is stored {self.quantisation.scheme} in a layout "
                f"read only by loading the model; evaluate and train online (--completions) with this target"
            )
        return weight.reshape(stored.shape).to(self.dtype).to(self.device)

    def _stored_matrix(self, name: str, what: str) -> StoredTensor:
        stored = self.files.require(name, what)
        if len(stored.shape) != 2 or stored.shape[1] != self.hidden_size:
            raise FlashdraftError(
                f"{stored.file}: tensor '{stored.name}' ({what}) has shape {list(stored.shape)}; "
                f"expected [vocab, {self.hidden_size}] (hidden_size of config.json)"
            )
        return stored

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_weight)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight)

    def final_norm_weight(self) -> torch.Tensor | None:
        """The multiplier of the target's final norm (fp32, [hidden]); None if it has none."""
        layout = self._layout
        if layout.norm_name is None:
            return None
        stored = self.files.require(layout.norm_name, "the final norm")
        return norm_multiplier(layout.norm_class, self.files.read(stored, torch.float32, torch.device("cpu")))

    def attention_layer_weights(self, layer_id: int) -> dict[str, torch.Tensor]:
        """A full-attention decoder layer's weights (fp32, CPU) under a Qwen3 layer's names
        (`self_attn.q_proj.weight`, `mlp.up_proj.weight`, `input_layernorm.weight`, ...), in
        Qwen3's convention: norms as what they multiply by, and of a gated query projection
        (Qwen3.5/3.6, Qwen3-Next: per head head_dim query rows, then head_dim gate rows) the
        query rows only. For starting a drafter layer from the target's own."""
        if not 0 <= layer_id < self.num_layers or self.layer_types[layer_id] != "full_attention":
            found = self.layer_types[layer_id] if 0 <= layer_id < self.num_layers else "no such layer"
            raise FlashdraftError(
                f"{self.path}: target layer {layer_id} is {found}; expected a full_attention layer (full-attention "
                f"layers: {[i for i, t in enumerate(self.layer_types) if t == 'full_attention']})"
            )
        prefix, cpu = self._layout.layer_prefixes[layer_id], torch.device("cpu")
        names = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"self_attn.{n}_norm.weight" for n in "qk"]
        names += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += ["input_layernorm.weight", "post_attention_layernorm.weight"]
        not_qwen3 = [prefix + name for name in names if prefix + name not in self._layout.state_dict_names]
        if not_qwen3:  # MoE MLPs, MLA projections, Nemotron-H's one-mixer blocks
            raise FlashdraftError(
                f"{self.path}: target layer {layer_id} ({self.config.model_type}) has no {not_qwen3[0]}: "
                f"--layers-from-target needs a layer of Qwen3's form (q/k/v/o projections, q/k norms, a dense "
                f"gate/up/down MLP)"
            )
        weights = {}
        for name in names:
            full = prefix + name
            tensor = self.files.read(self.files.require(full, f"layer {layer_id}"), torch.float32, cpu)
            if full in self._layout.norm_classes:
                tensor = norm_multiplier(self._layout.norm_classes[full], tensor)
            weights[name] = tensor
        heads = layer_value(self.config, "num_attention_heads", layer_id)
        head_dim = layer_value(self.config, "head_dim", layer_id) or self.hidden_size // heads
        query_rows = heads * head_dim
        q = weights["self_attn.q_proj.weight"]  # [heads * head_dim (* 2 when gated), hidden]
        if q.shape[0] == 2 * query_rows:
            weights["self_attn.q_proj.weight"] = q.view(-1, 2, head_dim, q.shape[1])[:, 0].reshape(query_rows, -1)
        return weights

    # -- a forward, when one is needed after all -----------------------------------------------

    def set_context_layers(self, layer_ids: list[int]) -> None:
        check_layer_ids(layer_ids, self.num_layers)
        self._context_layer_ids = list(layer_ids)

    def forward(self, input_ids: torch.Tensor, cache=None):
        if self._model is None:
            print(f"target {self.path}: loading the whole model for a forward the cache cannot replace", flush=True)
            self._model = TargetModel.load(self.path, self.device, self.dtype)
        self._model.set_context_layers(self._context_layer_ids)
        return self._model.forward(input_ids, cache)
