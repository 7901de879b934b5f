"""The aggregation loop, with a scripted reader and a fake clock (no Redis)."""
from __future__ import annotations

from dispatcher.aggregation import Aggregator


class FakeTime:
    """A clock that moves only when someone sleeps or blocks."""

    def __init__(self) -> None:
        self.now = 100.0  # seconds, like time.monotonic()
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        assert len(self.sleeps) < 100_000, "aggregation loop does not terminate"
        self.sleeps.append(seconds)
        # A real sleep takes at least a few microseconds; without this floor a
        # remaining window below the clock's resolution would never run out.
        self.now += max(seconds, 1e-6)


class FakeReader:
    """Entries arrive at scheduled fake times; a blocking read waits for them."""

    def __init__(self, t: FakeTime, arrivals: list[tuple[float, str]]) -> None:
        self.t = t
        self.pending = sorted(arrivals)  # (arrival time in s, entry)
        self.calls: list[tuple[int, int | None, float]] = []

    def _ready(self, count: int) -> list[str]:
        out = []
        while self.pending and self.pending[0][0] <= self.t.now + 1e-12 and len(out) < count:
            out.append(self.pending.pop(0)[1])
        return out

    def __call__(self, count: int, block_ms: int | None) -> list[str]:
        assert count > 0
        assert len(self.calls) < 100_000, "aggregation loop does not terminate"
        self.calls.append((count, block_ms, self.t.now))
        got = self._ready(count)
        if got or block_ms is None:
            return got
        assert block_ms > 0, "block_ms 0 would block forever in Redis"
        wake = self.t.now + block_ms / 1000.0
        if self.pending and self.pending[0][0] <= wake:
            self.t.now = max(self.t.now, self.pending[0][0])
            return self._ready(count)
        self.t.now = wake
        return []


def make(arrivals: list[tuple[float, str]], **kw: float) -> tuple[Aggregator[str], FakeReader, FakeTime]:
    t = FakeTime()
    reader = FakeReader(t, [(100.0 + at, e) for at, e in arrivals])
    agg: Aggregator[str] = Aggregator(reader, clock=t.clock, sleep=t.sleep, **kw)  # type: ignore[arg-type]
    return agg, reader, t


def test_full_batch_returns_at_once() -> None:
    agg, reader, t = make([(0.0, f"e{i}") for i in range(6)])
    batch = agg.next_batch(4, timeout_ms=5.0)
    assert batch == ["e0", "e1", "e2", "e3"]
    assert len(reader.calls) == 1
    assert reader.calls[0][:2] == (4, 500)
    assert t.now == 100.0 and t.sleeps == []
    # The rest is the next batch's start.
    assert agg.next_batch(4, timeout_ms=0.0) == ["e4", "e5"]


def test_empty_when_idle() -> None:
    agg, reader, t = make([])
    assert agg.next_batch(8, timeout_ms=5.0, idle_block_ms=300) == []
    assert reader.calls == [(8, 300, 100.0)]
    assert abs(t.now - 100.3) < 1e-9  # waited exactly the idle block, no more


def test_partial_batch_after_timeout_timer_starts_at_first_arrival() -> None:
    # First request arrives 0.2 s into the idle wait; the 5 ms window runs from then.
    agg, reader, t = make([(0.2, "a"), (0.2 + 0.010, "late")])
    batch = agg.next_batch(4, timeout_ms=5.0, idle_block_ms=500)
    assert batch == ["a"]
    elapsed_ms = (t.now - 100.2) * 1000.0
    assert 5.0 <= elapsed_ms < 5.0 + agg.poll_interval_ms + 1e-6
    # Short windows never block in Redis: all reads after the first are non-blocking.
    assert all(block is None for _, block, _ in reader.calls[1:])
    # Polling sleeps are bounded by the poll interval.
    assert t.sleeps and max(t.sleeps) <= agg.poll_interval_ms / 1000.0 + 1e-12
    # The late one is left for the next batch.
    assert reader.pending == [(100.21, "late")]


def test_entries_arriving_during_window_join() -> None:
    agg, reader, t = make([(0.0, "a"), (0.001, "b"), (0.003, "c"), (0.0049, "d"), (0.006, "e")])
    batch = agg.next_batch(8, timeout_ms=5.0)
    assert batch == ["a", "b", "c", "d"]
    assert reader.pending and reader.pending[0][1] == "e"


