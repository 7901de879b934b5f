"""Typed settings shared by every packrat-mq process.

One pydantic settings object; each field falls back to an environment
variable ``PACKRAT_<FIELD>`` (e.g. ``PACKRAT_REDIS_URL``), and CLI options
override both. Child processes receive their settings as JSON, so a worker
sees exactly what its supervisor was started with.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from packrat_mq import graph, shared_payloads
from packrat_mq.keys import Keys

#: URL schemes of Redis Cluster: ``redis.cluster.RedisCluster`` connects, and a model's keys carry its hash tag.
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def is_cluster_url(url: str | None) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return bool(url) and url.partition("://")[0].lower() in CLUSTER_SCHEMES  # type: ignore[union-attr]


class Settings(BaseSettings):
    """Settings of a packrat-mq deployment (one prefix on one Redis)."""

    model_config = SettingsConfigDict(env_prefix="PACKRAT_", extra="ignore")

    redis_url: str | None = Field(
        default=None,
        description="redis://, rediss:// or unix:// URL, redis+cluster://host:port[,host:port...] "
                    "(rediss+cluster:// with TLS) for Redis Cluster; None starts/finds the embedded server.",
    )
    prefix: str = Field(default="packrat", pattern=r"^[A-Za-z0-9_.\-]+$")
    batch_timeout_ms: float = Field(
        default=5.0, ge=0, description="Dispatch a partial batch this long after its first request."
    )
    batch_poll_ms: float = Field(
        default=1.0, gt=0,
        description="While a partial batch waits out the last server tick before its deadline, the stream is "
                    "read this often (Redis wakes a blocked reader at its timeout only on a tick). Each read "
                    "costs the dispatcher and Redis CPU (every 0.2 ms took 31-37% of a core while waiting). "
                    "Only where the server lacks CLIENT UNBLOCK: elsewhere the wait is one blocking read.",
    )
    max_payload_bytes: int = Field(default=16 * 1024 * 1024, ge=1, description="Larger payloads get an error reply.")
    shm_dir: str = Field(
        default=shared_payloads.DEFAULT_DIR, min_length=1,
        description="The host's directory of payloads in shared memory (a request's payload_shm names a file "
                    "there); producers on the serving host write large payloads there instead of into Redis.",
    )
    shm_ttl_s: float = Field(
        default=900.0, gt=0,
        description="Payload files older than this are deleted by the supervisors' sweep (their request was "
                    "answered without deleting them, or never reached a worker of this host).",
    )
    reply_ttl_s: int = Field(
        default=3600, ge=1, description="Reply streams expire this long after their last reply."
    )
    graph_mode: str = Field(
        default="eager",
        description="eager, graph (each model's default backend), torchscript, compile, export or aoti; "
                    "true/false as before mean graph/eager.",
    )
    heartbeat_s: float = Field(default=1.0, gt=0, description="How often instances and the dispatcher report.")
    node_grace_s: float = Field(
        default=10.0, gt=0,
        description="How long an instance and its node's supervisor must both be silent (record stale or gone) "
                    "before the dispatcher hands the requests the instance holds to other instances.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        default="INFO", description="Log level of every packrat-mq process."
    )
    omp_wait_policy: Literal["ACTIVE", "PASSIVE"] | None = Field(
        default=None,
        description="OMP_WAIT_POLICY of every instance; unset keeps the OpenMP library's default (spin briefly, then sleep).",
    )
    gomp_spincount: int | None = Field(
        default=None, ge=0, description="GOMP_SPINCOUNT of every instance (GNU OpenMP: spins before sleeping)."
    )
    kmp_blocktime_ms: int | None = Field(
        default=None, ge=0, description="KMP_BLOCKTIME of every instance (Intel OpenMP: ms before sleeping)."
    )
    malloc_retain_mb: int = Field(
        default=256, ge=0,
        description="glibc malloc of every instance keeps up to this many MiB of freed memory for reuse "
                    "(M_TRIM_THRESHOLD) and takes blocks up to 32 MiB from its heap (M_MMAP_THRESHOLD), so "
                    "batch-sized buffers (payloads, inputs, activations) are not handed back to the OS and "
                    "faulted in again every batch; 0 keeps glibc's own policy. A GLIBC_TUNABLES of the "
                    "operator's own wins for the names it sets.",
    )
    max_backlog: int = Field(
        default=100_000,
        ge=1,
        description="Bound on a model's request stream; newer requests past it get an 'overloaded' error reply.",
    )

    # --- the adaptive half: estimating B and reconfiguring (dispatcher.estimation) ---
    estimator_alpha: float = Field(default=0.1, gt=0, le=1, description="EWMA weight of a new backlog sample.")
    estimator_window: int = Field(default=10, ge=1, description="B̃ is the mode of this many recent estimates.")
    estimator_sample_ms: float = Field(default=5.0, gt=0, description="How often the request stream's length is read.")
    reconfigure_timeout_s: float = Field(
        default=1.0, gt=0, description="The estimate must differ from B this long before a reconfiguration."
    )
    reconfigure_up_timeout_s: float = Field(
        default=0.25, gt=0, description="The same for a larger B (and between two moves up): up quick, down slow."
    )
    reconfigure_up_utilisation: float = Field(
        default=0.6, ge=0, le=1,
        description="The estimate moves B up only while the dispatch rate is at least this share of the current "
                    "B's planned capacity (a queue that builds still moves it: the queue-delay trigger).",
    )
    estimator_knee: float = Field(
        default=0.05, ge=0, lt=1,
        description="The estimator asks for no larger B than the smallest whose planned capacity is within this "
                    "fraction of the best up to its estimate (a larger B that serves no more only slows batches).",
    )
    estimator_switch_factor: float = Field(
        default=2.0, ge=0,
        description="A move down that needs new processes (active-passive) waits this many times the seconds its "
                    "switch is expected to over-subscribe the cores (the last such change's, or what the current "
                    "B's instances hold under load, if longer) beyond its timeout: it must be worth the switch.",
    )
    estimator_switch_gain: float = Field(
        default=0.1, ge=0,
        description="Under a load no B carries, a move down that needs new processes (active-passive) is made only "
                    "to a B that serves at least this fraction more than the current one: the switch "
                    "over-subscribes the cores for seconds, and a few percent is within a measure's noise.",
    )
    estimator_switch_payback: bool = Field(
        default=True,
        description="A move down that needs new processes (active-passive) waits until the latency it is predicted "
                    "to save has paid for the backlog its switch is predicted to build (rent or buy).",
    )
    estimator_switch_keep: float = Field(
        default=0.5, ge=0, le=1,
        description="The share of the current B's capacity the payback rule counts on while a switch "
                    "over-subscribes the cores.",
    )
    adaptive_min_batch: int = Field(default=1, ge=1, description="Smallest B the estimator asks for.")
    adaptive_max_batch: int = Field(default=32, ge=1, description="Largest B the estimator asks for.")
    trigger_period_s: float = Field(
        default=1.0, gt=0, description="Window of the batch-timeout and queueing-delay triggers."
    )
    spare_instances: int | None = Field(
        default=None, ge=0,
        description="Loaded instances a supervisor keeps beyond the ones it serves with, so that a "
                    "reconfiguration re-threads them in place instead of starting processes. Unset: for an "
                    "adaptive deployment, the most instances any plan of its batch range needs; 0 otherwise.")
    prewarm_spares: bool | None = Field(
        default=None,
        description="Start the spare instances right after start-up (one at a time), so that even the first "
                    "reconfiguration is made from loaded instances; costs their memory from the start. "
                    "Unset: on for an adaptive deployment.")
    prewarm_max_cpu: float = Field(
        default=0.5, ge=0, le=1,
        description="A spare is pre-started only while the machine's CPU use since the supervisor's previous "
                    "check is at most this fraction: loading a model beside serving instances slows them. "
                    "1: whenever one is missing.")
    handover_timeout_s: float = Field(
        default=10.0, ge=0,
        description="In an active-passive change whose new instances take cores of the instances they replace, "
                    "each new instance holds its first sub-batch until those have answered what they hold, at "
                    "most this long: the two sets running on the same cores slow each other down by more than "
                    "they share (docs/decisions.md). 0: they run side by side.")
    spare_min_free_fraction: float = Field(
        default=0.1, ge=0, lt=1,
        description="A spare is kept or started only while the machine's available memory stays above this "
                    "fraction of its total.")

    # --- metrics (packrat_mq.exposition) ---
    metrics_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="Port of the Prometheus endpoint of up/pool/node/dispatch (/metrics); unset or empty: off.",
    )
    metrics_address: str = Field(
        default="127.0.0.1", min_length=1,
        description="Address the metrics endpoint binds; 0.0.0.0 inside a container's network.",
    )

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _empty_is_off(cls, v: object) -> object:
        # PACKRAT_METRICS_PORT= (set, empty) turns metrics off, as unset does (docker-compose).
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("graph_mode", mode="before")
    @classmethod
    def _graph_mode(cls, v: object) -> str:
        # A GraphModeError is a ValueError: pydantic reports it with the setting's name.
        return graph.parse(v)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.upper() if isinstance(v, str) else v

    @property
    def cluster(self) -> bool:
        """Whether this deployment runs on Redis Cluster (its URL says so)."""
        return is_cluster_url(self.redis_url)

    @property
    def payload_files(self) -> shared_payloads.SharedPayloads:
        """This host's payload files in shared memory."""
        return shared_payloads.SharedPayloads(self.shm_dir)

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix, cluster=self.cluster)
