"""The peers benchmark (``make bench-peers``) compares like with like, and reports what it measured.

No TorchServe here: its handler is a plain class that needs only numpy and
torch, so it runs in this process against the zoo's own ResNet-50.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.bench_peers import make_setups, markdown, ratios, round_order, text_tables
from packrat_mq import protocol


def _row(rnd: int, setup: str, p50: float, rate: float, idle: float, configuration: str | None = None) -> dict:
    figures = {"p50_ms": p50, "p90_ms": p50 * 1.1, "p99_ms": p50 * 1.2, "requests_per_s": rate, "errors": 0}
    return {"round": rnd, "setup": setup, "configuration": configuration, "load": figures,
            "idle": {**figures, "p50_ms": idle}}


def test_ratios_pair_each_packrat_setup_with_its_torchserve_peer_within_a_round() -> None:
    setups = make_setups(threads=2, batch=8, wait_ms=50)
    assert [(s.key, s.peer) for s in setups] == [
        ("torchserve", None), ("packrat-layout", "torchserve"), ("packrat-auto", "torchserve"),
        ("packrat-adaptive", "torchserve"), ("packrat-auto-shm", "torchserve"), ("packrat-auto-sealed", "torchserve"),
        ("torchserve-b1", None), ("packrat-b1", "torchserve-b1"), ("packrat-b1-shm", "torchserve-b1"),
        ("packrat-b1-sealed", "torchserve-b1"), ("packrat-b1-glibc", "torchserve-b1"), ("packrat-reserved", "torchserve")]
    by = {s.key: s for s in setups}
    assert by["packrat-reserved"].args == ("--threads", "1", "--batch", "8")
    # The malloc A/B is packrat-b1 with one setting of its processes changed.
    assert (by["packrat-b1-glibc"].args, dict(by["packrat-b1-glibc"].env), by["packrat-b1"].env) == (
        by["packrat-b1"].args, {"PACKRAT_MALLOC_RETAIN_MB": "0"}, ())
    # The shm and sealed setups are their plain twins with the clients' images in shared memory.
    for plain in ("packrat-auto", "packrat-b1"):
        assert (by[f"{plain}-shm"].args, by[f"{plain}-shm"].shm, by[plain].shm) == (by[plain].args, True, False)
        assert (by[f"{plain}-sealed"].args, by[f"{plain}-sealed"].shm) == (by[plain].args, "sealed")
    assert "packrat-reserved" not in {s.key for s in make_setups(threads=1, batch=8, wait_ms=50)}
    assert by["packrat-layout"].args == ("--instances", "2x8") and by["packrat-b1"].args == ("--instances", "2x1")
    assert by["packrat-adaptive"].args == ("--threads", "2")  # no --batch: adaptive from B=1
    rows = [_row(1, "torchserve", 400, 16, 100), _row(1, "packrat-layout", 200, 32, 150, "2x8"),
            _row(2, "torchserve", 800, 8, 100), _row(2, "packrat-layout", 400, 8, 50, "2x8"),
            {"round": 2, "setup": "packrat-auto", "error": "did not start"}]
    got = ratios(rows, setups)
    assert [(q["round"], q["setup"], q["peer"]) for q in got] == [(1, "packrat-layout", "torchserve"),
                                                                   (2, "packrat-layout", "torchserve")]
    assert got[0]["p50"] == pytest.approx(0.5) and got[0]["requests_per_s"] == pytest.approx(2.0)
    assert got[1]["idle_p50"] == pytest.approx(0.5)

    result = {"runs": rows, "ratios": got, "setups": [s.as_dict() for s in setups],
              "options": {"clients": 8, "rounds": 2, "warmup": 8, "measure": 25, "idle_measure": 15},
              "machine": {"cpu": "test cpu", "usable_cpus": 2, "peers_venv": {"torchserve": "0.12.0", "torch": "2"}}}
    table = markdown(result)
    assert "| packrat-mq `up --graph torchscript --instances 2x8` (same layout), 50 ms wait | 200 / 400 |" in table
    assert "| packrat-layout / torchserve | 0.50 / 0.50 |" in table
    assert "failed: did not start" in text_tables(result)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.trace/freeze/load are deprecated in torch 2.9+
def test_torchserve_handler_gives_the_zoo_models_answers(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    from benchmarks.peers import ts_handler
    from benchmarks.peers.export import export
    from benchmarks.peers.load import npy_image
    from packrat_mq.handler import Context, Input, load_handler, run_batch

    export(tmp_path / "resnet50.pt", batch=2, seed=0)
    served = ts_handler.NpyImageClassifier()
    context = SimpleNamespace(system_properties={"model_dir": str(tmp_path)},
                              manifest={"model": {"serializedFile": "resnet50.pt"}})
    served.initialize(context)
    payloads = [npy_image(seed=1), npy_image(seed=2)]
    assert len(payloads[0]) == 602_240  # the 602 KB float32 image the benchmark sends
    # TorchServe hands a body over as "data" or "body", bytes or bytearray.
    got = served.handle([{"body": bytearray(payloads[0])}, {"data": payloads[1]}], context)

    torch.manual_seed(0)
    zoo = load_handler("resnet50")
    zoo.initialize(Context(model_name="resnet50", threads=1, batch_size=2, graph_mode="torchscript"))
    items = [Input(id=str(i), data=protocol.decode_payload(protocol.NPY, p), content_type=protocol.NPY)
             for i, p in enumerate(payloads)]
    outcomes = run_batch(zoo, items).outcomes
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    want = [o.value for o in outcomes]
    # The same reply format: class indices and names, probabilities, what the weights are.
    assert [[(c["index"], c["label"]) for c in g["top5"]] for g in got] == \
        [[(c["index"], c["label"]) for c in w["top5"]] for w in want]
    assert [g["weights"] for g in got] == [w["weights"] for w in want] == ["random", "random"]
    for g, w in zip(got, want):
        assert [c["probability"] for c in g["top5"]] == pytest.approx([c["probability"] for c in w["top5"]], abs=1e-4)

    with pytest.raises(ValueError, match="shaped"):
        served.handle([{"body": protocol.encode_as(protocol.NPY, torch.zeros(4, 4).numpy())}], context)


def test_rounds_rotate_the_order_of_the_setups() -> None:
    setups = make_setups(threads=2, batch=8, wait_ms=50)[:3]
    keys = [[s.key for s in round_order(setups, k)] for k in (1, 2, 3, 4)]
    assert keys == [["torchserve", "packrat-layout", "packrat-auto"], ["packrat-layout", "packrat-auto", "torchserve"],
                    ["packrat-auto", "torchserve", "packrat-layout"], ["torchserve", "packrat-layout", "packrat-auto"]]
