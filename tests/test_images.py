"""Images as users send them: JPEG, PNG and WebP files for the vision models.

Every image is made here (Pillow), nothing is read from disk or downloaded.
Most tests run the zoo's image handling on a tiny stand-in classifier (a
pooling layer and a linear layer to 1,000 classes), so they take milliseconds;
the last one serves the real ResNet-50 through ``packrat-mq up`` and
``packrat-mq submit --file`` (``slow``).
"""
from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from packrat_mq import protocol
from packrat_mq.handler import Context, Input, run_batch

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")
Image = pytest.importorskip("PIL.Image")

from packrat_mq.zoo import vision  # noqa: E402
from tests.helpers import interrupt, wait_for  # noqa: E402


def picture(width: int = 64, height: int = 48, seed: int = 0) -> np.ndarray:
    """A small RGB picture: a gradient with some noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    return np.clip(base + rng.normal(0, 10, base.shape), 0, 255).astype(np.uint8)


def encode(array: np.ndarray, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **options)
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A decompression bomb's header: a valid PNG signature and IHDR claiming ``width`` x ``height``, few bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


JPEG = encode(picture(), "JPEG", quality=90)
PNG = encode(picture(seed=1), "PNG")
WEBP = encode(picture(seed=2), "WEBP", quality=90)


class TinyClassifier(vision.ImageClassifierHandler):
    """The zoo's image handling in front of a model that costs nothing."""

    def load_model(self, context: Context) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 1000))


@pytest.fixture(scope="module")
def handler() -> TinyClassifier:
    h = TinyClassifier()
    h.initialize(Context(model_name="tiny", threads=1, batch_size=8))
    return h


def item(payload: bytes, content_type: str, rid: str = "r") -> Input:
    """An input as the worker hands it over: decoded by content type first (images stay bytes)."""
    return Input(id=rid, data=protocol.decode_payload(content_type, payload), content_type=content_type)


def check_reply(value: dict) -> None:
    assert set(value) == {"top5", "weights"} and value["weights"] == "random"
    assert len(value["top5"]) == 5
    names = vision.imagenet_categories()
    for entry in value["top5"]:
        assert set(entry) == {"label", "index", "probability"}
        assert isinstance(entry["index"], int) and entry["label"] == names[entry["index"]]
    probs = [e["probability"] for e in value["top5"]]
    assert probs == sorted(probs, reverse=True) and 0.0 < sum(probs) <= 1.0 + 1e-5


def same_answer(a: dict, b: dict) -> bool:
    """The same classes in the same order, probabilities equal up to float rounding (batching changes it)."""
    return ([(e["index"], e["label"]) for e in a["top5"]] == [(e["index"], e["label"]) for e in b["top5"]]
            and [e["probability"] for e in a["top5"]] == pytest.approx([e["probability"] for e in b["top5"]], rel=1e-4))


# --- the wire format ------------------------------------------------------

def test_image_content_types_are_accepted_and_sniffed() -> None:
    assert {protocol.JPEG, protocol.PNG, protocol.WEBP} <= set(protocol.CONTENT_TYPES)
    assert protocol.sniff_content_type(JPEG) == protocol.JPEG
    assert protocol.sniff_content_type(PNG) == protocol.PNG
    assert protocol.sniff_content_type(WEBP) == protocol.WEBP
    assert protocol.sniff_content_type(protocol.encode_as(protocol.NPY, np.zeros(3))) == protocol.NPY
    assert protocol.sniff_content_type(b"hello") is None and protocol.sniff_content_type(b"") is None
    # The worker checks the signature and hands the bytes over as they are: pixels are the handler's.
    assert protocol.decode_payload(protocol.JPEG, JPEG) is JPEG


@pytest.mark.parametrize("payload, content_type, message", [
    (b"hello, not an image", protocol.JPEG, "begin b'hello, n'"),
    (PNG, protocol.JPEG, "they are image/png"),
    (JPEG, protocol.WEBP, "they are image/jpeg"),
    (b"", protocol.PNG, "begin b''"),
])
def test_bytes_that_are_not_the_image_type_claimed_are_refused(payload: bytes, content_type: str, message: str) -> None:
    with pytest.raises(protocol.PayloadError, match=f"payload is not valid {content_type}") as exc:
        protocol.decode_payload(content_type, payload)
    assert message in str(exc.value)


