"""The layer-step bodies: how a paged layer computes its experts over the K slots, one module each;
``contract`` (the ``LayerStep`` contract) and ``table`` (which body runs which experts
implementation on which path). docs/design-layer-step.md.
"""
