"""A quantised target: what its checkpoint says (the scheme, which layers, the LM head's dtype), whether it runs here,
and the weights it computes with, read from its files for the offline fingerprint.

transformers 5.23 loads compressed-tensors checkpoints (llm-compressor's W8A8, FP8_DYNAMIC, W4A16) on a CPU once the
`compressed-tensors` package is installed: it decompresses each quantised weight into the load dtype
(`weight = q * scale`, or `(q - zero_point) * scale`) and keeps its quantised forward (activations quantised per
token where the scheme says so). The loaded model's state dict then holds the dequantised weight beside its scales,
while the files hold the int8/fp8 values and the scales. A target's identity is the weights it computes with, so
the fingerprint hashes the dequantised weights on both sides (the scales are in them) and leaves the quantisation
parameters out; `dequantised_sample` computes the loaded values from the files, sample by sample.

Other quantisation methods (AWQ, GPTQ, bitsandbytes, transformers' own fp8) load where their packages and kernels
are; where they do not, loading is refused in one line naming the scheme (`load_error`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashdraft.errors import FlashdraftError

# safetensors' dtype names (the header's "dtype")
SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints (compressed-tensors float-quantized)
    "F8_E5M2": torch.float8_e5m2,
}
# the parameters a quantised linear layer holds beside (or instead of) its weight; the dequantised weight carries them
QUANTISATION_PARAMETERS = (
    "weight_scale",
    "weight_zero_point",
    "weight_global_scale",
    "weight_g_idx",
    "weight_shape",
    "weight_packed",
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
    "output_zero_point",
    "k_scale",
    "v_scale",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
)
# the stored weight formats whose samples `dequantised_sample` computes: one stored value per weight element
ELEMENTWISE_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")


def quantisation_config_of(config) -> dict | None:
    """The `quantization_config` of a model config (a dict as read from config.json, or the object a loaded model
    holds), as a dict; None for an unquantised target."""
    qc = getattr(config, "quantization_config", None)
    if qc is None and isinstance(config, dict):
        qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return qc


def is_quantisation_parameter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in QUANTISATION_PARAMETERS


def _args_name(args: dict | None, role: str) -> str:
    """`int8 channel`, `fp8 token dynamic`, ... of a compressed-tensors QuantizationArgs dict."""
    if not args:
        return "none"
    kind = "fp" if args.get("type") == "float" else "int"
    parts = [f"{kind}{args.get('num_bits')}", str(args.get("strategy") or "tensor")]
    if args.get("group_size"):
        parts[-1] += f" {args['group_size']}"
    if role == "input" and args.get("dynamic"):
        parts.append("dynamic")
    return " ".join(parts)


def scheme_name(qc: dict) -> str:
    """A scheme's usual name: int8 W8A8, FP8 dynamic, W4A16, NVFP4 (compressed-tensors); AWQ int4, GPTQ int4, ..."""
    method = qc.get("quant_method", "unknown")
    if method != "compressed-tensors":
        bits = qc.get("bits") or qc.get("w_bit")
        label = {"awq": "AWQ", "gptq": "GPTQ", "fp8": "FP8 (transformers)", "bitsandbytes": "bitsandbytes"}.get(
            method, method
        )
        if method == "bitsandbytes":
            bits = 4 if qc.get("load_in_4bit") else 8 if qc.get("load_in_8bit") else bits
        return f"{label} int{bits}" if bits else label
    names = []
    for group in (qc.get("config_groups") or {}).values():
        weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
        w_bits, a_bits = weights.get("num_bits"), inputs.get("num_bits")
        w_float, a_float = weights.get("type") == "float", inputs.get("type") == "float"
        if w_bits == 8 and a_bits == 8 and w_float and a_float:
            name = "FP8 dynamic" if inputs.get("dynamic") else "FP8"
        elif w_bits == 8 and a_bits == 8 and not w_float and not a_float:
            name = "int8 W8A8"
        elif w_bits == 4 and w_float:
            name = "NVFP4" if a_bits == 4 else "NVFP4A16"
        else:
            name = f"{'FP' if w_float else 'int'}{w_bits} W{w_bits}A{a_bits or 16}"
            name = "W4A16" if (w_bits, a_bits, w_float) == (4, None, False) else name
        names.append(name)
    return " + ".join(dict.fromkeys(names)) or "compressed-tensors (no groups)"