# --- decoding -------------------------------------------------------------

@pytest.mark.parametrize("payload, content_type", [(JPEG, protocol.JPEG), (PNG, protocol.PNG), (WEBP, protocol.WEBP)])
def test_each_format_decodes_to_the_models_input(handler: TinyClassifier, payload: bytes, content_type: str) -> None:
    image = handler.decode(payload, content_type)
    assert image.dtype == torch.uint8 and tuple(image.shape) == (3, 224, 224)


def test_resize_short_side_then_center_crop_the_imagenet_way() -> None:
    """A 512x256 picture whose middle half is white: resized to 448x256 and cropped to the center 224, all white."""
    array = np.zeros((256, 512, 3), dtype=np.uint8)
    array[:, 128:384] = 255
    image = vision.ResNet50Handler().decode(encode(array, "PNG"), protocol.PNG)
    assert tuple(image.shape) == (3, 224, 224) and int(image.min()) >= 250
    # Inception v3: short side 342, crop 299; a portrait picture is cropped top and bottom.
    portrait = np.zeros((684, 342, 3), dtype=np.uint8)
    portrait[171:513] = 255
    tall = vision.InceptionV3Handler().decode(encode(portrait, "PNG"), protocol.PNG)
    assert tuple(tall.shape) == (3, 299, 299) and int(tall.min()) >= 250


def test_decoded_pixels_match_a_plain_pillow_pipeline() -> None:
    """Against Pillow's resize + crop of the fully decoded file: the same picture (DCT scaling and cropping
    first change it by well under one grey level on average)."""
    array = picture(1280, 960)
    ours = vision.ResNet50Handler().decode(encode(array, "JPEG", quality=95), protocol.JPEG).float()
    im = Image.open(io.BytesIO(encode(array, "JPEG", quality=95))).convert("RGB").resize((341, 256), Image.BILINEAR)
    theirs = torch.from_numpy(np.asarray(im)[16:240, 58:282].copy()).permute(2, 0, 1).float()
    assert (ours - theirs).abs().mean() < 2.0


def test_exif_orientation_is_applied() -> None:
    """A phone's portrait photo stored landscape with orientation 6 (rotate 90 degrees clockwise to view)."""
    array = np.zeros((256, 512, 3), dtype=np.uint8)
    array[:, :256] = 255  # left half white as stored: the top half once turned
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=95, exif=exif)
    image = vision.ResNet50Handler().decode(buf.getvalue(), protocol.JPEG).float()
    assert image[:, :100].mean() > 200 and image[:, -100:].mean() < 50


def test_grey_palette_and_transparent_images_become_rgb(handler: TinyClassifier) -> None:
    rgb = picture()
    grey = Image.fromarray(rgb).convert("L")
    palette = Image.fromarray(rgb).convert("P")
    rgba = Image.fromarray(np.dstack([rgb, rgb[..., :1]]))
    for im in (grey, palette, rgba):
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        assert tuple(handler.decode(buf.getvalue(), protocol.PNG).shape) == (3, 224, 224)


def test_pixel_limit_is_a_handler_option() -> None:
    small = TinyClassifier()
    small.initialize(Context(model_name="tiny", options={"max_pixels": 64 * 47}))
    outcome = run_batch(small, [item(JPEG, protocol.JPEG)]).outcomes[0]
    assert outcome.error == "image of 64x48 pixels (0.0 megapixels) is over the limit of 0.003008 megapixels"
    with pytest.raises(ValueError, match="max_pixels"):
        TinyClassifier().initialize(Context(model_name="tiny", options={"max_pixels": "lots"}))


# --- one bad file fails its own request ------------------------------------

