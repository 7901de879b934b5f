"""Image classifiers from torchvision: ``resnet50`` and ``inception_v3``.

The models have random weights (``weights=None``: nothing is downloaded), so
the classes they return mean nothing, but the work per request is the real
one, which is what profiles and the optimizer need. Every reply says so
(``"weights": "random"``).

Input, one image per request, either

- an image file as users send them: ``image/jpeg``, ``image/png`` or
  ``image/webp`` bytes. It is decoded with Pillow (restricted to the format
  its content type names; its EXIF orientation applied), resized so that its
  short side is ``resize`` pixels (256 for ResNet-50, 342 for Inception v3)
  and center-cropped to the model's ``size`` (224, 299): the ImageNet
  evaluation transform. Its dimensions are read from the header and checked
  against ``max_pixels`` (a handler option, 40 megapixels by default) before
  any pixel is decoded, so a decompression bomb costs nothing; or
- an array already prepared: a ``numpy`` array (``application/x-npy``) or a
  JSON nested list (``application/json``), shaped ``(3, H, W)`` or
  ``(H, W, 3)``, RGB, ``uint8`` (or JSON integers) in ``[0, 255]`` or floats
  in ``[0, 1]``, each side between ``MIN_SIDE`` and ``MAX_SIDE`` pixels. An
  array that is not the model's size is resized bilinearly to it (not
  cropped), so a batch is always rectangular and a graph-mode model sees the
  shape it was traced with.

Either is normalised with the ImageNet mean and standard deviation. Files are
decoded per request in ``validate``, so a corrupt, truncated, oversized or
non-image payload fails its own request and no other (docs/decisions.md,
"Images are decoded per request").

Output, per request: ``{"top5": [{"label": "tabby", "index": 281,
"probability": ...}, ...], "weights": "random"}``, the labels being the
ImageNet-1k category names that torchvision ships with its weights' metadata
(nothing is downloaded).
"""
from __future__ import annotations

import functools
import io
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.transforms.v2 import functional as TF

from packrat_mq import protocol
from packrat_mq.handler import BadRequest, BaseHandler, Context, Input

MIN_SIDE = 16
MAX_SIDE = 2048
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: Largest image file accepted by default, in pixels (width x height, from its header).
MAX_PIXELS = 40_000_000
#: The Pillow plugin each image content type may be opened with, and no other.
PIL_FORMATS = {protocol.JPEG: "JPEG", protocol.PNG: "PNG", protocol.WEBP: "WEBP"}


@functools.cache
def imagenet_categories() -> tuple[str, ...]:
    """The 1,000 ImageNet-1k class names, by index, from torchvision's weights metadata (no download)."""
    from torchvision.models import ResNet50_Weights

    return tuple(ResNet50_Weights.IMAGENET1K_V2.meta["categories"])


