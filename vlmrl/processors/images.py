"""Images: load (bytes, path, data URI, PIL, opt-in remote URL), verify, resize as the model's own image processor
sizes them (transformers' smart_resize), hash.

Every image reaches the engines and the trainer through here, once, already resized: both engines then get the same
pixels, and their own image processors find nothing left to resize.
"""

from __future__ import annotations

import base64
import hashlib
import io
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from vlmrl.data.config import DataConfig


class ImageInputError(ValueError):
    """An image that cannot be used; `vlmrl.processors.base.Processor.build_request` turns it into a row error or skip."""


def load_image(source: Any, limits: DataConfig) -> Image.Image:
    """Decode and verify one dataset image (any mode, not resized: `resize_image` converts to RGB).

    Accepts a PIL image; raw bytes; a dict {"bytes": ..., "path": ...} (the HF datasets / verl form: bytes win when
    present); a string path (`file://` allowed), a `data:image/...;base64,` URI, or an http(s) URL when
    `limits.allow_remote_images`. Raises ImageInputError saying what is wrong.
    """
    if isinstance(source, Image.Image):
        return _checked(source, limits, "PIL image")
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            return _decode(bytes(source["bytes"]), limits, source_name(source))
        if source.get("path"):
            return _load_str(str(source["path"]), limits)
        if source.get("image") is not None:  # a content part carrying its image inline
            return load_image(source["image"], limits)
        raise ImageInputError(f"image entry has neither bytes nor path (keys: {sorted(source)})")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), limits, "image bytes")
    if isinstance(source, (str, Path)):
        return _load_str(str(source), limits)
    raise ImageInputError(f"unsupported image value of type {type(source).__name__}")


def source_name(source: Any, kind: str = "image") -> str:
    """How an error names a dataset image or video (`kind`): by its file, URL or form, so that a user can tell which
    of a row's images or videos it is about.

    >>> source_name({"bytes": b"...", "path": "cat.png"})
    'image bytes (cat.png)'
    >>> source_name("file://clips/a.mp4", "video")
    'video file clips/a.mp4'
    """
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            return f"{kind} bytes ({source['path']})" if source.get("path") else f"{kind} bytes"
        if source.get("path"):
            return source_name(str(source["path"]), kind)
        return source_name(source[kind], kind) if source.get(kind) is not None else f"{kind} entry"
    if isinstance(source, Image.Image):
        return f"PIL image {source.filename}" if getattr(source, "filename", "") else "PIL image"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"{kind} bytes"
    if isinstance(source, (list, tuple)):
        first = f" ({source_name(source[0])}, ...)" if source else ""
        return f"{kind} of {len(source)} frame images{first}"
    value = str(source)
    if value.startswith(("http://", "https://")):
        return f"{kind} from {value[:200]}"
    if value.startswith("data:"):
        return f"data URI {kind}"
    return f"{kind} file {value.removeprefix('file://')}"


