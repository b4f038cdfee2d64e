"""What tests and benchmarks share: the workloads and counters they run (host cost) and the paper's baseline
sampler. Tests import it from here; bench/ imports it too, so both measure the same thing."""
