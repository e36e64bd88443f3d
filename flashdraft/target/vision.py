"""Vision-language targets (Qwen3-VL, Qwen3.5/3.6 in their `...ForConditionalGeneration` layout): the images of a
conversation enter the target's language model as the model itself puts them there, and the drafter stays text-only.

- **Processor** (`ImageProcessor`): the checkpoint's own image processor settings (`preprocessor_config.json`) run
  through transformers' PIL image processor for the Qwen2-VL family (`Qwen2VLImageProcessorPil`: no torchvision,
  which `AutoProcessor` needs for Qwen3-VL's video processor), and each `<|image_pad|>` the chat template writes
  expanded to one placeholder per merged patch, as `Qwen3VLProcessor` does (tested equal to it).
- **Forward** (`VisionPrompt`): the vision tower's embeddings replace the placeholder embeddings, Qwen3-VL's
  deepstack features are added after decoder layers 0..k-1 at the image positions, and the language model runs on
  M-RoPE positions (3 rows: temporal, height, width) from the model's own `get_rope_index`; tokens after the prompt
  sit at their index plus the model's rope delta on all three rows.
- **Capture point**: vLLM's Qwen3-VL language model (`Qwen3LLMModel.forward`, vllm 0.32) adds the deepstack
  features right after layer l and only then captures the auxiliary hidden state of index l + 1 that a DFlash
  drafter reads; transformers' `output_hidden_states[l + 1]` is the same point. The context features of a layer
  that takes deepstack features are therefore taken after the addition (`TargetModel` replaces its capture).
  Qwen3.5/3.6 have no deepstack (vLLM's `Qwen3_5` model: `use_deepstack` false without
  `deepstack_visual_indexes`).
- **Served positions**: vLLM's DFlash proposer (`v1/spec_decode/dflash.py`, `set_inputs_first_pass`) hands the
  Triton kernel `copy_and_expand_dflash_inputs_kernel` the target's positions, which for an M-RoPE target are the
  model runner's `mrope_positions[:, :n]`, a [3, n] view; the kernel reads `target_positions_ptr + i`, i.e. row 0
  (temporal), for the context positions, and `row0(last context token) + 1 + k` for block position k. The drafter
  config itself must not use M-RoPE (`_raise_if_mrope`: "does not support M-RoPE yet"). So a drafter beside an
  M-RoPE target is served at M-RoPE's row 0 (`MROPE_ROW0`), not at the token index: after an image of h x w merged
  patches row 0 advances by max(h, w) while the index advances by h * w.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.errors import FlashdraftError

IMAGE_PAD = "<|image_pad|>"
# how a drafter's context and block positions are counted (recorded in checkpoints and caches)
TOKEN_INDEX = "token-index"  # text targets: position = the token's index in the sequence
MROPE_ROW0 = "mrope-row-0"  # M-RoPE targets as vLLM's DFlash proposer serves them: the temporal row
POSITION_SCHEMES = (TOKEN_INDEX, MROPE_ROW0)
SCHEME_WORDS = {
    TOKEN_INDEX: "the token index (a text target: one position row)",
    MROPE_ROW0: "M-RoPE's row 0 (temporal) for context and block, the block at row0(last context token) + 1 + k",
}
PIL_IMAGE_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")


def is_vision_language(config) -> bool:
    """A config of a vision-language model whose images enter as placeholder tokens (Qwen3-VL, Qwen3.5/3.6)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def uses_mrope(config) -> bool:
    """Whether the target's language model rotates by M-RoPE (`mrope_section` in its RoPE parameters)."""
    text = config.get_text_config(decoder=True)
    for field in ("rope_parameters", "rope_scaling"):
        params = getattr(text, field, None)
        if isinstance(params, dict) and params.get("mrope_section"):
            return True
    return False


def served_position_scheme(config) -> str:
    """The positions vLLM's DFlash proposer gives a drafter beside this target (module docstring)."""
    return MROPE_ROW0 if is_vision_language(config) and uses_mrope(config) else TOKEN_INDEX


