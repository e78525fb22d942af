"""The optional Prometheus endpoint (``--metrics-port``): a collector that asks the server for fresh Stats."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import infer_pb2 as pb

# Stats field -> (metric name, help, kind)
_METRICS: dict[str, tuple[str, str, str]] = {
    "queue_depth": ("infer_queue_depth", "Sequences waiting to be admitted to a batch (an n > 1 request's "
                    "children join once its prompt is computed)", "gauge"),
    "num_running": ("infer_running_sequences", "Sequences in the running batch", "gauge"),
    "beam_searches": ("infer_beam_searches", "BeamSearch calls under way", "gauge"),
    "in_flight": ("infer_server_in_flight_requests", "Requests accepted by the server and not finished", "gauge"),
    "max_queue": ("infer_server_max_queue", "In-flight requests past which calls get RESOURCE_EXHAUSTED", "gauge"),
    "kv_total_blocks": ("infer_kv_blocks_total_capacity", "KV cache blocks in the pool", "gauge"),
    "kv_usage": ("infer_kv_usage_ratio", "Used KV blocks / all KV blocks", "gauge"),
    "prefix_hit_rate": ("infer_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache", "gauge"),
    "spec_acceptance_rate": ("infer_spec_acceptance_ratio", "Accepted / proposed speculative tokens", "gauge"),
    "requests_finished": ("infer_requests_finished", "Requests finished (or aborted)", "counter"),
    "embedding_requests_finished": ("infer_embedding_requests_finished",
                                    "Embedding requests finished (or aborted), of infer_requests_finished", "counter"),
    "prompt_tokens": ("infer_prompt_tokens", "Prompt tokens received", "counter"),
    "output_tokens": ("infer_output_tokens", "Tokens generated", "counter"),
    "steps": ("infer_engine_steps", "Engine iterations", "counter"),
    "preemptions": ("infer_preemptions", "Sequences preempted for lack of KV blocks", "counter"),
    "mean_ttft_ms": ("infer_mean_ttft_milliseconds", "Mean time to first token", "gauge"),
    "mean_tpot_ms": ("infer_mean_tpot_milliseconds", "Mean time per output token", "gauge"),
    "output_tokens_per_s": ("infer_output_tokens_per_second", "Output tokens per second, last 10 s", "gauge"),
    "uptime_s": ("infer_server_uptime_seconds", "Seconds since the server started", "gauge"),
    "spec_enabled": ("infer_spec_enabled", "1 when the last step allowed speculation, 0 when off or degraded", "gauge"),
    "beam_searches_finished": ("infer_beam_searches_finished", "Beam searches ended with their beams", "counter"),
    "beam_searches_aborted": ("infer_beam_searches_aborted", "Beam searches stopped early", "counter"),
    "beam_searches_failed": ("infer_beam_searches_failed", "Beam searches ended by an error", "counter"),
    "beam_search_restarts": ("infer_beam_search_restarts",
                             "Beam searches begun again because an older one needed their KV blocks", "counter"),
    "beam_search_waits": ("infer_beam_search_waits", "Steps a beam search waited for KV blocks", "counter"),
    "spec_steps_on": ("infer_spec_steps_on", "Steps that speculated", "counter"),
    "spec_steps_off_large_batch": ("infer_spec_steps_off_large_batch",
                                   "Steps run without speculation: the batch was too large", "counter"),
    "spec_steps_off_low_acceptance": ("infer_spec_steps_off_low_acceptance",
                                      "Steps run without speculation: acceptance was too low", "counter"),
}


@dataclass(eq=False)
class StatsCollector:
    """A prometheus_client collector; ``fetch`` returns the current Stats (it may block briefly)."""

    fetch: Callable[[], pb.Stats]
    rejected: Callable[[], int]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.fetch()
        for field, (name, help_text, kind) in _METRICS.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_text, value=getattr(stats, field))
        blocks = GaugeMetricFamily("infer_kv_blocks", "KV cache blocks by state", labels=["state"])
        for state in ("free", "used", "cached"):
            blocks.add_metric([state], getattr(stats, f"kv_{state}_blocks"))
        yield blocks
        if stats.lora_requests:  # a server of LoRA adapters
            adapters = GaugeMetricFamily("infer_lora_requests", "Requests and beam searches under way per LoRA "
                                         "adapter (every adapter served)", labels=["adapter"])
            for adapter, count in sorted(stats.lora_requests.items()):
                adapters.add_metric([adapter], count)
            yield adapters
        yield CounterMetricFamily("infer_server_rejected_requests", "Requests refused because --max-queue requests "
                                  "were in flight (RESOURCE_EXHAUSTED)", value=self.rejected())
        yield GaugeMetricFamily("infer_server_draining", "1 while shutting down", value=int(stats.draining))


def registry_of(collector: StatsCollector) -> Any:
    """A prometheus_client registry of its own holding ``collector`` alone (no process or platform metrics)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]
    return registry


def start_metrics_server(host: str, port: int, collector: StatsCollector) -> tuple[int, Callable[[], None]]:
    """Serve ``/metrics`` on host:port from a registry of its own; return the bound port and a stop function."""
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=host, registry=registry_of(collector))
    except OSError as exc:
        from ..core.errors import ConfigError

        raise ConfigError(f"could not serve metrics on {host}:{port}: {exc}") from exc

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return server.server_port, stop
