"""Image classifiers from torchvision: ``resnet50`` and ``inception_v3``.

The models have random weights (``weights=None``: nothing is downloaded), so
the classes they return mean nothing, but the work per request is the real
one, which is what profiles and the optimizer need.

Input, one image per request:

- a ``numpy`` array (``application/x-npy``) or a JSON nested list
  (``application/json``), shaped ``(3, H, W)`` or ``(H, W, 3)``, RGB;
- ``uint8`` (or JSON integers) in ``[0, 255]``, or floats in ``[0, 1]``;
- each side between ``MIN_SIDE`` and ``MAX_SIDE`` pixels. An image that is not
  the model's size (224x224 for ResNet-50, 299x299 for Inception v3) is
  resized bilinearly to it, so a batch is always rectangular and a graph-mode
  model sees the shape it was traced with.

The image is normalised with the ImageNet mean and standard deviation.
Output, per request: ``{"top5": [[class_index, probability], ...]}``.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from packrat_mq.handler import BadRequest, BaseHandler, Context, Input

MIN_SIDE = 16
MAX_SIDE = 2048
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageClassifierHandler(BaseHandler):
    """Shared input handling for the torchvision classifiers; subclasses build the model."""

    #: Side of the square image the model takes.
    size: int = 224
    #: Seed of :meth:`example_batch`, so warm-up, tracing and profiles see the same images.
    seed: int = 0

    def __init__(self) -> None:
        super().__init__()
        self._mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

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
        image = self._as_array(item)
        if isinstance(item.data, list):
            # Converting a JSON image costs milliseconds; keep the array for preprocess.
            item.data = image

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
        return [
            {"top5": [[int(c), float(p)] for c, p in zip(row_c.tolist(), row_p.tolist())]}
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

    def load_model(self, context: Context) -> torch.nn.Module:
        from torchvision.models import inception_v3

        return inception_v3(weights=None, aux_logits=False, init_weights=False)


def _as_tensor(image: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``image``'s memory, also when it is a read-only view of a payload.

    ``.npy`` payloads decode to read-only views of the bytes read from Redis
    (no copy); torch warns that writing through such a tensor is undefined.
    ``preprocess`` only reads it (normalising builds new tensors), so the
    warning says nothing here.
    """
    if image.flags.writeable:
        return torch.from_numpy(image)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(image)
