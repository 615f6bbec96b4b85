"""Benchmarks: the figures `tandem bench` runs (`bench.suite`) and tandem against HF
transformers (`bench.engine_vs_hf`: the CPU comparison and figure 1's HF baselines)."""
