"""Prometheus metrics of one server, in a registry of its own (several servers can share a process).

The engine thread updates them between steps; `/metrics` renders them in the text format.
"""

from __future__ import annotations

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Requests, tokens, tokens per round (tau), queue depth, step time, hang-up lag."""

    def __init__(self, block_size: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("dflow_requests", "Requests that ended, by finish reason "
                                "(stop, length, cancelled, error, shutdown)", ["finish_reason"], registry=r)
        self.rejected = Counter("dflow_rejected_requests", "Requests refused at the door, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("dflow_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("dflow_generation_tokens", "Tokens generated", registry=r)
        self.tokens_per_round = Histogram("dflow_tokens_per_round", "Tokens one request gained in one round "
                                          "(accepted drafts + bonus: its mean is tau)",
                                          buckets=tuple(range(1, block_size + 1)), registry=r)
        self.step_seconds = Histogram("dflow_step_seconds", "Wall time of one Runtime.step(), by whether it "
                                      "prefilled prompt tokens (at most --max-prefill-tokens while others decode)",
                                      ["prefill"],
                                      buckets=STEP_BUCKETS, registry=r)
        self.batch_rows = Histogram("dflow_step_rows", "Live requests in one step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.ttft = Histogram("dflow_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.cancel_lag = Histogram("dflow_cancel_lag_steps", "Steps between a hang-up (or cancel) and its row "
                                    "freed", buckets=(0, 1, 2, 4, 8), registry=r)
        self.queue_depth = Gauge("dflow_queue_depth", "Requests waiting for a row", registry=r)
        self.running = Gauge("dflow_running_requests", "Requests holding a row", registry=r)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the text exposition format."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
