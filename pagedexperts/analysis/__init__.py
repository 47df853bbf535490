"""Analysis: routing traces, recording, the simulator, sizing, the link and disk benchmarks, and the
byte model of the fused and dequantizing paths (``fused_bytes``)."""
