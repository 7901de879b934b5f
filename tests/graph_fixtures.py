"""Small torch models for the graph backends' tests, importable by worker processes (``tests.graph_fixtures:...``)."""
from __future__ import annotations

from typing import Any

from packrat_mq.handler import BaseHandler, Context, Input


def _small_conv() -> Any:
    import torch

    class SmallConv(torch.nn.Module):
        """Conv, batch norm (folded by freezing), ReLU, pooling, linear: a miniature classifier."""

        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.norm = torch.nn.BatchNorm2d(8)
            self.head = torch.nn.Linear(8, 4)
            with torch.no_grad():  # running statistics other than 0/1, so folding them is checked
                self.norm.running_mean.uniform_(-0.5, 0.5)
                self.norm.running_var.uniform_(0.5, 2.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3)))

    return SmallConv()


class SmallConvHandler(BaseHandler):
    """Requests are ``{"seed": int}``; each becomes a seeded 3x8x8 image. Replies: 4 logits."""

    def load_model(self, context: Context) -> Any:
        import torch

        torch.manual_seed(0)
        return _small_conv()

    def example_batch(self, n: int) -> list[Input]:
        return [Input(id=str(i), data={"seed": i}, content_type="application/json") for i in range(n)]

    def preprocess(self, items: list[Input]) -> Any:
        import torch

        return torch.stack([image(item.data["seed"]) for item in items])

    def postprocess(self, output: Any) -> list[Any]:
        return output.tolist()


def image(seed: int) -> Any:
    import torch

    return torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(seed))


class KeywordHandler(BaseHandler):
    """A model taking two keyword inputs (as the language models do): ids and a mask, mean-pooled."""

    def load_model(self, context: Context) -> Any:
        import torch

        class Pool(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = torch.nn.Embedding(32, 6)

            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                mask = attention_mask.unsqueeze(-1).float()
                return (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)

        torch.manual_seed(0)
        return Pool()

    def example_batch(self, n: int) -> list[Input]:
        return [Input(id=str(i), data=[(i + k) % 32 for k in range(1 + i % 5)], content_type="application/json")
                for i in range(n)]

    def preprocess(self, items: list[Input]) -> Any:
        import torch

        ids = torch.zeros((len(items), 5), dtype=torch.long)
        mask = torch.zeros((len(items), 5), dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, : len(item.data)] = torch.tensor(item.data)
            mask[row, : len(item.data)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def postprocess(self, output: Any) -> list[Any]:
        return output.tolist()


class DataDependent(SmallConvHandler):
    """Python control flow on a tensor's value: ``torch.export`` cannot capture it."""

    def load_model(self, context: Context) -> Any:
        import torch

        class Branchy(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if x.sum() > 0:
                    return x.mean(dim=(1, 2, 3)).unsqueeze(1).repeat(1, 4)
                return x.amax(dim=(1, 2, 3)).unsqueeze(1).repeat(1, 4)

        return Branchy()
