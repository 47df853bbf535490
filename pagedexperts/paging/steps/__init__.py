"""The layer-step bodies: how a paged layer computes its experts over the K slots, one module each.

``contract`` (the ``LayerStep`` contract every body implements: prepared once per layer, then
begin a step, run a wave, combine; and what the bodies share), one module per body
(``host_grouped``, ``host_batched``, ``host_eager`` for host-planned steps; ``device_grouped``,
``device_batched``, ``fused`` for device-planned ones), and ``table`` (which body runs which
experts implementation on which path). The executors (``paging.host_executor``,
``paging.device_executor``) hold a body and never look into it (docs/design-layer-step.md).
"""