def test_bad_files_fail_alone_and_the_rest_of_the_batch_is_answered(handler: TinyClassifier) -> None:
    middle = len(JPEG) // 2
    requests = {
        "jpeg": (JPEG, protocol.JPEG),
        "truncated-jpeg": (JPEG[:middle], protocol.JPEG),
        "png": (PNG, protocol.PNG),
        "corrupt-jpeg-header": (JPEG[:3] + b"\0" * 40 + JPEG[43:], protocol.JPEG),
        "corrupt-png-data": (PNG[:60] + b"\xff" * 30 + PNG[90:], protocol.PNG),
        "bomb-png": (png_claiming(10_000, 5_000), protocol.PNG),
        "huge-png": (png_claiming(100_000, 100_000), protocol.PNG),
        "truncated-png": (PNG[: len(PNG) // 2], protocol.PNG),
        "webp": (WEBP, protocol.WEBP),
        "truncated-webp": (WEBP[: len(WEBP) // 2], protocol.WEBP),
        "tiny-png": (encode(picture(8, 8), "PNG"), protocol.PNG),
        "npy": (protocol.encode_as(protocol.NPY, picture(32, 32)), protocol.NPY),
    }
    items = [item(payload, ct, rid) for rid, (payload, ct) in requests.items()]
    outcomes = dict(zip(requests, run_batch(handler, items).outcomes))
    for rid in ("jpeg", "png", "webp", "npy"):
        assert outcomes[rid].ok, (rid, outcomes[rid].error)
        check_reply(outcomes[rid].value)
    errors = {rid: o.error for rid, o in outcomes.items() if not o.ok}
    assert set(errors) == set(requests) - {"jpeg", "png", "webp", "npy"}
    assert errors["truncated-jpeg"].startswith("payload is not a readable JPEG image: image file is truncated")
    assert errors["truncated-png"].startswith("payload is not a readable PNG image")
    assert errors["truncated-webp"].startswith("payload is not a readable WEBP image")
    assert errors["corrupt-jpeg-header"].startswith("payload is not a readable JPEG image")
    assert errors["corrupt-png-data"].startswith("payload is not a readable PNG image")
    assert errors["bomb-png"] == "image of 10000x5000 pixels (50.0 megapixels) is over the limit of 40 megapixels"
    assert errors["huge-png"].startswith("image is too large to decode")
    assert errors["tiny-png"] == "image of 8x8 pixels is too small; each side must be at least 16"
    # Bytes that never passed the worker's signature check (a handler used on its own) fail as clearly.
    [text] = run_batch(handler, [Input(id="t", data=b"plain text", content_type=protocol.PNG)]).outcomes
    assert text.error == "payload is not a readable PNG image: no valid PNG header (a corrupt file, or another format)"
    [raw] = run_batch(handler, [item(JPEG, protocol.BYTES)]).outcomes
    assert raw.error.startswith(f"got {len(JPEG)} bytes as application/octet-stream; send an image file as "
                                "image/jpeg, image/png, image/webp (its content_type)")
    # A file's answer does not depend on its neighbours.
    [alone] = run_batch(handler, [item(JPEG, protocol.JPEG)]).outcomes
    assert same_answer(alone.value, outcomes["jpeg"].value)


def test_an_instance_of_several_threads_decodes_in_parallel_with_the_same_answers(handler: TinyClassifier) -> None:
    threaded = TinyClassifier()
    threaded.initialize(Context(model_name="tiny", threads=2, batch_size=8))
    assert threaded._decoders is not None and handler._decoders is None
    payloads = [(JPEG, protocol.JPEG), (b"\xff\xd8\xff junk", protocol.JPEG), (PNG, protocol.PNG),
                (png_claiming(10_000, 5_000), protocol.PNG), (WEBP, protocol.WEBP)] * 2
    one = run_batch(handler, [item(p, ct, str(i)) for i, (p, ct) in enumerate(payloads)]).outcomes
    two = run_batch(threaded, [item(p, ct, str(i)) for i, (p, ct) in enumerate(payloads)]).outcomes
    assert [o.error for o in one] == [o.error for o in two]
    assert all(same_answer(a.value, b.value) for a, b in zip(one, two) if a.ok)
    assert [o.ok for o in two] == [True, False, True, False, True] * 2


def test_array_inputs_answer_in_the_same_format(handler: TinyClassifier) -> None:
    [value] = [o.value for o in run_batch(handler, handler.example_batch(1)).outcomes]
    check_reply(value)
    assert vision.imagenet_categories()[281] == "tabby" and len(vision.imagenet_categories()) == 1000


# --- the command line -------------------------------------------------------

def _submit(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PACKRAT_LOG_LEVEL="WARNING")
    return subprocess.run([sys.executable, "-m", "packrat_mq", "submit", *args], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.mark.parametrize("name, make", [("missing.jpg", None), ("a-directory", "dir")])
def test_submit_file_that_cannot_be_read_is_one_line(tmp_path: Path, name: str, make: str | None) -> None:
    path = tmp_path / name
    if make == "dir":
        path.mkdir()
    done = _submit("-m", "resnet50", "--file", str(path), "--redis-url", "redis://127.0.0.1:1/0")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: cannot read --file '{path}'"), done.stderr
    assert "Traceback" not in done.stderr


def test_submit_file_content_type_from_bytes_then_extension(tmp_path: Path) -> None:
    from packrat_mq.cli.submit import file_content_type

    assert file_content_type(tmp_path / "photo.bin", JPEG) == protocol.JPEG  # the bytes say, whatever the name
    assert file_content_type(tmp_path / "photo.JPG", b"not really") == protocol.JPEG  # the server will say
    assert file_content_type(tmp_path / "x.webp", WEBP) == protocol.WEBP
    assert file_content_type(tmp_path / "x.png", PNG) == protocol.PNG
    assert file_content_type(tmp_path / "x", protocol.encode_as(protocol.NPY, np.zeros(2))) == protocol.NPY
    assert file_content_type(tmp_path / "x.json", b"{}") == protocol.JSON
    assert file_content_type(tmp_path / "x.txt", b"hi") == protocol.TEXT
    assert file_content_type(tmp_path / "x.dat", b"\0\1") == protocol.BYTES


# --- end to end: the real ResNet-50 behind `packrat-mq up` -------------------

@pytest.fixture
def resnet_up(redis_url: str, prefix: str, r) -> Iterator[str]:
    cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", "resnet50", "--instances", "1x4",
           "--redis-url", redis_url, "--prefix", prefix, "--batch-timeout-ms", "20"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PACKRAT_LOG_LEVEL="WARNING"))
    try:
        wait_for(lambda: r.hget(f"{prefix}:dispatcher:resnet50", "state") == b"ready" and any(
            r.hget(f"{prefix}:instance:resnet50:{i.decode()}", "state") == b"ready"
            for i in r.smembers(f"{prefix}:index:instances:resnet50")), 120, "resnet50 ready")
        yield prefix
    finally:
        interrupt(proc)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resnet50_served_answers_image_files_and_each_bad_one_alone(resnet_up: str, redis_url: str, r,
                                                                      tmp_path: Path) -> None:
    from packrat_mq.client import Client

    photo = encode(picture(640, 480), "JPEG", quality=90)
    sent = [(photo, protocol.JPEG), (b"plain text", protocol.JPEG), (PNG, protocol.PNG),
            (png_claiming(10_000, 5_000), protocol.PNG), (photo[: len(photo) // 2], protocol.JPEG),
            (WEBP, protocol.WEBP)]
    client = Client(redis_url, prefix=resnet_up)
    try:
        ids = [client.send("resnet50", payload, content_type=ct) for payload, ct in sent]
        replies = client.gather(ids, timeout=60)
    finally:
        client.close()
    assert [rep.ok for rep in replies] == [True, False, True, False, False, True], [rep.error for rep in replies]
    for rep in (replies[0], replies[2], replies[5]):
        check_reply(rep.value())
    assert replies[1].error.startswith("payload is not valid image/jpeg")
    assert replies[3].error.startswith("image of 10000x5000 pixels")
    assert "truncated" in replies[4].error

    path = tmp_path / "photo.jpg"
    path.write_bytes(photo)
    done = _submit("-m", "resnet50", "--file", str(path), "--redis-url", redis_url, "--prefix", resnet_up, "--json")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["status"] == "ok" and reply["content_type"] == protocol.JSON
    check_reply(reply["value"])
    assert same_answer(reply["value"], replies[0].value())
