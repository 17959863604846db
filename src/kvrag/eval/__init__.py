"""The research harness: the generated QA set, the accuracy and TTFT benchmarks, answer metrics (the
map-reduce / map-rerank baselines it compares are kvrag.chains, shared with the integrations). Imported
on demand, never by `import kvrag`, so the engine's import stays small; the integrations never import it
(tests/test_integrations_api.py)."""