def test_batch_filling_during_window_returns_early() -> None:
    agg, reader, t = make([(0.0, "a"), (0.001, "b"), (0.002, "c"), (0.050, "d")])
    batch = agg.next_batch(3, timeout_ms=5.0)
    assert batch == ["a", "b", "c"]
    assert (t.now - 100.0) * 1000.0 < 2.0 + agg.poll_interval_ms + 1e-6


def test_reads_ask_only_for_what_is_missing() -> None:
    agg, reader, t = make([(0.0, "a"), (0.0, "b"), (0.001, "c")])
    agg.next_batch(5, timeout_ms=2.0)
    counts = [c for c, _, _ in reader.calls]
    assert counts[0] == 5 and counts[1] == 3
    assert counts[-1] == 2  # after "c" joined


def test_zero_timeout_drains_what_is_there_without_waiting() -> None:
    agg, reader, t = make([(0.0, "a"), (0.0, "b")])
    # Only "a" comes back from the first read (count limits it), then one drain.
    reader_calls_before = len(reader.calls)
    batch = agg.next_batch(4, timeout_ms=0.0)
    assert batch == ["a", "b"]
    assert t.now == 100.0 and t.sleeps == []
    assert len(reader.calls) - reader_calls_before <= 2


def test_final_drain_after_deadline_picks_up_arrivals() -> None:
    # The window runs out during a poll sleep; what arrived meanwhile still joins.
    t = FakeTime()
    calls: list[tuple[int | None, float]] = []

    def read(count: int, block_ms: int | None) -> list[str]:
        calls.append((block_ms, t.now))
        if len(calls) == 1:
            return ["first"]
        if t.now - 100.0 >= 0.005:
            return ["at-deadline"][:count] if not any(c[1] - 100.0 >= 0.005 for c in calls[:-1]) else []
        return []

    agg: Aggregator[str] = Aggregator(read, clock=t.clock, sleep=t.sleep, poll_interval_ms=10.0)  # type: ignore[arg-type]
    assert agg.next_batch(4, timeout_ms=5.0) == ["first", "at-deadline"]
    # The sleep was cut to the window, not the 10 ms poll interval.
    assert t.sleeps[0] == 0.005 and abs(sum(t.sleeps) - 0.005) < 1e-9
    assert all(block is None for block, _ in calls[1:])


def test_long_window_blocks_until_a_tick_before_deadline() -> None:
    # 1 s window, 100 ms ticks: one blocking read ending 100 ms early, then polls.
    agg, reader, t = make([(0.0, "a"), (0.950, "b")], server_tick_ms=100.0)
    batch = agg.next_batch(4, timeout_ms=1000.0)
    assert batch == ["a", "b"]
    blocking = [(block, at) for _, block, at in reader.calls[1:] if block is not None]
    assert blocking, "a long window should block in Redis instead of polling"
    first_block, at = blocking[0]
    assert at == 100.0
    assert first_block == 900  # remaining (1000) minus one server tick
    # No blocking read may end after the deadline minus a tick.
    for block, start in blocking:
        assert (start - 100.0) * 1000.0 + block <= 1000.0 - 100.0 + 1e-6
    # The window still closes on time, not a tick late.
    assert 1000.0 <= (t.now - 100.0) * 1000.0 < 1000.0 + agg.poll_interval_ms + 1e-6


def test_long_window_with_nothing_more_ends_at_deadline() -> None:
    agg, reader, t = make([(0.0, "a")], server_tick_ms=50.0)
    assert agg.next_batch(4, timeout_ms=400.0) == ["a"]
    elapsed = (t.now - 100.0) * 1000.0
    assert 400.0 <= elapsed < 400.0 + agg.poll_interval_ms + 1e-6
    blocks = [b for _, b, _ in reader.calls[1:] if b is not None]
    assert blocks and blocks[0] == 350
    # Polling sleeps cover only the last stretch (under two ticks).
    assert sum(t.sleeps) * 1000.0 < 2 * 50.0 + 1e-6


def test_windows_up_to_two_ticks_never_block() -> None:
    agg, reader, t = make([(0.0, "a")], server_tick_ms=100.0)
    assert agg.next_batch(4, timeout_ms=200.0) == ["a"]
    assert all(b is None for _, b, _ in reader.calls[1:])
    assert 200.0 <= (t.now - 100.0) * 1000.0 < 200.0 + agg.poll_interval_ms + 1e-6
