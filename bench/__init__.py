"""Benchmarks: the figures `tandem bench` runs (`bench.suite`), the CPU comparison with HF
transformers (`bench.engine_vs_hf`) and the two-GPU cluster check (`bench.cluster_gpu`)."""
