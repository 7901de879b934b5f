"""Payloads in shared memory: the files, the request field, and a worker that reads and deletes them."""
from __future__ import annotations

import io
import os
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from packrat_mq import protocol, shared_payloads
from packrat_mq.settings import Settings
from packrat_mq.shared_payloads import MappedFile, PayloadBuffer, SharedPayloadError, SharedPayloads
from tests.test_worker import make_worker, push, replies, request, step, text


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


@pytest.fixture
def files(tmp_path: Path) -> SharedPayloads:
    return SharedPayloads(tmp_path / "shm")


# --- the files -------------------------------------------------------------------
def test_written_payload_reads_back_as_bytes_and_into_a_reused_buffer(files: SharedPayloads) -> None:
    data = os.urandom(200_000)
    name = files.write(data)
    assert shared_payloads.valid_name(name)
    assert files.read(name, 1 << 20) == data
    buffer = PayloadBuffer()
    view = files.read(name, 1 << 20, into=buffer)
    assert isinstance(view, memoryview) and view.readonly and view == data
    # The next, smaller read reuses the buffer; a larger one replaces it and leaves the old view whole.
    small = files.write(b"abc")
    assert files.read(small, 100, into=buffer) == b"abc"
    big = files.write(data * 2)
    assert files.read(big, 1 << 20, into=buffer) == data * 2
    assert bytes(view[3:10]) == data[3:10]
    files.discard([name, small, big])
    assert not os.listdir(files.directory)


