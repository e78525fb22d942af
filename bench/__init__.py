"""Benchmarks: workloads, the interleaved A/B runner, and reports (rich table, JSON, PNG plots).

``infer bench`` (registered by ``infer.plugins.bench_command``) drives these modules:

- :mod:`infer.bench.workloads`: seeded request sets (random, shared-prefix, multi-turn, long-prompt-arrival, file),
  of generation or embedding requests.
- :mod:`infer.bench.command`: the click command (options, errors) and its report step.
- :mod:`infer.bench.tasks`: ``--task generate|embed``: which options each task takes.
- :mod:`infer.bench.arms`: parsing ``--ab`` arm strings into engine configs, HF baselines or servers.
- :mod:`infer.bench.session`: building each arm once, every round's workload, the interleaved rounds.
- :mod:`infer.bench.runner`: replaying a workload against one arm, recording per-token timestamps.
- :mod:`infer.bench.hf`: the HF transformers baseline (static ``generate`` or continuous batching).
- :mod:`infer.bench.hf_embed`: the HF baseline's embeddings (padded ``AutoModel`` batches, pooled).
- :mod:`infer.bench.openai_arm`: an ``openai:URL`` arm, a running server of OpenAI's HTTP API.
- :mod:`infer.bench.openai_client`: the stdlib HTTP client it (and benchmarks/grpc_load.py) sends with.
- :mod:`infer.bench.stats`: per-run metrics and their aggregation over repeats.
- :mod:`infer.bench.report`: the side-by-side table, the JSON file and the plots.
"""
