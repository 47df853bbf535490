"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, as llm-compressor writes
them): the config groups (``schemes``), the non-expert linears' formats (``linear``) and the
formats (``w4a16`` and ``packed``: ``pack-quantized``; ``fp8``, ``fp4``, ``int8``).
"""