class ImageClassifierHandler(BaseHandler):
    """Shared input handling for the torchvision classifiers; subclasses build the model."""

    #: Side of the square image the model takes (the center crop of an image file).
    size: int = 224
    #: An image file's short side is resized to this before the center crop.
    resize: int = 256
    #: What the reply says of the weights.
    weights: str = "random"
    #: Seed of :meth:`example_batch`, so warm-up, tracing and profiles see the same images.
    seed: int = 0

    def __init__(self) -> None:
        super().__init__()
        self._mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
        self.max_pixels = MAX_PIXELS
        self._decoders: ThreadPoolExecutor | None = None

    def initialize(self, context: Context) -> None:
        """Options: ``max_pixels`` (largest image file, default 40 megapixels), ``decode_threads``
        (files of a sub-batch decoded at once, default the instance's threads)."""
        self.max_pixels = _int_option(context, "max_pixels", MAX_PIXELS, MIN_SIDE * MIN_SIDE)
        decode_threads = _int_option(context, "decode_threads", context.threads, 1)
        super().initialize(context)
        if decode_threads > 1:
            # Decoding releases the GIL (Pillow's decoders, torch's resize): an instance of t
            # threads decodes t files at once rather than one after the other on one of its cores.
            self._decoders = ThreadPoolExecutor(decode_threads, thread_name_prefix="decode")

    def example_batch(self, n: int) -> list[Input]:
        rng = np.random.default_rng(self.seed)
        return [
            Input(
                id=f"example-{i}",
                data=rng.integers(0, 256, size=(self.size, self.size, 3), dtype=np.uint8),
                content_type="application/x-npy",
            )
            for i in range(n)
        ]

    # --- per request --------------------------------------------------
    def validate(self, item: Input) -> None:
        if item.content_type in PIL_FORMATS:
            # Decoded here, per request: a bad file fails its own request only.
            item.data = self.decode(item.data, item.content_type)
            return
        image = self._as_array(item)
        if isinstance(item.data, list):
            # Converting a JSON image costs milliseconds; keep the array for preprocess.
            item.data = image

    def validate_all(self, items: list[Input]) -> list[Exception | None]:
        files = sum(item.content_type in PIL_FORMATS for item in items)
        if self._decoders is None or files < 2:
            return super().validate_all(items)
        return list(self._decoders.map(self.rejection, items))

    def decode(self, payload: bytes, content_type: str) -> torch.Tensor:
        """An image file as the model's input: a ``uint8`` ``(3, size, size)`` tensor, or :class:`BadRequest`.

        Pillow opens the file with the one plugin its content type names (no
        guessing among Pillow's other formats) and reads only the header;
        the pixel count is checked before any pixel is decoded. A JPEG is
        decoded at the smallest 1/2, 1/4 or 1/8 scale that is still at least
        the resize's size (``Image.draft``, DCT scaling: a 1920x1080 photo
        decodes at 480x270). torch crops and resizes the decoded pixels (its
        vectorised ``uint8`` antialiased kernel is several times faster than
        Pillow's); figures in docs/figures.md, "Decoding images".
        """
        name = content_type.partition("/")[2].upper()
        try:
            with Image.open(io.BytesIO(payload), formats=[PIL_FORMATS[content_type]]) as im:
                width, height = im.size
                if width * height > self.max_pixels:
                    raise BadRequest(
                        f"image of {width}x{height} pixels ({width * height / 1e6:.1f} megapixels) is over the "
                        f"limit of {self.max_pixels / 1e6:g} megapixels"
                    )
                if min(width, height) < MIN_SIDE:
                    raise BadRequest(f"image of {width}x{height} pixels is too small; each side must be at least {MIN_SIDE}")
                if im.format == "JPEG":
                    im.draft("RGB", _short_side_to(width, height, self.resize))
                im.load()
                ImageOps.exif_transpose(im, in_place=True)  # a phone's portrait photo stands up
                image = im if im.mode == "RGB" else im.convert("RGB")
                pixels = np.asarray(image)
        except BadRequest:
            raise
        except Image.DecompressionBombError as exc:  # Pillow's own limit, checked in Image.open
            raise BadRequest(f"image is too large to decode: {exc}") from None
        except UnidentifiedImageError:
            raise BadRequest(f"payload is not a readable {name} image: no valid {name} header "
                             f"(a corrupt file, or another format)") from None
        except Exception as exc:  # noqa: BLE001 - anything the decoder raises is this file's fault
            reason = str(exc) or type(exc).__name__
            raise BadRequest(f"payload is not a readable {name} image: {reason}") from None
        # Resizing the short side to `resize` and then cropping the center `size` x `size` keeps the
        # center square of side short * size / resize: crop that first, then resize it to the model's
        # size. The same pixels for less work, and a 40000x16 strip cannot become a 640000-pixel-wide
        # intermediate.
        height, width = pixels.shape[:2]
        side = max(1, round(min(height, width) * self.size / self.resize))
        top, left = (height - side) // 2, (width - side) // 2
        square = _as_tensor(pixels[top:top + side, left:left + side]).permute(2, 0, 1)
        return TF.resize(square, [self.size, self.size], antialias=True)

    def _as_array(self, item: Input) -> np.ndarray:
        """The request as a ``(3, H, W)`` array, or :class:`BadRequest` saying what is expected."""
        expected = (
            f"expected one RGB image shaped (3, H, W) or (H, W, 3) with {MIN_SIDE} <= H, W <= {MAX_SIDE} "
            f"(it is resized to {self.size}x{self.size}), as uint8 in [0, 255] or float in [0, 1]"
        )
        data = item.data
        if isinstance(data, list):
            try:
                data = np.asarray(data)
            except ValueError as exc:  # ragged nested lists
                raise BadRequest(f"image is not a rectangular nested list; {expected}") from exc
        if isinstance(data, (bytes, bytearray, memoryview)):
            raise BadRequest(f"got {len(data)} bytes as {item.content_type}; send an image file as "
                             f"{', '.join(PIL_FORMATS)} (its content_type), or an array: {expected}")
        if not isinstance(data, np.ndarray):
            raise BadRequest(f"got {type(data).__name__} ({item.content_type}); {expected}")
        if data.ndim != 3 or 3 not in (data.shape[0], data.shape[-1]):
            raise BadRequest(f"got an array of shape {data.shape}; {expected}")
        image = data if data.shape[0] == 3 else np.moveaxis(data, -1, 0)
        if not all(MIN_SIDE <= side <= MAX_SIDE for side in image.shape[1:]):
            raise BadRequest(f"got an image of {image.shape[1]}x{image.shape[2]} pixels; {expected}")
        if data.dtype == np.uint8:
            return image
        if np.issubdtype(data.dtype, np.integer):
            if data.min() < 0 or data.max() > 255:
                raise BadRequest(f"integer pixel values must lie in [0, 255]; {expected}")
            return image.astype(np.uint8)
        if np.issubdtype(data.dtype, np.floating):
            if not np.isfinite(data).all() or data.min() < 0.0 or data.max() > 1.0:
                raise BadRequest(f"float pixel values must lie in [0, 1]; {expected}")
            return image.astype(np.float32, copy=False)
        raise BadRequest(f"got dtype {data.dtype}; {expected}")

    def preprocess(self, items: list[Input]) -> torch.Tensor:
        images = []
        for item in items:
            if isinstance(item.data, torch.Tensor):  # an image file, decoded and cropped by validate
                images.append((item.data.float().div_(255.0) - self._mean) / self._std)
                continue
            image = self._as_array(item)
            tensor = _as_tensor(np.ascontiguousarray(image))
            tensor = tensor.float().div_(255.0) if image.dtype == np.uint8 else tensor.float()
            tensor = (tensor - self._mean) / self._std
            if tensor.shape[1:] != (self.size, self.size):
                # Normalising first is equivalent (resizing is linear) and keeps one code path.
                tensor = F.interpolate(
                    tensor.unsqueeze(0), size=(self.size, self.size), mode="bilinear",
                    align_corners=False, antialias=True,
                ).squeeze(0)
            images.append(tensor)
        return torch.stack(images)

    def postprocess(self, output: torch.Tensor) -> list[Any]:
        probs, classes = torch.softmax(output.float(), dim=1).topk(5, dim=1)
        names = imagenet_categories()
        return [
            {
                "top5": [{"label": names[c], "index": c, "probability": p}
                         for c, p in zip(row_c.tolist(), row_p.tolist())],
                "weights": self.weights,
            }
            for row_c, row_p in zip(classes, probs)
        ]


