"""Paging: the layer-step executors, transfer, wave compute, prefetch and the baselines."""
