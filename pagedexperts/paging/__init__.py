"""Paging: the layer-step executors, their contracts, bodies (``steps``), transfer, prefetch, baselines
and ``kernels``.
"""
