"""Image records: the forms users write them in -> one canonical example (messages whose content
is a list of text and image parts, and the image files in the order they appear).

    chat     `messages` (role/content) or ShareGPT `conversations` (from/value), a content being a
             string or a list of parts: {"type": "text", "text"}, {"type": "image", "image": PATH}
             (also "url" / "path"), {"type": "image_url", "image_url": {"url": PATH}} as
             transformers' chat templates and TRL take them; a bare {"type": "image"} takes the
             next file of the record's `images` column (TRL's vision datasets)
    alpaca   LLaMA-Factory's instruction / input / output (+ system)
    either   LLaMA-Factory's `images: [PATH, ...]` (also a single `image`) with one `<image>`
             placeholder in the text per image, in order; TRL's vision form, `images` with string
             contents and no placeholder: the images before the first user message's text
             (trl.data_utils.prepare_multimodal_messages)

Local files only (PNG, JPEG, WebP, ...), a relative path taken from the data file's folder. Every
problem is one InputError naming the data file and the record: a remote URL, placeholders and
images that do not pair up (more or fewer), a part with no image.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..data.records import SHAREGPT_ROLES
from ..errors import InputError

PLACEHOLDER = "<image>"  # LLaMA-Factory's IMAGE_PLACEHOLDER
IMAGE_TYPES = ("image", "image_url")
TURNS = ("messages", "conversations")


@dataclass
class ImageExample:
    """messages: [{"role", "content": [{"type": "text", "text"} | {"type": "image"}]}];
    images: the files of the image parts, in order."""

    messages: list[dict]
    images: list[Path] = field(default_factory=list)


def has_image_parts(record: dict) -> bool:
    """The record names images: an `images` column with files, or an image content part."""
    if record.get("images"):
        return True
    for key in TURNS:
        for turn in record.get(key) or []:
            content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
            if isinstance(content, list) and any(_is_image(p) for p in content):
                return True
    return False


def _is_image(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_TYPES


class _Files:
    """The record's `images` column, taken in order by placeholders and bare image parts."""

    def __init__(self, listed: object, where: str) -> None:
        if listed is not None and not isinstance(listed, list | tuple):
            listed = [listed]
        self.listed = [_path_of(v, f"{where}: images") for v in (listed or [])]
        self.taken = 0
        self.where = where

    def next(self) -> str:
        self.taken += 1
        if self.taken > len(self.listed):
            raise InputError(
                f"{self.where}: more image placeholders than images (the `images` field lists "
                f"{len(self.listed)})"
            )
        return self.listed[self.taken - 1]

    def check_all_taken(self) -> None:
        if self.taken < len(self.listed):
            raise InputError(
                f"{self.where}: fewer image placeholders ({self.taken}) than images in the `images` field "
                f"({len(self.listed)}); put one {PLACEHOLDER} in the text per image"
            )


def _path_of(value: object, what: str) -> str:
    """A file name from an `images` entry, an image part's field or an image_url's url."""
    if isinstance(value, dict):  # {"url": ...}, {"path": ...} (datasets' Image dicts)
        value = value.get("url") or value.get("path")
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{what}: an image must be a file name, not {type(value).__name__} {value!r}"[:300])
    if value.startswith("file://"):
        value = value[len("file://") :]
    if value.startswith(("http://", "https://", "data:")):
        raise InputError(f"{what}: {value[:80]}: only local image files are read (download it first)")
    return value


def _text_parts(text: str, files: _Files) -> list[dict]:
    """A string content -> parts, one image part per `<image>` placeholder."""
    parts: list[dict] = []
    for k, piece in enumerate(text.split(PLACEHOLDER)):
        if k:
            parts.append({"type": "image", "file": files.next()})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _content(content: object, files: _Files, where: str) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return _text_parts(content, files)
    if not isinstance(content, list):
        raise InputError(f"{where}: a content must be text or a list of parts, not {type(content).__name__}")
    parts: list[dict] = []
    for i, p in enumerate(content):
        if not isinstance(p, dict):
            raise InputError(f"{where}: content part {i + 1} is {type(p).__name__}, not an object")
        kind = p.get("type")
        if kind == "text":
            parts.extend(_text_parts(str(p.get("text") or ""), files))
        elif kind == "image":
            given = p.get("image") or p.get("url") or p.get("path")
            parts.append({"type": "image", "file": _path_of(given, where) if given else files.next()})
        elif kind == "image_url":
            url = p.get("image_url")
            parts.append({"type": "image", "file": _path_of(url, f"{where}: image_url")})
        else:
            raise InputError(
                f"{where}: content part {i + 1} has type {kind!r}; text and images are read "
                "(video and audio parts are not supported)"
            )
    return parts


def _before_first_user(messages: list[dict], turns: list, files: _Files) -> None:
    """TRL's vision form (string contents, no placeholder): the `images` go before the text of the
    first user message written as a string, as trl.data_utils.prepare_multimodal_messages does."""
    offset = len(messages) - len(turns)  # a record's `system` field comes first
    for i, turn in enumerate(turns):
        if messages[offset + i]["role"] == "user" and isinstance(turn.get("content", turn.get("value")), str):
            images = [{"type": "image", "file": files.next()} for _ in files.listed]
            messages[offset + i]["content"][:0] = images
            return


def image_example(record: dict, where: str, base: Path) -> ImageExample:
    """One record -> its canonical example; relative files are taken from `base`."""
    if record.get("videos") or record.get("audios"):
        raise InputError(f"{where}: videos and audio are not supported (images are)")
    if "chosen" in record or "rejected" in record:
        raise InputError(f"{where}: a preference pair with images needs both chosen and rejected")
    files = _Files(record.get("images") or record.get("image"), where)  # TRL's vision sets: images (or image)
    messages: list[dict] = []
    if record.get("system"):
        messages.append({"role": "system", "content": _content(record["system"], files, where)})
    key = next((k for k in TURNS if record.get(k)), None)
    if key is not None:
        for i, turn in enumerate(record[key]):
            if not isinstance(turn, dict):
                raise InputError(f"{where}: {key}[{i}] is {type(turn).__name__}, not an object")
            role = turn.get("role") or SHAREGPT_ROLES.get(str(turn.get("from")))
            if role not in ("system", "user", "assistant"):
                raise InputError(f"{where}: {key}[{i}]: role {role!r} is not read with images")
            content = turn["content"] if "content" in turn else turn.get("value")
            messages.append({"role": role, "content": _content(content, files, f"{where}: {key}[{i}]")})
    elif "instruction" in record:
        prompt = "\n".join(str(record.get(k) or "") for k in ("instruction", "input") if record.get(k))
        messages.append({"role": "user", "content": _content(prompt, files, where)})
        messages.append({"role": "assistant", "content": _content(record.get("output") or "", files, where)})
    else:
        raise InputError(f"{where}: an image record needs messages, conversations or instruction/output")
    if key is not None and files.listed and not files.taken:
        _before_first_user(messages, record[key], files)
    files.check_all_taken()
    paths = []
    for m in messages:
        for p in m["content"]:
            if p["type"] == "image":
                path = Path(p.pop("file")).expanduser()
                paths.append(path if path.is_absolute() else base / path)
    return ImageExample(messages, paths)
