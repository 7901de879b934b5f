"""Payloads in shared memory: large inputs that do not cross Redis.

A producer on the serving host may write a request's payload to a file in
the host's shared payload directory (``shm_dir``, ``/dev/shm/packrat`` by
default: a tmpfs, so the file is memory) and XADD only the file's name, in
the ``payload_shm`` field, instead of the bytes in ``payload``. The worker
that serves the request reads the file, and deletes it once the request is
answered (after the transaction that answers it commits, so a worker that
dies before that leaves the file for the instance that serves the request
again).

A producer that sends many may keep its files instead (``payload_shm_keep
1``): the service only reads them, and the producer writes the next payload
into a file whose request has been answered. That is what the Python client
does: creating a 600 KB tmpfs file and deleting it cost 0.28 ms, rewriting
one 0.05 ms (eight of each: 2.25 against 0.36 ms), and it keeps each file
mapped (:class:`MappedFile`), so the next write is one memory copy.

Why: Redis carries a 600 KB image four times as slowly as the bytes are
worth on a small machine. On two shared cores, eight such requests at B=8
spent 4-8 ms in the producer's XADDs and 4-6 ms in the worker's fetch,
bounded by redis-server's output (64 KB per event-loop turn); the
handler's work was all that was left to cut (docs/figures.md, "Large
payloads"). A tmpfs write and read of the same bytes is a memory copy each.

What it does not change: the request entry is the request. It is
dispatched, claimed, answered and deleted exactly as one with ``payload``,
so exactly-once, the backlog, deadlines and every error reply stay as they
are. Only where the bytes live differs.

Files nobody deletes (a request refused by a dispatcher on another host, a
worker killed between its commit and the unlink, a producer whose XADD
failed on a broken connection) are removed by every supervisor's sweep
once they are ``shm_ttl_s`` old; a request must be served within that
time, or it is answered with an error saying its payload is gone.

Safety: a name is a plain file name (letters, digits, ``.``, ``_``, ``-``;
no slash, no leading dot), opened without following symbolic links, and
must be a regular file no larger than ``max_payload_bytes``. The bytes are
decoded by content type like any payload, never unpickled. Anyone who can
XADD can already read every request stream, so naming another producer's
file reveals nothing a Redis client could not read.

Sealed payloads (``payload_fd``), for a producer in the workers' PID
namespace and of their user: the payload is a memfd the producer made and
sealed against shrinking (:class:`SealedFile`), named by ``<pid>:<fd>``.
The worker opens it through ``/proc/<pid>/fd/<fd>`` and maps it instead of
reading it (:class:`SealedMaps`): no copy before the handler. A mapped file
that shrinks ends the process that reads it with SIGBUS, which is why a
named file is read, never mapped; a sealed one cannot shrink, and the seal
cannot be removed, so its map is as safe as a read. The producer owns the
memfd (the service never deletes it; it is freed when the producer closes
it), and reuses it for its next payload of the same size once the reply has
arrived. Why: at B=8, 600 KB each, reading the eight files cost 0.9 ms of a
4.5 ms overhead whose floor, without the payload, is 2.6 ms
(docs/figures.md, "Large payloads").
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import socket
import stat
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

#: Where the payload files live unless ``PACKRAT_SHM_DIR`` says otherwise.
DEFAULT_DIR = "/dev/shm/packrat"
#: The request field that names a payload file, instead of ``payload``.
FIELD = "payload_shm"
#: With ``1``, the producer keeps the file: the service reads it and leaves it (the producer reuses
#: or deletes it once the reply has arrived). Without it, the service deletes it after answering.
KEEP_FIELD = "payload_shm_keep"
#: The two fields as they are read from a stream entry.
FIELD_BYTES = FIELD.encode()
KEEP_FIELD_BYTES = KEEP_FIELD.encode()
#: A payload file's name: one path component, not hidden, at most 128 characters.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
#: What a name must be, as a producer is told when it is not.
NAME_RULE = f"{FIELD} must be a file name of 1-128 letters, digits, '.', '_' or '-' (not starting with '.' or '-')"
#: The request field that names a producer's sealed payload, ``<pid>:<fd>``, instead of ``payload``.
FD_FIELD = "payload_fd"
FD_FIELD_BYTES = FD_FIELD.encode()
FD_REF = re.compile(r"([1-9][0-9]{0,9}):([0-9]{1,9})")
FD_RULE = f"{FD_FIELD} must be '<pid>:<fd>', a process id and one of its file descriptors (decimal)"
#: The memfd name of a sealed payload; the worker maps only memfds of this name.
MEMFD_NAME = "packrat-payload"
#: A sealed payload's seals: its size is fixed for good (a seal cannot be removed).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Sealed payloads a worker keeps mapped between batches (a producer reuses its memfds: mapped once),
#: and the most bytes they may hold: a kept map keeps its memfd's memory alive after its producer closed it.
MAPS_KEPT = 256
MAPS_KEPT_BYTES = 256 << 20
#: Files are readable by the producer's user and group (workers may run as another user of the group).
FILE_MODE = 0o640
DIR_MODE = 0o750


class SharedPayloadError(ValueError):
    """A payload file that cannot be used; the message is the producer's error reply."""


