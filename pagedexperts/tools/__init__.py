"""Tools: the exactness check, the benchmark and the quantizer behind the CLI commands."""