def position_scheme_of(target) -> str:
    """The served positions of a loaded target (`TargetModel`) or one read from its files (`TargetHead`)."""
    scheme = getattr(target, "position_scheme", None)
    if scheme is not None:
        return scheme
    config = getattr(target, "full_config", None) or getattr(target, "config", None)
    return served_position_scheme(config) if config is not None else TOKEN_INDEX


def placeholder_free(target, ids: torch.Tensor) -> torch.Tensor:
    """[T] True where a token is not an image placeholder of the target (all True for a text target): the loss mask
    and the anchors never fall on a placeholder, which the target reads as an image, never as a token to draft."""
    config = getattr(target, "full_config", None) or getattr(getattr(target, "model", None), "config", None)
    image_token = getattr(config, "image_token_id", None) if config is not None else None
    return torch.ones_like(ids, dtype=torch.bool) if image_token is None else ids != image_token


def model_class_for(config):
    """The transformers auto class that builds the whole target: image-text-to-text for a vision-language config
    (its vision tower and language model), else the causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def loads_as_vision_language(path: Path, config) -> bool:
    """A checkpoint directory is loaded with its vision tower when it is a vision-language model and holds its image
    processor's settings, or when transformers builds no text-only causal LM of it (Qwen3-VL)."""
    from transformers import AutoModelForCausalLM

    if not is_vision_language(config):
        return False
    return (path / "preprocessor_config.json").is_file() or type(config) not in AutoModelForCausalLM._model_mapping


def text_state_name(name: str) -> str | None:
    """A vision-language model's tensor under the name its text-only causal LM gives it (the fingerprint's names: a
    target is the same whichever of the two layouts loaded it); None for the vision tower's tensors."""
    if name.startswith("model.visual."):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


# -- the processor ---------------------------------------------------------------------------------------------


@dataclass
class ImageInputs:
    """What the vision tower takes for one sequence's images, in order."""

    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch]
    image_grid_thw: torch.Tensor  # [images, 3]: temporal, height, width in patches


