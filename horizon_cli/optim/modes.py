"""Memory modes (`optim.memory`): how a full fine-tuning run holds its trained state in host RAM.

A mode is a value, not a word: the config's word is parsed once (`memory_mode`, at the config's
edge: `OptimConfig.mode`), and from there on each question that depends on the mode is asked of
the mode itself, never answered by comparing its name:

  host state layout   `packed`: the optimizer state packed per state kind over segments of a unit
                      (lean: matrices 8-bit, 1-D tensors exact; state/layout.py) or one exact
                      segment over the whole unit (exact)
  dtype rule          the streaming copy's dtype (`stream_dtype`: lean keeps a bf16 weight whatever
                      it computes in), what `engine.grad_dtype: auto` means (`grad_dtype`), the
                      note the dtype choice prints (`dtype_note`)
  plan terms          the host bytes of its optimizer state (`state_bytes`) and of its gradients
                      (`grad_bytes`), by category, as planning.memory prints them
  checkpoint form     `form`: what a checkpoint's trainer.json records as `memory`; a run resumes
                      only from a checkpoint of its own form (`reads`)
  config checks       what it refuses beside it (`problems`)
  the ladder          its rung's words (`what`, `how`)

A new memory behaviour is a new `MemoryMode` value (in `MODES`, so the ladder shows its rung) with
its answers, not a new branch in planning/, state/, train/ or engine/: a mode that releases each
unit's gradients as soon as its update has run holds fewer gradient bytes (its `grad_bytes`) and
keeps its base mode's state layout and checkpoint form (`form`), so a run may resume across it.

Host bytes per parameter (bf16 compute, state/layout.py): exact 2 + 2 + 4 + 4 + 2 = 14 (fp32:
4 + 4 + 4 + 4 = 16); lean 2 + 1 + 1 + 1 + 8/64 + 2 = 7.125. With release the gradients' 2 become
RELEASE_CHUNKS chunks of RELEASE_CHUNK elements (192 MiB of bf16) + the embedding's fp32 gradient, about
a hundredth of a byte per parameter at model scale (on one rank; a rank of several holds
RELEASE_BUFFERS buffers of its largest unit slice's gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

BF16, FP32 = "bfloat16", "float32"
# a release run's host gradient buffers (state.pool; engine and plan agree): one the device's copy
# fills, one the optimizer reads, one queued between them. One rank: RELEASE_CHUNKS chunks of
# RELEASE_CHUNK elements (64 MiB of bf16). Several ranks: RELEASE_BUFFERS of the largest unit slice's
RELEASE_CHUNK = 1 << 25
RELEASE_CHUNKS = 3
RELEASE_BUFFERS = 3


@dataclass(frozen=True)
class MemoryMode:
    """One way of holding full fine-tuning's trained state (module doc). Frozen: compared by value."""

    name: str  # optim.memory's word: the ladder's rung
    what: str  # the ladder's column: what the rung trains and keeps
    packed: bool  # optimizer state packed per state kind (lean); else one exact segment per unit
    bf16_weight: bool  # the streaming copy is bf16 whatever the run computes in (upcast per layer)
    bf16_grads: bool  # host gradients are bf16 (engine.grad_dtype auto; float32 refused)
    form: str  # a checkpoint's trainer.json `memory`: which state files it holds
    # optim.grad_release: each unit's update runs inside the backward as soon as its gradient is
    # whole, and its host gradient buffer is returned at once (issue 39); same layout and form
    release: bool = False

    @property
    def base(self) -> str:
        """optim.memory's word (the rung's name without release)."""
        return self.form

    @property
    def how(self) -> str:
        """The config line that picks this rung (the ladder's advice)."""
        return f"optim.memory: {self.base}" + (", optim.grad_release: true" if self.release else "")

    def in_backward(self, grad_clip: float, lora: bool) -> bool:
        """Whether a step runs each update inside the backward: a release mode, except LoRA with
        optim.grad_clip > 0, whose small adapters' gradients are kept whole anyway and updated
        after its one pass (a norm-first pass would double the step for nothing)."""
        return self.release and not (lora and grad_clip > 0)

    def passes(self, grad_clip: float, lora: bool) -> int:
        """A training step's forward and backward passes: 2 norm-first (updates inside the
        backward with optim.grad_clip > 0: the global norm is measured first), else 1."""
        return 2 if self.in_backward(grad_clip, lora) and grad_clip > 0 else 1

    def released(self, on: bool = True) -> MemoryMode:
        """This mode with gradient release on (or off): the same state layout and checkpoint form."""
        return RELEASED[self.base] if on else MODES[self.base]

    def stream_dtype(self, dtype: str) -> str:
        """The streaming copy's dtype for compute dtype `dtype` (in fp32 exact runs: the master)."""
        return BF16 if self.bf16_weight else dtype

    def grad_dtype(self, given: str, dtype: str) -> str:
        """engine.grad_dtype resolved: `auto` is the compute dtype, or bf16 where the mode holds
        bf16 gradients whatever it computes in."""
        if given != "auto":
            return given
        return BF16 if self.bf16_grads else dtype

    def rung_grad_dtype(self, given: str) -> str:
        """The engine.grad_dtype this mode's rung is planned with: the config's, or `auto` where
        the mode fixes its gradients' dtype (another mode's config may name one it refuses)."""
        return "auto" if self.bf16_grads else given

    def dtype_note(self, dtype: str) -> str:
        """What the dtype choice adds to its reason for this mode computing in `dtype`."""
        if self.bf16_weight and dtype == FP32:
            return f"; {self.how} keeps its bf16 weight, upcast per layer"
        return ""

    def problems(self, grad_dtype: str, lora: bool) -> list[str]:
        """The config's settings this mode refuses beside it (config.load's checks)."""
        out = []
        if self.bf16_grads and grad_dtype == FP32:
            out.append(
                f"{self.how} holds bf16 gradients (<= 8 B/param); engine.grad_dtype: float32 is not allowed with it"
            )
        if self.packed and lora:
            out.append(
                f"{self.how} is for full fine-tuning; a lora: run trains its adapters exactly "
                f"(they are small) and its base has no optimizer state: leave {EXACT.how}"
            )
        return out

    def state_bytes(self, numel: int, dtype: str, kinds: Callable[[], tuple[int, int]]) -> dict[str, int]:
        """Host bytes of the optimizer state by category, for `numel` trained elements whose
        streaming copy is `dtype`. kinds: (lean, exact) elements of the packed layout (asked
        only by a packed mode: it walks every unit's segments)."""
        if self.packed:
            from .lean import BLOCK  # torch's module: config imports this one

            n_lean, n_exact = kinds()
            return {
                "master correction (int8)": n_lean,
                "moments (8-bit + block scales)": n_lean * 2 + n_lean // BLOCK * 8,
                "1-D tensors: master remainder + fp32 moments": n_exact * 10,
            }
        out = {"master remainder (int16)": numel * 2} if dtype == BF16 else {}
        return {**out, "AdamW moments (fp32)": numel * 8}

    def grad_bytes(
        self, numel: int, embed: int, item: int, largest: int, world: int = 1, embed_held: int | None = None
    ) -> int:
        """Host bytes of the gradients of `numel` trained elements, `embed` of them the embedding's
        (always fp32: the host accumulates it row by row; `embed_held` of its elements held, by
        default all: one rank's untied table holds only the rows a step touches), the rest `item`
        bytes each. Without release every unit's whole gradient is held until the clip norm is
        known; with it, besides the embedding's, one rank holds RELEASE_CHUNKS chunks of at most
        RELEASE_CHUNK elements, a rank of several RELEASE_BUFFERS buffers of its largest other
        unit slice's gradient (`largest` elements), as state.pool allocates them."""
        rows = (embed if embed_held is None else embed_held) * 4
        if self.release and world == 1:
            return RELEASE_CHUNKS * min(largest, RELEASE_CHUNK) * item + rows
        if self.release:
            return RELEASE_BUFFERS * largest * item + rows
        return (numel - embed) * item + rows

    def grad_label(self, item: int, world: int = 1) -> str:
        """The plan's category of the host gradients (grad_bytes), `item` bytes an element."""
        held = ""
        if self.release:
            held = (
                f", {RELEASE_CHUNKS} released chunks"
                if world == 1
                else f", {RELEASE_BUFFERS} released buffers"
            )
            held += " + embedding"
        return f"gradients ({'bf16' if item == 2 else 'fp32'}{held})"

    def reads(self, form: str) -> bool:
        """Whether a checkpoint of this form holds this mode's state files."""
        return form == self.form


