"""GET /metrics (Prometheus): request counts by finish reason, latency histograms, token counters,
and the scheduler's load, KV pool use, retractions, new-token ratio, prefix-cache hit rate and
grammar mask-fill time read at scrape time."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from weft.runtime.ipc.messages import StrOut
from weft.runtime.server.output import ReqState

router = APIRouter()

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "weft_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "weft_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "weft_cached_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter("weft_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "weft_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "weft_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "weft_inter_token_latency_seconds",
            "Time between tokens",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "weft_e2e_request_latency_seconds",
            "Request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("weft_num_running_reqs", "Requests decoding", registry=r)
        self.waiting = Gauge("weft_num_waiting_reqs", "Requests waiting for admission", registry=r)
        self.kv_usage = Gauge(
            "weft_kv_pool_usage",
            "Fraction of KV slots held by requests or the prefix cache",
            registry=r,
        )
        self.kv_used_by_requests = Gauge(
            "weft_kv_pool_protected_tokens", "KV slots locked by running requests", registry=r
        )
        self.retractions = Counter(
            "weft_retracted_requests",
            "Requests retracted (their KV given up, to be prefilled again) when the KV pool ran "
            "out during decoding",
            registry=r,
        )
        self._retractions_seen = 0
        self.new_token_ratio = Gauge(
            "weft_new_token_ratio",
            "Share of its remaining max_new_tokens a request without ignore_eos is expected to "
            "use, in admission's forecast of the KV pool",
            registry=r,
        )
        self.hit_rate = Gauge(
            "weft_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens so far", registry=r
        )
        # speculative decoding, over the server's life (SGLang reports both as gauges)
        self.spec_accept_rate = Gauge(
            "weft_spec_accept_rate",
            "Speculative decoding: draft tokens accepted / draft tokens verified (0 before any)",
            registry=r,
        )
        self.spec_accept_length = Gauge(
            "weft_spec_accept_length",
            "Speculative decoding: mean tokens a request gets per verify step, accepted drafts "
            "plus the verified token (0 before any)",
            registry=r,
        )
        self.mask_fill = Gauge(
            "weft_grammar_mask_fill_microseconds",
            "Scheduler-thread time per constrained request and step in mask filling, over the "
            "last 10k fills (0 before any)",
            ["quantile"],
            registry=r,
        )

    def observe(self, state: ReqState, out: StrOut, prev_token_at: float | None) -> None:
        """TokenizerManager observer: called on every output of every request."""
        token = out.token
        n = len(token.new_ids)
        if n and state.last_token_at is not None:
            if prev_token_at is None:
                self.ttft.observe(state.last_token_at - state.created)
            else:
                gap = (state.last_token_at - prev_token_at) / n
                for _ in range(n):
                    self.itl.observe(gap)
        if token.finish is None:
            return
        self.requests.labels(finish_reason=token.finish.type).inc()
        self.prompt_tokens.inc(token.prompt_tokens)
        self.cached_tokens.inc(token.cached_tokens)
        self.generation_tokens.inc(token.completion_tokens)
        if state.last_token_at is not None:
            self.e2e.observe(state.last_token_at - state.created)
        if state.first_token_at is not None and token.completion_tokens > 1:
            assert state.last_token_at is not None
            self.tpot.observe(
                (state.last_token_at - state.first_token_at) / (token.completion_tokens - 1)
            )

    def update_scheduler(self, sched: dict[str, Any]) -> None:
        self.running.set(sched["num_running"])
        self.waiting.set(sched["num_waiting"])
        total = max(int(sched["max_total_tokens"]), 1)
        self.kv_usage.set((total - int(sched["free_tokens"])) / total)
        self.kv_used_by_requests.set(sched["protected_tokens"])
        retractions = int(sched["retractions"])  # the scheduler's count since it started
        self.retractions.inc(max(retractions - self._retractions_seen, 0))
        self._retractions_seen = max(retractions, self._retractions_seen)
        self.new_token_ratio.set(float(sched["new_token_ratio"]))
        prompt = int(sched.get("prompt_tokens", 0))
        self.hit_rate.set(int(sched.get("cached_tokens", 0)) / prompt if prompt else 0.0)
        steps = int(sched.get("spec_verify_steps", 0))
        drafted = int(sched.get("spec_draft_tokens", 0))
        accepted = int(sched.get("spec_accepted_tokens", 0))
        self.spec_accept_rate.set(accepted / drafted if drafted else 0.0)
        self.spec_accept_length.set((accepted + steps) / steps if steps else 0.0)
        fills = sched.get("mask_fill", {})
        for quantile, key in (("0.5", "p50_us"), ("0.99", "p99_us")):
            self.mask_fill.labels(quantile).set(float(fills.get(key, 0.0)))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = request.app.state.weft
    m: Metrics = state.metrics
    if state.ready:
        m.update_scheduler(await state.manager.get_state())
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
