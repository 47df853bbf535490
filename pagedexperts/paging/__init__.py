"""Paging: the layer-step executors (host-planned and device-planned), transfer, wave compute,
prefetch and the baselines; ``kernels``: the device-planned path's Triton kernels and their torch
references."""
