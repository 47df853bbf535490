"""The packed CPU matmuls against the checkpoint's float32 dequantization, under a derived bound.

Owns ``check``'s second verdict where experts run packed (the first, exactness to itself, is
``tools.check``'s): each sampled expert tensor converted by the code that pages it in
(``formats.cpu_pack.KernelTensor.convert``) and each ``loading.packed_linears.PackedLinear``,
multiplied by ``formats.cpu_pack.packed_matmul``, against the float32 product with the weights
dequantized in float32 (``W = (q - z) * s``, ``formats.unpack.int_groups``) on the same x
(seeded standard normal rows in d, at 1 and ``PROBE_ROWS[-1]`` rows). The bound per output
element i of ``y = x @ W^T`` (K the reduction length):

    |y_i - y*_i| <= (3 u_d + gamma_K) (1 + u_d) sum_k |x_k| M_ik + u_d |y*_i|

- ``u_d`` the unit roundoff of the run dtype d (``torch.finfo(d).eps / 2``); three roundings to
  d per weight: the scale, the float zero point ``(8 - z) * s`` (int4) and the weight the
  kernel forms; the output rounded to d once;
- ``gamma_K = K u / (1 - K u)``, u = 2**-24: float32 accumulation of K products in any order
  (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 2002, Lemma 3.1, eq. (3.5));
  torch's CPU int4 / int8 kernels accumulate in float32 (aten/src/ATen/native/cpu/int4mm_kernel.cpp,
  int8mm_kernel.cpp);
- ``M_ik``: ``(|q - 8| + |8 - z|) |s|`` for int4 (its ``(q - 8) * scale + zero``), ``|q - z| |s|`` for int8.

Why per matmul, not on the logits: docs/formats.md, "Computed packed on a CPU". Does not: load
models, run prompts, or check exactness (``tools.check``).

Legend: N output features, K input features, M rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACCUMULATE_UNIT_ROUNDOFF = 2.0 ** -24  # float32: the kernels' accumulator
ROUNDINGS_PER_WEIGHT = 3  # scale, float zero point, the weight the kernel forms (module docstring)
PROBE_ROWS = (1, 16)  # decode and prefill row counts of x
SAMPLE_EXPERTS_PER_LAYER = 4


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a floating dtype: half its machine epsilon (2**-8 bfloat16, 2**-11 float16, 2**-24 float32)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, u: float = ACCUMULATE_UNIT_ROUNDOFF) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound of a length-n sum of products."""
    return n * u / (1 - n * u)


