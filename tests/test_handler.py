"""The handler contract as run_batch enforces it, and handler loading."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from packrat_mq.handler import BadRequest, BaseHandler, Context, Input, load_handler, run_batch
from packrat_mq.zoo.testing import EchoHandler, SleepHandler


def items(*values: Any) -> list[Input]:
    return [Input(id=f"r{i}", data=v, content_type="application/json") for i, v in enumerate(values)]


class Recording(BaseHandler):
    """Doubles numbers; rejects negatives in validate; records each batch it ran."""

    traceable = False

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[Any]] = []

    def load_model(self, context: Context) -> Any:
        return None

    def validate(self, item: Input) -> None:
        if isinstance(item.data, (int, float)) and item.data < 0:
            raise BadRequest(f"expected a non-negative number, got {item.data}")
        if item.data == "crash-validate":
            raise KeyError("oops")

    def inference(self, batch: Any) -> Any:
        self.batches.append(list(batch))
        return [x * 2 for x in batch]


class Failing(Recording):
    def inference(self, batch: Any) -> Any:
        self.batches.append(list(batch))
        raise RuntimeError("CUDA out of memory, or similar")


class WrongLength(Recording):
    def __init__(self, result: Any) -> None:
        super().__init__()
        self.result = result

    def inference(self, batch: Any) -> Any:
        return self.result

    def postprocess(self, output: Any) -> Any:
        return output


class PerItemErrors(Recording):
    def inference(self, batch: Any) -> Any:
        return [BadRequest("too long") if x == "long" else ValueError("odd") if x == "odd" else x for x in batch]


def init(h: BaseHandler) -> BaseHandler:
    h.initialize(Context(model_name="t"))
    return h


# --- run_batch --------------------------------------------------------------
def test_all_good() -> None:
    h = init(Recording())
    res = run_batch(h, items(1, 2, 3))
    assert [o.value for o in res.outcomes] == [2, 4, 6]
    assert all(o.ok and o.error is None for o in res.outcomes)
    assert h.batches == [[1, 2, 3]]


def test_validate_rejects_only_that_item() -> None:
    h = init(Recording())
    res = run_batch(h, items(1, -5, 3))
    assert res.outcomes[0].value == 2 and res.outcomes[2].value == 6
    assert not res.outcomes[1].ok
    # BadRequest messages go to the producer as written.
    assert res.outcomes[1].error == "expected a non-negative number, got -5"
    # The rejected item never reached the model.
    assert h.batches == [[1, 3]]


def test_validate_other_exception_named() -> None:
    h = init(Recording())
    res = run_batch(h, items("crash-validate", 4))
    assert res.outcomes[0].error == "KeyError: 'oops'"
    assert res.outcomes[1].value == 8


def test_all_items_rejected_model_not_run() -> None:
    h = init(Recording())
    res = run_batch(h, items(-1, -2))
    assert [o.ok for o in res.outcomes] == [False, False]
    assert h.batches == []


class ValidatesAllAtOnce(Recording):
    """A handler of its own validate_all (the vision models decode files in threads there)."""

    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self.result = result

    def validate_all(self, items: list[Input]) -> list[Exception | None]:
        if self.result is not None:
            return self.result
        return [self.rejection(item) for item in reversed(items)][::-1]


def test_validate_all_gives_each_request_its_own_rejection() -> None:
    h = init(ValidatesAllAtOnce())
    res = run_batch(h, items(1, -5, "crash-validate", 3))
    assert [o.value for o in res.outcomes] == [2, None, None, 6]
    assert res.outcomes[1].error == "expected a non-negative number, got -5"
    assert res.outcomes[2].error == "KeyError: 'oops'"
    assert res.inference_ms > 0  # validation is part of the handler's time


@pytest.mark.parametrize("result", [[None], "not a list"])
def test_validate_all_of_the_wrong_length_fails_the_batch_only(result: Any) -> None:
    h = init(ValidatesAllAtOnce(result))
    res = run_batch(h, items(1, 2))
    assert all(o.error and o.error.startswith("inference failed for this batch: RuntimeError: handler "
                                              "ValidatesAllAtOnce.validate_all returned") for o in res.outcomes)
    assert h.batches == []


def test_handler_exception_fails_whole_batch_only() -> None:
    h = init(Failing())
    res = run_batch(h, items(1, -1, 2))
    assert res.outcomes[0].error == res.outcomes[2].error
    assert res.outcomes[0].error == "inference failed for this batch: RuntimeError: CUDA out of memory, or similar"
    # The validate rejection keeps its own message.
    assert res.outcomes[1].error == "expected a non-negative number, got -1"
    # A second batch on the same handler is unaffected by the first failure.
    h2 = init(Recording())
    assert [o.value for o in run_batch(h2, items(5)).outcomes] == [10]


@pytest.mark.parametrize(
    "result, got",
    [([1], "1"), ([1, 2, 3, 4], "4"), ([], "0"), (None, "NoneType"), (np.array([1, 2, 3]), "ndarray")],
)
def test_wrong_length_output_errors_every_item(result: Any, got: str) -> None:
    h = init(WrongLength(result))
    res = run_batch(h, items(1, 2, 3))
    assert len(res.outcomes) == 3
    for o in res.outcomes:
        assert not o.ok and o.value is None
        assert o.error is not None
        assert o.error.startswith("inference failed for this batch: RuntimeError: handler WrongLength returned")
        assert f"returned {got} results for a batch of 3" in o.error


def test_tuple_output_accepted() -> None:
    h = init(WrongLength((7, 8)))
    assert [o.value for o in run_batch(h, items(1, 2)).outcomes] == [7, 8]


def test_per_item_exception_objects_become_that_items_error() -> None:
    h = init(PerItemErrors())
    res = run_batch(h, items("a", "long", "odd", "b"))
    assert [o.ok for o in res.outcomes] == [True, False, False, True]
    assert res.outcomes[0].value == "a" and res.outcomes[3].value == "b"
    assert res.outcomes[1].error == "too long"
    assert res.outcomes[2].error == "ValueError: odd"


def test_empty_batch() -> None:
    h = init(Recording())
    res = run_batch(h, [])
    assert res.outcomes == [] and h.batches == []


def test_exception_without_message_named_by_type() -> None:
    class Silent(Recording):
        def inference(self, batch: Any) -> Any:
            raise ZeroDivisionError

    res = run_batch(init(Silent()), items(1))
    assert res.outcomes[0].error == "inference failed for this batch: ZeroDivisionError: ZeroDivisionError"


def test_zoo_testing_handlers() -> None:
    echo = init(EchoHandler())
    res = run_batch(echo, items({"a": 1}, "x"))
    assert [o.value for o in res.outcomes] == [{"a": 1}, "x"]

    sleep = SleepHandler()
    sleep.initialize(Context(model_name="s", options={"base_ms": 0}))
    res = run_batch(sleep, items({"sleep_ms": 5}, "not a dict", {"sleep_ms": -3}))
    assert res.outcomes[0].value == {"slept_ms": 5, "batch": 2}
    assert res.inference_ms >= 5.0, "inference_ms times the handler"
    # Any other input stands in for a real model's (benchmarks send it images): it only sleeps.
    assert res.outcomes[1].value == {"slept_ms": 5, "batch": 2}
    assert "between 0 and 60000" in (res.outcomes[2].error or "")


# --- load_handler -----------------------------------------------------------
class NotAHandler:
    pass


def not_a_class() -> BaseHandler:
    raise AssertionError("load_handler must not call a non-class")


def test_load_zoo_name_and_import_path() -> None:
    assert type(load_handler("echo")) is EchoHandler
    assert type(load_handler("packrat_mq.zoo.testing:SleepHandler")) is SleepHandler
    h = load_handler(f"{__name__}:Recording")
    assert type(h).__name__ == "Recording" and not h.initialized


def test_load_unknown_name_lists_zoo() -> None:
    with pytest.raises(ValueError) as info:
        load_handler("no-such-model")
    msg = str(info.value)
    assert "unknown model 'no-such-model'" in msg
    assert "echo" in msg and "resnet50" in msg and "module:Class" in msg


def test_load_bad_module() -> None:
    with pytest.raises(ValueError, match="cannot import handler module 'no_such_module_xyz'"):
        load_handler("no_such_module_xyz:Handler")


def test_load_missing_attribute() -> None:
    with pytest.raises(ValueError, match="has no handler 'Nope'"):
        load_handler("packrat_mq.zoo.testing:Nope")


@pytest.mark.parametrize(
    "spec",
    [f"{__name__}:NotAHandler", f"{__name__}:not_a_class", "os:path", "json:dumps", "packrat_mq.handler:Context"],
)
def test_load_non_handler(spec: str) -> None:
    with pytest.raises(ValueError, match="is not a packrat_mq.handler.BaseHandler subclass"):
        load_handler(spec)
