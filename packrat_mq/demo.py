"""``make demo``: the main job end to end on an embedded Redis.

Starts a real redis-server, serves the pretrained all-MiniLM-L6-v2 sentence
embedding model with several core-pinned instances, sends sentences through
the wire format with the Python client, and prints what came back: the
similarities of real embeddings, latency figures (medians with spread), a
bad request's error reply and the service status.
"""
from __future__ import annotations

import logging
import statistics
import sys
import time

import numpy as np

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A woman is holding an infant in her arms.",
    "A man is riding a horse.",
    "A cowboy rides a horse across the field.",
    "The stock market fell sharply today.",
    "Shares dropped as investors sold off.",
]


def _configuration(threads: int, batch: int):  # type: ignore[no-untyped-def]
    from pathlib import Path

    from packrat_mq.instances import Configuration

    try:
        from optimizer.profile import Profile, resolve_profile_path
        from optimizer.solving import solve

        path = resolve_profile_path("minilm")
        if path and Path(path).exists():
            return solve(Profile.load(path), threads, batch), f"optimizer on {path}"
    except (ImportError, FileNotFoundError, ValueError) as exc:
        print(f"(optimizer unavailable: {exc})")
    per = max(1, batch // threads)
    return Configuration.uniform(threads, 1, per), "one-thread instances (no profile)"


def _spread(values: list[float]) -> str:
    q = np.percentile(values, [10, 50, 90])
    return f"median {q[1]:.1f} ms (p10 {q[0]:.1f}, p90 {q[2]:.1f}, n={len(values)})"


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from packrat_mq.cli.status import collect_status
    from packrat_mq.client import Client
    from packrat_mq.connection import EmbeddedRedis, connect
    from packrat_mq.service import Service, default_threads
    from packrat_mq.settings import Settings

    threads = default_threads()
    batch = 8
    config, source = _configuration(threads, batch)
    print(f"== packrat-mq demo: all-MiniLM-L6-v2 on {threads} cores, B={batch}")
    print(f"configuration {config} from {source}"
          + (f", predicted {config.predicted_latency_ms:.1f} ms per batch" if config.predicted_latency_ms else ""))
    with EmbeddedRedis() as server:
        print(f"embedded Redis: {server.url}")
        settings = Settings(redis_url=server.url, batch_timeout_ms=5.0)
        r = connect(server.url)
        t0 = time.perf_counter()
        with Service(r, settings, server.url, "minilm", config) as service:
            print(f"{len(service.pool.instances)} instances ready in {time.perf_counter() - t0:.1f} s:")
            for inst in service.pool.instances:
                print(f"  {inst.record.id}: {inst.record.threads} thread(s), batch {inst.record.batch}, "
                      f"cpus {inst.record.cpus}, pid {inst.process.pid if inst.process else '-'}")
            client = Client(connect(server.url))

            print("\n== real embeddings: most similar sentence for each")
            replies = client.submit_many("minilm", SENTENCES, timeout=120)
            emb = np.array([rep.value() for rep in replies], dtype=np.float32)
            sims = emb @ emb.T
            for i, sentence in enumerate(SENTENCES):
                j = int(np.argsort(sims[i])[-2])
                print(f"  {sentence:<45} -> {SENTENCES[j]:<45} cos {sims[i, j]:.2f}")
            print(f"  (dimension {emb.shape[1]}, norms {np.linalg.norm(emb, axis=1).min():.3f}.."
                  f"{np.linalg.norm(emb, axis=1).max():.3f})")

            print("\n== latency, one request at a time (client send -> reply)")
            single = [client.submit("minilm", SENTENCES[i % 8], timeout=60) for i in range(40)]
            print(f"  end to end  {_spread([x.latency_ms or 0 for x in single])}")
            print(f"  inference   {_spread([x.inference_ms for x in single])}")

            print(f"\n== latency, bursts of {batch} requests (one aggregated batch each)")
            burst_lat: list[float] = []
            t1 = time.perf_counter()
            rounds = 15
            for k in range(rounds):
                reps = client.submit_many("minilm", [SENTENCES[(k + i) % 8] for i in range(batch)], timeout=60)
                burst_lat.extend(x.latency_ms or 0 for x in reps)
            elapsed = time.perf_counter() - t1
            print(f"  end to end  {_spread(burst_lat)}; {rounds * batch / elapsed:.0f} requests/s")

            print("\n== a bad request gets its own error reply")
            bad = client.submit("minilm", {"text": ""}, timeout=30)
            print(f"  status={bad.status} error={bad.error!r}")

            print("\n== status")
            for m in collect_status(r, settings.keys)["models"]:
                print(f"  {m['model']}: {m['configuration']} backlog {m['backlog']} stats {m['stats']}")
                for i in m["instances"]:
                    print(f"    {i['id']}: {i['state']} pid {i['pid']} cpus {i['cpus']} batches {i['batches']}")
            client.close()
        print("\nstopped cleanly: dispatcher first, then instances after draining their queues")
    med = statistics.median(x.latency_ms or 0 for x in single)
    print(f"done. single-request median {med:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
