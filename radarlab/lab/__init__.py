"""The instruments' common tools, above the core: this machine's facts and timers, the roofline
model, seeded workloads, the step recorder, kernel benchmarks and the chi-square test. The core
(README's reading order) imports nothing from here; benchmarks, validation and draft training are
radarlab.bench, radarlab.validate and radarlab.train."""