class ImageProcessor:
    """The target's processor for images: its tokenizer and its image processor settings, with no torchvision."""

    def __init__(self, tokenizer, image_processor, image_token: str = IMAGE_PAD) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.merge_size = int(image_processor.merge_size)

    @classmethod
    def from_directory(cls, path: Path, tokenizer) -> ImageProcessor:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        file = Path(path) / "preprocessor_config.json"
        if not file.is_file():
            raise FlashdraftError(
                f"{path}: no preprocessor_config.json; expected the image processor settings of a vision-language "
                f"checkpoint (the images of a prompt are processed as the model's processor processes them)"
            )
        try:
            settings = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise FlashdraftError(f"{file}: not valid JSON ({e.msg})") from None
        kind = settings.get("image_processor_type")
        if kind not in PIL_IMAGE_PROCESSORS:
            raise FlashdraftError(
                f"{file}: image_processor_type {kind!r}; expected one of {', '.join(PIL_IMAGE_PROCESSORS)} (the "
                f"Qwen2-VL family's image processor, which transformers runs on PIL)"
            )
        fields = {k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")}
        legacy = Path(path) / "chat_template.json"  # the processor's template, where the tokenizer carries none
        if not getattr(tokenizer, "chat_template", None) and legacy.is_file():
            try:
                tokenizer.chat_template = json.loads(legacy.read_text())["chat_template"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise FlashdraftError(f"{legacy}: expected a JSON object with a 'chat_template' string") from None
        return cls(tokenizer, Qwen2VLImageProcessorPil(**fields))

    def images(self, images: list) -> ImageInputs:
        """Pixel values and grids of PIL images, as the checkpoint's image processor makes them."""
        out = self.image_processor(images=images, return_tensors="pt")
        return ImageInputs(out["pixel_values"], out["image_grid_thw"])

    def placeholders(self, grid_thw: torch.Tensor) -> int:
        """Placeholder tokens of one image: its patches over the merge window."""
        return int(grid_thw.prod()) // self.merge_size**2

    def expand(self, text: str, inputs: ImageInputs, where: str) -> str:
        """`text` with its k-th image token repeated once per placeholder of the k-th image (as Qwen3VLProcessor)."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(inputs.image_grid_thw):
            raise FlashdraftError(
                f"{where}: the chat template wrote {len(pieces) - 1} image token(s) {self.image_token} for "
                f"{len(inputs.image_grid_thw)} image(s); expected one per image part"
            )
        out = pieces[0]
        for grid, piece in zip(inputs.image_grid_thw, pieces[1:], strict=True):
            out += self.image_token * self.placeholders(grid) + piece
        return out

    def encode(self, text: str, images: list, where: str) -> tuple[list[int], ImageInputs]:
        """Token ids of a rendered prompt with its images' placeholders, and the images' inputs."""
        inputs = self.images(images)
        expanded = self.expand(text, inputs, where)
        return list(self.tokenizer(expanded, add_special_tokens=False)["input_ids"]), inputs


# -- positions -------------------------------------------------------------------------------------------------


def position_runs(positions: torch.Tensor) -> list[list[int]]:
    """A drafter's positions [T] as runs [start index, position, step]: step 1 where they count up by one, 0 where
    they stay (an image's tokens on M-RoPE's row 0). The last run continues past T (the completion's tokens)."""
    values = positions.tolist()
    runs: list[list[int]] = []
    for i, p in enumerate(values):
        if runs:
            start, first, step = runs[-1]
            if p == first + step * (i - start):
                continue
            if step == 1 and i - start == 1 and p == first:  # a constant run that began one token earlier
                runs[-1][2] = 0
                continue
        runs.append([i, p, 1])
    return runs


def positions_from_runs(runs: list[list[int]] | None, length: int) -> torch.Tensor:
    """The positions [length] `position_runs` describes (None: the token index)."""
    if not runs:
        return torch.arange(length)
    out = torch.empty(length, dtype=torch.long)
    for k, (start, first, step) in enumerate(runs):
        end = runs[k + 1][0] if k + 1 < len(runs) else length
        if start < length:
            out[start:end] = first + step * torch.arange(end - start)
    return out


def check_runs(runs, where: str) -> list[list[int]] | None:
    """`position_runs` as read from a file: None, or a list of [start, position, step] starting at 0, increasing."""
    if runs is None:
        return None
    ok = isinstance(runs, list) and runs and all(isinstance(r, list) and len(r) == 3 for r in runs)
    ok = ok and all(isinstance(v, int) for r in runs for v in r) and runs[0][0] == 0
    ok = ok and all(a[0] < b[0] for a, b in zip(runs, runs[1:], strict=False)) and all(r[2] in (0, 1) for r in runs)
    if not ok:
        raise FlashdraftError(
            f"{where}: position_runs is {str(runs)[:80]}; expected a list of [start index, position, step 0 or 1] "
            f"starting at index 0"
        )
    return runs


# -- the forward -----------------------------------------------------------------------------------------------


@dataclass
class VisionPrompt:
    """One prompt's images prepared for the language model: the placeholders' embeddings, deepstack features and
    M-RoPE positions. Bound to a `TargetModel` (`TargetModel.images`), every forward over tokens of that sequence
    takes them (a prefill, a verified block, a whole record)."""

    length: int  # prompt tokens
    image_mask: torch.Tensor  # [length] True on image placeholders
    embeds: torch.Tensor  # [placeholders, H]: the vision tower's output, in placeholder order
    deepstack: list[torch.Tensor] | None  # per deepstack layer [placeholders, H] (Qwen3-VL), else None
    positions: torch.Tensor  # [3, length] M-RoPE rows of the prompt
    rope_delta: int  # tokens after the prompt sit at index + rope_delta on every row

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """M-RoPE positions [3, N, T] of token indices [N, T] of this sequence."""
        inside = index < self.length
        after = (index + self.rope_delta)[None].expand(3, -1, -1)
        prompt = self.positions[:, index.clamp(max=self.length - 1)]  # [3, N, T]
        return torch.where(inside[None], prompt, after)

    def drafter_positions(self, index: torch.Tensor) -> torch.Tensor:
        """The drafter's positions of token indices as vLLM serves them (row 0, module docstring)."""
        return self.rows(index[None] if index.dim() == 1 else index)[0].reshape(index.shape)

    def decoder_inputs(self, embed, input_ids: torch.Tensor, index: torch.Tensor) -> dict:
        """The language model's inputs for input_ids [N, T] at token indices [N, T]: embeddings with the images'
        in place of their placeholders, M-RoPE positions and, on Qwen3-VL, the deepstack features there."""
        embeds = embed(input_ids)  # [N, T, H]
        inside = index < self.length
        visual = inside & self.image_mask[index.clamp(max=self.length - 1)]  # [N, T]
        out = {"inputs_embeds": embeds, "position_ids": self.rows(index)}
        if visual.any():
            order = torch.cumsum(self.image_mask.long(), 0) - 1  # placeholder k's row in `embeds`
            rows = order[index[visual]]
            embeds = embeds.clone()
            embeds[visual] = self.embeds[rows].to(embeds.dtype)
            out["inputs_embeds"] = embeds
            if self.deepstack is not None:
                out["visual_pos_masks"] = visual
                out["deepstack_visual_embeds"] = [f[rows].to(embeds.dtype) for f in self.deepstack]
        return out


class VisionTower:
    """A vision-language target's vision side: its tower, its image token and its M-RoPE index."""

    def __init__(self, model) -> None:
        self.inner = model.model  # Qwen3VLModel / Qwen3_5Model: visual + language_model
        self.config = model.config
        self.image_token_id = int(model.config.image_token_id)
        self.merge_size = int(model.config.vision_config.spatial_merge_size)
        self.deepstack_layers = len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or [])
        self.position_scheme = served_position_scheme(model.config)

    @torch.no_grad()
    def prompt_positions(self, prompt_ids: list[int], image_grid_thw: torch.Tensor) -> torch.Tensor:
        """The drafter's positions [T] of a prompt as served (row 0 of the model's M-RoPE index; no tower run)."""
        if self.position_scheme != MROPE_ROW0:
            return torch.arange(len(prompt_ids))
        ids = torch.tensor([prompt_ids])
        mask = (ids == self.image_token_id).int()
        positions, _ = self.inner.get_rope_index(ids, mask, image_grid_thw=image_grid_thw.cpu())
        return positions[0, 0]

    @torch.no_grad()
    def prepare(self, prompt_ids: list[int], inputs: ImageInputs, where: str) -> VisionPrompt:
        device = next(self.inner.parameters()).device
        ids = torch.tensor([prompt_ids], device=device)  # [1, T]
        grids = inputs.image_grid_thw.to(device)
        mask = ids[0] == self.image_token_id
        expected = int((grids.prod(-1) // self.merge_size**2).sum())
        if int(mask.sum()) != expected:
            raise FlashdraftError(
                f"{where}: {int(mask.sum())} image placeholder tokens for {len(grids)} image(s) of {expected} "
                f"placeholders; expected the prompt rendered with these images"
            )
        features = self.inner.get_image_features(inputs.pixel_values.to(device), grids, return_dict=True)
        embeds = torch.cat(list(features.pooler_output), dim=0)  # [placeholders, H]
        deepstack = None
        if self.deepstack_layers and getattr(features, "deepstack_features", None) is not None:
            deepstack = [torch.cat(list(f), dim=0) for f in features.deepstack_features]
        positions, delta = self.inner.get_rope_index(ids, mask[None].int(), image_grid_thw=grids)
        return VisionPrompt(len(prompt_ids), mask, embeds, deepstack, positions[:, 0], int(delta.reshape(-1)[0]))


class VisionBinding:
    """What `TargetModel` does with images (a mixin: its attributes `vision`, `decoder`, `path`, `_vision_prompt`,
    `_registered_images`, `_captured`, `_context_layer_ids` and `_last_layer_run` are the target's): bind a prompt's
    images to its forwards, capture after deepstack, and give the drafter's positions as served. `cache` arguments
    are the target's `TargetCache` (its `vision` field holds the images of the sequence in it)."""

    def _capture_after_deepstack(self) -> None:
        """Qwen3-VL adds deepstack features to the output of its first layers at the image positions; vLLM captures
        a layer's output after that addition (`flashdraft.target.vision`), so the capture of such a layer is replaced
        by the sum."""
        add = self.decoder._deepstack_process

        def after_deepstack(hidden_states, visual_pos_masks, visual_embeds):
            out = add(hidden_states, visual_pos_masks, visual_embeds)
            if self._last_layer_run in self._context_layer_ids:
                self._captured[self._last_layer_run] = out
            return out

        self.decoder._deepstack_process = after_deepstack

    @contextlib.contextmanager
    def images(self, prompt_ids: list[int], inputs: ImageInputs | None, where: str = "a prompt"):
        """Within the block, every forward over tokens of the sequence that starts with `prompt_ids` takes its
        images (`inputs`; None: a text-only sequence, nothing bound)."""
        if inputs is None:
            yield None
            return
        if self.vision is None:
            raise FlashdraftError(
                f"{where}: has image parts, but the target {self.path} reads text only (no vision tower loaded); "
                f"expected a vision-language checkpoint with its preprocessor_config.json"
            )
        previous, self._vision_prompt = self._vision_prompt, self.vision.prepare(prompt_ids, inputs, where)
        try:
            yield self._vision_prompt
        finally:
            self._vision_prompt = previous

    def register_images(
        self, prompt_ids: list[int], load: Callable[[], ImageInputs], where: str, sources: tuple = ()
    ) -> None:
        """Every later forward from the start of a sequence that begins with `prompt_ids` takes the images `load`
        gives (read when such a forward runs); its cached continuation keeps them (`TargetCache.vision`)."""
        if self.vision is None:
            raise FlashdraftError(
                f"{where}: has images, but the target {self.path} reads text only (no vision tower loaded); "
                f"expected a vision-language checkpoint with its preprocessor_config.json"
            )
        key = tuple(prompt_ids)
        earlier = self._registered_images.get(key)
        if earlier is not None and earlier[2] != sources:  # the same tokens with other images: never guessed
            load, where = None, f"{earlier[1]} and {where}"
        self._registered_images[key] = (load, where, sources)

    def _vision_for(self, input_ids: torch.Tensor, cache) -> VisionPrompt | None:
        """The images a forward takes: those bound (`images`), else its cache's, else those registered for the
        sequence it starts (a forward from position 0 of one row)."""
        if self._vision_prompt is not None:
            found = self._vision_prompt
        elif cache is not None and cache.vision is not None:
            return cache.vision
        elif self._registered_images and (cache is None or cache.length == 0) and input_ids.shape[0] == 1:
            row = tuple(input_ids[0].tolist())
            lengths = {len(k) for k in self._registered_images}
            key = next((row[:n] for n in sorted(lengths, reverse=True) if row[:n] in self._registered_images), None)
            if key is None:
                return None
            load, where, _ = self._registered_images[key]
            if load is None:
                raise FlashdraftError(
                    f"{where}: the same prompt tokens with different images; a forward over them cannot tell which "
                    f"images it reads (bind the record's images: `TargetModel.images`)"
                )
            found = self.vision.prepare(list(key), load(), where)
        else:
            return None
        if cache is not None:
            cache.vision = found
        return found

    @property
    def position_scheme(self) -> str:
        """How a drafter's positions are counted beside this target as served (`flashdraft.target.vision`)."""
        return self.vision.position_scheme if self.vision is not None else TOKEN_INDEX

    def drafter_positions(self, index: torch.Tensor, cache=None) -> torch.Tensor:
        """The drafter's positions of token indices of the bound sequence (or the one in `cache`): the index itself
        for text, M-RoPE's row 0 where images are bound on an M-RoPE target (as vLLM's DFlash proposer serves them)."""
        prompt = self._vision_prompt or (cache.vision if cache is not None else None)
        if prompt is None or self.position_scheme == TOKEN_INDEX:
            return index
        return prompt.drafter_positions(index)

    def drafter_position_shift(self, cache=None) -> int:
        """What the drafter's position of a token after the prompt adds to its index (M-RoPE's rope delta where
        images are bound on an M-RoPE target; else 0)."""
        prompt = self._vision_prompt or (cache.vision if cache is not None else None)
        return 0 if prompt is None or self.position_scheme == TOKEN_INDEX else prompt.rope_delta
