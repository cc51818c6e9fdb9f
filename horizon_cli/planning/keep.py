"""Kept layers (`engine.keep_activations`): how many of the last layers of the forward keep their
autograd graph and their weights on the device until their backward, and what that costs.

A kept layer is neither recomputed nor loaded a second time (a step moves 2L - K layer loads).
It holds, from its forward to its backward (planning.memory and lora.sizes size one):

    weights   a buffer of its own (the ring's slots are reused by the next loads); LoRA: its
              adapters; NF4: its own dequantized copy too (the shared scratch is overwritten)
    graph     the tensors its forward saved for the backward, for every micro-batch of the step

and it needs no saved input on the host. `auto` keeps the largest K whose bytes fit what the
K = 0 plan leaves free:

    CUDA      90 % of the device's free memory (planning.transients) - the plan's device bytes - RESERVE
    CPU       the host memory this process may allocate - the plan's host and device bytes (both
              in RAM) - RESERVE, shared by the node's ranks

With no machine to judge against, `auto` keeps none. A number N keeps min(N, L); the fit check
then judges the plan with its bytes.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import InputError
from .fit import RESERVE, Machine
from .memory import MemoryPlan
from .transients import KEEP_MARGIN

WEIGHTS = "kept layers: weights"
GRAPHS = "kept layers: graphs"


def room(plan: MemoryPlan, where: Machine) -> int:
    """Bytes one rank may spend on kept layers: what the K = 0 plan leaves free on `where`."""
    if where.device is None:
        free = where.host - plan.node_host_total - plan.node_device_total - RESERVE
        return max(0, free) // plan.per_node
    return max(0, int(where.device * (1 - KEEP_MARGIN)) - plan.device_total - RESERVE)


def auto_keep(plan: MemoryPlan, where: Machine | None) -> int:
    """The largest K (<= L) whose kept bytes fit the room the K = 0 plan leaves on `where`."""
    per_layer = sum(plan.kept_layer)
    if where is None or per_layer <= 0:
        return 0
    return min(plan.layers, room(plan, where) // per_layer)


def resolve(setting: int | str, plan: MemoryPlan, where: Machine | None) -> int:
    """engine.keep_activations -> K for this plan (`plan` planned with K = 0)."""
    if setting == "auto":
        return auto_keep(plan, where)
    if plan.loop and int(setting) > 0:
        raise InputError(
            f"engine.keep_activations: {setting}: the model runs its layers in a loop ({plan.loop}): "
            "kept layers are not supported; set 0 or auto"
        )
    return min(int(setting), plan.layers)


def with_kept(plan: MemoryPlan, k: int) -> MemoryPlan:
    """The plan with K kept layers: their device bytes added, their saved inputs off the host."""
    if k <= 0:
        return plan
    w, g = plan.kept_layer
    host = dict(plan.host)
    if "saved activations" in host:
        host["saved activations"] = (plan.layers - k) * plan.saved_layer
    device = {**plan.device, WEIGHTS: k * w, GRAPHS: k * g}
    return replace(plan, host=host, device=device, kept=k)


def keep_plan(plan: MemoryPlan, setting: int | str, where: Machine | None) -> MemoryPlan:
    """The plan (planned with K = 0) with K decided and its bytes in it."""
    return with_kept(plan, resolve(setting, plan, where))
