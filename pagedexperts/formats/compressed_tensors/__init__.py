"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, as llm-compressor writes
them): the config groups (``schemes``), the non-expert linears' formats (``linear``) and one
module per ``format`` of the library (``w4a16``, ``packed``, ``fp8``, ``fp4``, ``int8``).
"""
