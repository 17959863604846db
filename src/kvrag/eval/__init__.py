"""The research harness: the generated QA set, the accuracy and TTFT benchmarks, answer metrics and
the map-reduce / map-rerank baselines. Imported on demand, never by `import kvrag`, so the engine's
import stays small; the integrations import `kvrag.eval.chains` for the baselines they share."""
