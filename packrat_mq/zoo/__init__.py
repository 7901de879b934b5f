"""The model zoo: handlers by short name; users add their own by import path."""
from __future__ import annotations

ZOO: dict[str, str] = {
    "echo": "packrat_mq.zoo.testing:EchoHandler",
    "sleep": "packrat_mq.zoo.testing:SleepHandler",
    "resnet50": "packrat_mq.zoo.vision:ResNet50Handler",
    "inception_v3": "packrat_mq.zoo.vision:InceptionV3Handler",
    "bert": "packrat_mq.zoo.language:BertHandler",
    "gpt2": "packrat_mq.zoo.language:GPT2Handler",
    "minilm": "packrat_mq.zoo.minilm:MiniLMHandler",
}
