"""Reading the request stream, without its payloads when they are large.

The dispatcher checks and routes requests by their fields; it never needs a
payload, which the worker fetches from the stream itself (see
:mod:`dispatcher.dispatcher`). XREADGROUP cannot leave a field out, so a
batch of eight 600 KB images would cross to the dispatcher only to be
dropped. :func:`read_fields` runs the same XREADGROUP inside a Lua script
that returns each entry with its ``payload`` replaced by the payload's size
(``PAYLOAD_BYTES``), so the images stay in Redis.

The script has its own cost: Redis converts the reply into Lua tables and
back. Measured on redis-server 6.2 (medians of 40, interleaved): eight
602 KB entries took 3.0 ms through the script against 6.0 ms for
XREADGROUP, but 256 small JSON entries took 1.8 ms against 0.9 ms. So
:class:`RequestReader` uses the script only while the payloads it has read
lately are large (``LARGE_PAYLOAD_BYTES`` on average), and plain XREADGROUP
otherwise; the two give the same fields but for ``payload`` /
``PAYLOAD_BYTES``, which :func:`packrat_mq.protocol.parse_request` takes
either way.

A script cannot block, so the first request of a batch at idle is waited for
with a plain ``XREADGROUP COUNT 1 BLOCK`` (that one entry carries its
payload) and the rest of the batch is read by the script. While payloads are
small the blocking read takes the whole batch's count instead.
"""
from __future__ import annotations

from typing import Any

import redis

from dispatcher.waiting import DeadlineRead
from packrat_mq.protocol import PAYLOAD_BYTES, payload_size

#: Payloads this large on average are left in Redis when the dispatcher reads (see the module text).
LARGE_PAYLOAD_BYTES = 16 * 1024
_SIZE = PAYLOAD_BYTES.encode()

#: KEYS[1] stream; ARGV: group, consumer, count, start id (">" or a pending id), the size field's name.
#: An entry deleted while pending comes back as its id alone.
_READ = """
local res = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], ARGV[4])
if not res then return {} end
local entries = res[1][2]
for _, entry in ipairs(entries) do
  local fields = entry[2]
  if fields then
    for i = 1, #fields, 2 do
      local name = fields[i]
      if name == 'payload' then
        fields[i] = ARGV[5]
        fields[i + 1] = tostring(#fields[i + 1])
      elseif name == ARGV[5] then
        fields[i] = name .. ':from-producer'
      end
    end
  end
end
return entries
"""

Entry = tuple[bytes, "dict[bytes, bytes] | None"]


def read_fields(r: redis.Redis, stream: str, group: str, consumer: str, count: int, start: str | bytes = ">") -> list[Entry]:
    """Up to ``count`` entries for ``consumer`` from ``start``, without payloads (never blocks).

    ``start`` is ``">"`` for new entries, or an id to re-read the consumer's
    own pending entries after it (as XREADGROUP). Each entry's fields have
    ``payload`` replaced by ``PAYLOAD_BYTES`` (its length, as text); an
    entry deleted while pending has ``None`` for fields.
    """
    raw = r.eval(_READ, 1, stream, group, consumer, count, start, PAYLOAD_BYTES)
    entries: list[Entry] = []
    for item in raw:
        flat = item[1] if len(item) > 1 else None
        entries.append((item[0], dict(zip(flat[0::2], flat[1::2])) if flat else None))
    return entries


class RequestReader:
    """Reads one consumer's requests, through the script while payloads are large."""

    def __init__(self, r: redis.Redis, stream: str, group: str, consumer: str,
                 waiter: DeadlineRead | None = None) -> None:
        self.r, self.stream, self.group, self.consumer = r, stream, group, consumer
        #: The blocking read for the first entry (:mod:`dispatcher.waiting`): it ends at its deadline once
        #: probed, and is a plain blocking XREADGROUP until then.
        self.waiter = waiter or DeadlineRead(r, stream)
        #: Mean payload size of recent reads (an exponential average over reads).
        self.mean_payload_bytes = 0.0

    @property
    def without_payloads(self) -> bool:
        return self.mean_payload_bytes >= LARGE_PAYLOAD_BYTES

    def read(self, count: int, start: str | bytes = ">") -> list[Entry]:
        """Up to ``count`` entries from ``start`` (see :func:`read_fields`); never blocks."""
        if self.without_payloads:
            entries = read_fields(self.r, self.stream, self.group, self.consumer, count, start)
        else:
            resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: start}, count=count)
            entries = self._plain(resp)
        self._observe(entries)
        return entries

    def wait(self, block_ms: int, count: int = 1) -> list[Entry]:
        """Block up to ``block_ms`` for new entries: up to ``count`` while payloads are small, else one.

        Read with their payloads (scripts cannot block): while payloads are
        large only the first entry comes this way and the rest through the
        script. While they are small, a burst (B producers arriving together)
        is read at once: one round trip less before the batch goes out.
        """
        n = 1 if self.without_payloads else max(1, count)
        resp = self.waiter.read(self.group, self.consumer, self.stream, n, block_ms)
        entries = self._plain(resp)
        self._observe(entries)
        return entries

    @staticmethod
    def _plain(resp: Any) -> list[Entry]:
        entries: list[Entry] = resp[0][1] if resp else []
        for _, fields in entries:
            if fields:
                fields.pop(_SIZE, None)  # only the script may say a payload's size
        return entries

    def _observe(self, entries: list[Entry]) -> None:
        sizes = [payload_size(fields) or 0 for _, fields in entries if fields]
        if sizes:
            self.mean_payload_bytes = 0.5 * self.mean_payload_bytes + 0.5 * (sum(sizes) / len(sizes))
