"""``make demo``: the main job end to end on an embedded Redis.

Starts a real redis-server, serves the pretrained all-MiniLM-L6-v2 sentence
embedding model with several core-pinned instances, sends sentences through
the wire format with the Python client, and prints what came back: the
similarities of real embeddings, latency figures (medians with spread), a
bad request's error reply and the service status.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from optimizer.planning.selection import choose
from packrat_mq import logs
from packrat_mq.cli.status import collect_status
from packrat_mq.client import Client
from packrat_mq.connection import EmbeddedRedis, connect
from packrat_mq.instances import Configuration
from packrat_mq.interrupts import exit_code, terminate_as_interrupt
from packrat_mq.settings import Settings
from packrat_mq.topology import Topology
from workers.supervisor import Supervisor

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


def _bursts(client: Client, batch: int, rounds: int = 20) -> tuple[list[float], float]:
    """Batch latencies (first send to last reply) of ``rounds`` bursts, and requests/s."""
    client.submit_many("minilm", [SENTENCES[i % len(SENTENCES)] for i in range(batch)], timeout=60)  # warm-up
    latencies = []
    start = time.perf_counter()
    for k in range(rounds):
        latency_ms, _ = client.time_batch("minilm", [SENTENCES[(k + i) % 8] for i in range(batch)], timeout=60)
        latencies.append(latency_ms)
    return latencies, rounds * batch / (time.perf_counter() - start)


def _spread(values: list[float]) -> str:
    q = np.percentile(values, [10, 50, 90])
    return f"median {q[1]:.1f} ms (p10 {q[0]:.1f}, p90 {q[2]:.1f}, n={len(values)})"


def main() -> int:
    """Run the demo; Ctrl-C or SIGTERM stop it with everything it started (exit 130 / 143)."""
    try:
        with terminate_as_interrupt():
            return _demo()
    except KeyboardInterrupt as exc:
        print(f"\ndemo interrupted by {exc.args[0] if exc.args else 'SIGINT'}; what it started is stopped",
              file=sys.stderr)
        return exit_code(exc)


def _demo() -> int:
    threads = Topology.detect().max_cores_per_socket
    batch = 8
    choice = choose("minilm", threads, batch)
    config = choice.configuration
    print(f"== packrat-mq demo: all-MiniLM-L6-v2 on {threads} cores, B={batch}")
    print(f"configuration: {choice.note}")
    if choice.warning:
        print(choice.warning)
    with EmbeddedRedis() as server:
        print(f"embedded Redis: {server.url}")
        settings = Settings(redis_url=server.url, batch_timeout_ms=5.0)
        if "log_level" not in settings.model_fields_set:
            # Quiet unless asked: the demo prints what matters; its processes get the same level.
            settings = settings.model_copy(update={"log_level": "WARNING"})
        logs.configure(settings, "demo")
        r = connect(server.url)
        t0 = time.perf_counter()
        with Supervisor(r, settings, server.url, "minilm", config) as service:
            print(f"{len(service.instances)} instances ready in {time.perf_counter() - t0:.1f} s:")
            for inst in service.instances:
                print(f"  {inst.record.id}: {inst.record.threads} thread(s), batch {inst.record.batch}, "
                      f"cpus {inst.record.cpus}, pid {inst.child.process.pid if inst.child.process else '-'}")
            client = Client(server.url)

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
            chosen_batches, rate = _bursts(client, batch)
            print(f"  batch latency {_spread(chosen_batches)}; {rate:.0f} requests/s")

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

        baseline = Configuration.uniform(1, threads, batch)
        if str(baseline) != str(config):
            print(f"\n== the same bursts on one instance with all {threads} threads (the TorchServe default)")
            with Supervisor(r, settings, server.url, "minilm", baseline):
                client = Client(server.url)
                base_batches, base_rate = _bursts(client, batch)
                client.close()
            print(f"  batch latency {_spread(base_batches)}; {base_rate:.0f} requests/s")
            ratio = statistics.median(base_batches) / statistics.median(chosen_batches)
            # A speed-up below 1 reads as "0.96x faster"; say the slowdown as the factor it is.
            verdict = f"{ratio:.2f}x faster than" if ratio >= 1 else f"{1 / ratio:.2f}x the batch latency of"
            print(f"  {config} is {verdict} {baseline} (median batch latency, measured in this run)")
    med = statistics.median(x.latency_ms or 0 for x in single)
    print(f"done. single-request median {med:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
