"""Paging: the layer-step executors (host-planned and device-planned), their contracts
(``runner_contract``), the layer-step bodies (``steps``), transfer, prefetch and the baselines;
``kernels``: the device-planned path's Triton kernels, each with its torch backend."""