class ResNet50Handler(ImageClassifierHandler):
    """ResNet-50 (25.6 M parameters, about 4.1 GFLOPs per 224x224 image), random weights."""

    size = 224

    def load_model(self, context: Context) -> torch.nn.Module:
        from torchvision.models import resnet50

        return resnet50(weights=None)


class InceptionV3Handler(ImageClassifierHandler):
    """Inception v3 (27 M parameters, about 5.7 GFLOPs per 299x299 image), random weights.

    Built without the auxiliary classifier (it is used only in training) and
    with PyTorch's default initialisation instead of torchvision's truncated
    normal, which takes seconds and buys nothing for random weights.
    """

    size = 299
    resize = 342

    def load_model(self, context: Context) -> torch.nn.Module:
        from torchvision.models import inception_v3

        return inception_v3(weights=None, aux_logits=False, init_weights=False)


def _int_option(context: Context, name: str, default: int, least: int) -> int:
    value = context.options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
    return value


def _short_side_to(width: int, height: int, side: int) -> tuple[int, int]:
    """The size of a ``width`` x ``height`` image resized so that its short side is ``side``."""
    if width <= height:
        return side, max(1, round(height * side / width))
    return max(1, round(width * side / height)), side


def _as_tensor(image: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``image``'s memory, also when it is a read-only view of a payload.

    ``.npy`` payloads decode to read-only views of the bytes read from Redis
    (no copy), and so do Pillow's pixels; torch warns that writing through
    such a tensor is undefined. ``preprocess`` and ``decode`` only read it
    (normalising and resizing build new tensors), so the warning says
    nothing here.
    """
    if image.flags.writeable:
        return torch.from_numpy(image)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(image)