EXACT = MemoryMode("exact", "all weights, fp32 state", False, False, False, form="exact")
LEAN = MemoryMode("lean", "all weights, 8-bit state", True, True, True, form="lean")
MODES: dict[str, MemoryMode] = {m.name: m for m in (EXACT, LEAN)}  # the ladder's full rungs, most exact first
# the same modes with gradient release, by optim.memory's word (their rung names: "exact+release", ...)
RELEASED: dict[str, MemoryMode] = {
    m.name: MemoryMode(
        f"{m.name}+release",
        f"{m.what}, gradients released",
        m.packed,
        m.bf16_weight,
        m.bf16_grads,
        m.form,
        True,
    )
    for m in (EXACT, LEAN)
}
# every full fine-tuning rung of the ladder by its name, most exact first, each without and with
# release ("exact", "exact+release", "lean", "lean+release")
RUNG_MODES: dict[str, MemoryMode] = {m.name: m for base in MODES for m in (MODES[base], RELEASED[base])}
OLDEST_FORM = EXACT.form  # checkpoints written before optim.memory existed hold exact state


def memory_mode(memory: MemoryMode | str, release: bool = False) -> MemoryMode:
    """The mode an `optim.memory` word names (the config's schema admits only these) or a rung of
    the ladder (RUNG_MODES: "exact+release"), or the mode; release: with optim.grad_release on."""
    mode = memory if isinstance(memory, MemoryMode) else RUNG_MODES[memory]
    return mode.released(release) if release else mode
