"""Paging runtime: residency, page-in and the experts step of one MoE layer (being reorganised).

This subpackage holds, for now, the device-planned layer-step (``device_residency``,
``device_pager``, ``device_layout``, ``device_stats``) and its Triton kernels (``kernels``).
"""