@dataclass(frozen=True)
class Quantisation:
    """What a target's checkpoint says of its quantisation; `method` "none" for an unquantised target."""

    method: str  # quant_method: compressed-tensors, awq, gptq, ...; "none"
    scheme: str  # int8 W8A8, FP8 dynamic, W4A16, ...; "none"
    format: str  # compressed-tensors' stored format (int-quantized, float-quantized, pack-quantized, ...); "" else
    weights: str  # e.g. "int8 channel"
    activations: str  # e.g. "int8 token dynamic"; "none" for weight-only schemes
    quantised_layers: int  # linear layers stored quantised
    ignore: tuple[str, ...]  # what the config leaves unquantised (lm_head, ...)
    lm_head_dtype: str  # the LM head as stored: bf16, f32, int8 (quantised), ...

    @property
    def quantised(self) -> bool:
        return self.method != "none"

    def describe(self) -> str:
        if not self.quantised:
            return f"not quantised (weights {self.lm_head_dtype})"
        ignore = f", left out: {', '.join(self.ignore)}" if self.ignore else ""
        return (
            f"{self.scheme} ({self.method}{', ' + self.format if self.format else ''}: weights {self.weights}, "
            f"activations {self.activations}; {self.quantised_layers} linear layers quantised{ignore}; "
            f"LM head {self.lm_head_dtype})"
        )

    def record(self) -> dict:
        return asdict(self) | {"ignore": list(self.ignore)}

    @classmethod
    def from_record(cls, record: dict | None) -> Quantisation | None:
        """A recorded quantisation (a cache's or checkpoint's); None where none was recorded (made before)."""
        if not isinstance(record, dict):
            return None
        try:
            return cls(**{**record, "ignore": tuple(record.get("ignore", ()))})
        except TypeError:
            return None

    def same_as(self, other: Quantisation) -> bool:
        """Whether two targets are quantised alike (the scheme and the layers; where they were loaded aside)."""
        return (self.method, self.scheme, self.format, self.quantised_layers, self.lm_head_dtype) == (
            other.method,
            other.scheme,
            other.format,
            other.quantised_layers,
            other.lm_head_dtype,
        )


STORED_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}


def read_quantisation(config, stored_dtypes: dict[str, torch.dtype], lm_head_name: str) -> Quantisation:
    """The quantisation of a target from its config and its stored tensors' dtypes by name (`lm_head_name`: the
    stored name of the LM head's values, the embedding's where tied)."""
    qc = quantisation_config_of(config)
    head_dtype = stored_dtypes.get(lm_head_name)
    head = STORED_DTYPE_NAMES.get(head_dtype, str(head_dtype).removeprefix("torch.")) if head_dtype else "unknown"
    module = lm_head_name.removesuffix(".weight")
    if any(f"{module}.{p}" in stored_dtypes for p in QUANTISATION_PARAMETERS):
        head += " (quantised)"
    if qc is None:
        return Quantisation("none", "none", "", head, "none", 0, (), head)
    modules = {n.rsplit(".", 1)[0] for n in stored_dtypes if n.rsplit(".", 1)[-1] in ("weight_scale", "qweight")}
    groups = list((qc.get("config_groups") or {}).values())
    first = groups[0] if groups else {}
    weights = _args_name(first.get("weights"), "weights") if groups else f"int{qc.get('bits', '?')}"
    activations = _args_name(first.get("input_activations"), "input") if groups else "none"
    ignore = tuple(str(x) for x in qc.get("ignore") or qc.get("modules_to_not_convert") or ())
    return Quantisation(
        method=str(qc.get("quant_method", "unknown")),
        scheme=scheme_name(qc),
        format=str(qc.get("format") or ""),
        weights=weights,
        activations=activations,
        quantised_layers=len(modules),
        ignore=ignore,
        lm_head_dtype=head,
    )


def identity_of(config) -> str:
    """What of the quantisation goes into the fingerprint: the scheme as configured (not where it was loaded: the
    status, compressed on disk and decompressed in memory, and the writer's version are left out)."""
    qc = quantisation_config_of(config)
    if qc is None:
        return ""
    kept = {k: qc.get(k) for k in ("quant_method", "config_groups", "ignore", "kv_cache_scheme", "format", "bits")}
    return json.dumps({k: v for k, v in kept.items() if v not in (None, {}, [])}, sort_keys=True, default=str)


