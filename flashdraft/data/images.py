"""Images in prompt data and completion records, for vision-language targets (`flashdraft.target.vision`).

Read (`image_part`): OpenAI content parts `{"type": "image_url", "image_url": {"url": U}}` (or the URL as a
string) and `{"type": "image", "image": U}`, where U is a local path (relative to the prompt file's folder), a
`file://` URL or a `data:image/...;base64,` URL. Nothing is fetched: a remote URL is refused in one line, and so is a
path that is not a file. LLaVA rows (`image` beside `conversations` whose text holds `<image>`) and ShareGPT rows with
an `images` list become the same parts (`llava_parts`). Every part is normalised to `{"type": "image", "image": U}`
with U absolute, so the record of a prompt names the files it read, and the chat template sees an image part as
the servers give it one.

Images open with PIL (`flashdraft.target.image_files`): no file read runs code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from flashdraft.errors import FlashdraftError
from flashdraft.target.image_files import data_url_bytes

LLAVA_IMAGE = "<image>"  # LLaVA's and ShareGPT's placeholder for an image in a message's text


def image_source(ref: Any, base: Path | None, where: str) -> str:
    """The image a part names, as an absolute local path or a data: URL; remote URLs and missing files refused."""
    if not isinstance(ref, str) or not ref:
        raise FlashdraftError(f"{where}: image is {str(ref)[:80]!r}; expected a local path, file:// or data: URL")
    if ref.startswith("data:"):
        data_url_bytes(ref, where)  # refused now if it does not decode
        return ref
    scheme = urlparse(ref).scheme
    if scheme == "file":
        path = Path(unquote(urlparse(ref).path))
    elif scheme and len(scheme) > 1:  # "C:" is a drive, not a scheme
        raise FlashdraftError(
            f"{where}: image {ref[:80]!r} is a remote URL; nothing is fetched from the network: expected a local "
            f"path, a file:// or a data: URL (download the image and name the file)"
        )
    else:
        path = Path(ref)
        if not path.is_absolute() and base is not None:
            path = base / path
    if not path.is_file():
        raise FlashdraftError(f"{where}: image file {path} does not exist; expected a local image file")
    return str(path.resolve())


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def image_part(part: dict[str, Any], base: Path | None, where: str) -> dict[str, str]:
    """An OpenAI `image_url` part or an `image` part, normalised to {"type": "image", "image": source}."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        ref = url.get("url") if isinstance(url, dict) else url
    else:
        ref = part.get("image", part.get("url"))
    return {"type": "image", "image": image_source(ref, base, where)}


def llava_parts(text: str, sources: list[str], where: str) -> tuple[list[dict[str, str]], int]:
    """A message's text whose `<image>` markers stand for the next images of `sources`, as content parts; returns
    the parts and how many images they took."""
    pieces = text.split(LLAVA_IMAGE)
    if len(pieces) - 1 > len(sources):
        raise FlashdraftError(
            f"{where}: {len(pieces) - 1} {LLAVA_IMAGE} markers for {len(sources)} image(s); expected one image each"
        )
    parts: list[dict[str, str]] = []
    for k, piece in enumerate(pieces):
        if k > 0:
            parts.append({"type": "image", "image": sources[k - 1]})
        if piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    return parts, len(pieces) - 1


def row_images(row: dict[str, Any], base: Path | None, loc: str) -> list[str] | None:
    """The images of a LLaVA row (`image`: one path or a list) or a ShareGPT row (`images`), resolved; None if none."""
    given = row.get("images", row.get("image"))
    if given is None:
        return None
    name = "images" if "images" in row else "image"
    given = [given] if isinstance(given, str) else given
    if not isinstance(given, list) or not given:
        raise FlashdraftError(f"{loc}: field {name!r} is {str(given)[:80]}; expected a path or a list of paths")
    return [image_source(ref, base, f"{loc}: {name}[{k}]") for k, ref in enumerate(given)]


def with_row_images(messages: list[dict[str, Any]], sources: list[str], loc: str) -> list[dict[str, Any]]:
    """Messages whose `<image>` markers take `sources` in order; with no marker at all, the images open the first
    user message (as LLaVA's data puts them). Every image must be placed."""
    placed, out = 0, []
    marked = any(LLAVA_IMAGE in m["content"] for m in messages if isinstance(m.get("content"), str))
    for k, message in enumerate(messages):
        content = message.get("content")
        if marked and isinstance(content, str) and LLAVA_IMAGE in content:
            parts, used = llava_parts(content, sources[placed:], f"{loc}: message {k}")
            message, placed = message | {"content": parts}, placed + used
        elif not marked and placed == 0 and message["role"] == "user":
            text = [{"type": "text", "text": content}] if isinstance(content, str) and content else []
            message, placed = (
                message | {"content": [{"type": "image", "image": s} for s in sources] + text},
                len(sources),
            )
        out.append(message)
    if placed != len(sources):
        raise FlashdraftError(
            f"{loc}: {len(sources)} image(s) but {placed} placed; expected one {LLAVA_IMAGE} marker per image (or "
            f"none: the images then open the first user message)"
        )
    return out


def message_images(messages: list[dict[str, Any]]) -> list[str]:
    """The image sources of a conversation's parts, in order."""
    return [
        part["image"]
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if is_image_part(part)
    ]
