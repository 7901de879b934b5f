"""The TorchScript ResNet-50 that TorchServe serves, made by packrat-mq's own zoo handler.

``packrat-mq up --graph torchscript`` builds torchvision's ResNet-50 (``weights=None``),
traces it on an example batch of the instance's size and freezes it
(``BaseHandler.prepare``). This module does exactly that through the same
handler and saves the result with ``torch.jit.save``, so the file TorchServe
loads is the computation packrat-mq runs, not a look-alike. Weights are
random (seeded): latency does not depend on their values.

Beside it goes ``index_to_name.json`` (TorchServe's name for it), the ImageNet
class names the zoo handler's replies carry, so the TorchServe handler answers
in the same format without torchvision.

Run in the project's environment: ``python -m benchmarks.peers.export --batch 8 --out resnet50-b8.pt``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from packrat_mq.handler import Context, load_handler
from packrat_mq.zoo.vision import imagenet_categories

#: The class names' file, beside the TorchScript file and in the archive (TorchServe's convention).
CATEGORIES = "index_to_name.json"


def export(path: Path, *, model: str = "resnet50", batch: int = 8, seed: int = 0) -> Path:
    """Trace and freeze ``model`` as ``up --graph torchscript`` does for an instance of ``batch``; save it to ``path``."""
    torch.manual_seed(seed)
    handler = load_handler(model)
    handler.initialize(Context(model_name=model, threads=torch.get_num_threads(), batch_size=batch,
                                graph_mode="torchscript"))
    if not isinstance(handler.model, torch.jit.ScriptModule):
        raise TypeError(f"{model}'s graph mode did not give a TorchScript module ({type(handler.model).__name__})")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(handler.model, str(path))
    (path.parent / CATEGORIES).write_text(json.dumps({str(i): name for i, name in enumerate(imagenet_categories())}))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=8, help="batch the trace is taken at (the served B)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    print(export(args.out, model=args.model, batch=args.batch, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
