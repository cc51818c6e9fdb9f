"""Mutation audit: does the test suite catch realistic one-line bugs in the core paths?

    make audit                     # = .venv/bin/python scripts/mutation_audit.py --json bench_out/audit.json
    .venv/bin/python scripts/mutation_audit.py [--only ID,...] [--area AREA] [--list] [--json FILE]

Each mutation below is one line of production code replaced by a plausible bug (off-by-one,
wrong sign, dropped term, wrong buffer, swapped arguments, missing scale, wrong dtype), with the
tests that ought to catch it. For each in turn the script edits the file in place, runs those
tests (`pytest -x`, stopping at the first failure), restores the file (also on Ctrl-C), and
records `caught` (a test failed: the first one is named), `survived` (every selected test
passed) or `timeout`. Mutations of the native kernel rebuild it into a scratch
TORCH_EXTENSIONS_DIR, so the user's kernel cache is never touched.

A row is anchored on what it mutates, not on a file's text: `where` names a function (its
qualified name in a module, `horizon_cli.model.layer:rms_norm`, `...:Class.method`; a module-level
name such as a constant; or `kernels/adamw.cpp:make_coeffs`, a C++ function), and `pattern` is
text that occurs exactly once in that function's source, any run of whitespace matching any run
(so a reformatted line still matches). A refactor that keeps the code where the row says leaves the
row applicable; one that moves it to another function or module, or rewrites the line, makes the
row `stale`: it is listed as such (with the places the pattern now occurs, when the function moved
under its own name) and tests nothing, and the audit's exit status does not count it. Re-anchor a
stale row when convenient. tests/test_mutation_audit.py (in `make test`) checks only the machinery:
every row well formed, the anchors resolved (stale ones reported as a warning), a mutant of a tiny
function caught, a stale anchor reported rather than raised.

`--without FILE,...` drops test files from every selection (a mutation left with none is skipped):
run with the files a change added, it shows what the suite caught before them.

An `expect` of "equivalent" marks a mutant that cannot change any result on this machine's code
paths (the reason is in its note); such mutants are run too and are expected to survive. The
results and their reading are recorded in docs/reliability.md ("Mutation audit").

The working tree must be clean in the files mutated (the script refuses otherwise), and nothing
else should edit them while it runs.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NATIVE = (".c", ".cc", ".cpp", ".cu", ".h", ".hpp")


@dataclass
class Mutation:
    id: str
    area: str  # engine | optim | data | checkpoint | run
    where: str  # "package.module:qualname" (a function, method or module-level name) or "file.cpp:function"
    pattern: str  # occurs exactly once in that function's source (whitespace runs match any whitespace)
    mutated: str  # what replaces it
    tests: list[str]
    what: str  # the bug, in words
    expect: str = "caught"  # or "equivalent"
    note: str = ""


@dataclass(frozen=True)
class Site:
    """Where a row's pattern is today: file (relative to the root), its text, the span replaced."""

    file: str
    text: str
    start: int
    end: int

    def mutant(self, mutated: str) -> str:
        line_start = self.text.rfind("\n", 0, self.start) + 1
        indent = re.match(r"[ \t]*", self.text[line_start:]).group(0)
        body = mutated.strip().replace("\n", "\n" + indent)  # later lines at the matched line's indent
        return self.text[: self.start] + body + self.text[self.end :]


class Stale(Exception):
    """A row whose anchor no longer applies to the code (the reason is the message)."""


def regex(pattern: str) -> re.Pattern:
    return re.compile(r"\s+".join(re.escape(p) for p in pattern.split()))


def module_file(module: str, root: Path) -> Path:
    base = root.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    raise Stale(f"no module {module}")


