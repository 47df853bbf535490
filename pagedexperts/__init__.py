"""pagedexperts: run MoE models with K of E routed experts per layer resident on the device.

Quick start::

    from pagedexperts import load_model
    model, tokenizer = load_model(num_resident=16)          # bundled tiny model, 16 of 64
    out = model.generate(**tokenizer("ROMEO:", return_tensors="pt"), max_new_tokens=20)
    print(tokenizer.decode(out[0]), model.pagedexperts.stats().as_dict()["hit_rate"])

torch and transformers are imported lazily: ``residency``, ``stats``, ``models.config`` and
``analysis.sizing`` need the standard library alone.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load_model", "bundled_model_path", "__version__"]


def __getattr__(name):
    if name == "load_model":
        from pagedexperts.loading.loader import load_model

        return load_model
    if name == "bundled_model_path":
        from pagedexperts.loading.bundled import bundled_model_path

        return bundled_model_path
    raise AttributeError(f"module 'pagedexperts' has no attribute {name!r}")
