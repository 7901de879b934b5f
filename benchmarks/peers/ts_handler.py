"""TorchServe handler of the peers benchmark: a TorchScript image classifier fed ``.npy`` images.

It does what packrat-mq's zoo ``resnet50`` does per batch (``packrat_mq/zoo/vision.py``),
so both servers run the same computation on the same input:

- each request body is one ``.npy`` array (loaded with ``allow_pickle=False``),
  shaped ``(3, H, W)`` or ``(H, W, 3)``, ``uint8`` in [0, 255] or float in [0, 1];
- it is normalised with the ImageNet mean and standard deviation (resized
  bilinearly first if it is not the model's size), the batch is stacked and run
  through the TorchScript model (``torch.jit.load`` of the archive's serialized
  file, traced and frozen by the zoo handler itself: see ``benchmarks.peers.export``);
- each request gets ``{"top5": [{"label": ..., "index": ..., "probability": ...}, ...],
  "weights": "random"}``, the labels read from the archive's ``index_to_name.json``
  (written by the export with the zoo's ImageNet class names).

The model runs on ``OMP_NUM_THREADS`` intra-op threads and one inter-op
thread, as a packrat-mq instance does.

It runs inside TorchServe's Python worker (the peers virtual environment),
so it imports only numpy and torch; TorchServe takes the one class of this
module as the handler and calls ``initialize(context)`` then
``handle(data, context)`` per batch.
"""
from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MIN_SIDE = 16
MAX_SIDE = 2048


class NpyImageClassifier:
    """TorchScript classifier over ``.npy`` images; the one class TorchServe looks for."""

    size = 224

    def __init__(self) -> None:
        self.model: Any = None
        self.categories: list[str] = []
        self.initialized = False
        self._mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def initialize(self, context: Any) -> None:
        threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set, or inter-op work already ran in this process
            pass
        model_dir = context.system_properties.get("model_dir")
        serialized = context.manifest["model"]["serializedFile"]
        self.model = torch.jit.load(os.path.join(model_dir, serialized), map_location="cpu").eval()
        with open(os.path.join(model_dir, "index_to_name.json"), encoding="utf-8") as f:
            names = json.load(f)
        self.categories = [names[str(i)] for i in range(len(names))]
        self.initialized = True

    @staticmethod
    def _body(row: Any) -> bytes:
        body = (row.get("data") or row.get("body")) if isinstance(row, dict) else row
        if not isinstance(body, (bytes, bytearray)):
            raise ValueError(f"expected an application/x-npy body, got {type(body).__name__}")
        return bytes(body)

    def _image(self, payload: bytes) -> torch.Tensor:
        data = np.load(io.BytesIO(payload), allow_pickle=False)
        if data.ndim != 3 or 3 not in (data.shape[0], data.shape[-1]):
            raise ValueError(f"expected one RGB image shaped (3, H, W) or (H, W, 3), got {data.shape}")
        image = data if data.shape[0] == 3 else np.moveaxis(data, -1, 0)
        if not all(MIN_SIDE <= side <= MAX_SIDE for side in image.shape[1:]):
            raise ValueError(f"image sides must lie in [{MIN_SIDE}, {MAX_SIDE}], got {image.shape[1:]}")
        if image.dtype == np.uint8:
            tensor = torch.from_numpy(np.ascontiguousarray(image)).float().div_(255.0)
        elif np.issubdtype(image.dtype, np.floating):
            if not np.isfinite(image).all() or image.min() < 0.0 or image.max() > 1.0:
                raise ValueError("float pixel values must lie in [0, 1]")
            tensor = torch.from_numpy(np.ascontiguousarray(image.astype(np.float32, copy=False)))
        else:
            raise ValueError(f"expected uint8 or float pixels, got {image.dtype}")
        tensor = (tensor - self._mean) / self._std
        if tensor.shape[1:] != (self.size, self.size):
            tensor = F.interpolate(tensor.unsqueeze(0), size=(self.size, self.size), mode="bilinear",
                                   align_corners=False, antialias=True).squeeze(0)
        return tensor

    def handle(self, data: list[Any], context: Any) -> list[dict[str, Any]]:
        batch = torch.stack([self._image(self._body(row)) for row in data])
        with torch.inference_mode():
            output = self.model(batch)
        probs, classes = torch.softmax(output.float(), dim=1).topk(5, dim=1)
        return [{"top5": [{"label": self.categories[c], "index": c, "probability": p}
                          for c, p in zip(row_c.tolist(), row_p.tolist())],
                 "weights": "random"}
                for row_c, row_p in zip(classes, probs)]
