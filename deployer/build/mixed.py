"""Measured mixed precision (`quantization.scheme: auto`): each decoder linear's precision chosen
from its measured sensitivity, within a size budget (`max_size`).

Sensitivity: how much the model's output distribution moves (mean KL per token, reference ||
quantized) when that one linear alone is stored int4-g128, int4-g32 or int8. It is measured on
the calibration text with the second-order (Fisher) estimate KL ~ 1/2 E[(g . dY)^2], where dY =
X dW^T is the linear's output change under that precision on the text's real activations X, and
g the gradient of log p(y) with respect to the linear's output for a token y drawn from the
model's own prediction (seeded): an unbiased sample of the Fisher information, whose quadratic
form is KL's second-order term. One forward and one backward pass over the text measure every
linear and every choice at once (SmolLM2: 210 linears x 3 choices in seconds on 2 cores, where
re-running the model per linear and choice would take minutes); the activations X keep the
correlations between input channels that a per-weight (diagonal) estimate would drop.

Choice: every candidate starts at int4-g128 (the smallest); upgrades (to int4-g32 or int8) are
taken greedily by KL removed per byte added while the stored tensors fit `max_size`. The chosen
precisions become exact-name overrides of a resolved spec, so the artifact, its manifest's
`quantization.modules` and the device's kernels are those of any per-module mix. Linears that a
user override names keep it (their bytes count against the budget).

The forward, backward and products run in float64 and the figures are rounded to 4 significant
digits, so the choice (recorded in the manifest) does not depend on thread scheduling.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from deployer.build import quality
from deployer.build.awq import Calibration
from deployer.build.quantize import is_head_or_embedding, plan_tensor
from deployer.build.source import SourceModel
from deployer.build.spec import Override, QuantSpec
from deployer.core.memory import linear_bytes
from deployer.core.quant_layout import dequantize_int8, fake_quantize_int4, quantize_int8
from deployer.core.safetensors_io import DTYPE_SIZES
from deployer.errors import BuildError

# (scheme, group size, label), cheapest first: the precisions auto chooses among.
CHOICES: tuple[tuple[str, int | None, str], ...] = (
    ("int4", 128, "int4-g128"),
    ("int4", 32, "int4-g32"),
    ("int8", None, "int8"),
)
# Calibration tokens of the measuring pass: a few hundred keep its forward, backward and products
# to seconds on 2 cores (quantizing every linear twice as int4 costs as much again).
CALIBRATION_TOKENS = 256
SEED = 0  # of the tokens drawn from the model's predictions


@dataclass(frozen=True)
class Choice:
    """What auto chose: the resolved spec (one override per chosen linear), each candidate's
    measured KL per choice label, the chosen label, and the stored tensors' bytes."""

    spec: QuantSpec
    sensitivity: dict[str, dict[str, float]]
    chosen: dict[str, str]
    size: int
    tokens: int

    def record(self, calibration: Calibration) -> dict[str, Any]:
        """The manifest's `quantization.spec.auto`."""
        return {
            "calibration_sha256": calibration.sha256,
            "tokens": self.tokens,
            "size": self.size,
            "modules": {
                m: {"choice": self.chosen[m], "kl": self.sensitivity[m]} for m in sorted(self.chosen)
            },
        }


