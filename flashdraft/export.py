"""`flashdraft export`: any accepted checkpoint form (drafter directory, training run, bare
state dict) to the public drafter format, with a README that shows how to serve it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flashdraft.checkpoint import save_drafter
from flashdraft.errors import FlashdraftError
from flashdraft.run_dir import LoadedDrafter, load_any_drafter

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def serving_snippet(target: str, drafter_dir: str, block_size: int) -> str:
    """README text with the vLLM and SGLang command lines for a drafter directory."""
    spec = json.dumps({"method": "dflash", "model": drafter_dir, "num_speculative_tokens": block_size - 1})
    return f"""# DFlash drafter

Exported by flashdraft in the public DFlash format (`config.json` + `model.safetensors`),
block size {block_size} ({block_size - 1} drafted tokens per step). It has no embedding and no
LM head: it borrows the target's, so serve it with its target model.

## Serving

These are the command lines documented by vLLM and SGLang at the time of writing; check
your server's documentation if they have changed.

vLLM:

```sh
vllm serve {target} --speculative-config '{spec}'
```

SGLang:

```sh
python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH \\
    --speculative-draft-model-path {drafter_dir}
```
"""


def export_drafter(
    checkpoint: str | Path,
    out_dir: str | Path,
    target=None,
    *,
    target_name: str | None = None,
    dtype: str = "auto",
    block_size: int | None = None,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
) -> LoadedDrafter:
    """Write `checkpoint` (any form `load_any_drafter` accepts; a bare state dict needs
    `target`, a `TargetModel`) to out_dir in the public format plus README.md. dtype:
    bf16/fp16/fp32, or auto = as stored."""
    if dtype != "auto" and dtype not in DTYPES:
        raise FlashdraftError(f"--dtype {dtype}: expected auto, {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise FlashdraftError(f"{out}: exists and is not empty (nor a drafter directory); choose a new --out")
    loaded = load_any_drafter(checkpoint, target, block_size=block_size, target_layer_ids=target_layer_ids,
                              mask_token_id=mask_token_id)  # fmt: skip
    if out.resolve() == loaded.path.resolve():
        raise FlashdraftError(f"{out}: is the checkpoint being exported; choose another --out")
    save_drafter(loaded.drafter, out, dtype=loaded.stored_dtype if dtype == "auto" else DTYPES[dtype])
    name = target_name or (str(target.path) if target is not None and target.path else "<target-model>")
    (out / "README.md").write_text(serving_snippet(name, str(out), loaded.drafter.config.block_size))
    return loaded