class MappedFile:
    """A producer's own payload file, kept mapped: writing the next payload is one memory copy.

    Why: ``pwrite`` of 600 KB into a tmpfs file walks the file's page cache
    page by page; eight cost 0.53-0.63 ms on the Zen 3 host of 12-03, a copy
    into the same file's mapping 0.13 ms (``docs/figures.md``, "The
    producer's payload files kept mapped"). A producer that keeps its files
    (``payload_shm_keep``) writes each of them again and again, so it maps
    each once.

    Safety, for the producer: the file is (re)made and sized by name when it
    is missing, another file under the name (the sweep deleted it), or of
    another size, and its memory is reserved then (``posix_fallocate``): a
    full tmpfs is an ``OSError`` there, never a SIGBUS at the copy. A write
    through a mapping does not touch tmpfs's modification time, which the
    supervisors' sweep reads, so each write sets it. Workers only read the
    file (:meth:`SharedPayloads.read`), never map it: nothing a producer does
    to its file can end a worker.
    """

    def __init__(self, files: SharedPayloads, name: str) -> None:
        self.name = name
        self.path = files.path(name)
        self._files = files
        self._map: mmap.mmap | None = None
        self._ino = -1

    def write(self, *parts: Any) -> None:
        """Write the payload, the ``parts`` joined, into the file; each part a C-contiguous buffer (bytes, an array)."""
        views = [memoryview(part).cast("B") for part in parts]
        if not self._mapped(sum(len(view) for view in views)):
            self._files.rewrite(self.name, b"".join(views))  # no mapping (empty, or cannot reserve): written
            return
        assert self._map is not None
        _copy_into(self._map, views)
        os.utime(self.path, follow_symlinks=False)

    def _mapped(self, size: int) -> bool:
        """Whether the file is mapped at ``size`` bytes, remapped (or made) if it was not; False: it cannot be."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
            if (self._map is not None and st.st_ino == self._ino and st.st_size == size
                    and stat.S_ISREG(st.st_mode)):
                return True
        except FileNotFoundError:
            pass
        return self._remap(size)

    def _remap(self, size: int) -> bool:
        """Open (or make) the file by name at ``size`` bytes and map it; False where it cannot be mapped."""
        self.close()
        if size == 0:
            return False
        os.makedirs(self._files.directory, mode=DIR_MODE, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SharedPayloadError(f"{FIELD} {self.name!r} is not a regular file")
            if st.st_size != size:
                os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)  # the memory now, or ENOSPC now
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                return False  # a directory that cannot reserve (not a tmpfs): written, not mapped
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._ino = st.st_ino
        finally:
            os.close(fd)
        return True

    def array(self, header: bytes, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The file made ``header`` + the array's bytes long, the header written, and the array in it returned.

        The producer fills the array in place (:meth:`packrat_mq.client.Client.empty`): no copy at send.
        """
        if not self._mapped(array_file_size(header, shape, dtype)):
            raise SharedPayloadError(f"{self.path} cannot be mapped (not a tmpfs?)")
        assert self._map is not None
        self._map[:len(header)] = header
        os.utime(self.path, follow_symlinks=False)
        return _array_in(self._map, len(header), shape, dtype)

    def close(self) -> None:
        """Unmap (the file stays); a map an array still uses is unmapped when the array goes."""
        if self._map is not None:
            _unmap(self._map)
            self._map = None
            self._ino = -1


