"""Benchmark tooling, not needed to generate text: the engines we compare with (`baselines`), the
memory-cgroup runner that proves a budget (`cgroup`, `in_cgroup`), the attention and format
measurements behind `launch bench --suite attention|formats` (`attention`, `quality`), the disk read
benchmark (`disk`), random-weight MoE GGUF files in llama.cpp's olmoe / qwen3moe layouts (`synth_moe`),
the HTML chart of a bench's rows (`chart`) and the timing helpers they share
(`measure`). `launch bench` and `launch profile` import it; `launch run`, `launch serve` and the
runtime never do. Keep this file free of imports: `python -m bench.baselines` runs under a
memory limit and must not pull in torch or the runtime."""
