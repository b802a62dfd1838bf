"""Images in records: where each comes from and whether it can be read.

A chat record's images arrive in the forms peers write them: TRL's ``images`` (or ``image``)
column beside messages whose content lists ``{"type": "image"}`` and ``{"type": "text"}`` parts,
an image given inside its part (``{"type": "image", "image": "cat.png"}``), or LLaMA-Factory's
``<image>`` placeholders in string content with an ``images`` list. Each image is a file (a path
relative to the data file, or absolute) or bytes in the data (a ``datasets.Image`` cell's
``{"bytes": ...}``, or a ``data:image/...;base64,`` URI). URLs are refused: a prepared run must
not depend on what a web server answers later.

A canonical record keeps its images in order under ``images``, each as a reference
(``{"path": absolute path}`` or ``{"bytes": base64 text}``), and every image part of its messages
is ``{"type": "image"}``. Each image is opened and checked as the record is read, so that a missing,
unreadable or oversized one is named by file, row and field like any bad row (:class:`ImageProblem`,
which the reader turns into an :class:`sft_play.data.formats.InvalidRow`).
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any



class ImageProblem(ValueError):
    """An image of a record that cannot be used, or images that do not fit the record's places for
    them (the data's reader names the file and row: :class:`sft_play.data.formats.InvalidRow`)."""

    def __init__(self, field: str, reason: str):
        super().__init__(reason)
        self.field, self.reason = field, reason


PLACEHOLDER = "<image>"  # LLaMA-Factory's and ShareGPT's mark of where an image goes in string content
_INLINE_KEYS = ("image", "path", "url", "image_url")  # where a part names its own image


def part_image(part: dict[str, Any]) -> Any:
    """The image a content part carries itself (None: it is given in the record's images list)."""
    for key in _INLINE_KEYS:
        value = part.get(key)
        if isinstance(value, dict) and key == "image_url":  # OpenAI's {"image_url": {"url": ...}}
            value = value.get("url")
        if value is not None and value != "":
            return value
    return None


def reference(value: Any, base: Path | None, field: str) -> dict[str, str]:
    """An image value of the data as a canonical reference, checked (:func:`check`).

    Raises:
        ImageProblem: a URL, a value of another kind, or an image that cannot be used.
    """
    if isinstance(value, dict):
        if value.get("bytes"):
            raw = value["bytes"]
            ref = {"bytes": raw if isinstance(raw, str) else base64.b64encode(raw).decode("ascii")}
        elif value.get("path"):
            return reference(str(value["path"]), base, field)
        else:
            raise ImageProblem(field, "an image object needs 'bytes' or 'path'")
    elif hasattr(value, "getexif") and hasattr(value, "save"):  # a PIL image: datasets decodes an Image column so
        buffer = io.BytesIO()
        value.save(buffer, format=value.format or "PNG")
        ref = {"bytes": base64.b64encode(buffer.getvalue()).decode("ascii")}
    elif isinstance(value, (bytes, bytearray)):
        ref = {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith(("http://", "https://")):
            raise ImageProblem(field, f"{text[:80]} is a URL: images are read from files or the data "
                             "itself, not fetched (download them and give their paths)")
        if text.startswith("data:"):
            head, _, body = text.partition(",")
            if ";base64" not in head or not body:
                raise ImageProblem(field, "a data: URI of an image must be base64 (data:image/png;base64,...)")
            ref = {"bytes": body}
        else:
            path = Path(text.removeprefix("file://")).expanduser()
            if not path.is_absolute() and base is not None:
                path = base / path
            ref = {"path": str(path.resolve())}
            check(ref, field)
            return {**ref, **_stamp(ref["path"])}
    else:
        raise ImageProblem(field, f"expected an image path or bytes, got {type(value).__name__}")
    check(ref, field)
    return ref


def _stamp(path: str) -> dict[str, int]:
    """What a file's size and modification time are now: a prepared example records them, so that an
    image changed after its tokens were counted is noticed (:func:`changed`)."""
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime": stat.st_mtime_ns}


def changed(ref: dict[str, Any]) -> bool:
    """Whether the file `ref` names is gone, or not the one whose tokens were counted (its size or
    modification time differ from those recorded); never for bytes in the data."""
    if "path" not in ref or "size" not in ref:
        return False
    try:
        return _stamp(ref["path"]) != {"size": ref["size"], "mtime": ref["mtime"]}
    except OSError:
        return True


def raw_bytes(ref: dict[str, str]) -> bytes:
    return base64.b64decode(ref["bytes"])


def describe(ref: dict[str, str]) -> str:
    return ref["path"] if "path" in ref else "the image bytes in the data"


def check(ref: dict[str, str], field: str) -> None:
    """Open `ref` and read it through (PIL's ``verify``), so that a missing, unreadable or oversized
    image is named now rather than failing a batch hours into training.

    Raises:
        ImageProblem: naming what is wrong with it.
    """
    from PIL import Image, UnidentifiedImageError

    where = describe(ref)
    try:
        with (open(ref["path"], "rb") if "path" in ref else io.BytesIO(raw_bytes(ref))) as handle:
            with Image.open(handle) as image:
                width, height = image.size
                if width * height > Image.MAX_IMAGE_PIXELS:
                    raise ImageProblem(field, f"{where} is {width}x{height} pixels, more than the "
                                     f"{Image.MAX_IMAGE_PIXELS:,} an image may have (PIL's decompression-bomb limit): "
                                     "scale it down first")
                image.verify()
    except ImageProblem:
        raise
    except FileNotFoundError:
        raise ImageProblem(field, f"no such image file: {where}") from None
    except IsADirectoryError:
        raise ImageProblem(field, f"{where} is a folder, not an image file") from None
    except PermissionError:
        raise ImageProblem(field, f"cannot read {where}: permission denied") from None
    except UnidentifiedImageError:
        raise ImageProblem(field, f"{where} is not an image (no format PIL reads)") from None
    except (OSError, SyntaxError, ValueError) as exc:  # (PIL reports a broken file so)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageProblem(field, f"{where} is not a readable image ({reason})") from None
    except Image.DecompressionBombError:
        raise ImageProblem(field, f"{where} is larger than PIL's decompression-bomb limit") from None


def load(ref: dict[str, Any]) -> Any:
    """The image `ref` names, decoded (a ``PIL.Image`` in RGB, as processors take it).

    Raises:
        ImageProblem: the file changed, or went, since its tokens were counted.
    """
    from PIL import Image

    if changed(ref):
        raise ImageProblem("images", f"{ref['path']} changed or went since it was read")
    with Image.open(ref["path"] if "path" in ref else io.BytesIO(raw_bytes(ref))) as image:
        return image.convert("RGB")


def attach(record: dict[str, Any], listed: Any, base: Path | None, field: str, given: bool = False) -> dict[str, Any]:
    """`record` (a chat, its content strings or lists of parts) with its images in place: the
    `listed` images (the ``images``/``image`` column's) matched in order to its image parts or
    ``<image>`` placeholders, and images given inside parts taken in turn; each checked.

    With images and no place marked for any, they go before the text of the first user turn
    (as TRL does). Without images, parts of text only become strings again.

    Raises:
        ImageProblem: the images and the places marked for them do not match in number, or an image
            cannot be used.
    """
    if listed is None or listed == "" or listed == []:
        listed = []
    elif not isinstance(listed, list):
        listed = [listed]
    messages = record["messages"]
    if not listed and not given:  # an "<image>" in the text of a record without an images column is text
        for message in messages:
            if isinstance(message["content"], str):
                message["content"] = message["content"].replace(PLACEHOLDER, _KEPT)
    marked = sum(_places(message["content"]) for message in messages)
    inline = sum(1 for message in messages if isinstance(message["content"], list)
                 for part in message["content"] if part.get("type") == "image" and part_image(part) is not None)
    if listed and not marked:
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is None:
            raise ImageProblem(field, f"{len(listed)} image(s) but no user turn to show them in")
        first["content"] = [{"type": "image"}] * len(listed) + _parts(first["content"])
        marked = len(listed)
    if marked != len(listed) + inline:
        raise ImageProblem(field, f"{len(listed) + inline} image(s) for {marked} place(s) marked in the "
                         f"messages ({PLACEHOLDER} or {{\"type\": \"image\"}} parts): they must match in number")
    refs, queue = [], iter(listed)
    for turn, message in enumerate(messages):
        if not _places(message["content"]):
            message["content"] = _text_only(message["content"])
            continue
        parts = []
        for part in _parts(message["content"]):
            if part.get("type") == "image":
                own = part_image(part)
                value, where = (own, f"messages[{turn}].content") if own is not None else (next(queue), field)
                refs.append(reference(value, base, where))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        message["content"] = parts
    for message in messages:
        if isinstance(message["content"], str):
            message["content"] = message["content"].replace(_KEPT, PLACEHOLDER)
    if refs:
        record["images"] = refs
    return record


_KEPT = "\x00image\x00"  # an "<image>" that is text while placeholders are matched


def _places(content: Any) -> int:
    if isinstance(content, str):
        return content.count(PLACEHOLDER)
    return sum(1 for part in content if part.get("type") == "image")


def _parts(content: Any) -> list[dict[str, Any]]:
    """Content as parts, string content split at its ``<image>`` placeholders."""
    if isinstance(content, list):
        return content
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(content.split(PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _text_only(content: Any) -> Any:
    """Content without images as a string (text templates take strings)."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)
