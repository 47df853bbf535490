"""Analysis: routing traces, recording, the simulator, sizing and the link and disk benchmarks."""
