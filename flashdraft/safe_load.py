"""Files from elsewhere execute nothing: run directories, drafters, targets and data are shared
between people and machines, so every file flashdraft reads is parsed as data, never run.

- `.pt` files (trainer state, bare state dicts) are read by `load_tensors_only`: torch's
  `weights_only` unpickler, which builds tensors, numbers, strings and containers and refuses any
  other object a pickle names before calling it; what it refuses is an `UnsafeFileError`.
- what flashdraft writes into a `.pt` is checked to be of those types (`to_plain`), so that its
  own files always load that way; `to_plain(..., convert=True)` turns an older file's numpy
  values into them (`flashdraft convert-run`).
- transformers never runs a model directory's own code (`HF_LOCAL`: no `trust_remote_code`, no
  download); a prompt directory holding a `datasets` loading script is refused (`refuse_script`).

Everything else is JSON, YAML (`yaml.safe_load`), safetensors, Parquet/Arrow or a tokenizer's
JSON, which no reader executes.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

from flashdraft.errors import FlashdraftError

# transformers' from_pretrained options for a local target: its files only (no download), and
# the code a config's `auto_map` names is never run: left at None, transformers asks on a
# terminal and runs it on "y"; False makes such a model an error, a natively supported one loads.
HF_LOCAL = {"local_files_only": True, "trust_remote_code": False}


def hf_load_error(path: Path, what: str, e: Exception) -> FlashdraftError:
    """The one-line error of a failed from_pretrained of `what` (a target's model, or its config
    and tokenizer), naming the refused custom code when that was the cause."""
    if "custom code" in str(e):  # transformers' refusal under trust_remote_code=False
        return FlashdraftError(
            f"{path}: {what} needs Python code shipped in the model directory (auto_map); "
            f"flashdraft runs none, expected an architecture transformers has"
        )
    return FlashdraftError(f"{path}: cannot load {what} ({_first_line(e)})")


class UnsafeFileError(FlashdraftError):
    """A file only executing code could load (a pickle naming objects other than tensors and
    plain containers): refused before any of it runs."""


def load_tensors_only(path: Path, hint: str = "", mmap: bool = False) -> Any:
    """torch.load of `path` that runs nothing from it (`weights_only=True`). `hint`: what to do
    with a refused file; `mmap`: tensors left on disk until read (a check of a large file)."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        names = sorted(set(re.findall(r"GLOBAL ([\w.]+)", str(e))))
        found = f"names {', '.join(names)}" if names else f"holds what torch's safe loader refuses ({_first_line(e)})"
        raise UnsafeFileError(
            f"{path}: a pickle that {found}; expected only tensors and plain containers, as loading anything else "
            f"could run code the file carries (none of it was run)" + (f"; {hint}" if hint else "")
        ) from None
    except Exception as e:  # torch raises many types for a truncated or foreign file
        raise FlashdraftError(
            f"{path}: not readable by torch.load ({type(e).__name__}: {_first_line(e)}); "
            f"truncated or corrupt, copy it again"
        ) from None


def _first_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(e).__name__


def to_plain(obj: Any, where: str, convert: bool = False) -> Any:
    """`obj` when it holds only what `load_tensors_only` reads (tensors, dtypes, devices, None,
    bools, numbers, strings, bytes, and lists, tuples and dicts of them); else a FlashdraftError
    naming the first other value by its key path. `convert`: numpy arrays become tensors and numpy
    scalars Python numbers instead (what older trainer states held)."""
    import torch

    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.Tensor, torch.dtype, torch.device)):
        return obj
    if type(obj) in (dict, OrderedDict) and all(k is None or isinstance(k, (str, int, float)) for k in obj):
        return type(obj)((k, to_plain(v, f"{where}[{k!r}]", convert)) for k, v in obj.items())
    if type(obj) in (list, tuple, torch.Size):
        return type(obj)(to_plain(v, f"{where}[{i}]", convert) for i, v in enumerate(obj))
    if convert and type(obj).__module__ == "numpy":
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            return torch.from_numpy(np.ascontiguousarray(obj))
    raise FlashdraftError(
        f"{where}: a {type(obj).__module__}.{type(obj).__qualname__}; expected only tensors, numbers, strings, "
        f"None and lists, tuples and dicts of them (what torch.load reads without running code)"
    )


def refuse_script(directory: Path) -> None:
    """Refuse a `datasets` directory with a loading script (DIR/DIR.py, the file older datasets
    versions run): datasets >= 4 runs none, and flashdraft does not depend on which is installed."""
    script = directory.resolve() / f"{directory.resolve().name}.py"
    if script.is_file():
        raise FlashdraftError(
            f"{script}: a dataset loading script; flashdraft runs no code from data, expected data files only "
            f"(.jsonl, .json, .parquet) or a Dataset.save_to_disk directory"
        )
