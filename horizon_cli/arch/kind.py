"""The two kinds of architecture: `NativeArch` (horizon's functional layer computes it) and
`GenericArch` (transformers' own decoder layers do, arch.generic_arch), as one union.

`ArchSpec.kind` is the one place a spec's kind is told apart; everything else either asks the
kind a question both kinds answer (`moe`, `carried`, `model`, `boundary`: the native kind has
none of them) or lets the spec pick its kind's strategy (`ArchSpec.pick(native, generic)`: a
template, a layout, a tensor table, a working-set estimate), so no module outside arch/spec.py
branches on which kind it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .generic_arch import GenericArch, Moe
from .structure import Stack


@dataclass(frozen=True)
class NativeArch:
    """A model horizon's functional layer computes (model/layer.py): its features are the
    ArchSpec's flags (biases, q/k norm, windows, RoPE scaling); it has nothing of what a generic
    description adds."""

    moe: Moe | None = None  # no routed experts (the native families are dense)
    carried: tuple[str, ...] = ()  # no tensors carried untrained (a multimodal tower)
    model: Stack | None = None  # no probed forward structure: one (b, T, hidden) stream, layers in order

    @property
    def boundary(self) -> None:
        """What crosses layers: (b, T, hidden), the default form."""
        return None


NATIVE = NativeArch()
ArchKind = NativeArch | GenericArch