def test_a_file_truncated_while_read_is_an_error_not_a_crash(files: SharedPayloads,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    name = files.write(b"x" * 10_000)
    real_fstat = os.fstat

    def fstat_then_truncate(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        os.truncate(files.path(name), 100)  # the producer shrinks it between the size and the read
        return st

    monkeypatch.setattr(os, "fstat", fstat_then_truncate)
    with pytest.raises(SharedPayloadError, match=r"changed while it was read \(100 of 10000 bytes\)"):
        files.read(name, 1 << 20, into=PayloadBuffer())


def test_rewrite_reuses_a_file_shrinks_it_and_makes_it_again_after_a_sweep(files: SharedPayloads) -> None:
    files.rewrite("abc-1", b"x" * 1000)
    files.rewrite("abc-1", b"short")
    assert files.read("abc-1", 100) == b"short"
    files.discard(["abc-1"])
    files.rewrite("abc-1", b"again")
    assert files.read("abc-1", 100) == b"again"


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", ".hidden", "-flag", "", "x" * 129, "a b", "é"])
def test_names_that_are_not_one_plain_file_name_are_refused(files: SharedPayloads, name: str) -> None:
    assert not shared_payloads.valid_name(name)
    with pytest.raises(SharedPayloadError, match="payload_shm must be a file name"):
        files.read(name, 100)


def test_reading_refuses_links_directories_missing_and_oversized_files(files: SharedPayloads, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    os.makedirs(files.directory)
    os.symlink(secret, os.path.join(files.directory, "link"))
    with pytest.raises(SharedPayloadError, match="cannot be opened"):
        files.read("link", 100)
    os.mkdir(os.path.join(files.directory, "dir"))
    with pytest.raises(SharedPayloadError, match="not a regular file|cannot be opened"):
        files.read("dir", 100)
    with pytest.raises(SharedPayloadError, match="is not in .* on host .*: a payload in shared memory must"):
        files.read("missing", 100)
    name = files.write(b"y" * 101)
    with pytest.raises(SharedPayloadError, match="payload of 101 bytes is over the limit of 100 bytes"):
        files.read(name, 100)


def test_sweep_deletes_old_payload_files_only(files: SharedPayloads) -> None:
    old, fresh = files.write(b"old"), files.write(b"fresh")
    foreign = os.path.join(files.directory, ".not-ours")
    Path(foreign).write_bytes(b"x")
    past = time.time() - 1000
    os.utime(os.path.join(files.directory, old), (past, past))
    os.utime(foreign, (past, past))
    assert files.sweep(older_than_s=600) == 1
    assert sorted(os.listdir(files.directory)) == sorted([fresh, ".not-ours"])
    assert SharedPayloads("/nonexistent/dir").sweep(1) == 0


# --- a producer's files, kept mapped ---------------------------------------------------
def test_mapped_file_writes_in_place_and_remakes_what_changed_under_it(files: SharedPayloads) -> None:
    f = MappedFile(files, "p-1")
    first = os.urandom(100_000)
    f.write(first[:10], first[10:])  # parts, joined
    assert files.read("p-1", 1 << 20) == first
    ino = os.stat(files.path("p-1")).st_ino
    second = os.urandom(100_000)
    f.write(second)  # same size: a copy into the same file
    assert files.read("p-1", 1 << 20) == second and os.stat(files.path("p-1")).st_ino == ino
    f.write(b"short")  # another size: resized, and the service reads exactly the payload
    assert files.read("p-1", 1 << 20) == b"short"
    os.unlink(files.path("p-1"))  # the sweep deleted it: made again by name, not written unseen
    f.write(second)
    assert files.read("p-1", 1 << 20) == second
    f.write(b"")  # nothing to map: written as an empty file
    assert files.read("p-1", 10) == b""
    f.write(first)
    assert files.read("p-1", 1 << 20) == first
    f.close()
    assert files.read("p-1", 1 << 20) == first  # unmapping leaves the file


def test_a_write_through_the_mapping_renews_the_files_age_for_the_sweep(files: SharedPayloads) -> None:
    f = MappedFile(files, "p-2")
    f.write(b"x" * 5000)
    past = time.time() - 1000
    os.utime(files.path("p-2"), (past, past))
    f.write(b"y" * 5000)  # tmpfs does not date a write through a mapping; the writer does
    assert files.sweep(older_than_s=600) == 0
    assert files.read("p-2", 1 << 20) == b"y" * 5000
    f.close()


def test_no_room_for_a_mapped_file_is_an_error_at_the_write(files: SharedPayloads,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    f = MappedFile(files, "p-3")
    with pytest.raises(OSError, match="No space left"):
        f.write(b"z" * 5000)  # not a SIGBUS at the copy
    monkeypatch.undo()
    f.write(b"z" * 5000)
    assert files.read("p-3", 1 << 20) == b"z" * 5000
    f.close()


def test_a_directory_that_cannot_reserve_memory_is_written_not_mapped(files: SharedPayloads,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(fd: int, offset: int, size: int) -> None:
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    f = MappedFile(files, "p-4")
    f.write(b"a" * 5000)
    assert files.read("p-4", 1 << 20) == b"a" * 5000 and f._map is None


@pytest.mark.parametrize("arr", [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
    np.arange(40, dtype=np.float16)[::3],  # not contiguous
    np.array(3.5),
    np.zeros((0, 5), dtype=np.uint8),
    np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", ">f8")]),
    np.array(["2026-12-03"], dtype="datetime64[D]"),
])
def test_npy_parts_joined_decode_to_the_array(arr: np.ndarray) -> None:
    header, data = protocol.npy_parts(arr)
    joined = header + data.tobytes()
    got = protocol.decode_payload(protocol.NPY, joined)
    assert got.dtype == arr.dtype and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)
    if arr.flags.c_contiguous:
        assert joined == _npy(arr)  # byte for byte what np.save writes


def test_npy_parts_refuses_object_arrays() -> None:
    with pytest.raises(TypeError, match="pickle"):
        protocol.npy_parts(np.array([{"a": 1}], dtype=object))


# --- the request field -----------------------------------------------------------
def _fields(**extra: bytes) -> dict[bytes, bytes]:
    return {b"id": b"r1", b"reply_to": b"elsewhere", b"content_type": b"application/x-npy",
            **{k.encode(): v for k, v in extra.items()}}


def test_a_request_may_name_its_payload_file_instead_of_carrying_it() -> None:
    req = protocol.parse_request(b"1-0", _fields(payload_shm=b"abc-1"), max_payload_bytes=10)
    assert req.payload is None and req.payload_shm == "abc-1" and not req.payload_shm_keep
    kept = protocol.parse_request(b"1-0", _fields(payload_shm=b"abc-1", payload_shm_keep=b"1"), max_payload_bytes=10)
    assert kept.payload_shm_keep
    assert protocol.request_fields("r", "t", None, protocol.NPY, payload_shm="n", keep=True) == {
        "id": "r", "reply_to": "t", "payload_shm": "n", "payload_shm_keep": 1, "content_type": protocol.NPY}


@pytest.mark.parametrize(("extra", "message"), [
    ({"payload": b"1", "payload_shm": b"abc"}, "payload and payload_shm are exclusive"),
    ({"payload_shm": b"../../etc/passwd"}, "payload_shm must be a file name"),
    ({"payload_shm": b"\xff\xfe"}, "payload_shm must be a file name"),
    ({"payload": b"1", "payload_fd": b"1:2"}, "payload_fd and payload or payload_shm are exclusive"),
    ({"payload_shm": b"a", "payload_fd": b"1:2"}, "payload_fd and payload or payload_shm are exclusive"),
    ({"payload_fd": b"/proc/1/fd/2"}, "payload_fd must be"),
    ({"payload_fd": b"0:2"}, "payload_fd must be"),
])
def test_bad_payload_file_fields_are_refused_with_an_answer(extra: dict[str, bytes], message: str) -> None:
    with pytest.raises(protocol.RequestRejected, match=message) as info:
        protocol.parse_request(b"1-0", _fields(**extra), max_payload_bytes=10)
    assert info.value.reply_to == "elsewhere"
    assert protocol.error_kind(str(info.value)) == "bad_request"


def test_npy_decodes_in_place_from_a_read_buffer(files: SharedPayloads) -> None:
    arr = np.arange(60_000, dtype=np.float32).reshape(3, 20_000)
    view = files.read(files.write(_npy(arr)), 1 << 20, into=PayloadBuffer())
    out = protocol.decode_payload(protocol.NPY, view)  # type: ignore[arg-type]
    np.testing.assert_array_equal(out, arr)
    assert not out.flags.writeable


# --- a worker that reads and deletes them ----------------------------------------
def _shm_request(i: int, reply_to: str, name: str, *, keep: bool = False) -> protocol.Request:
    req = request(i, reply_to=reply_to, payload=b"", content_type=protocol.NPY)
    req.payload, req.payload_shm, req.payload_shm_keep = None, name, keep
    return req


@pytest.mark.parametrize("carry_bytes", [0, protocol.CARRY_MAX_BYTES], ids=["fetched", "named-in-the-sub-batch"])
def test_worker_serves_payload_files_and_deletes_only_the_service_owned_ones(
    r: redis.Redis, settings: Settings, carry_bytes: int
) -> None:
    w = make_worker(r, settings)
    files = settings.payload_files
    reply_to = settings.keys.replies("c1")
    arrays = [np.full((2, 3), i, dtype=np.float32) for i in range(3)]
    owned, kept = files.write(_npy(arrays[0])), files.write(_npy(arrays[1]))
    reqs = [_shm_request(0, reply_to, owned), _shm_request(1, reply_to, kept, keep=True),
            request(2, reply_to=reply_to, payload=_npy(arrays[2]), content_type=protocol.NPY)]
    push(r, w, reqs, carry_bytes=carry_bytes)
    assert step(w) == 1
    got = {text(f, "id"): f for f in replies(r, reply_to)}
    for i, arr in enumerate(arrays):
        f = got[f"req-{i}"]
        assert text(f, "status") == protocol.OK, f
        np.testing.assert_array_equal(protocol.decode_payload(text(f, "content_type"), f[b"payload"]), arr)
    assert os.listdir(files.directory) == [kept], "the answered request's file is deleted, the kept one stays"


def test_a_missing_payload_file_fails_its_request_alone(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings)
    reply_to = settings.keys.replies("c1")
    push(r, w, [_shm_request(0, reply_to, "never-written"), request(1, reply_to=reply_to)])
    assert step(w) == 1
    got = {text(f, "id"): f for f in replies(r, reply_to)}
    assert text(got["req-0"], "status") == protocol.ERROR
    assert "payload_shm 'never-written' is not in" in text(got["req-0"], "error")
    assert protocol.error_kind(text(got["req-0"], "error")) == "bad_payload"
    assert text(got["req-1"], "status") == protocol.OK


def test_a_worker_that_dies_before_its_commit_leaves_the_file_for_the_next(r: redis.Redis, settings: Settings) -> None:
    first = make_worker(r, settings)
    reply_to = settings.keys.replies("c1")
    name = settings.payload_files.write(_npy(np.ones(4, dtype=np.float32)))
    push(r, first, [_shm_request(0, reply_to, name)])
    [(entry_id, fields)] = first.read(block_ms=50)
    requests = protocol.decode_subbatch(fields)
    first.fetch_payloads(requests)  # read, then "died": no transaction, no delete
    assert os.listdir(settings.payload_files.directory) == [name]
    fresh = make_worker(r, settings)
    assert step(fresh) == 1
    [f] = replies(r, reply_to)
    assert text(f, "status") == protocol.OK
    assert os.listdir(settings.payload_files.directory) == []


# --- sealed payloads (payload_fd): memfds a worker maps -------------------------------
def _ref(fd: int) -> str:
    return f"{os.getpid()}:{fd}"


def test_a_sealed_payload_is_mapped_once_and_cannot_shrink_under_its_reader() -> None:
    arr = np.arange(30_000, dtype=np.float32)
    sealed = shared_payloads.SealedFile(len(_npy(arr)))
    sealed.write(_npy(arr))
    maps = shared_payloads.SealedMaps()
    view = maps.read(sealed.ref, 1 << 20)
    assert view.readonly
    out = protocol.decode_payload(protocol.NPY, view)  # type: ignore[arg-type]
    np.testing.assert_array_equal(out, arr)
    with pytest.raises(PermissionError):
        os.ftruncate(sealed.fd, 10)  # the seal: no SIGBUS for the worker that maps it
    sealed.write(_npy(arr + 1))  # the producer reuses it for its next payload: the same map sees it
    again = protocol.decode_payload(protocol.NPY, maps.read(sealed.ref, 1 << 20))  # type: ignore[arg-type]
    np.testing.assert_array_equal(again, arr + 1)
    assert len(maps._maps) == 1
    with pytest.raises(SharedPayloadError, match="over the limit"):
        maps.read(sealed.ref, 100)
    sealed.close()
    with pytest.raises(SharedPayloadError, match="is not open"):
        maps.read(sealed.ref, 1 << 20)
    np.testing.assert_array_equal(out, arr + 1)  # a view handed out keeps its map
    maps.close()


def test_a_kept_map_is_found_again_without_opening_and_a_reused_fd_number_is_checked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sealed = shared_payloads.SealedFile(4096)
    sealed.write(b"a" * 4096)
    maps = shared_payloads.SealedMaps()
    assert bytes(maps.read(sealed.ref, 1 << 20)[:1]) == b"a"
    with monkeypatch.context() as m:  # a payload already checked and mapped: one stat, no open
        m.setattr(shared_payloads.os, "open", lambda *a, **k: pytest.fail("opened again"))
        assert bytes(maps.read(sealed.ref, 1 << 20)[:1]) == b"a"
    number, ref = sealed.fd, sealed.ref
    sealed.close()
    other = os.memfd_create("other", os.MFD_ALLOW_SEALING)
    if other != number:  # the same fd number, another file
        os.dup2(other, number)
        os.close(other)
    try:
        import fcntl
        os.ftruncate(number, 4096)
        fcntl.fcntl(number, fcntl.F_ADD_SEALS, shared_payloads.SEALS)
        with pytest.raises(SharedPayloadError, match="is not a sealed payload"):
            maps.read(ref, 1 << 20)
    finally:
        os.close(number)
    maps.close()


def test_only_sealed_packrat_memfds_are_mapped(tmp_path: Path) -> None:
    maps = shared_payloads.SealedMaps()
    plain = tmp_path / "plain"
    plain.write_bytes(b"x" * 100)
    fds = [os.open(plain, os.O_RDONLY),
           os.memfd_create(shared_payloads.MEMFD_NAME),  # not sealable
           os.memfd_create("other", os.MFD_ALLOW_SEALING)]
    try:
        import fcntl
        os.ftruncate(fds[2], 10)
        fcntl.fcntl(fds[2], fcntl.F_ADD_SEALS, shared_payloads.SEALS)  # sealed, but not a packrat payload
        for fd in fds:
            with pytest.raises(SharedPayloadError, match="is not a sealed payload"):
                maps.read(_ref(fd), 1 << 20)
    finally:
        for fd in fds:
            os.close(fd)
    with pytest.raises(SharedPayloadError, match="payload_fd must be"):
        maps.read("../1:2", 1 << 20)


def test_sealed_maps_keep_the_most_recent_and_views_outlive_eviction() -> None:
    maps = shared_payloads.SealedMaps(kept=2)
    files = [shared_payloads.SealedFile(4096) for _ in range(3)]
    views = []
    for i, f in enumerate(files):
        f.write(bytes([i]) * 4096)
        views.append(maps.read(f.ref, 1 << 20))
    assert len(maps._maps) == 2
    assert [bytes(v[:1]) for v in views] == [b"\x00", b"\x01", b"\x02"]
    by_bytes = shared_payloads.SealedMaps(kept_bytes=2 * 4096)
    for f in files:
        by_bytes.read(f.ref, 1 << 20)
    assert len(by_bytes._maps) == 2 and by_bytes._bytes == 2 * 4096
    for f in files:
        f.close()


def test_a_request_may_name_a_sealed_payload() -> None:
    req = protocol.parse_request(b"1-0", _fields(payload_fd=b"123:4"), max_payload_bytes=10)
    assert req.payload is None and req.payload_fd == "123:4" and req.payload_shm is None
    assert protocol.request_fields("r", "t", None, protocol.NPY, payload_fd="1:2") == {
        "id": "r", "reply_to": "t", "payload_fd": "1:2", "content_type": protocol.NPY}
    encoded = protocol.encode_subbatch([req], "b", carry_bytes=protocol.CARRY_MAX_BYTES)
    [carried] = protocol.decode_subbatch({k.encode(): v if isinstance(v, bytes) else str(v).encode()
                                          for k, v in encoded.items()})
    assert carried.carried and carried.payload_fd == "123:4" and carried.payload_shm is None


@pytest.mark.parametrize("carry_bytes", [0, protocol.CARRY_MAX_BYTES], ids=["fetched", "named-in-the-sub-batch"])
def test_worker_serves_sealed_payloads_in_place_and_fails_a_closed_one_alone(
    r: redis.Redis, settings: Settings, carry_bytes: int
) -> None:
    w = make_worker(r, settings)
    reply_to = settings.keys.replies("c1")
    arrays = [np.full((2, 3), i, dtype=np.float32) for i in range(2)]
    sealed = [shared_payloads.SealedFile(len(_npy(a))) for a in arrays]
    for f, a in zip(sealed, arrays):
        f.write(_npy(a))
    gone = shared_payloads.SealedFile(10)
    text_file = shared_payloads.SealedFile(5)  # made first: a descriptor closed is the next one made
    text_file.write(b"hello")
    gone_ref = gone.ref
    gone.close()
    sealed.append(text_file)
    reqs = []
    for i, ref in enumerate([sealed[0].ref, sealed[1].ref, gone_ref, text_file.ref]):
        req = request(i, reply_to=reply_to, payload=b"", content_type=protocol.TEXT if i == 3 else protocol.NPY)
        req.payload, req.payload_fd = None, ref
        reqs.append(req)
    push(r, w, reqs, carry_bytes=carry_bytes)
    assert step(w) == 1
    got = {text(f, "id"): f for f in replies(r, reply_to)}
    for i, arr in enumerate(arrays):
        f = got[f"req-{i}"]
        assert text(f, "status") == protocol.OK, f
        np.testing.assert_array_equal(protocol.decode_payload(text(f, "content_type"), f[b"payload"]), arr)
    assert "is not open" in text(got["req-2"], "error")
    assert text(got["req-3"], "status") == protocol.OK and b"hello" in got["req-3"][b"payload"]
    assert protocol.error_kind(text(got["req-2"], "error")) == "bad_payload"
    for f in sealed:
        os.fstat(f.fd)  # the producer's own: the service closed and deleted nothing
        f.close()
