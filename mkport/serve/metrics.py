"""The server's Prometheus metrics, in a registry of their own (one per app, so that several apps in one
process, as in the tests, never collide)."""

from __future__ import annotations

import time
from contextlib import contextmanager

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# finer where the targets are (25 ms and 40 ms at p95 on the GPU), coarse up to the CPU's seconds
TTFA_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2, 5, 10)
RTF_BUCKETS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 5, 10)


class ServeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.time_to_first_audio = Histogram(
            "mkport_time_to_first_audio_seconds", "Request arrival to its first audio chunk leaving the scheduler",
            buckets=TTFA_BUCKETS, registry=r)
        self.real_time_factor = Histogram(
            "mkport_real_time_factor", "A finished stream's wall time from arrival to its last chunk / its audio seconds",
            buckets=RTF_BUCKETS, registry=r)
        self.active_streams = Gauge(
            "mkport_active_streams", "Stream slots in use: HTTP requests being answered and open WebSocket sessions",
            registry=r)
        self.max_streams = Gauge("mkport_max_streams", "Stream slots (--max-streams)", registry=r)
        self.queue_length = Gauge(
            "mkport_queue_length", "Admitted streams whose first frame the scheduler has not run yet", registry=r)
        self.rejected = Counter(
            "mkport_rejected_requests", "Requests refused: busy (no free slot, 503), not_ready (loading or shutting "
            "down, 503), invalid (4xx)", ["reason"], registry=r)
        self.streams = Counter(
            "mkport_streams", "Streams ended, by outcome: completed, cancelled (client gone or interrupted), timeout, error",
            ["outcome"], registry=r)
        self.audio_seconds = Counter("mkport_audio_seconds", "Seconds of audio sent", registry=r)
        self.underruns = Counter(
            "mkport_underruns", "Audio chunks made after the listener's earlier audio of the stream had run out", registry=r)
        self.scheduler_seconds = Counter(
            "mkport_scheduler_seconds", "Time the scheduler thread spent, by part: join (a new stream's prompt, and "
            "batched its prefill), frame (talker and code predictor; by turns, a stream's prefill is in its first "
            "frame), codec (chunks decoded and sent); per second, the fraction of the time it was busy",
            ["part"], registry=r)

    @contextmanager
    def busy(self, part: str):
        """Counts the time of the block into mkport_scheduler_seconds{part}."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.scheduler_seconds.labels(part).inc(time.perf_counter() - start)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
