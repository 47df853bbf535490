"""Checkpoints whose ``quant_method`` names one floating-point format: block FP8 and its INT8 twin
(``block``), gpt-oss's MXFP4 (``mxfp4``) and NVIDIA ModelOpt's NVFP4 / FP8 (``modelopt``).
"""