def array_file_size(header: bytes, shape: tuple[int, ...], dtype: np.dtype) -> int:
    """The bytes of a payload file that holds ``header`` and then a C-order array of ``shape`` and ``dtype``."""
    return len(header) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _copy_into(buffer: mmap.mmap, views: list[memoryview]) -> None:
    """The views, one after another, from the start of a mapping: one memory copy each."""
    offset = 0
    for view in views:
        buffer[offset:offset + len(view)] = view
        offset += len(view)


def _array_in(buffer: mmap.mmap, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A C-order array of ``shape`` and ``dtype`` in the mapping from ``offset`` on (its memory, no copy)."""
    return np.frombuffer(buffer, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)), offset=offset).reshape(shape)


def _unmap(buffer: mmap.mmap) -> None:
    try:
        buffer.close()
    except BufferError:
        pass  # an array lent out still views it: unmapped when that array is collected


class SealedFile:
    """A producer's sealed payload: a memfd of a fixed size, kept mapped, named by ``<pid>:<fd>``.

    Made, sized, its memory reserved (``posix_fallocate``: a full tmpfs is
    an ``OSError`` here, never a SIGBUS later) and mapped, then sealed
    (:data:`SEALS`): from then on nobody, the producer included, can change
    its size, so a worker may map it (:class:`SealedMaps`). Writes go
    through the producer's map, as :class:`MappedFile`'s do. Only a
    process in the workers' PID namespace, of their user, can be read this
    way; the worker answers anyone else with an error saying so.
    """

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError("a sealed payload holds at least one byte")
        self.size = size
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.ref = f"{os.getpid()}:{fd}"

    def write(self, *parts: Any) -> None:
        """Write the payload, the ``parts`` joined (C-contiguous buffers, exactly ``size`` bytes in all)."""
        views = [memoryview(part).cast("B") for part in parts]
        if sum(len(view) for view in views) != self.size:
            raise ValueError(f"a sealed payload of {self.size} bytes gets exactly that many")
        _copy_into(self._map, views)

    def array(self, header: bytes, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The header written, and the array after it returned, for the producer to fill in place."""
        self._map[:len(header)] = header
        return _array_in(self._map, len(header), shape, dtype)

    def close(self) -> None:
        """Unmap and close: the memory is freed once no worker maps it either."""
        if self.fd >= 0:
            _unmap(self._map)
            os.close(self.fd)
            self.fd = -1


class PayloadBuffer:
    """One reusable read buffer: a worker keeps one per position in its sub-batches.

    Reused from batch to batch, so its pages are faulted in once, not at
    every read. It grows by replacement, never in place: views handed out
    earlier (a previous batch's arrays) keep the old memory alive and
    unchanged in size. Its contents change at the next batch: a handler
    must not keep its input arrays past the batch they came in (a cache of
    inputs must copy them).
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def take(self, size: int) -> memoryview:
        if len(self._buf) < size:
            self._buf = bytearray(size)
        return memoryview(self._buf)[:size]


class SealedMaps:
    """A worker's maps of producers' sealed payloads (``payload_fd``): read in place, no copy.

    Each payload is opened through ``/proc/<pid>/fd/<fd>`` and checked: a
    memfd named :data:`MEMFD_NAME`, sealed against shrinking, no larger
    than the limit. Its map is kept (up to :data:`MAPS_KEPT`, the least
    recently used let go), keyed by the file's inode: a producer reuses its
    memfds, so each is mapped once, and a kept map keeps its inode alive,
    so the same key is the same file. Views handed to a handler keep a map
    alive past its eviction; it is unmapped when they go.
    """

    def __init__(self, kept: int = MAPS_KEPT, kept_bytes: int = MAPS_KEPT_BYTES) -> None:
        self._maps: OrderedDict[tuple[int, int], mmap.mmap] = OrderedDict()
        self._kept = kept
        self._kept_bytes = kept_bytes
        self._bytes = 0

    def read(self, ref: str, max_bytes: int) -> memoryview:
        """A read-only view of sealed payload ``ref``; :class:`SharedPayloadError` says why it cannot be had."""
        match = FD_REF.fullmatch(ref)
        if match is None:
            raise SharedPayloadError(f"{FD_RULE}, not {ref[:80]!r}")
        path = f"/proc/{match.group(1)}/fd/{match.group(2)}"
        known = self._known(path, max_bytes)
        if known is not None:
            return memoryview(known)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SharedPayloadError(
                f"{FD_FIELD} {ref!r} is not open in a process of host {socket.gethostname()}'s workers' PID "
                "namespace: a sealed payload's producer must run there, and keep it open until its reply "
                "arrives") from None
        except OSError as exc:  # EACCES: another user's process
            raise SharedPayloadError(f"{FD_FIELD} {ref!r} cannot be opened: {exc.strerror} (a sealed payload's "
                                     "producer must run as the workers' user)") from None
        try:
            try:
                target = os.readlink(path)
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals, target = 0, ""
            if not target.startswith(f"/memfd:{MEMFD_NAME}") or not seals & fcntl.F_SEAL_SHRINK:
                raise SharedPayloadError(f"{FD_FIELD} {ref!r} is not a sealed payload (a memfd named "
                                         f"{MEMFD_NAME!r}, sealed against shrinking)")
            st = os.fstat(fd)
            if st.st_size > max_bytes:
                raise SharedPayloadError(f"payload of {st.st_size} bytes is over the limit of {max_bytes} bytes")
            if st.st_size == 0:
                return memoryview(b"")
            key = (st.st_dev, st.st_ino)
            kept = self._maps.get(key)
            if kept is None or len(kept) != st.st_size:  # grown (sealed against shrinking only): mapped again
                if kept is not None:
                    self._let_go(key)
                kept = self._maps[key] = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
                self._bytes += len(kept)
            self._maps.move_to_end(key)
            while len(self._maps) > 1 and (len(self._maps) > self._kept or self._bytes > self._kept_bytes):
                self._let_go(next(iter(self._maps)))
        finally:
            os.close(fd)
        return memoryview(kept)

    def _known(self, path: str, max_bytes: int) -> mmap.mmap | None:
        """The kept map of the file ``path`` names, if that file was checked and mapped here at its size now.

        One ``stat`` through ``/proc``'s link (with the same permission check
        as ``open``), where a new payload takes ``open``, ``readlink``,
        ``F_GET_SEALS``, ``fstat`` and ``close``: 4 against 10 us a request.
        A kept map holds its file, so an inode kept here is still the memfd
        that was checked, and neither its name nor its seals (only ever added)
        can have changed. Anything else (unknown, resized, an error) takes the
        full check, which says what is wrong.
        """
        if not self._maps:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino)
        kept = self._maps.get(key)
        if kept is None or len(kept) != st.st_size or st.st_size > max_bytes:
            return None
        self._maps.move_to_end(key)
        return kept

    def _let_go(self, key: tuple[int, int]) -> None:
        kept = self._maps.pop(key)
        self._bytes -= len(kept)
        _unmap(kept)

    def close(self) -> None:
        while self._maps:
            self._let_go(next(iter(self._maps)))


def valid_name(name: str) -> bool:
    return NAME.fullmatch(name) is not None


class SharedPayloads:
    """One host's payload directory: producers write, workers read and delete, supervisors sweep."""

    def __init__(self, directory: str | os.PathLike[str] = DEFAULT_DIR) -> None:
        self.directory = os.fspath(directory)

    def path(self, name: str) -> str:
        if not valid_name(name):
            raise SharedPayloadError(f"{NAME_RULE}, not {name[:80]!r}")
        return os.path.join(self.directory, name)

    # --- the producer's side ---------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> str:
        """Write ``data`` to a new file; returns its name for the request's ``payload_shm``."""
        name = uuid.uuid4().hex
        try:
            self._write(name, data, os.O_EXCL)
        except FileExistsError:
            raise  # not ours to delete
        except BaseException:
            self.discard([name])  # the part written
            raise
        return name

    def rewrite(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` into file ``name``, created if it is not there, reusing its memory if it is.

        For a producer that keeps its files (``payload_shm_keep``) and
        writes the next payload into one whose request was answered. The
        file is opened by name each time: one the sweep deleted meanwhile is
        made again, not written unseen through an old descriptor.
        """
        self._write(name, data, 0)

    def _write(self, name: str, data: bytes | bytearray | memoryview, flags: int) -> None:
        path = self.path(name)
        os.makedirs(self.directory, mode=DIR_MODE, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | flags, FILE_MODE)
        try:
            view = memoryview(data).cast("B")
            size = len(view)
            offset = 0
            while offset < size:
                offset += os.pwrite(fd, view[offset:], offset)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # a rewritten file that held a larger payload
        finally:
            os.close(fd)

    # --- the worker's side -----------------------------------------------
    def read(self, name: str, max_bytes: int, *, into: PayloadBuffer | None = None) -> bytes | memoryview:
        """The bytes of payload file ``name``; :class:`SharedPayloadError` says why they cannot be had.

        ``into``: read into that reusable buffer and return a read-only view of
        it, for a decoder that reads in place (``.npy``). A 600 KB read into a
        new buffer cost about 0.3 ms, most of it page faults of the buffer; a
        buffer reused from one batch to the next has its pages already. The
        file is read, not memory-mapped: a map of a file its producer
        truncates meanwhile ends the reading process with SIGBUS, and no
        input may end a worker.
        """
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise SharedPayloadError(
                f"{FIELD} {name!r} is not in {self.directory} on host {socket.gethostname()}: a payload in "
                "shared memory must be written on the host that serves the request, and is removed "
                "once its request is answered or when it is older than shm_ttl_s") from None
        except OSError as exc:  # a symbolic link (ELOOP), no permission, ...
            raise SharedPayloadError(f"{FIELD} {name!r} cannot be opened: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SharedPayloadError(f"{FIELD} {name!r} is not a regular file")
            size = st.st_size
            if size > max_bytes:
                raise SharedPayloadError(f"payload of {size} bytes is over the limit of {max_bytes} bytes")
            if into is None:
                chunks, left = [], size
                while left > 0:
                    chunk = os.read(fd, left)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    left -= len(chunk)
                data: bytes | memoryview = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                got = len(data)
            else:
                view = into.take(size)
                got = 0
                while got < size:
                    n = os.readv(fd, [view[got:]])
                    if n == 0:
                        break
                    got += n
                data = view.toreadonly()
            if got != size:
                raise SharedPayloadError(f"{FIELD} {name!r} changed while it was read ({got} of {size} bytes)")
        finally:
            os.close(fd)
        return data

    def discard(self, names: Iterable[str]) -> int:
        """Delete these payload files where they exist here; returns how many were deleted. Never raises."""
        deleted = 0
        for name in names:
            if not valid_name(name):
                continue
            try:
                os.unlink(os.path.join(self.directory, name))
                deleted += 1
            except OSError:
                pass  # gone already, or on another host: the sweep of that host has it
        return deleted

    # --- the supervisor's side -------------------------------------------
    def sweep(self, older_than_s: float, now: float | None = None) -> int:
        """Delete payload files last written more than ``older_than_s`` ago; returns how many."""
        cutoff = (time.time() if now is None else now) - older_than_s
        deleted = 0
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return 0  # no directory: nobody wrote here
        for entry in entries:
            try:
                if (valid_name(entry.name) and entry.is_file(follow_symlinks=False)
                        and entry.stat(follow_symlinks=False).st_mtime < cutoff):
                    os.unlink(entry.path)
                    deleted += 1
            except OSError:
                continue  # deleted by its worker or another sweep meanwhile
        return deleted


def kept(fields: dict[bytes, bytes]) -> bool:
    """Whether the entry's producer keeps its payload file (the service must not delete it)."""
    return fields.get(KEEP_FIELD_BYTES) == b"1"


def owned_name(fields: dict[bytes, bytes]) -> str | None:
    """The payload file the service deletes once it answered the entry: the one it names, unless kept."""
    return None if kept(fields) else name_of(fields)


def name_of(fields: dict[bytes, bytes]) -> str | None:
    """The payload file an entry names, if it names a valid one."""
    raw = fields.get(FIELD_BYTES)
    if raw is None:
        return None
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return name if valid_name(name) else None