def candidates(spec: QuantSpec, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The decoder linears auto chooses for: 2-D weights, not the head or embeddings, that no user
    override names."""
    found = []
    for name, shape in shapes.items():
        module = name.removesuffix(".weight")
        if len(shape) != 2 or module == name or is_head_or_embedding(module):
            continue
        if any(fnmatch.fnmatchcase(module, o.pattern) for o in spec.overrides):
            continue
        found.append(module)
    return sorted(found)


def fixed_bytes(spec: QuantSpec, shapes: dict[str, tuple[int, ...]], chosen: set[str]) -> int:
    """Stored bytes of every tensor auto does not choose for (norms, embeddings, user overrides)."""
    total = 0
    for name, shape in shapes.items():
        if name.removesuffix(".weight") in chosen:
            continue
        for stored in plan_tensor(spec, name, shape).outputs:
            total += DTYPE_SIZES[stored.dtype] * math.prod(stored.shape)
    return total


def choose(
    source: SourceModel,
    spec: QuantSpec,
    shapes: dict[str, tuple[int, ...]],
    calibration: Calibration,
    log: Callable[[str], None],
) -> Choice:
    """Measure the candidates' sensitivities on `calibration` and choose within `spec.max_size`.

    `shapes` are the stored source tensors (a tied head left out). Raises BuildError, with the
    minimum, when even int4-g128 everywhere does not fit."""
    if spec.max_size is None:
        raise BuildError("internal: mixed.choose without max_size")
    modules = candidates(spec, shapes)
    costs = {m: [linear_bytes(s, g, *shapes[f"{m}.weight"]) for s, g, _ in CHOICES] for m in modules}
    fixed = fixed_bytes(spec, shapes, set(modules))
    minimum = fixed + sum(c[0] for c in costs.values())
    if spec.max_size < minimum:
        raise BuildError(
            f"model.quantization.max_size: {spec.max_size} bytes is below the smallest choice of "
            f"scheme auto, {minimum} bytes (every decoder linear int4-g128)",
            hint=f"raise max_size to at least {minimum} bytes, or choose a scheme yourself",
        )
    log(f"auto: measuring {len(modules)} linears' sensitivity on {calibration.path.name}")
    sensitivity, tokens = measure(source, modules, calibration)
    levels, size = greedy(sensitivity, costs, spec.max_size - fixed)
    chosen = {m: CHOICES[levels[m]][2] for m in modules}
    picked = tuple(Override(m, CHOICES[levels[m]][0], CHOICES[levels[m]][1]) for m in modules)
    resolved = QuantSpec("auto", spec.group_size, spec.overrides + picked, spec.max_size)
    counts = {label: sum(1 for c in chosen.values() if c == label) for _, _, label in CHOICES}
    log(f"auto: {counts} in {fixed + size} of {spec.max_size} bytes")
    return Choice(resolved, sensitivity, chosen, fixed + size, tokens)


def greedy(
    sensitivity: dict[str, dict[str, float]], costs: dict[str, list[int]], budget: int
) -> tuple[dict[str, int], int]:
    """Each module's choice (an index of CHOICES) and their bytes: all start at the cheapest, then
    the upgrade removing the most KL per added byte that still fits is taken, until none is left
    (ties go to the first module by name: the same inputs, the same choice)."""
    levels = dict.fromkeys(sensitivity, 0)
    size = sum(costs[m][0] for m in levels)
    labels = [label for _, _, label in CHOICES]
    while True:
        best: tuple[float, str, int] | None = None
        for m in sorted(levels):
            kl, cost = sensitivity[m], costs[m]
            for j in range(levels[m] + 1, len(CHOICES)):
                added = cost[j] - cost[levels[m]]
                gain = kl[labels[levels[m]]] - kl[labels[j]]
                if gain <= 0 or size + added > budget:
                    continue
                if best is None or gain / added > best[0]:
                    best = (gain / added, m, j)
        if best is None:
            return levels, size
        _, m, j = best
        size += costs[m][j] - costs[m][levels[m]]
        levels[m] = j


def measure(
    source: SourceModel, modules: list[str], calibration: Calibration
) -> tuple[dict[str, dict[str, float]], int]:
    """Each module's estimated mean KL per token for each choice (see the module docstring), and
    the calibration tokens used."""
    limit = min(CALIBRATION_TOKENS, int(source.config.get("max_position_embeddings", CALIBRATION_TOKENS)))
    ids = quality.encode(source, calibration.text)[:limit]
    model = quality.load_model(source).to(torch.float64)
    model.requires_grad_(False)
    named = dict(model.named_modules())
    sums = {m: [0.0] * len(CHOICES) for m in modules}

    def hook(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def forward(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])

            def backward(grad: torch.Tensor) -> None:
                g = grad.detach().reshape(-1, grad.shape[-1])
                source = cast(torch.Tensor, module.weight)
                weight = source.float()  # quantized as the build does: from fp32
                for i, (scheme, group, _) in enumerate(CHOICES):
                    delta = _stored(weight, scheme, group).double() - source
                    # (g_t . dW x_t) for every token t, as rows of (g dW) dotted with x.
                    per_token = ((g @ delta) * x).sum(dim=1)
                    sums[name][i] += float(per_token.pow(2).sum())

            output.register_hook(backward)

        return forward

    handles = [named[m].register_forward_hook(hook(m)) for m in modules]
    try:
        embed: torch.nn.Module = model.get_input_embeddings()  # type: ignore[operator]
        embeddings = embed(torch.tensor([ids])).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeddings).logits[0]
        logp = torch.log_softmax(logits, dim=-1)
        # A token drawn from each position's prediction (Gumbel-max, seeded): the Fisher information
        # of the model's own distribution, whose quadratic form is KL's second-order term.
        noise = torch.rand(logp.shape, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64)
        drawn = (logp.detach() - torch.log(-torch.log(noise.clamp(min=1e-300)))).argmax(dim=-1)
        logp.gather(1, drawn[:, None]).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    positions = len(ids)
    sensitivity = {
        m: {label: _sig(0.5 * sums[m][i] / positions) for i, (_, _, label) in enumerate(CHOICES)}
        for m in modules
    }
    return sensitivity, positions


def _stored(weight: torch.Tensor, scheme: str, group: int | None) -> torch.Tensor:
    """`weight` as stored under `scheme` and read back."""
    if scheme == "int4" and group is not None:
        return fake_quantize_int4(weight, group)
    return dequantize_int8(*quantize_int8(weight))


def _sig(value: float) -> float:
    """4 significant digits: float noise from thread scheduling cannot move the manifest."""
    return float(f"{value:.4g}")