def load_error(path, qc: dict, error: BaseException) -> FlashdraftError:
    """One line for a quantised checkpoint that does not load or run here, naming its scheme."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:240]
    hint = ""
    if qc.get("quant_method") == "compressed-tensors" and isinstance(error, ImportError):
        hint = "; install the compressed-tensors package (pip install compressed-tensors==0.20.1)"
    return FlashdraftError(
        f"{path}: quantised target ({scheme_name(qc)}, {qc.get('quant_method')}) cannot run here: "
        f"{type(error).__name__}: {first}{hint}"
    )


def dequantised_sample(
    weight: torch.Tensor, shape: tuple[int, ...], indices: torch.Tensor, parameters: dict[str, torch.Tensor], fmt: str
) -> torch.Tensor | None:
    """The dequantised values of a weight of `shape` at flat `indices`, as compressed-tensors decompresses them on
    load (`(q - zero_point) * scale`, in fp32): `weight` [len(indices)] the stored values there (int8 or fp8),
    `parameters` the module's stored `weight_scale` (and `weight_zero_point`, whole). None for a layout this does not
    compute (packed int4, NVFP4's global scale, an activation-ordered group index)."""
    scale = parameters.get("weight_scale")
    if fmt not in ELEMENTWISE_FORMATS or scale is None or len(shape) != 2 or "weight_g_idx" in parameters:
        return None
    if "weight_global_scale" in parameters:
        return None
    rows, cols = shape
    row, col = indices // cols, indices % cols
    zero = parameters.get("weight_zero_point")

    def at(t: torch.Tensor) -> torch.Tensor:
        """t broadcast over the weight (tensor, channel [rows, 1], group [rows, groups], block [r/bh, c/bw])."""
        if t.numel() == 1:
            return t.reshape(1).expand(len(indices))
        if t.dim() == 1:
            t = t[:, None]
        r_block, c_block = -(-rows // t.shape[0]), -(-cols // t.shape[1])
        return t[row // r_block, col // c_block]

    q = weight.float()
    if zero is not None:
        q = q - at(zero).float()
    return q * at(scale).float()


# stored dtypes that hold quantised values (not the values a model computes with)
QUANTISED_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)


def stored_format(qc: dict | None) -> str:
    """compressed-tensors' stored format of the weights: the config's, else its groups' one format."""
    if not qc:
        return ""
    formats = {g.get("format") for g in (qc.get("config_groups") or {}).values() if g.get("format")}
    fmt = qc.get("format")
    return str(fmt if fmt and fmt != "mixed-precision" else formats.pop() if len(formats) == 1 else fmt or "")


def stored_dtypes(path) -> dict[str, torch.dtype] | None:
    """Every tensor's stored dtype by name, from the safetensors headers of a local checkpoint (`model.safetensors`,
    or the shards its index names); None where it has none (a model built in memory)."""
    from safetensors import safe_open

    if path is None:
        return None
    path = Path(path)
    files = [path / "model.safetensors"]
    if (path / "model.safetensors.index.json").is_file():
        weight_map = json.loads((path / "model.safetensors.index.json").read_text()).get("weight_map", {})
        files = [path / name for name in sorted(set(weight_map.values()))]
    files = [f for f in files if f.is_file()]
    if not files:
        return None
    dtypes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                dtypes[name] = SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
    return dtypes


def quantisation_of(config, path, model) -> Quantisation:
    """The quantisation of a loaded target: from its config and, where it has them, its files (what is stored
    quantised, under the names the files use); from its state dict for a model built in memory."""
    names = {id(m): n for n, m in model.named_modules()}
    head = names[id(model.get_output_embeddings())] + ".weight"
    embed = names[id(model.get_input_embeddings())] + ".weight"
    dtypes = stored_dtypes(path) or {n: t.dtype for n, t in model.state_dict().items()}
    # the stored name of the LM head's values: its own, under a prefix the files may add, else the tied embedding's
    for name in (head, embed):
        found = next((n for n in dtypes if n == name or n.endswith("." + name.removeprefix("model."))), None)
        if found is not None:
            return read_quantisation(config, dtypes, found)
    return read_quantisation(config, dtypes, head)


def quantisation_record(target) -> dict | None:
    """What a cache or a run records of its target's quantisation; None for a target that cannot say (an engine's)."""
    quantisation = getattr(target, "quantisation", None)
    return quantisation.record() if isinstance(quantisation, Quantisation) else None


def mismatch(recorded: Quantisation | None, target_quantisation: Quantisation | None) -> str | None:
    """A line naming two quantisations that differ (the recorded one, then the target's); None where they agree
    or either is unknown."""
    if recorded is None or target_quantisation is None or recorded.same_as(target_quantisation):
        return None
    return (
        f"captured from a target quantised {_short(recorded)}, this target is quantised {_short(target_quantisation)}"
    )


def _short(q: Quantisation) -> str:
    return f"{q.scheme} ({q.method})" if q.quantised else f"none ({q.lm_head_dtype})"


def is_quantised_checkpoint(config) -> bool:
    return quantisation_config_of(config) is not None