def matmul_bound(x: torch.Tensor, magnitudes: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bound on |y - y*| (module docstring) for x [M, K], the term magnitudes M_ik [N, K] and
    the float32 product y* [M, N], at run dtype ``dtype``: [M, N] float32."""
    u = unit_roundoff(dtype)
    eps = (ROUNDINGS_PER_WEIGHT * u + gamma(x.shape[-1])) * (1 + u)
    return eps * (x.float().abs() @ magnitudes.T) + u * reference.abs()


def dequantized_float32(groups) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``formats.unpack.IntGroups`` of one matrix -> (W [N, K] = (q - z) * s, every operation in
    float32; the kernel's term magnitudes [N, K]: int4 ``(|q - 8| + |8 - z|) |s|``, int8 ``|q - z| |s|``)."""
    from pagedexperts.formats.cpu_pack import INT4_OFFSET

    q = groups.codes[0].float()
    columns = torch.arange(q.shape[-1]) // groups.group_size
    z = groups.zeros[0].float()[:, columns]
    s = groups.scales[0].float()[:, columns]
    weight = (q - z) * s
    if groups.bits == 4:
        return weight, ((q - INT4_OFFSET).abs() + (INT4_OFFSET - z).abs()) * s.abs()
    return weight, weight.abs()


@dataclass
class KernelBound:
    """Over every bounded matrix and row count: ``matmuls`` checked, ``worst`` max |y - y*| / bound
    (<= 1: within), ``where`` the worst's 'module[expert] M=rows', ``layers`` packed experts layers
    of ``layer_count`` (a layer whose tensors the kernels cannot take runs grouped_mm: nothing to
    bound), ``linears`` the packed non-expert linears bounded."""

    matmuls: int = 0
    worst: float = 0.0
    where: str = ""
    layers: int = 0
    layer_count: int = 0
    linears: int = 0

    @property
    def passed(self) -> bool:
        return self.worst <= 1.0

    def line(self) -> str:
        if not self.matmuls:
            return "packed matmuls: none to bound (nothing runs packed)"
        return (f"packed matmuls vs the checkpoint's weights dequantized in float32 ({self.matmuls} matmuls: "
                f"{self.layers} of {self.layer_count} experts layers, {self.linears} non-expert linears, "
                f"M = {' and '.join(map(str, PROBE_ROWS))} rows): max |diff| / bound {self.worst:.3g} "
                f"(at {self.where}; bound (3 u_d + gamma_K) sum |x||w| + u_d |y|, u_d of the run dtype) "
                f"-> {'PASS (within the bound)' if self.passed else 'FAIL'}")


def bound_matmul(result: KernelBound, where: str, plan, weight: torch.Tensor, scales: torch.Tensor, groups,
                 gen: torch.Generator) -> None:
    """One kernel matrix (``weight``, ``scales`` in ``plan``'s layout, a ``KernelTensor``) against
    the float32 dequantization of its checkpoint ``groups`` (``IntGroups`` of one matrix) at each
    of ``PROBE_ROWS``; the worst ratio to the bound kept in ``result``."""
    from pagedexperts.formats.cpu_pack import packed_matmul

    dense, magnitudes = dequantized_float32(groups)
    x = torch.randn(max(PROBE_ROWS), plan.in_features, generator=gen).to(plan.dtype)
    for m in PROBE_ROWS:
        xm = x[:m].contiguous()
        y = packed_matmul(plan, weight, scales, xm).float()
        reference = xm.float() @ dense.T
        diff, bound = (y - reference).abs(), matmul_bound(xm, magnitudes, reference, plan.dtype)
        ratio = torch.where(bound > 0, diff / bound, torch.where(diff > 0, torch.inf, 0.0)).max().item()
        result.matmuls += 1
        if ratio > result.worst or result.matmuls == 1:
            result.worst, result.where = ratio, f"{where} M={m}"


def kernel_bound_check(model, files, fmt, dtype: torch.dtype, *, per_layer: int = SAMPLE_EXPERTS_PER_LAYER,
                       seed: int = 0) -> KernelBound:
    """The bound of the module docstring on ``per_layer`` seeded experts of each experts module of
    ``model`` (any model with the checkpoint's experts modules, e.g. ``experts_on_meta``: its
    dense specs give the layout), their rows read from the checkpoint ``files`` in ``fmt``'s
    layout through safetensors' own reader (``loading.independence.reference_rows``), at run
    dtype ``dtype``."""
    from pagedexperts.formats.cpu_pack import plan_layout
    from pagedexperts.formats.unpack import int_groups
    from pagedexperts.loading.checkpoint import KeyMap, expert_sources
    from pagedexperts.loading.independence import reference_rows
    from pagedexperts.models.sites import find_experts_sites

    sites = {s.name: s for s in find_experts_sites(model)}
    sources = expert_sources(model.config.model_type)
    layouts = {n: fmt.layout(s.specs, sources=sources, transposed=bool(getattr(s.module, "is_transposed", False)))
               for n, s in sites.items()}
    plans = {n: plan_layout(layout, dtype) for n, layout in layouts.items()}
    packed = {n: p for n, p in plans.items() if not isinstance(p, str)}
    result = KernelBound(layer_count=len(sites), layers=len(packed))
    if not packed:
        return result
    gen = torch.Generator().manual_seed(seed)
    wanted = {n: torch.randperm(sites[n].num_experts, generator=gen)[:per_layer].tolist() for n in packed}
    rows = reference_rows(files, KeyMap(model.config.model_type, sites, fmt),
                          {n: layouts[n].packed_specs for n in packed}, wanted)
    for name, experts in wanted.items():
        for j in experts:
            for plan in packed[name]:
                one = {p.name: rows[name][j][p.name].unsqueeze(0) for p in plan.tensor.packed}
                kernel = plan.convert(one)
                bound_matmul(result, f"{name}.{plan.name}[{j}]", plan, kernel[plan.weight_name][0],
                             kernel[plan.scale_name][0], int_groups(plan.fmt.packing_of(plan.tensor), one), gen)
    return result


def linear_bound_check(model, files, result: KernelBound, *, seed: int = 0) -> KernelBound:
    """The module docstring's bound on every ``PackedLinear`` of ``model`` (kernel tensors as
    installed) against the float32 dequantization of its serialized tensors read from ``files``
    through safetensors' own reader; added to ``result``.

    Raises:
        ValueError: a packed linear whose serialized tensors are not under its module name.
    """
    from safetensors import safe_open

    from pagedexperts.formats.base import LINEAR_WEIGHT, store_name
    from pagedexperts.formats.unpack import int_groups
    from pagedexperts.loading.packed_linears import PackedLinear

    modules = {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    serialized: dict[str, dict[str, torch.Tensor]] = {name: {} for name in modules}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                module, _, local = key.rpartition(".")
                if module in serialized:
                    serialized[module][store_name(LINEAR_WEIGHT, LINEAR_WEIGHT, local)] = f.get_tensor(key)
    gen = torch.Generator().manual_seed(seed)
    for name, module in modules.items():
        plan = module.plan
        rows = {p.name: serialized[name][p.name].reshape(p.shape).unsqueeze(0) for p in plan.tensor.packed
                if p.name in serialized[name]}
        if len(rows) != len(plan.tensor.packed):
            raise ValueError(f"{name}: the checkpoint's tensors of this packed linear are not under its name (found "
                             f"{sorted(serialized[name])}); check bounds each packed matmul against them")
        bound_matmul(result, name, plan, module.weight_packed, module.scales,
                     int_groups(plan.fmt.packing_of(plan.tensor), rows), gen)
        result.linears += 1
    return result


def experts_on_meta(config) -> torch.nn.Module:
    """transformers' model of ``config`` on the meta device (no memory): its experts modules give
    ``kernel_bound_check`` the dense specs of each layer."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