def py_spans(tree: ast.Module) -> dict[str, ast.AST]:
    """Qualified name -> node: every function and class (nested: outer.inner), and the names that
    module-level assignments bind."""
    out: dict[str, ast.AST] = {}

    def walk(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out[prefix + node.name] = node
                walk(node.body, f"{prefix}{node.name}.")
            elif not prefix and isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node

    walk(tree.body, "")
    return out


def offsets(text: str, node: ast.AST) -> tuple[int, int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return starts[first - 1], starts[node.end_lineno]


def native_span(text: str, name: str) -> tuple[int, int] | None:
    """The definition of C++ function `name`: from its name to its closing brace."""
    for m in re.finditer(rf"\b{re.escape(name)}\s*\(", text):
        head = re.match(r"[^;{]*", text[m.end() :]).group(0)
        at = m.end() + len(head)
        if at >= len(text) or text[at] != "{":
            continue  # a call or a declaration
        depth = 0
        for i in range(at, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text.rfind("\n", 0, m.start()) + 1, i + 1
    return None


def scope(where: str, root: Path) -> tuple[str, str, int, int]:
    """(file relative to root, its text, start, end) of the function `where` names."""
    mod, _, qual = where.partition(":")
    if not qual:
        raise Stale(f"anchor {where!r} is not module:function")
    if mod.endswith(NATIVE):
        path = root / mod
        if not path.is_file():
            raise Stale(f"no file {mod}")
        text = path.read_text()
        span = native_span(text, qual)
        if span is None:
            raise Stale(f"no function {qual} in {mod}")
        return mod, text, *span
    path = module_file(mod, root)
    text = path.read_text()
    node = py_spans(ast.parse(text, str(path))).get(qual)
    if node is None:
        raise Stale(f"no {qual} in {mod}")
    return str(path.relative_to(root)), text, *offsets(text, node)


def locate(m: Mutation, root: Path = ROOT) -> Site:
    """Where m's pattern is today; raises Stale (with the reason) when the row no longer applies."""
    try:
        file, text, a, b = scope(m.where, root)
    except Stale as e:
        raise Stale(f"{e}{moved_hint(m, root)}") from None
    found = list(regex(m.pattern).finditer(text, a, b))
    if len(found) != 1:
        raise Stale(
            f"pattern found {len(found)} times in {m.where}{moved_hint(m, root) if not found else ''}"
        )
    site = Site(file, text, found[0].start(), found[0].end())
    if file.endswith(".py"):
        try:
            ast.parse(site.mutant(m.mutated))
        except SyntaxError as e:
            raise Stale(f"the mutant does not parse: {e}") from None
    return site


def moved_hint(m: Mutation, root: Path) -> str:
    """Where the pattern occurs once in a function of the same name elsewhere in the package."""
    mod, _, qual = m.where.partition(":")
    if mod.endswith(NATIVE) or not qual:
        return ""
    pkg = mod.split(".")[0]
    name = qual.rpartition(".")[2]
    seen = []
    for f in sorted((root / pkg).rglob("*.py")):
        dotted = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        try:
            spans = py_spans(ast.parse(f.read_text()))
        except SyntaxError:
            continue
        text = f.read_text()
        for q, node in spans.items():
            if q.rpartition(".")[2] == name and f"{dotted}:{q}" != m.where:
                a, b = offsets(text, node)
                if len(list(regex(m.pattern).finditer(text, a, b))) == 1:
                    seen.append(f"{dotted}:{q}")
    return f" (the pattern is now in {', '.join(seen)})" if seen else ""


def problems(m: Mutation, root: Path = ROOT) -> list[str]:
    """Why row m tests nothing today (empty: it applies). Never raises."""
    out = []
    try:
        locate(m, root)
    except Stale as e:
        out.append(str(e))
    for t in m.tests:
        fname, _, func = t.partition("::")
        tf = root / fname
        if not tf.is_file():
            out.append(f"test file {fname} does not exist")
        elif func and not re.search(rf"^(async )?def {re.escape(func)}\(", tf.read_text(), re.M):
            out.append(f"{fname} has no test {func}")
    return out


def malformed(m: Mutation) -> list[str]:
    """What is wrong with the row itself, whatever the code (an audit edit fixes it)."""
    out = []
    if ":" not in m.where:
        out.append("where is not module:function")
    if " ".join(m.mutated.split()) == " ".join(m.pattern.split()):
        out.append("mutated equals pattern")
    if not m.tests:
        out.append("names no test")
    if m.expect not in ("caught", "equivalent"):
        out.append(f"expect {m.expect!r}")
    elif m.expect == "equivalent" and not m.note:
        out.append("an equivalent mutant needs a note saying why")
    return out


M = Mutation
# fmt: off
MUTATIONS: list[Mutation] = [
    # ---- engine: the functional layer -------------------------------------------------------------
    M("rope-llama3-factor", "engine", "horizon_cli.model.layer:inv_freq",
      "smoothed = (1 - smooth) * scaled / factor + smooth * scaled",
      "smoothed = (1 - smooth) * scaled + smooth * scaled",
      ["tests/test_rope_scaling.py", "tests/test_engine_parity.py"],
      "llama3 RoPE smoothing loses its division by factor"),
    M("rope-linear-factor", "engine", "horizon_cli.model.layer:inv_freq",
      'return inv / float(rp["factor"])',
      'return inv * float(rp["factor"])',
      ["tests/test_rope_scaling.py", "tests/test_engine_parity.py"],
      "linear RoPE scaling multiplies instead of dividing"),
    M("rmsnorm-eps", "engine", "horizon_cli.model.layer:eager_rms_norm",
      "xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)",
      "xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True))",
      ["tests/test_engine_parity.py"],
      "RMSNorm drops its epsilon"),
    M("rope-rotate-sign", "engine", "horizon_cli.model.layer:_rotate_half",
      "return torch.cat((-x[..., half:], x[..., :half]), dim=-1)",
      "return torch.cat((x[..., half:], -x[..., :half]), dim=-1)",
      ["tests/test_engine_parity.py"],
      "rotate_half with the sign on the wrong half"),
    M("attn-scale", "engine", "horizon_cli.model.layer:attention",
      "scale = spec.head_dim**-0.5",
      "scale = 1.0",
      ["tests/test_engine_parity.py"],
      "attention without the 1/sqrt(head_dim) scale"),
    M("qk-norm-weight", "engine", "horizon_cli.model.layer:_heads",
      'y = rms_norm(y, w[f"{which}_norm"], spec.rms_eps)',
      'y = rms_norm(y, w["q_norm"], spec.rms_eps)',
      ["tests/test_engine_parity.py"],
      "Qwen3 k norm applied with the q norm's weights"),
    M("swiglu-swapped", "engine", "horizon_cli.model.layer:eager_swiglu",
      "return F.silu(gate) * up",
      "return F.silu(up) * gate",
      ["tests/test_engine_parity.py"],
      "SwiGLU with gate and up swapped"),
    M("residual", "engine", "horizon_cli.model.layer:layer_forward",
      'return h + mlp(w, rms_norm(h, w["mlp_norm"], spec.rms_eps), lora)',
      'return x + mlp(w, rms_norm(h, w["mlp_norm"], spec.rms_eps), lora)',
      ["tests/test_engine_parity.py"],
      "second residual adds the layer input instead of h"),
    # ---- engine: the loss head ---------------------------------------------------------------------
    M("labels-shift", "engine", "horizon_cli.model.head:label_index",
      "tgt = labels[:, 1:].reshape(-1)",
      "tgt = labels[:, :-1].reshape(-1)",
      ["tests/test_engine_parity.py"],
      "targets not shifted by one (off-by-one)"),
    M("head-positions", "engine", "horizon_cli.model.head:_chunked_backward",
      "sel = hn[:, :-1].reshape(-1, hn.shape[-1]).index_select(0, idx)  # (n, H) rows that carry a label",
      "sel = hn[:, 1:].reshape(-1, hn.shape[-1]).index_select(0, idx)  # (n, H) rows that carry a label",
      ["tests/test_engine_parity.py"],
      "hidden states of the wrong positions feed the head"),
    M("head-inv-n", "engine", "horizon_cli.model.head:head_forward_backward.ce",
      "return loss * inv_n, loss",
      "return loss, loss",
      ["tests/test_engine_parity.py"],
      "head gradient misses the 1/N token scale"),
    M("head-chunk-accumulate", "engine", "horizon_cli.model.head:_chunked_backward",
      "g_t.add_(gw)",
      "g_t.copy_(gw)",
      ["tests/test_engine_parity.py"],
      "LM-head gradient overwritten by each chunk instead of summed"),
    M("head-logits-fp32", "engine", "horizon_cli.model.head:_chunked_backward",
      "diff, value = chunk_loss(logits.float(), a, a + x.shape[0])",
      "diff, value = chunk_loss(logits, a, a + x.shape[0])",
      ["tests/test_engine_parity.py", "tests/test_bf16_training.py"],
      "cross-entropy on bf16 logits (no fp32 upcast)"),
    # ---- engine: the schedule ----------------------------------------------------------------------
    M("clip-min", "engine", "horizon_cli.engine.step:TrainStep.apply_update",
      "scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0",
      "scale = clip / (norm + 1e-6) if clip > 0 else 1.0",
      ["tests/test_engine_training.py::test_twenty_steps_match_resident_adamw", "tests/test_grad_clip.py"],
      "clipping also scales small gradients up"),
    M("adam-step", "engine", "horizon_cli.engine.step:TrainStep.apply_update",
      "p.adam_step += 1",
      "p.adam_step = 1",
      ["tests/test_engine_training.py::test_twenty_steps_match_resident_adamw"],
      "AdamW bias correction always at step 1"),
    M("loss-mean", "engine", "horizon_cli.engine.engine:Engine.step",
      'loss = loss_sum / tokens if tokens else float("nan")',
      'loss = loss_sum / len(mbs) if tokens else float("nan")',
      ["tests/test_engine_training.py::test_twenty_steps_match_resident_adamw"],
      "reported loss divided by micro-batches, not tokens"),
    M("norm-host-part", "engine", "horizon_cli.engine.reduce:LocalReduce.total",
      "return float(loss_sum.item()), dev_sq + host_sq",
      "return float(loss_sum.item()), dev_sq",
      ["tests/test_engine_parity.py"],
      "global grad norm misses the embedding's part"),
    M("embed-grad-zero", "engine", "horizon_cli.engine.embed:HostEmbedding._zero",
      'st.views(st.grad)["embed"].index_fill_(0, self.touched, 0.0)',
      "pass",
      ["tests/test_engine_training.py::test_twenty_steps_match_resident_adamw",
       "tests/test_gpu_ready.py::test_the_embedding_gradient_is_the_last_backwards_alone"],
      "embedding gradient not cleared between steps"),
    M("padding-row-grad", "engine", "horizon_cli.engine.embed:embed_grad",
      "rows[ids == padding_idx] = 0.0",
      "rows[ids == padding_idx] *= 1.0",
      ["tests/test_generic_training.py"],
      "the padding row of the embedding gets a gradient (nn.Embedding(padding_idx) gives none)"),
    M("microbatch-accumulate", "engine", "horizon_cli.engine.passes:backprop",
      "gv[name].add_(gw)  # fp32 accumulation across micro-batches",
      "gv[name].copy_(gw)  # fp32 accumulation across micro-batches",
      ["tests/test_engine_parity.py"],
      "layer gradients overwritten by each micro-batch"),
    M("saved-input-layer", "engine", "horizon_cli.engine.passes:SavePass.backward_load",
      "buf = self.buffers[j][: self.total]",
      "buf = self.buffers[j - 1][: self.total]",
      ["tests/test_engine_parity.py"],
      "backward recomputes a layer from the wrong saved input"),
    M("saved-input-offset", "engine", "horizon_cli.engine.passes:SavePass.run",
      "off += xm.numel()",
      "off = xm.numel()",
      ["tests/test_engine_parity.py", "tests/test_engine_training.py::test_micro_batch_size_does_not_change_the_update"],
      "saved inputs of the third and later micro-batches overwrite the second's (offset not accumulated)"),
    M("gacc-one-buffer", "engine", "horizon_cli.engine.step:TrainStep._backward_layers",
      "k = j % 2",
      "k = 0",
      ["tests/test_engine_training.py", "tests/test_cuda_transport.py"],
      "one gradient accumulator instead of two ping-pong buffers", "equivalent",
      "each reuse waits for the buffer's previous D2H, so it only serialises (slower, same numbers)"),
    M("gacc-no-wait", "engine", "horizon_cli.engine.grads:GradSums.buffer",
      "self.t.wait(self.free[k])  # its previous contents have reached the host",
      "pass  # its previous contents have reached the host",
      ["tests/test_cuda_transport.py", "tests/test_engine_training.py"],
      "a gradient accumulator zeroed while its previous D2H may still read it"),
    M("embed-scale", "engine", "horizon_cli.engine.embed:Embedding.scale",
      "return x if s is None else [xm * s for xm in x]",
      "return x",
      ["tests/test_generic_parity.py"],
      "Gemma's embedding scale dropped"),
    M("weight-loads-count", "engine", "horizon_cli.runtime.loader:Loader._issue",
      'self.layer_loads += load.unit.startswith("layer.")',
      "self.layer_loads += 1",
      ["tests/test_engine_training.py::test_micro_batch_size_does_not_change_the_update"],
      "weight_loads counts the head too"),
    M("update-order", "engine", "horizon_cli.engine.params:FullParams.order",
      'return [self.layers[0], "embed", *self.layers[1:], "head"]',
      'return [*self.layers, "embed", "head"]',
      ["tests/test_engine_robust.py::test_layer_0_does_not_wait_for_the_update_of_layer_1"],
      "the embedding updated after every layer: the next step's start waits for all of them"),
    M("device-activations-kept", "engine", "horizon_cli.engine.passes:ForwardPass.run",
      'p.loader.release(f"f{j}")',
      'p.loader.release(f"f{j}"); p.__dict__.setdefault("kept", []).append(x)',  # on the run's parts: a pass lives one call
      ["tests/test_device_memory.py"],
      "every layer's activations stay alive (device memory grows with depth)"),
    # ---- engine: the loader ------------------------------------------------------------------------
    M("prefetch-one-buffer", "engine", "horizon_cli.runtime.loader:Loader.__init__",
      "for i in range(prefetch)]",
      "for i in range(1)]",
      ["tests/test_pipeline.py::test_loads_are_issued_ahead_and_overlap_compute"],
      "the ring has one buffer whatever engine.prefetch says (no prefetching)"),
    M("prefetch-synchronous", "engine", "horizon_cli.runtime.loader:Loader._issue",
      'slot.loaded = self.t.h2d(pairs, deps, label=f"{load.key}@{slot.name}")',
      'slot.loaded = self.t.h2d(pairs, deps, label=f"{load.key}@{slot.name}"); self.t.wait(slot.loaded)',
      ["tests/test_pipeline.py::test_loads_are_issued_ahead_and_overlap_compute"],
      "each load waited for as soon as it is issued (transfers serialised with compute)"),
    M("load-before-update", "engine", "horizon_cli.runtime.loader:Loader._issue",
      "deps = [slot.free, self.ready.get(load.unit, READY), *load.deps]",
      "deps = [slot.free, *load.deps]",
      ["tests/test_pipeline.py::test_schedule_ordering", "tests/test_cuda_transport.py", "tests/test_update_order.py"],
      "a unit streamed without waiting for its AdamW update"),
    M("slot-free-event", "engine", "horizon_cli.runtime.loader:Loader.release",
      "slot.key, slot.free = None, self.t.record()",
      "slot.key = None",
      ["tests/test_cuda_transport.py", "tests/test_pipeline.py::test_schedule_ordering"],
      "a buffer refilled without waiting for the compute that read it", "equivalent",
      "every copy already waits for all compute issued before it is requested (the transport's contract), and a buffer is refilled only by a load requested after its release"),
    M("dropout-recompute-masks", "engine", "horizon_cli.engine.passes:SavePass.backward",
      "with self.scope(j, self.mb_base + m):  # the forward's masks (engine.dropout)",
      "with contextlib.nullcontext():",
      ["tests/test_dropout.py::test_recompute_draws_the_forward_masks_bitwise"],
      "the backward recompute runs without the forward's dropout scope (other masks, or none)"),
    M("dropout-seed-micro-batch", "engine", "horizon_cli.engine.dropout:SeededDropout.scope",
      "s = call_seed(self.seed, step, call, mb)",
      "s = call_seed(self.seed, step, call, 0)",
      ["tests/test_dropout.py::test_gradients_equal_transformers_under_the_same_masks"],
      "every micro-batch of a call draws the same dropout masks"),
    # ---- engine: LoRA adapters and NF4 bases --------------------------------------------------------
    M("lora-dropout-rescale", "engine", "horizon_cli.lora.linear:LayerLora._dropout",
      "return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))",
      "return x * keep.to(x.dtype)",
      ["tests/test_lora_engine.py::test_dropout_masks_are_the_same_in_the_recompute",
       "tests/test_lora_engine.py::test_dropout_scales_what_it_keeps_as_torch_dropout_does"],
      "LoRA dropout drops inputs without rescaling the kept ones by 1 / (1 - p) (PEFT's nn.Dropout does)"),
    M("lora-norm-every-rank", "engine", "horizon_cli.engine.sharded:ShardedGrads.reduce.job",
      "self.sq.append(sumsq64(mine) if self.d.is_main else 0.0)",
      "self.sq.append(sumsq64(mine))",
      ["tests/test_dist.py::test_bf16_exact_lean_lora_and_moe_on_two_ranks_match_one"],
      "a sharded LoRA run counts the replicated adapters' squared norm on every rank: the grad norm is sqrt(world) too large and clips wrongly"),
    M("nf4-dequant-mean", "engine", "horizon_cli.quant.nf4_bnb:block_scales",
      'return q["dynamic"][q["absmax"].to(torch.int32)] * group + q["offset"]',
      'return q["dynamic"][q["absmax"].to(torch.int32)] * group',
      ["tests/test_nf4.py"],
      "NF4 block scales dequantized without adding back the double quantization's offset"),
    M("nf4-absmax-bins", "engine", "horizon_cli.quant.nf4_bnb:double_quantize",
      "bins = ((v + 1.0) * 0.5 * (BINS - 1) + 0.5).to(torch.int32)",
      "bins = ((v + 1.0) * 0.5 * (BINS - 1)).to(torch.int32)",
      ["tests/test_nf4.py"],
      "the 8-bit absmax index takes the bin below instead of the nearest bin (bitsandbytes rounds)"),
    M("nf4-dequant-in-dtype", "engine", "horizon_cli.quant.nf4_bnb:dequantize",
      "torch.mul(vals, scale[a : a + CHUNK], out=dst[a : a + CHUNK])",
      "torch.mul(vals.to(dst.dtype), scale[a : a + CHUNK].to(dst.dtype), out=dst[a : a + CHUNK])",
      ["tests/test_nf4.py"],
      "NF4 dequantized in the store dtype (bf16 products) instead of fp32 products rounded once"),
    M("nf4-legacy-scheme", "engine", "horizon_cli.store.packed:scheme_of",
      'return "bnb" if version >= 5 else "torchao"',
      'return "bnb"',
      ["tests/test_nf4_legacy.py"],
      "stores of versions 3 and 4 read as bitsandbytes' NF4 layout"),
    M("widen-host-copy", "engine", "horizon_cli.state.frozen:FrozenState.__init__",
      "keep = narrow and store.dtype.is_floating_point",
      "keep = False and store.dtype.is_floating_point",
      ["tests/test_narrow_stream.py"],
      "a bf16 base computing in fp32 converted on the host again: its fp32 copy crosses the link"),
    M("widen-kept-shared", "engine", "horizon_cli.state.widen:Widen.__call__",
      "buf = self.own.get(unit, self.scratch)",
      "buf = self.scratch",
      ["tests/test_narrow_stream.py"],
      "kept layers upcast into the shared buffer, which the next layer's upcast overwrites before their backward"),
    # ---- engine: kept layers (engine.keep_activations) ---------------------------------------------
    M("kept-shared-dequant", "engine", "horizon_cli.state.frozen:FrozenState.weights",
      "out = self.kept.get(unit, self.scratch)",
      "out = self.scratch",
      ["tests/test_keep.py::test_moe_and_qlora_kept_equal_recomputed"],
      "a kept NF4 layer dequantized into the shared scratch buffer, which the next layer overwrites"),
    M("kept-ring-slot", "engine", "horizon_cli.runtime.loader:Loader._free_slot",
      "for s in self.kept if load.kept else self.ring:",
      "for s in self.ring:",
      ["tests/test_keep.py::test_kept_slots_are_ordered_on_cuda_streams", "tests/test_keep.py::test_kept_equals_recomputed_bitwise"],
      "a kept layer held in a ring slot (the ring runs dry: the backward's loads find no buffer)"),
    M("kept-aux-dropped", "engine", "horizon_cli.model.generic:GenericTemplate.held_objective",
      "aux = None if self.moe is None or logits is None else self.moe.objective(logits, ctx.tokens)",
      "aux = None",
      ["tests/test_keep.py::test_moe_and_qlora_kept_equal_recomputed"],
      "a kept MoE layer's backward misses its share of the load-balancing loss"),
    M("kept-loaded-twice", "engine", "horizon_cli.engine.step:TrainStep._passes",
      "[save] * self.recomputed + [kept] * p.keep",
      "[save] * len(p.tmpl.calls)",
      ["tests/test_keep.py::test_kept_equals_recomputed_bitwise"],
      "kept layers loaded again for the backward"),
    M("kept-auto-all", "engine", "horizon_cli.planning.keep:auto_keep",
      "return min(plan.layers, room(plan, where) // per_layer)",
      "return plan.layers",
      ["tests/test_keep.py::test_auto_keeps_what_the_budget_holds"],
      "auto keeps every layer whatever the room"),
    M("kept-graph-no-mlp", "engine", "horizon_cli.planning.memory:kept_graph_bytes",
      "mlp = 3 * H if tiled else 4 * spec.intermediate",
      "mlp = 3 * H if tiled else 0",
      ["tests/test_keep.py::test_plan_covers_what_kept_graphs_save"],
      "the plan's kept graph leaves out the MLP's saved tensors"),
    M("kept-forward-only", "engine", "horizon_cli.engine.engine:Engine.__init__",
      'if forward_only:\n    keep = 0\nelif keep is None:',
      "if keep is None:",
      ["tests/test_keep.py::test_forward_only_engines_keep_nothing_and_generation_beside_kept_layers"],
      "a forward-only engine (generation, evaluation) keeps layers as a training run's config says"),
    # ---- optimizer ---------------------------------------------------------------------------------
    M("optim-grad-slice", "optim", "horizon_cli.state.optimizer:OptimizerWorker._update_slice",
      "g, s = st.grad[a:b], st.state",
      "g, s = st.grad[: b - a], st.state",
      ["tests/test_optimizer_slices.py", "tests/test_engine_training.py"],
      "AdamW reads the first slice's gradient for every slice of a large unit"),
    M("optim-lo-slice", "optim", "horizon_cli.state.optimizer:OptimizerWorker._update_slice",
      'self.impl.adamw_split_(st.stream[a:b], s["lo"][q], g, s["m"][q], s["v"][q], h)',
      'self.impl.adamw_split_(st.stream[a:b], s["lo"][: b - a], g, s["m"][q], s["v"][q], h)',
      ["tests/test_optimizer_slices.py", "tests/test_bf16_training.py"],
      "bf16 master's remainder taken from the wrong slice"),
    M("optim-bf16-copy", "optim", "horizon_cli.state.optimizer:OptimizerWorker._update_slice",
      'self.impl.adamw_split_(st.stream[a:b], s["lo"][q], g, s["m"][q], s["v"][q], h)',
      'self.impl.adamw_split_(st.stream[a:b].clone(), s["lo"][q], g, s["m"][q], s["v"][q], h)',
      ["tests/test_bf16_training.py", "tests/test_engine_training.py"],
      "bf16 weight updates written into a copy"),
    M("optim-frozen", "optim", "horizon_cli.state.host:segments",
      "n = layout.trainable_numel",
      "n = layout.numel",
      ["tests/test_generic_training.py"],
      "AdamW also updates frozen buffers (a routing bias): the unit's state segments cover all its elements"),
    M("adamw-bias-correction", "optim", "horizon_cli.optim.adamw:adamw_fp32_",
      "bc1 = 1.0 - h.beta1**h.step",
      "bc1 = 1.0 - h.beta1",
      ["tests/test_kernel_adamw.py", "tests/test_engine_training.py"],
      "first-moment bias correction without the step"),
    M("adamw-decay", "optim", "horizon_cli.optim.adamw:adamw_fp32_",
      "p.mul_(1.0 - h.lr * h.weight_decay)",
      "p.mul_(1.0 - h.weight_decay)",
      ["tests/test_kernel_adamw.py", "tests/test_engine_training.py"],
      "weight decay not scaled by lr"),
    M("adamw-eps", "optim", "horizon_cli.optim.adamw:adamw_fp32_",
      "denom = (v.sqrt() / bc2_sqrt).add_(h.eps)",
      "denom = v.sqrt().add_(h.eps) / bc2_sqrt",
      ["tests/test_kernel_adamw.py", "tests/test_engine_training.py"],
      "eps added before the bias correction"),
    M("adamw-clip-scale", "optim", "horizon_cli.optim.adamw:adamw_fp32_",
      "g = g * h.grad_scale",
      "g = g / h.grad_scale",
      ["tests/test_kernel_adamw.py", "tests/test_engine_training.py"],
      "clip coefficient divides"),
    M("split-round", "optim", "horizon_cli.optim.split:split_",
      "h = (u + 0x8000) >> 16",
      "h = u >> 16",
      ["tests/test_kernel_adamw.py", "tests/test_bf16_training.py"],
      "bf16 streaming copy truncated instead of rounded (the master stays exact)"),
    M("split-join-sign", "optim", "horizon_cli.optim.split:join",
      "u = (hi.view(torch.int16).to(torch.int32) << 16) + lo.to(torch.int32)",
      "u = (hi.view(torch.int16).to(torch.int32) << 16) - lo.to(torch.int32)",
      ["tests/test_kernel_adamw.py", "tests/test_bf16_training.py"],
      "master rebuilt with the remainder's sign flipped"),
    M("split-into-copy", "optim", "horizon_cli.optim.split:split_",
      "hi.view(torch.int16).copy_(h.to(torch.int16))",
      "hi.clone().view(torch.int16).copy_(h.to(torch.int16))",
      ["tests/test_bf16_training.py", "tests/test_kernel_adamw.py"],
      "the refreshed bf16 copy written into a temporary (torch path)"),
    M("native-scalars", "optim", "horizon_cli.optim.native:_scalars",
      "return (h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, int(h.step), h.grad_scale)",
      "return (h.lr, h.beta2, h.beta1, h.eps, h.weight_decay, int(h.step), h.grad_scale)",
      ["tests/test_kernel_adamw.py"],
      "betas swapped on the way into the native kernel"),
    M("native-tail", "optim", "kernels/adamw_impl.h:fp32_range",
      "for (; i < n; ++i) adamw_math<Scalar>(p[i]",
      "for (; i <= n; ++i) adamw_math<Scalar>(p[i]",
      ["tests/test_kernel_adamw.py::test_a_call_touches_exactly_its_elements"],
      "the kernel's scalar tail writes one element past its buffer"),
    M("native-decay", "optim", "kernels/adamw.cpp:make_coeffs",
      "c.decay = static_cast<float>(1.0 - lr * weight_decay);",
      "c.decay = static_cast<float>(1.0 - weight_decay);",
      ["tests/test_kernel_adamw.py"],
      "kernel's weight decay not scaled by lr"),
    M("native-split-lo", "optim", "kernels/adamw.cpp:split_bits",
      "*lo = static_cast<int16_t>(static_cast<uint16_t>(u));",
      "*lo = static_cast<int16_t>(static_cast<uint16_t>(u >> 1));",
      ["tests/test_kernel_adamw.py"],
      "kernel's scalar split writes a wrong remainder"),
    M("lean-1d-exact", "optim", "horizon_cli.state.host:stays_exact",
      "return len(shape) <= 1",
      "return len(shape) < 1",
      ["tests/test_lean.py"],
      "optim.memory lean keeps no tensor exact: norm scales and biases get the 16-bit master, which rounds away updates of about lr"),
    M("lean-segment-at", "optim", "horizon_cli.state.optimizer:OptimizerWorker._update_slice",
      "k = seg.at + (a - seg.start)",
      "k = a - seg.start",
      ["tests/test_lean.py"],
      "a lean unit's segments all read their kind's packed state from its start (segments after the first share the first one's moments and master remainder)"),
    M("lean-w-nonzero", "optim", "horizon_cli.optim.lean:quantize_w",
      "qw.copy_(encode(x, W_MANT, keep_nonzero=True)",
      "qw.copy_(encode(x, W_MANT, keep_nonzero=False)",
      ["tests/test_lean.py"],
      "lean's reference quantizer lets a small nonzero sqrt(v) round to code 0 (the next update divides by eps)"),
    M("lr-warmup", "optim", "horizon_cli.optim.schedules:lr_at",
      "return lr * (step + 1) / (warmup + 1)",
      "return lr * step / warmup",
      ["tests/test_schedules.py"],
      "warmup starts at lr 0 (off by one)"),
    M("lr-cosine-sign", "optim", "horizon_cli.optim.schedules:lr_at",
      "scale = 0.5 * (1.0 + math.cos(math.pi * frac))",
      "scale = 0.5 * (1.0 - math.cos(math.pi * frac))",
      ["tests/test_schedules.py"],
      "cosine schedule rises instead of decaying"),
    M("plan-moments", "optim", "horizon_cli.planning.memory:trained_host",
      'host["AdamW moments (fp32)"] = numel * 8',
      'host["AdamW moments (fp32)"] = numel * 4',
      ["tests/test_inspect_store.py"],
      "memory plan counts one moment instead of two (inspect's B/param)"),
    M("plan-embed-grad", "optim", "horizon_cli.planning.memory:trained_host",
      "grads = (numel - embed) * gitem + embed * 4",
      "grads = (numel - embed) * gitem + embed * gitem",
      ["tests/test_inspect_store.py"], "memory plan counts the embedding's gradient in bf16 (it is fp32 on the host)"),
    # ---- data ------------------------------------------------------------------------------------------
    M("pack-boundary-label", "data", "horizon_cli.data.pack:Packer.add",
      "labels[0] = IGNORE  # the previous document's last token must not predict this one",
      "labels[0] = labels[0]  # the previous document's last token must not predict this one",
      ["tests/test_data_pipeline.py"],
      "a packed document's first token is predicted from the previous one"),
    M("pack-fit", "data", "horizon_cli.data.pack:Packer.add",
      "if self._used + len(ids) > self.max_len:",
      "if self._used + len(ids) >= self.max_len:",
      ["tests/test_data_pipeline.py", "tests/test_data_boundaries.py"],
      "a row that would be exactly full is closed early (off-by-one)"),
    M("sampler-offset", "data", "horizon_cli.data.sampler:batch_indices",
      "k = step * batch_size + np.arange(batch_size, dtype=np.int64)",
      "k = (step + 1) * batch_size + np.arange(batch_size, dtype=np.int64)",
      ["tests/test_data_batching.py"],
      "step s takes the rows of step s + 1"),
    M("sampler-epoch-seed", "data", "horizon_cli.data.sampler:epoch_permutation",
      "perm = np.random.default_rng([seed, epoch]).permutation(n)",
      "perm = np.random.default_rng(seed).permutation(n)",
      ["tests/test_data_batching.py"],
      "the same permutation every epoch"),
    M("collate-label-pad", "data", "horizon_cli.data.collate:_micro",
      "labels = np.full((b, T), IGNORE, dtype=np.int64)  # (b, T)",
      "labels = np.full((b, T), pad_id, dtype=np.int64)  # (b, T)",
      ["tests/test_data_batching.py"],
      "padding positions carry loss"),
    M("collate-pad-doc", "data", "horizon_cli.data.collate:_padded_docs",
      "n_docs = int(real[-1]) + 1 if L else 0",
      "n_docs = int(real[-1]) if L else 0",
      ["tests/test_data_batching.py"],
      "a packed row's padding joins its last document"),
    M("positions-restart", "data", "horizon_cli.data.tokset:positions",
      "return pos - np.repeat(starts, run)",
      "return pos",
      ["tests/test_data_batching.py", "tests/test_data_pipeline.py"],
      "positions do not restart per packed document"),
    M("label-tokens-shift", "data", "horizon_cli.data.tokset:TokenSet.row_label_tokens",
      "return csum[end] - csum[start] - has[start]",
      "return csum[end] - csum[start]",
      ["tests/test_data_batching.py", "tests/test_data_pipeline.py"],
      "a row's first label counted as a loss token"),
    M("span-overlap", "data", "horizon_cli.data.encode:_span_labels",
      "hit |= (off[:, 0] < b) & (off[:, 1] > a)",
      "hit |= (off[:, 0] <= b) & (off[:, 1] > a)",
      ["tests/test_data_formats.py"],
      "the token right after an assistant span also gets loss"),
    M("eos-double", "data", "horizon_cli.data.encode:encode_rendered",
      "if eos is not None and (len(ids) == 0 or ids[-1] != eos):",
      "if eos is not None:",
      ["tests/test_data_formats.py"],
      "EOS appended even when the text already ends with it"),
    M("truncate-boundary", "data", "horizon_cli.data.encode:truncate",
      "if len(ids) <= max_len:",
      "if len(ids) < max_len:",
      ["tests/test_data_formats.py", "tests/test_data_pipeline.py", "tests/test_data_boundaries.py"],
      "an example of exactly max_seq_len counted as truncated"),
    M("no-label-shift", "data", "horizon_cli.data.build:_add",
      "if not (ex[1][1:] != IGNORE).any():  # after the shift, nothing to predict",
      "if not (ex[1] != IGNORE).any():  # after the shift, nothing to predict",
      ["tests/test_data_formats.py", "tests/test_data_pipeline.py", "tests/test_data_boundaries.py"],
      "an example whose only label is its first token is kept (it has nothing to predict)"),
    M("alpaca-span", "data", "horizon_cli.data.templates:alpaca",
      "spans.append((len(text), len(text) + len(ins.output)))",
      "spans.append((len(text) - 1, len(text) + len(ins.output)))",
      ["tests/test_data_formats.py", "tests/test_data_fidelity.py"],
      "Alpaca output span starts one character early"),
    M("chat-span-end", "data", "horizon_cli.data.templates:_span_by_prefix",
      "return start, max(start, len(q.rstrip()))",
      "return start, len(q)",
      ["tests/test_data_formats.py"],
      "an assistant span includes the template's trailing whitespace"),
    M("auto-order", "data", "horizon_cli.data.formats:DETECT",
      'DETECT = ("tokens", "preference", "unpaired", "chat", "prompt_completion", "instruction", "text", "prompt")',
      'DETECT = ("text", "tokens", "preference", "unpaired", "chat", "prompt_completion", "instruction", "prompt")',
      ["tests/test_data_formats.py"],
      "auto detection tries text first"),
    M("eval-split-swapped", "data", "horizon_cli.data.prepare:split_eval",
      "return ts.select(np.flatnonzero(~is_eval)), ts.select(np.flatnonzero(is_eval))",
      "return ts.select(np.flatnonzero(is_eval)), ts.select(np.flatnonzero(~is_eval))",
      ["tests/test_data_pipeline.py"],
      "train and eval rows swapped"),
    M("meaning-numbers-silent", "data", "horizon_cli.data.fields:meaningful",
      "return isinstance(value, bool | numbers.Number)",
      "return False",
      ["tests/test_data_meaning.py"],
      "a number or boolean no format reads (a weight, a score) ignored silently"),
    M("ignore-fields-not-keyed", "data", "horizon_cli.data.prepare:_entry",
      'reading={**spec.mapping, "ignore_fields": sorted(data_cfg.ignore_fields)},',
      "reading=spec.mapping,",
      ["tests/test_data_meaning.py"],
      "a cache entry built with data.ignore_fields reused without them (the meaning check skipped)"),
    M("long-text-no-overlap", "data", "horizon_cli.data.pack:pieces",
      "start += room - 1  # the overlap: this piece's last token opens the next",
      "start += room  # the overlap: this piece's last token opens the next",
      ["tests/test_data_long_text.py"],
      "a long document's pieces do not overlap: the token at each boundary is never predicted"),
    M("completion-prefix", "data", "horizon_cli.data.completion:encode_records",
      "labels[: 0 if train_on_prompt else _common_prefix(prompt_ids, ids)] = IGNORE",
      "labels[: 0 if train_on_prompt else _common_prefix(prompt_ids, ids) - 1] = IGNORE",
      ["tests/test_data_prompt_completion.py"],
      "the prompt's last token carries loss in prompt/completion data"),
    M("mixture-weight", "data", "horizon_cli.data.mixture:repeat_rows",
      "np.tile(np.arange(n, dtype=np.int64), whole)",
      "np.tile(np.arange(n, dtype=np.int64), 1)",
      ["tests/test_data_mixture.py"],
      "a source's whole weight ignored (each row once)"),
    # ---- checkpoints and the run dir -------------------------------------------------------------------
    M("ckpt-no-lo", "checkpoint", "horizon_cli.engine.tuning:STATE_BUFFERS",
      'STATE_BUFFERS = ("lo", "m", "v", "lo8",',
      'STATE_BUFFERS = ("m", "v", "lo8",',
      ["tests/test_bf16_training.py", "tests/test_train_resume.py::test_killed_run_resumes_bitwise_identical"],
      "the bf16 master's 16-bit remainder not saved in checkpoints"),
    M("ckpt-adam-step", "checkpoint", "horizon_cli.train.checkpoint:load",
      'engine.adam_step = trainer["adam_step"]',
      "engine.adam_step = 0",
      ["tests/test_bf16_training.py"],
      "a resumed run restarts AdamW's bias correction"),
    M("ckpt-load-buffer", "checkpoint", "horizon_cli.train.checkpoint:load",
      "_read_raw(ck / rel, bufs[key], sums[rel][1])",
      '_read_raw(ck / rel, bufs["m"], sums[rel][1])',
      ["tests/test_bf16_training.py"],
      "every state file read into the first moment's buffer"),
    M("ckpt-rng", "checkpoint", "horizon_cli.train.checkpoint:load",
      '_set_rng_state(trainer["rng"])',
      "pass",
      ["tests/test_train_resume.py::test_killed_run_resumes_bitwise_identical"],
      "a resumed run does not restore the RNG state", "equivalent",
      "training draws no random numbers (data order is a function of (seed, step), dropout is off), so nothing depends on the RNG; the soak compares outcomes without it"),
    M("ckpt-load-crc", "checkpoint", "horizon_cli.train.checkpoint:_read_raw",
      "if zlib.crc32(buf) != crc:",
      "if False:",
      ["tests/test_run_dir.py", "tests/test_checkpoint_integrity.py"],
      "large state files are not checked against their CRC when loaded"),
    M("ckpt-sums-small", "checkpoint", "horizon_cli.store.ckpt:write_sums",
      'crc = known.get(rel, None if rel.startswith("units/") else crc_file(p))',
      'crc = known.get(rel, None if rel.startswith(("units/", "state/")) else crc_file(p))',
      ["tests/test_run_dir.py"],
      "trainer.json and config.yaml are not checksummed"),
    M("ckpt-newest-first", "checkpoint", "horizon_cli.store.ckpt:intact",
      "for ck in reversed(listed(run_dir)):",
      "for ck in listed(run_dir):",
      ["tests/test_export_store.py", "tests/test_run_dir.py"],
      "the oldest checkpoint is resumed and exported"),
    M("prune-keep", "checkpoint", "horizon_cli.store.ckpt:prune",
      "for old in listed(run_dir)[:-keep_last]:",
      "for old in listed(run_dir)[: -keep_last - 1]:",
      ["tests/test_run_dir.py", "tests/test_train_cli.py::test_train_writes_the_run_dir"],
      "pruning keeps one checkpoint too many"),
    M("resume-complete", "checkpoint", "horizon_cli.train.rundir:RunDir.trained",
      "return bool(self.candidates) and self.resume_step >= self.cfg.train.steps",
      "return bool(self.candidates) and self.resume_step > self.cfg.train.steps",
      ["tests/test_run_dir.py"],
      "a run whose last checkpoint is at train.steps is not seen as trained"),
    M("compat-free-inverted", "checkpoint", "horizon_cli.train.compat:changes",
      "a[k] != b[k] and not _under(k, FREE)]",
      "a[k] != b[k] and _under(k, FREE)]",
      ["tests/test_run_dir.py"],
      "only free settings count as changes to the run"),
    M("compat-steps-free", "checkpoint", "horizon_cli.train.compat:_moved",
      'if schedule["kind"] == "constant":  # warmup and constant: the total is never read',
      'if schedule["kind"] != "":  # warmup and constant: the total is never read',
      ["tests/test_resume_steps.py"],
      "train.steps may change on resume under any schedule, moving a decaying lr silently"),
    M("compat-steps-below", "checkpoint", "horizon_cli.train.compat:check_steps",
      "if new < step:",
      "if new < 0:",
      ["tests/test_resume_steps.py"],
      "train.steps below the step a checkpoint reached is taken as a finished run"),
    M("export-given-unchecked", "checkpoint", "horizon_cli.export.export:resolve_source",
      "check_given(src)",
      "pass",
      ["tests/test_checkpoint_edits.py"],
      "a checkpoint named to `horizon export` is exported without its checksums"),
    M("metrics-resume-cut", "checkpoint", "horizon_cli.train.metrics:MetricsLog.__init__",
      'kept = [r for r in rows if r.get("step", 0) <= resume_step] if resume_step else []',
      'kept = [r for r in rows if r.get("step", 0) < resume_step] if resume_step else []',
      ["tests/test_run_dir.py"],
      "a resumed run drops the metrics line of its checkpoint's step"),
    M("dpo-ref-sign", "engine", "horizon_cli.engine.pref_loss:PairObjective._losses",
      'lc, lr = pc - c["rc"], pr - c["rr"]  # log-ratios against the reference',
      'lc, lr = pc + c["rc"], pr + c["rr"]  # log-ratios against the reference',
      ["tests/test_pref_losses.py"],
      "DPO adds the reference log-prob instead of subtracting it"),
    M("pair-truncate-end", "data", "horizon_cli.data.pairs:add_pair",
      "seqs.append((ids[:max_len], labels[:max_len]))",
      "seqs.append((ids[-max_len:], labels[-max_len:]))",
      ["tests/test_pref_data.py"],
      "over-long pairs keep their end instead of their start (TRL's keep_start)"),
    M("pairs-split-micro", "data", "horizon_cli.data.pairs:collate_pairs",
      "mbs = collate(rows, 2 * micro_pairs, pad_id)",
      "mbs = collate(rows, micro_pairs + 1, pad_id)",
      ["tests/test_pref_engine.py"],
      "a micro-batch of pairs cut across a pair"),
    M("pairs-mixed-by-rows", "data", "horizon_cli.data.mixture:mix",
      "rows = ts.row_ids(items) if pairs else items  # a pair: its chosen and rejected rows",
      "rows = items  # a pair: its chosen and rejected rows",
      ["tests/test_pref_sources.py"],
      "a mixture of preference sources picks rows, not whole pairs"),
    M("pair-fields-unjudged", "data", "horizon_cli.data.pairs:build_pairs",
      "ignored = unread_columns(ds, read, judge)  # refuses meaning (kto_tag, score, ...) before any work",
      "ignored = unread_columns(ds, list(ds.column_names), judge)  # refuses meaning (kto_tag, score, ...) before any work",
      ["tests/test_data_meaning.py"],
      "a preference record's kto_tag or score is not judged (trained as a plain pair)"),
    M("soak-phases-unwritten", "run", "horizon_cli.faults:phase",
      "if _PHASES:",
      "if False:",
      ["tests/test_train_resume.py::test_crash_soak_short"],
      "the phase log is never written: the soak cannot tell where its kills landed"),
    M("grpo-clip-symmetric", "rl", "horizon_cli.engine.grpo_loss:GRPOObjective.loss",
      "coef_2 = torch.clamp(coef_1, 1 - self.eps_low, 1 + self.eps_high)",
      "coef_2 = torch.clamp(coef_1, 1 - self.eps_low, 1 + self.eps_low)",
      ["tests/test_grpo_loss.py"],
      "GRPO clips the ratio's upper side at epsilon, not epsilon_high"),
    M("grpo-kl-sign", "rl", "horizon_cli.engine.grpo_loss:GRPOObjective.loss",
      "kl = torch.exp(ref - lp) - (ref - lp) - 1",
      "kl = torch.exp(lp - ref) - (lp - ref) - 1",
      ["tests/test_grpo_loss.py"],
      "GRPO's k3 KL estimator with the log-ratio the wrong way round"),
    M("grpo-adv-batch-std", "rl", "horizon_cli.rl.advantages:advantages",
      'if scale == "batch":',
      'if scale == "group":',
      ["tests/test_grpo_loss.py"],
      "scale_rewards group and batch swapped"),
    M("grpo-resume-regroups", "rl", "horizon_cli.rl.batches:GRPOBatches.step",
      "got = ro.load_group(self.run_dir, g)",
      "got = ro.load_group(self.run_dir, step)",
      ["tests/test_grpo_train.py::test_a_resumed_run_samples_and_trains_as_an_uninterrupted_one"],
      "a run resumed inside a num_iterations group looks for its own step's rollouts"),
    M("grpo-lora-ref-adapters-on", "rl", "horizon_cli.rl.batches:GRPOBatches.attach",
      "self.ref_adapters = False",
      "self.ref_adapters = True",
      ["tests/test_grpo_modes.py::test_lora_and_qlora_steps_equal_trl_on_peft"],
      "a LoRA run's reference (beta > 0) keeps the adapters on: the policy itself, not the base"),
    M("grpo-ref-is-policy", "rl", "horizon_cli.rl.batches:GRPOBatches._sample",
      "self._logps(self.ref_engine or self.engine, mbs,",
      "self._logps(self.engine, mbs,",
      ["tests/test_grpo_modes.py::test_moe_and_generic_steps_equal_trl"],
      "a full fine-tune's reference log-probs come from the trained weights, not the initial model"),
    M("grpo-moe-aux-dropped", "rl", "horizon_cli.model.moe:RouterStats.__init__",
      "self.coef = moe.aux_coef",
      "self.coef = None",
      ["tests/test_grpo_modes.py::test_moe_and_generic_steps_equal_trl"],
      "a MoE model's router aux loss is reported but not trained (GRPO's TRL oracle)"),
    M("grpo-plan-kv-kept-room", "rl", "horizon_cli.train.report:dry_run_report",
      "where.device - (plan.device_total - plan.kept_bytes)",
      "where.device - plan.device_total",
      ["tests/test_grpo_plan.py"],
      "the dry run plans the rollout's KV cache beside the kept layers' graphs, gone between steps"),
    # ---- vision: Qwen2-VL's multimodal rotary position ids -------------------------------------------
    M("mrope-positions-dropped", "engine", "horizon_cli.vision.embed:VisionEmbedding.positioned",
      "return mb if got is None else dataclasses.replace(mb, position_ids=got[0])",
      "return mb",
      ["tests/test_vision_qwen.py"],
      "a micro-batch with images keeps its 1-D positions (Qwen2-VL's get_rope_index ids never reach the layers)"),
    M("mrope-unmasked", "engine", "horizon_cli.vision.tower:VisionTower.positions",
      'if "attention_mask" in takes and mask is not None:',
      'if False:',
      ["tests/test_vision_qwen.py::test_qwen_vl_positions_are_the_models_own"],
      "the rope index ignores the rows' padding (pad positions numbered as text)"),
    M("mrope-decode-deltas-dropped", "engine", "horizon_cli.data.batch:DecodeBatch.next",
      "deltas = None if self.mrope is None else (None, self.mrope[1])",
      "deltas = None",
      ["tests/test_vision_qwen.py::test_qwen_vl_generate_with_images_equals_transformers_greedy"],
      "generated tokens after an image prefill lose the rope deltas (positions restart as text)"),
    # ---- vision: Gemma 3's image blocks, Idefics3's tile stacks ----------------------------------------
    M("image-blocks-dropped", "engine", "horizon_cli.model.token_masks:owner_inputs",
      "if ctx.types is None:",
      "if True:",
      ["tests/test_vision_families.py::test_loss_grads_adamw_match_transformers"],
      "Gemma 3's image tokens attend causally (the bidirectional block mask never reaches the layers)"),
    M("image-merge-unscaled", "engine", "horizon_cli.vision.embed:VisionEmbedding.forward",
      "merged = self.tower.merge(ids, self.tower.embed(ids, rows), feats)",
      "merged = self.tower.merge(ids, rows, feats)",
      ["tests/test_vision_families.py::test_loss_grads_adamw_match_transformers"],
      "the image features merged into rows the embedding module has not run on (Gemma 3's text unscaled)"),
    M("image-stack-flat", "engine", "horizon_cli.vision.encode:stacked",
      "if STACK not in kw:",
      "if True:",
      ["tests/test_vision_families.py::test_loss_grads_adamw_match_transformers"],
      "Idefics3's tiles reach get_image_features without the per-row stack dimension it reads"),
    # ---- rl under torchrun: the decode's lock step -----------------------------------------------
    M("decode-lockstep-alone", "rl", "horizon_cli.generate.decoder:Decoder.run",
      "still, nxt = [m], [dbs[m].next(tok.reshape(-1, 1))]",
      "break",
      ["tests/test_grpo_dist.py::test_a_rank_whose_rows_have_stopped_sweeps_along_until_no_rank_has_one"],
      "a rank whose rows have all stopped leaves the sweeps while another rank's rows go on"),
    M("decode-kv-own-limit", "rl", "horizon_cli.generate.decoder:Decoder.run",
      "kv = self.gen.open(dbs, most, self.host_kv)",
      "kv = self.gen.open(dbs, max(max(lim) for lim in limits), self.host_kv)",
      ["tests/test_grpo_dist.py::test_a_rank_whose_rows_have_stopped_sweeps_along_until_no_rank_has_one"],
      "a rank's KV caches sized for its own longest limit, not the longest of any rank (host mode overflows)"),
    # ---- sequence tiles: the native layer's attention per query tile ---------------------------------
    M("tile-attn-dkv-dropped", "engine", "horizon_cli.model.tiled_layer:_Layer.backward",
      "dK[:, :, lo:e] += g[1]",
      "pass",
      ["tests/test_seq_tile.py::test_native_layer_tiled_equals_untiled"],
      "the tiled backward drops the query tiles' K gradients (K's weights learn only from their own tile)"),
    M("tile-attn-doc-rows", "engine", "horizon_cli.model.attend:rows_mask",
      "m = m & (doc[r, s:e, None] == doc[r, None, lo:e])",
      "m = m",
      ["tests/test_seq_tile.py::test_packed_documents_across_tile_edges"],
      "a query tile's mask rows ignore the packed documents (attention across documents)"),
    M("tile-rows-window-late", "engine", "horizon_cli.model.attend:_toeplitz",
      'line[: n - window] = float("-inf")',
      'line[: n - window - 1] = float("-inf")',
      ["tests/test_causal_rows.py::test_tiles_of_causal_rows_equal_the_whole_sequence"],
      "a query tile's causal rows see one key past the sliding window"),
    M("tile-rows-flex-on-cuda", "engine", "horizon_cli.model.masks:attn_context",
      "elif fused and not rows:",
      "elif fused:",
      ["tests/test_attention.py::test_a_tiled_micro_batch_gets_the_masks_rule_where_flex_would_run"],
      "a tiled micro-batch on CUDA gets flex's block mask: its attention runs whole, its projections untiled"),
    M("kept-graph-untiled-under-tiles", "engine", "horizon_cli.planning.memory:kept_graph_bytes",
      "tiled = 0 < tile < tokens",
      "tiled = False",
      ["tests/test_keep.py::test_plan_covers_what_kept_graphs_save",
       "tests/test_seq_tile_plan.py::test_a_kept_layer_is_planned_as_the_tiled_layer_saves_it"],
      "a kept layer under tiles is planned with its untiled graph (auto keeps fewer layers than fit)"),
    # ---- vision: LoRA adapters on the projector ------------------------------------------------------
    M("projector-lora-no-grad", "engine", "horizon_cli.engine.headgrad:FrozenHead.embed_backward",
      "return self.embedding.stage_backward(dx)",
      "return 0.0",
      ["tests/test_vision_lora.py::test_lm_and_projector_adapters_equal_peft"],
      "a frozen base's head skips the stage's backward: the projector's adapters get no gradient"),
    M("projector-lora-unmerged", "checkpoint", "horizon_cli.export.export:export",
      "merge_carried(store, merge, carried, tmp)",
      "pass",
      ["tests/test_vision_lora.py::test_cli_adapter_loads_in_peft_and_merged_export_equals_merge_and_unload"],
      "the merged export copies the carried projector weights without their adapters"),
    M("projector-lora-generate-off", "run", "horizon_cli.generate.run:build",
      'mode = ("projector", lora) if lora is not None and lora.tower else ("frozen", None)',
      'mode = ("frozen", None)',
      ["tests/test_vision_lora.py::test_generate_from_the_run_applies_the_projector_adapters"],
      "generate on a LoRA run dir leaves the projector's adapters out"),
    # ---- vision under torchrun: the replicated tower's gradients -----------------------------------------
    M("tower-grads-unsummed", "engine", "horizon_cli.vision.embed:VisionEmbedding._sum_over_ranks",
      "sharded.sum_replicated(flat, lambda f: sumsq64(f[:n]))",
      "pass",
      ["tests/test_vision_dist.py::test_tower_gradients_summed_over_ranks_with_their_reach"],
      "a sharded run's trained projector steps on its own rank's gradient only (the ranks' towers drift apart)"),
    M("tower-reach-local", "engine", "horizon_cli.vision.embed:VisionEmbedding._sum_over_ranks",
      "tr.used = {name for name, f in zip(names, flat[n:].tolist(), strict=True) if f > 0}",
      "pass",
      ["tests/test_vision_dist.py::test_tower_gradients_summed_over_ranks_with_their_reach"],
      "a rank whose micro-batches hold no image skips the projector's update that the others make"),
]
# fmt: on


def run_one(m: Mutation, timeout: int, ext_dir: Path, py: str, root: Path = ROOT) -> dict:
    """Apply m, run its tests in `root`, restore the file: the row and its result."""
    why = problems(m, root)
    if why:
        return {**asdict(m), "result": "stale", "detail": "; ".join(why)}
    site = locate(m, root)
    path = root / site.file
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if site.file.endswith(NATIVE):
        env["TORCH_EXTENSIONS_DIR"] = str(ext_dir)  # a mutant kernel never lands in the user's cache
    cmd = [py, "-m", "pytest", "-x", "-p", "no:cacheprovider", *m.tests]  # pyproject's markers: fast tests
    t0 = time.time()
    path.write_text(site.mutant(m.mutated))
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        out = r.stdout + r.stderr
        if r.returncode == 0:
            result, detail = "survived", _summary(out)
        elif r.returncode == 1:
            failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
            result, detail = "caught", failed[0] if failed else _summary(out)
        else:
            result, detail = "error", f"pytest exit {r.returncode}: {_summary(out)}"
    except subprocess.TimeoutExpired:
        result, detail = "timeout", f"no verdict within {timeout} s"
    finally:
        path.write_text(site.text)
    return {
        **asdict(m),
        "file": site.file,
        "result": result,
        "detail": detail,
        "seconds": round(time.time() - t0, 1),
    }


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _summary(out: str) -> str:
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated mutation ids")
    ap.add_argument("--area", help="engine | optim | data | checkpoint | run")
    ap.add_argument("--list", action="store_true", help="list the mutations (stale ones marked) and exit")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutation")
    ap.add_argument(
        "--without",
        help="comma-separated test files left out of every selection (to see what the rest of the suite catches)",
    )
    args = ap.parse_args()
    todo = [m for m in MUTATIONS if (not args.area or m.area == args.area)]
    if args.without:
        drop = set(args.without.split(","))
        todo = [replace(m, tests=[t for t in m.tests if t.split("::")[0] not in drop]) for m in todo]
        todo = [m for m in todo if m.tests]
    if args.only:
        ids = set(args.only.split(","))
        unknown = ids - {m.id for m in MUTATIONS}
        if unknown:
            print(f"error: unknown mutation id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        todo = [m for m in todo if m.id in ids]
    bad = {m.id: p for m in todo if (p := malformed(m))}
    if bad:
        print(f"error: malformed rows: {bad}", file=sys.stderr)
        return 2
    stale = {m.id: p for m in todo if (p := problems(m))}
    if args.list:
        for m in todo:
            flag = f"STALE: {'; '.join(stale[m.id])}  " if m.id in stale else ""
            print(f"{m.id:26s} {m.area:10s} {flag}{m.where}: {m.what}")
        print(f"{len(todo) - len(stale)} applicable, {len(stale)} stale")
        return 0
    files = sorted({locate(m).file for m in todo if m.id not in stale})
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", *files], cwd=ROOT, capture_output=True, text=True
    ).stdout
    if dirty.strip():
        print(f"error: uncommitted changes in files to mutate:\n{dirty}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # restore the file being mutated, as on Ctrl-C
    results = []
    with tempfile.TemporaryDirectory(prefix="horizon-mutants-") as ext:
        for i, m in enumerate(todo, 1):
            res = run_one(m, args.timeout, Path(ext), sys.executable)
            results.append(res)
            unexpected = res["result"] != "stale" and (res["result"] == "caught") != (m.expect == "caught")
            print(
                f"[{i:3d}/{len(todo)}] {m.id:26s} {res['result']:8s} {res.get('seconds', 0):6.1f}s  {res['detail']}"
                + ("   <-- unexpected" if unexpected else ""),
                flush=True,
            )
            if args.json:  # written as it goes: a long audit keeps what it has
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1))
    counts = {
        k: sum(r["result"] == k for r in results) for k in ("caught", "survived", "timeout", "error", "stale")
    }
    print("; ".join(f"{v} {k}" for k, v in counts.items() if v))
    if counts["stale"]:
        print(
            f"stale (re-anchor when convenient): {', '.join(r['id'] for r in results if r['result'] == 'stale')}"
        )
    unexpected = [
        r["id"]
        for r in results
        if r["result"] != "stale" and (r["result"] == "caught") != (r["expect"] == "caught")
    ]
    if unexpected:
        print(f"unexpected: {', '.join(unexpected)}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
