"""Turns the image parts of a chat request into decoded images, or a 400 that names the part.

An image arrives as an OpenAI `image_url` part: a `data:image/png|jpeg|webp;base64,...` URL, or an
`http(s)://` URL fetched here with a byte limit and a timeout (and only when fetching is on). The
bytes must decode as the declared format, within a pixel limit (no decompression bombs), before
any engine work starts.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass, field

import httpx
from PIL import Image, UnidentifiedImageError

from splitserve.api.openai_protocol import ApiError, ImagePart
from splitserve.engine.multimodal.image_items import image_digest

DATA_URL_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
DECODABLE_FORMATS = frozenset(DATA_URL_TYPES.values())


@dataclass
class ImageInputConfig:
    """Limits on the images one request may carry and how http(s) image URLs are fetched."""

    max_images_per_request: int = field(default=8, metadata={"help": "images one chat request may carry"})
    max_image_bytes: int = field(default=16 << 20, metadata={"help": "encoded bytes per image"})
    max_image_pixels: int = field(default=40_000_000, metadata={"help": "width x height per image"})
    allow_image_urls: bool = field(default=True, metadata={
        "help": "fetch http(s):// image URLs (off: only data: URLs are taken)"})
    image_fetch_timeout: float = field(default=10.0, metadata={"help": "seconds to fetch one image URL"})

    def __post_init__(self) -> None:
        if self.max_images_per_request < 0 or self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise ValueError("image limits must be positive")
        if self.image_fetch_timeout <= 0:
            raise ValueError(f"--image-fetch-timeout must be > 0, got {self.image_fetch_timeout}")


@dataclass
class LoadedImage:
    """An image part's bytes, decoded image and content hash."""

    part: ImagePart
    data: bytes
    image: Image.Image
    digest: str


def check_image_count(parts: list[ImagePart], cfg: ImageInputConfig) -> None:
    if len(parts) > cfg.max_images_per_request:
        raise ApiError(f"the request carries {len(parts)} images; at most {cfg.max_images_per_request} are "
                       f"allowed ({parts[cfg.max_images_per_request].where} is one too many)",
                       parts[cfg.max_images_per_request].where, code="too_many_images")


async def load_images(parts: list[ImagePart], cfg: ImageInputConfig) -> list[LoadedImage]:
    """Every part's image, in order; the first bad part raises an ApiError naming it."""
    check_image_count(parts, cfg)
    out = []
    async with httpx.AsyncClient(timeout=cfg.image_fetch_timeout, follow_redirects=False) as client:
        for part in parts:
            data = await image_bytes(part, cfg, client)
            out.append(LoadedImage(part, data, decode_image(part, data, cfg), image_digest(data)))
    return out


async def image_bytes(part: ImagePart, cfg: ImageInputConfig, client: httpx.AsyncClient) -> bytes:
    url = part.url
    if url.startswith("data:"):
        return data_url_bytes(part, cfg)
    if url.startswith(("http://", "https://")):
        if not cfg.allow_image_urls:
            raise ApiError(f"{part.where}: fetching image URLs is turned off on this server; send the image as a "
                           "data: URL", part.where, code="image_url_fetch_disabled")
        return await fetch(part, cfg, client)
    scheme = url.split(":", 1)[0] if ":" in url else url[:16]
    raise ApiError(f"{part.where}: unsupported image URL scheme {scheme!r} (data:, http:, https:)", part.where,
                   code="unsupported_image_url")


def data_url_bytes(part: ImagePart, cfg: ImageInputConfig) -> bytes:
    header, sep, payload = part.url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ApiError(f"{part.where}: a data URL must look like data:image/png;base64,<data>", part.where,
                       code="invalid_image")
    mime = header[len("data:"):-len(";base64")].lower()
    if mime not in DATA_URL_TYPES:
        raise ApiError(f"{part.where}: unsupported image type {mime!r} (image/png, image/jpeg, image/webp)",
                       part.where, code="unsupported_image_type")
    if len(payload) * 3 // 4 > cfg.max_image_bytes:
        raise _too_large(part, len(payload) * 3 // 4, cfg)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(f"{part.where}: the data URL is not valid base64", part.where, code="invalid_image") from None
    if not data:
        raise ApiError(f"{part.where}: the image is empty", part.where, code="invalid_image")
    return data


async def fetch(part: ImagePart, cfg: ImageInputConfig, client: httpx.AsyncClient) -> bytes:
    try:
        async with client.stream("GET", part.url) as resp:
            if resp.status_code != 200:
                raise ApiError(f"{part.where}: fetching the image URL answered HTTP {resp.status_code}", part.where,
                               code="image_fetch_failed")
            length = resp.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > cfg.max_image_bytes:
                raise _too_large(part, int(length), cfg)
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > cfg.max_image_bytes:
                    raise _too_large(part, size, cfg)
                chunks.append(chunk)
    except httpx.TimeoutException:
        raise ApiError(f"{part.where}: fetching the image URL took over {cfg.image_fetch_timeout:g} s", part.where,
                       code="image_fetch_failed") from None
    except httpx.HTTPError as exc:
        raise ApiError(f"{part.where}: fetching the image URL failed: {exc}", part.where,
                       code="image_fetch_failed") from None
    return b"".join(chunks)


def decode_image(part: ImagePart, data: bytes, cfg: ImageInputConfig) -> Image.Image:
    """Decodes fully (a truncated file fails here, not in the engine), within the pixel limit."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in DECODABLE_FORMATS:
                raise ApiError(f"{part.where}: image format {image.format} not supported (PNG, JPEG, WEBP)",
                               part.where, code="unsupported_image_type")
            if image.width * image.height > cfg.max_image_pixels:
                raise ApiError(f"{part.where}: the image is {image.width}x{image.height} pixels; at most "
                               f"{cfg.max_image_pixels} are allowed", part.where, code="image_too_large")
            image.load()
    except ApiError:
        raise
    except UnidentifiedImageError:  # its message names the BytesIO object: nothing for a client
        raise ApiError(f"{part.where}: the image could not be decoded (its bytes are not a PNG, JPEG or WEBP image)",
                       part.where, code="invalid_image") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ApiError(f"{part.where}: the image could not be decoded ({_reason(exc)})", part.where,
                       code="invalid_image") from None
    return image


def _reason(exc: BaseException) -> str:
    """PIL's message without the reprs of Python objects (`<_io.BytesIO object at 0x...>`) it may carry."""
    text = re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", str(exc)).strip()
    return text or type(exc).__name__


def _too_large(part: ImagePart, size: int, cfg: ImageInputConfig) -> ApiError:
    return ApiError(f"{part.where}: the image is {size} bytes; at most {cfg.max_image_bytes} are allowed",
                    part.where, status=400, code="image_too_large")
