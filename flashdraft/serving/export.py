"""`flashdraft export`: any accepted checkpoint form (drafter directory, training run, bare
state dict) to the public drafter format, with a README that shows how to serve it."""

from __future__ import annotations

from pathlib import Path

import torch

from flashdraft.drafter.checkpoint import check_drafter_matches_target, save_drafter
from flashdraft.drafter.config import DrafterConfig
from flashdraft.drafter.families import family
from flashdraft.drafter.init import mask_token_string
from flashdraft.drafter.run_dir import LoadedDrafter, load_any_drafter
from flashdraft.drafter.server_fields import SGLANG, VLLM
from flashdraft.errors import FlashdraftError
from flashdraft.files import write_text_atomic
from flashdraft.serving.chat_mode import trained_mode_lines
from flashdraft.serving.checks import serving_commands
from flashdraft.serving.family_rules import V2_RUNNER, mixes_sliding_and_full

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def serving_snippet(target: str, drafter_dir: str, cfg: DrafterConfig) -> str:
    """README text with the vLLM and SGLang command lines for a drafter directory."""
    vllm, sglang = serving_commands(cfg, target, drafter_dir)
    sglang = sglang.replace(" --speculative-draft-model-path", " \\\n    --speculative-draft-model-path")
    b = cfg.block_size
    name = family(cfg.family).title
    drafts = cfg.drafts_per_block
    if cfg.family == "dspark":
        v2 = (
            f"\nA DSpark drafter (`Qwen3DSparkModel`): {cfg.describe_layout()}; a Markov head\n"
            f"(rank {cfg.markov_rank}) drafts the block left to right"
            + (", and a confidence head estimates each draft's acceptance" if cfg.confidence_head else "")
            + f".\nvLLM serves it with method `dspark` and `num_speculative_tokens` {b} (= block_size: a shorter\n"
            f"block changes every draft); SGLang with `DSPARK` and `--speculative-dspark-block-size` {b}.\n"
        )
    elif cfg.family == "dflash2":  # the runner it needs and the conv's block
        v2 = (
            f"\nA DFlash2 drafter (`DFlash2DraftModel`: a convolution around each sublayer and a candidate\n"
            f"selector). {VLLM} runs it on the V2 model runner, its default (the command pins it:\n"
            f"`{V2_RUNNER}`); the V1 runner, chosen when a feature V2 lacks is asked for, refuses it\n"
            f"with an error. vLLM takes the convolutions' block from\n"
            f"`1 + num_speculative_tokens`, so `num_speculative_tokens` must be {b - 1}: any other value\n"
            f"convolves across another block than the drafter was trained with. The vLLM method stays\n"
            f"`dflash` (the checkpoint's `architectures` selects DFlash2); SGLang serves it as\n"
            f"`DFLASH`.\n"
        )
    elif mixes_sliding_and_full(cfg):
        v2 = (
            f"\nIts layers mix sliding and full attention: {VLLM} serves it only with the V2 model runner\n"
            f"(`{V2_RUNNER}`).\n"
        )
    else:
        v2 = ""
    head = (
        "no\nLM head: it borrows the target's"
        if cfg.draft_vocab_size is None
        else f"its own LM head\nover {cfg.draft_vocab_size} tokens (`d2t` maps them to the target's; vLLM serves it, "
        f"SGLang's DFlash\nignores that head)"
    )
    mode_lines = trained_mode_lines(cfg)
    chat_mode = (
        ""
        if len(mode_lines) < 2
        else f"\n## Chat mode\n\n{mode_lines[0][0].upper()}{mode_lines[0][1:]}.\n\nA server renders a chat "
        f"request with its template and its default kwargs; prompts in another mode are\ntext the drafter "
        f"was not trained on (acceptance falls): {mode_lines[1]}.\n"
    )
    return f"""# {name} drafter

Exported by flashdraft in the public {name} format (`config.json` + `model.safetensors`),
block size {b} ({drafts} drafted tokens per step). It has no embedding and {head}, so serve it with its target model.

Layers, as both servers run them: {cfg.describe_layers()}.
{v2}
## Serving

These are the command lines of {VLLM} and {SGLANG} at the time of writing (vLLM
ignores `block_size`: `num_speculative_tokens` is {drafts}); check your server's documentation if
they have changed.
`flashdraft doctor {drafter_dir} --serving` checks every serving rule.

vLLM:

```sh
{vllm}
```

SGLang:

```sh
{sglang}
```
{chat_mode}"""


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
    bf16/fp16/fp32, or auto = as stored. With `target` (a TargetModel or TargetHead) the drafter
    is checked against it and `dflash_config.mask_token` is written (the token's string, which
    SGLang checks against mask_token_id)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise FlashdraftError(f"--dtype {dtype}: expected auto, {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise FlashdraftError(f"{out}: exists and is not empty (nor a drafter directory); choose a new --out")
    loaded = load_any_drafter(
        checkpoint, target, block_size=block_size, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id
    )
    if out.resolve() == loaded.path.resolve():
        raise FlashdraftError(f"{out}: is the checkpoint being exported; choose another --out")
    cfg = loaded.drafter.config
    if target is not None:
        check_drafter_matches_target(cfg, target, str(loaded.path))
        token = mask_token_string(cfg, target)
        if token is not None:
            cfg.extra["dflash_config"] = {**cfg.dflash_options, "mask_token": token}
    save_drafter(loaded.drafter, out, dtype=loaded.stored_dtype if dtype == "auto" else DTYPES[dtype])
    name = target_name or (str(target.path) if target is not None and target.path else "<target-model>")
    # describe what was written (is_causal stated where the source left it to the servers' default)
    written = DrafterConfig.load(out / "config.json")
    write_text_atomic(out / "README.md", serving_snippet(name, str(out), written), "the serving README")
    return loaded