def processor_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                   frames: int | None = None, temporal_factor: int = 2) -> tuple[int, int]:
    """(height, width) the model's own image or video processor resizes a (height, width) image or frame to:
    transformers' `smart_resize`, called, not copied. Sides become multiples of `factor`; a side that rounds below
    one factor keeps one factor, so a long sliver may end over `max_pixels`.

    `frames` None: qwen2_vl's rule, the bounds holding for one image (Qwen2/2.5-VL, Qwen3-VL and Qwen3.5 images;
    Qwen2/2.5-VL video frames). `frames` t: glm4v's rule, the bounds holding for t copies together (t x h x w:
    GLM-4.1V's images, t = 2; Qwen3-VL's and Qwen3.5's videos, t = the frame count: their video processor's
    `smart_resize` is the same function), which first scales a side under one factor up to it. Raises ValueError
    where transformers does (an aspect ratio over 200, measured after that scaling).

    >>> processor_size(1114, 69, 28, 3136, 12544)  # qwen-vl-utils' own rule rounds the short side to 0 here
    (448, 28)
    """
    if frames is None:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    from transformers.models.glm4v.image_processing_glm4v import smart_resize as temporal_smart_resize

    return temporal_smart_resize(num_frames=frames, height=height, width=width, temporal_factor=temporal_factor,
                                 factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


@dataclass(frozen=True)
class ImageSizing:
    """How a patch-layout model's image processor sizes an image, and the bounds vlmrl sizes it within
    (`vlmrl.processors.patches.PatchesProcessor.sizing`)."""

    factor: int
    """Resized sides are multiples of this: the model's patch size x merge size (28, or 32 for Qwen3-VL)."""
    min_pixels: int
    max_pixels: int
    """Pixels of one image, data.min_pixels / data.max_pixels or the model's (lying within `model_bounds`)."""
    copies: int = 1
    """How many copies of an image the processor's bounds count (`InputFormat.image_bound_copies`): GLM-4.1V's 2
    (t x h x w, glm4v's rule in `processor_size`), else 1 (qwen2_vl's rule)."""
    model_bounds: tuple[int, int] | None = None
    """The model's image processor's own (shortest_edge, longest_edge), counting `copies`: what the engines and the
    trainer's pixel values resize by. None: `min_pixels`, `max_pixels` x `copies`."""

    def size(self, height: int, width: int, bounds: tuple[int, int] | None = None) -> tuple[int, int]:
        """(height, width) the model's image processor resizes an image to within `bounds` (processor units,
        counting copies; default vlmrl's)."""
        low, high = bounds or (self.min_pixels * self.copies, self.max_pixels * self.copies)
        return processor_size(height, width, self.factor, low, high, self.copies if self.copies > 1 else None)

    def engines_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the engines' (and the trainer's) image processor resizes an already-resized image to."""
        return self.size(height, width, self.model_bounds)


def resize_image(image: Image.Image, sizing: ImageSizing, what: str = "an image") -> Image.Image:
    """RGB, resized (bicubic) to the size the model's own image processor gives it (`ImageSizing.size`), so that
    the engines' processors, which get this image, find nothing to resize. `what` names the image in errors
    (`source_name`). Raises ImageInputError where transformers' processor refuses the image (an aspect ratio over
    200), and where the engines would resize the result again (`_check_engines_keep`).

    RGBA goes onto a white background first (qwen-vl-utils' `to_rgb`).
    """
    from qwen_vl_utils.vision_process import to_rgb

    try:
        rgb = to_rgb(to_8bit(image))
        height, width = sizing.size(rgb.height, rgb.width)
        resized = rgb if (width, height) == rgb.size else rgb.resize((width, height), Image.Resampling.BICUBIC)
    except (ValueError, OSError) as err:  # an aspect ratio over 200:1; a lazily opened PIL image that is truncated
        raise ImageInputError(f"cannot resize {what} ({image.width}x{image.height}): {err}") from err
    _check_engines_keep(resized, image, sizing, what)
    return resized


HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
"""PIL modes of 16-bit, 32-bit integer and float pixels, which PIL's RGB conversion clips to 0..255 (a 16-bit image
comes out all white, a 0..1 float image all black)."""


def to_8bit(image: Image.Image) -> Image.Image:
    """A high-depth grey image (`HIGH_DEPTH_MODES`) as 8-bit grey ("L"), scaled by its value range; others unchanged.

    16-bit (`I;16*`) is scaled by the mode's range, 0..65535 -> 0..255, so brightness means the same in every image.
    32-bit integer (`I`) and float (`F`) have no range that images use (a float image may hold 0..1, 0..255 or
    anything), so they are scaled by the image's own min..max (NaN -> 0; an image of one value -> black).

    >>> to_8bit(Image.new("I;16", (2, 1), 65535)).getpixel((0, 0))
    255
    >>> np.asarray(to_8bit(Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32)))).tolist()
    [[0, 128, 255]]
    """
    if image.mode not in HIGH_DEPTH_MODES:
        return image
    values = np.asarray(image).astype(np.float64)
    if image.mode.startswith("I;16"):
        low, span = 0.0, 65535.0
    else:
        finite = values[np.isfinite(values)]
        low = float(finite.min()) if finite.size else 0.0
        span = (float(finite.max()) - low if finite.size else 0.0) or 1.0
    scaled = np.nan_to_num((values - low) / span * 255.0, nan=0.0, posinf=255.0, neginf=0.0)
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), mode="L")


def _check_engines_keep(resized: Image.Image, original: Image.Image, sizing: ImageSizing, what: str) -> None:
    """The engines (and the trainer's pixel values) run the model's image processor on the resized image, which
    resizes again by the same rule within the model's bounds. Where the rule's result lies outside them (a sliver
    whose short side was kept at one factor: over max_pixels when the bounds are small, as the embedded models'
    are), that processor resizes its own output again, and the token count would differ between the request and
    the engines: refuse such an image here, by name, instead of failing later inside a step."""
    try:
        again = sizing.engines_size(resized.height, resized.width)
    except ValueError as err:
        again, reason = None, str(err)
    else:
        reason = f"resizes it again to {again[1]}x{again[0]}"
    if again != (resized.height, resized.width):
        raise ImageInputError(f"{what} ({original.width}x{original.height}) resizes to {resized.width}x"
                              f"{resized.height} (as the model's image processor sizes it), but the engines' image "
                              f"processor {reason}: its token count would differ between the trainer and the "
                              "engines (crop or pad it)")


def image_hash(image: Image.Image) -> str:
    """sha256 over (width, height, mode, raw pixel bytes): identical pixels give identical hashes on every backend."""
    digest = hashlib.sha256(f"{image.width}x{image.height}:{image.mode}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _load_str(value: str, limits: DataConfig) -> Image.Image:
    if value.startswith(("http://", "https://")):
        if not limits.allow_remote_images:
            raise ImageInputError(
                f"remote image URL {value[:200]!r} is not allowed: set allow_remote_images=true to fetch it, "
                "or store the image bytes in the dataset"
            )
        return _decode(_fetch(value, limits), limits, f"image from {value[:200]}")
    if value.startswith("data:image"):
        if "base64," not in value:
            raise ImageInputError("data URI image is not base64-encoded")
        try:
            data = base64.b64decode(value.split("base64,", 1)[1], validate=True)
        except ValueError as err:
            raise ImageInputError(f"data URI image is not valid base64: {err}") from err
        return _decode(data, limits, "data URI image")
    path = _resolve_path(value.removeprefix("file://"), limits.data_root)
    try:
        data = path.read_bytes()
    except FileNotFoundError as err:
        raise ImageInputError(f"image file not found: {path}") from err
    except OSError as err:
        raise ImageInputError(f"cannot read image file {path}: {err}") from err
    return _decode(data, limits, f"image file {path}")


def _resolve_path(value: str, data_root: str | None) -> Path:
    """Relative paths resolve under data_root; no path may leave it (symlinks and '..' resolved first)."""
    if data_root is None:
        return Path(value)
    root = Path(data_root).resolve()
    full = (root / value).resolve()  # an absolute `value` replaces root here and is checked the same way
    if not full.is_relative_to(root):
        raise ImageInputError(f"image path {value!r} resolves outside data_root {str(root)!r}")
    return full


def _fetch(url: str, limits: DataConfig) -> bytes:
    """GET with a size cap and a deadline for the whole body (qwen-vl-utils would wait forever and read anything;
    requests' own timeout bounds each read, so a server sending a byte at a time could keep one fetch going for ever).
    The connection and the headers are bounded per read by remote_timeout_s."""
    import requests
    import urllib3

    try:
        with requests.get(url, stream=True, timeout=limits.remote_timeout_s) as response:
            deadline = time.monotonic() + limits.remote_timeout_s
            response.raise_for_status()
            declared = int(response.headers.get("Content-Length") or 0)
            if declared > limits.remote_max_bytes:
                raise ImageInputError(f"remote image {url[:200]} is {declared} bytes > {limits.remote_max_bytes}")
            sock = getattr(response.raw.connection, "sock", None)
            chunks, size = [], 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ImageInputError(f"remote image {url[:200]}: the download took over remote_timeout_s="
                                          f"{limits.remote_timeout_s} s ({size} bytes by then)")
                if sock is not None:
                    sock.settimeout(left)  # the next read waits no longer than the time left
                chunk = response.raw.read1(64 * 1024, decode_content=True)  # what has arrived, without waiting for more
                if not chunk:
                    return b"".join(chunks)
                size += len(chunk)
                if size > limits.remote_max_bytes:
                    raise ImageInputError(f"remote image {url[:200]} exceeds {limits.remote_max_bytes} bytes")
                chunks.append(chunk)
    except (requests.RequestException, urllib3.exceptions.HTTPError) as err:
        raise ImageInputError(f"cannot fetch remote image {url[:200]}: {err}") from err


DECODED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "PPM")
"""Image formats read from dataset bytes and files (JPEG includes the MPO variant phone cameras write)."""


def _decode(data: bytes, limits: DataConfig, what: str) -> Image.Image:
    if not data:
        raise ImageInputError(f"{what} is empty (0 bytes)")
    with warnings.catch_warnings():
        # Our own pixel limit below decides; PIL's global warning threshold must not (it is process-wide state).
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            # reads the header only: size is known before decoding. Raster formats only: PIL would hand EPS/PDF
            # bytes from a dataset to Ghostscript when it is installed.
            image = Image.open(io.BytesIO(data), formats=DECODED_FORMATS)
        except Image.DecompressionBombError as err:
            raise ImageInputError(f"{what}: decompression bomb rejected ({err})") from err
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
            raise ImageInputError(f"{what} is not a readable image: {err}") from err
        image = _checked(image, limits, what)
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            raise ImageInputError(f"{what} is corrupt or truncated: {err}") from err
    return image


def _checked(image: Image.Image, limits: DataConfig, what: str) -> Image.Image:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageInputError(f"{what} has zero size ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise ImageInputError(
            f"{what} declares {width}x{height} = {width * height} pixels > max_image_pixels="
            f"{limits.max_image_pixels} (decompression-bomb guard; raise max_image_pixels if the image is genuine)"
        )
    return image

