"""Mutation audit: does the test suite catch realistic one-line bugs in the core paths?

    .venv/bin/python scripts/mutation_audit.py [--only ID,...] [--area AREA] [--list] [--json FILE]

Each mutation below is one line of production code replaced by a plausible bug (off-by-one,
wrong sign, dropped term, wrong buffer, swapped arguments, missing scale, wrong dtype), with the
tests that ought to catch it. For each in turn the script edits the file in place, runs those
tests (`pytest -x`, stopping at the first failure), restores the file (also on Ctrl-C), and
records `caught` (a test failed: the first one is named), `survived` (every selected test
passed) or `timeout`. Mutations of the native kernel rebuild it into a scratch
TORCH_EXTENSIONS_DIR, so the user's kernel cache is never touched.

`--without FILE,...` drops test files from every selection (a mutation left with none is skipped):
run with the files a change added, it shows what the suite caught before them.

An `expect` of "equivalent" marks a mutant that cannot change any result on this machine's code
paths (the reason is in its note); such mutants are run too and are expected to survive. The
results and their reading are recorded in docs/reliability.md ("Mutation audit").

tests/test_mutation_audit.py (fast, part of `make test`) checks that every `original` below still
occurs exactly once in its file and that every test named exists, so a change that moves mutated
code must update this list.

The working tree must be clean in the files mutated (the script refuses otherwise), and nothing
else should edit them while it runs.
"""

from __future__ import annotations

import argparse
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


@dataclass
class Mutation:
    id: str
    area: str  # engine | optim | data | checkpoint | run
    file: str
    original: str  # must occur exactly once in the file
    mutated: str
    tests: list[str]
    what: str  # the bug, in words
    expect: str = "caught"  # or "equivalent"
    note: str = ""


M = Mutation
# fmt: off
MUTATIONS: list[Mutation] = [
    # ---- engine: the functional layer -------------------------------------------------------------
    M("rope-llama3-factor", "engine", "horizon_cli/model/layer.py",
      "smoothed = (1 - smooth) * scaled / factor + smooth * scaled",
      "smoothed = (1 - smooth) * scaled + smooth * scaled",
      ["tests/test_rope_scaling.py", "tests/test_engine_parity.py"],
      "llama3 RoPE smoothing loses its division by factor"),
    M("rope-linear-factor", "engine", "horizon_cli/model/layer.py",
      'return inv / float(rp["factor"])',
      'return inv * float(rp["factor"])',
      ["tests/test_rope_scaling.py", "tests/test_engine_parity.py"],
      "linear RoPE scaling multiplies instead of dividing"),
    M("rmsnorm-eps", "engine", "horizon_cli/model/layer.py",
      "xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)",
      "xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True))",
      ["tests/test_engine_parity.py"],
      "RMSNorm drops its epsilon"),
    M("rope-rotate-sign", "engine", "horizon_cli/model/layer.py",
      "return torch.cat((-x[..., half:], x[..., :half]), dim=-1)",
      "return torch.cat((x[..., half:], -x[..., :half]), dim=-1)",
      ["tests/test_engine_parity.py"],
      "rotate_half with the sign on the wrong half"),
    M("attn-scale", "engine", "horizon_cli/model/layer.py",
      "out = attend(q, k, v, ctx.masks.get(window), hd**-0.5)",
      "out = attend(q, k, v, ctx.masks.get(window), 1.0)",
      ["tests/test_engine_parity.py"],
      "attention without the 1/sqrt(head_dim) scale"),
    M("qk-norm-weight", "engine", "horizon_cli/model/layer.py",
      'rms_norm(k, w["k_norm"], spec.rms_eps)',
      'rms_norm(k, w["q_norm"], spec.rms_eps)',
      ["tests/test_engine_parity.py"],
      "Qwen3 k norm applied with the q norm's weights"),
    M("swiglu-swapped", "engine", "horizon_cli/model/layer.py",
      "return _linear(F.silu(gate) * up, w, \"w_down\", \"b_down\", lora)",
      "return _linear(F.silu(up) * gate, w, \"w_down\", \"b_down\", lora)",
      ["tests/test_engine_parity.py"],
      "SwiGLU with gate and up swapped"),
    M("residual", "engine", "horizon_cli/model/layer.py",
      'return h + mlp(w, rms_norm(h, w["mlp_norm"], spec.rms_eps), lora)',
      'return x + mlp(w, rms_norm(h, w["mlp_norm"], spec.rms_eps), lora)',
      ["tests/test_engine_parity.py"],
      "second residual adds the layer input instead of h"),
    # ---- engine: the loss head ---------------------------------------------------------------------
    M("labels-shift", "engine", "horizon_cli/model/head.py",
      "tgt = labels[:, 1:].reshape(-1)",
      "tgt = labels[:, :-1].reshape(-1)",
      ["tests/test_engine_parity.py"],
      "targets not shifted by one (off-by-one)"),
    M("head-positions", "engine", "horizon_cli/model/head.py",
      "sel = hn[:, :-1].reshape(-1, hn.shape[-1]).index_select(0, idx)  # (n, H) rows that carry a label",
      "sel = hn[:, 1:].reshape(-1, hn.shape[-1]).index_select(0, idx)  # (n, H) rows that carry a label",
      ["tests/test_engine_parity.py"],
      "hidden states of the wrong positions feed the head"),
    M("head-inv-n", "engine", "horizon_cli/model/head.py",
      "return loss * inv_n, loss",
      "return loss, loss",
      ["tests/test_engine_parity.py"],
      "head gradient misses the 1/N token scale"),
    M("head-chunk-accumulate", "engine", "horizon_cli/model/head.py",
      "g_t.add_(gw)",
      "g_t.copy_(gw)",
      ["tests/test_engine_parity.py"],
      "LM-head gradient overwritten by each chunk instead of summed"),
    M("head-logits-fp32", "engine", "horizon_cli/model/head.py",
      "diff, value = chunk_loss(logits.float(), a, a + x.shape[0])",
      "diff, value = chunk_loss(logits, a, a + x.shape[0])",
      ["tests/test_engine_parity.py", "tests/test_bf16_training.py"],
      "cross-entropy on bf16 logits (no fp32 upcast)"),
    # ---- engine: the schedule ----------------------------------------------------------------------
    M("clip-min", "engine", "horizon_cli/engine/step.py",
      "scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0",
      "scale = clip / (norm + 1e-6) if clip > 0 else 1.0",
      ["tests/test_engine_training.py::test_twenty_steps_match_resident_adamw", "tests/test_grad_clip.py"],
      "clipping also scales small gradients up"),
    M("adam-step", "engine", "horizon_cli/engine/step.py",
      "p.adam_step += 1",
      "p.adam_step = 1",
      ["tests/test_engine_training.py::test_twenty_steps_match_resident_adamw"],
      "AdamW bias correction always at step 1"),
    M("loss-mean", "engine", "horizon_cli/engine/engine.py",
      'loss = loss_sum / tokens if tokens else float("nan")',
      'loss = loss_sum / len(mbs) if tokens else float("nan")',
      ["tests/test_engine_training.py::test_twenty_steps_match_resident_adamw"],
      "reported loss divided by micro-batches, not tokens"),
    M("norm-host-part", "engine", "horizon_cli/engine/reduce.py",
      "return float(loss_sum.item()), dev_sq + host_sq",
      "return float(loss_sum.item()), dev_sq",
      ["tests/test_engine_parity.py"],
      "global grad norm misses the embedding's part"),
    M("embed-grad-zero", "engine", "horizon_cli/engine/embed.py",
      "            st.grad.zero_()\n",
      "            pass\n",
      ["tests/test_engine_training.py::test_twenty_steps_match_resident_adamw"],
      "embedding gradient not cleared between steps"),
    M("padding-row-grad", "engine", "horizon_cli/engine/embed.py",
      "rows[ids == padding_idx] = 0.0",
      "rows[ids == padding_idx] *= 1.0",
      ["tests/test_generic_training.py"],
      "the padding row of the embedding gets a gradient (nn.Embedding(padding_idx) gives none)"),
    M("microbatch-accumulate", "engine", "horizon_cli/engine/step.py",
      "gv[name].add_(gw)  # fp32 accumulation across micro-batches",
      "gv[name].copy_(gw)  # fp32 accumulation across micro-batches",
      ["tests/test_engine_parity.py"],
      "layer gradients overwritten by each micro-batch"),
    M("saved-input-layer", "engine", "horizon_cli/engine/step.py",
      "[(self.ckpt[i][:total], saved[i]) for i in range(self.recomputed)]",
      "[(self.ckpt[i - 1][:total], saved[i]) for i in range(self.recomputed)]",
      ["tests/test_engine_parity.py"],
      "backward recomputes a layer from the wrong saved input"),
    M("saved-input-offset", "engine", "horizon_cli/engine/sweep.py",
      "                    off += xm.numel()",
      "                    off = xm.numel()",
      ["tests/test_engine_parity.py", "tests/test_engine_training.py::test_micro_batch_size_does_not_change_the_update"],
      "saved inputs of the third and later micro-batches overwrite the second's (offset not accumulated)"),
    M("gacc-one-buffer", "engine", "horizon_cli/engine/step.py",
      "            k = j % 2\n",
      "            k = 0\n",
      ["tests/test_engine_training.py", "tests/test_cuda_transport.py"],
      "one gradient accumulator instead of two ping-pong buffers", "equivalent",
      "each reuse waits for the buffer's previous D2H, so it only serialises (slower, same numbers)"),
    M("gacc-no-wait", "engine", "horizon_cli/engine/grads.py",
      "self.t.wait(self.free[k])  # its previous contents have reached the host",
      "pass  # its previous contents have reached the host",
      ["tests/test_cuda_transport.py", "tests/test_engine_training.py"],
      "a gradient accumulator zeroed while its previous D2H may still read it"),
    M("embed-scale", "engine", "horizon_cli/engine/embed.py",
      "return x if s is None else [xm * s for xm in x]",
      "return x",
      ["tests/test_generic_parity.py"],
      "Gemma's embedding scale dropped"),
    M("weight-loads-count", "engine", "horizon_cli/runtime/loader.py",
      'self.layer_loads += load.unit.startswith("layer.")',
      "self.layer_loads += 1",
      ["tests/test_engine_training.py::test_micro_batch_size_does_not_change_the_update"],
      "weight_loads counts the head too"),
    M("update-order", "engine", "horizon_cli/engine/params.py",
      'return [self.layers[0], "embed", *self.layers[1:], "head"]',
      'return [*self.layers, "embed", "head"]',
      ["tests/test_engine_robust.py::test_layer_0_does_not_wait_for_the_update_of_layer_1"],
      "the embedding updated after every layer: the next step's start waits for all of them"),
    M("device-activations-kept", "engine", "horizon_cli/engine/sweep.py",
      '            p.loader.release(f"f{j}")\n',
      '            p.loader.release(f"f{j}"); self.__dict__.setdefault("kept", []).append(x)\n',
      ["tests/test_device_memory.py"],
      "every layer's activations stay alive (device memory grows with depth)"),
    # ---- engine: the loader ------------------------------------------------------------------------
    M("prefetch-one-buffer", "engine", "horizon_cli/runtime/loader.py",
      "for i in range(prefetch)]",
      "for i in range(1)]",
      ["tests/test_pipeline.py::test_loads_are_issued_ahead_and_overlap_compute"],
      "the ring has one buffer whatever engine.prefetch says (no prefetching)"),
    M("prefetch-synchronous", "engine", "horizon_cli/runtime/loader.py",
      'slot.loaded = self.t.h2d(pairs, deps, label=f"{load.key}@{slot.name}")',
      'slot.loaded = self.t.h2d(pairs, deps, label=f"{load.key}@{slot.name}"); self.t.wait(slot.loaded)',
      ["tests/test_pipeline.py::test_loads_are_issued_ahead_and_overlap_compute"],
      "each load waited for as soon as it is issued (transfers serialised with compute)"),
    M("load-before-update", "engine", "horizon_cli/runtime/loader.py",
      "deps = [slot.free, self.ready.get(load.unit, READY), *load.deps]",
      "deps = [slot.free, *load.deps]",
      ["tests/test_pipeline.py::test_schedule_ordering", "tests/test_cuda_transport.py", "tests/test_update_order.py"],
      "a unit streamed without waiting for its AdamW update"),
    M("slot-free-event", "engine", "horizon_cli/runtime/loader.py",
      "slot.key, slot.free = None, self.t.record()",
      "slot.key = None",
      ["tests/test_cuda_transport.py", "tests/test_pipeline.py::test_schedule_ordering"],
      "a buffer refilled without waiting for the compute that read it", "equivalent",
      "every copy already waits for all compute issued before it is requested (the transport's contract), and a buffer is refilled only by a load requested after its release"),
    # ---- engine: LoRA adapters and NF4 bases --------------------------------------------------------
    M("lora-dropout-rescale", "engine", "horizon_cli/model/lora.py",
      "return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))",
      "return x * keep.to(x.dtype)",
      ["tests/test_lora_engine.py::test_dropout_masks_are_the_same_in_the_recompute",
       "tests/test_lora_engine.py::test_dropout_scales_what_it_keeps_as_torch_dropout_does"],
      "LoRA dropout drops inputs without rescaling the kept ones by 1 / (1 - p) (PEFT's nn.Dropout does)"),
    M("lora-norm-every-rank", "engine", "horizon_cli/engine/sharded.py",
      "self.sq.append(sumsq64(mine) if self.d.is_main else 0.0)",
      "self.sq.append(sumsq64(mine))",
      ["tests/test_dist.py::test_bf16_exact_lean_lora_and_moe_on_two_ranks_match_one"],
      "a sharded LoRA run counts the replicated adapters' squared norm on every rank: the grad norm is sqrt(world) too large and clips wrongly"),
    M("nf4-dequant-mean", "engine", "horizon_cli/quant/nf4_bnb.py",
      'return q["dynamic"][q["absmax"].to(torch.int32)] * group + q["offset"]',
      'return q["dynamic"][q["absmax"].to(torch.int32)] * group',
      ["tests/test_nf4.py"],
      "NF4 block scales dequantized without adding back the double quantization's offset"),
    M("nf4-absmax-bins", "engine", "horizon_cli/quant/nf4_bnb.py",
      "bins = ((v + 1.0) * 0.5 * (BINS - 1) + 0.5).to(torch.int32)",
      "bins = ((v + 1.0) * 0.5 * (BINS - 1)).to(torch.int32)",
      ["tests/test_nf4.py"],
      "the 8-bit absmax index takes the bin below instead of the nearest bin (bitsandbytes rounds)"),
    M("nf4-dequant-in-dtype", "engine", "horizon_cli/quant/nf4_bnb.py",
      "torch.mul(vals, scale[a : a + CHUNK], out=dst[a : a + CHUNK])",
      "torch.mul(vals.to(dst.dtype), scale[a : a + CHUNK].to(dst.dtype), out=dst[a : a + CHUNK])",
      ["tests/test_nf4.py"],
      "NF4 dequantized in the store dtype (bf16 products) instead of fp32 products rounded once"),
    M("nf4-legacy-scheme", "engine", "horizon_cli/store/packed.py",
      'return "bnb" if version >= 5 else "torchao"',
      'return "bnb"',
      ["tests/test_nf4_legacy.py"],
      "stores of versions 3 and 4 read as bitsandbytes' NF4 layout"),
    # ---- engine: kept layers (engine.keep_activations) ---------------------------------------------
    M("kept-shared-dequant", "engine", "horizon_cli/state/frozen.py",
      "out = self.kept.get(unit, self.scratch)",
      "out = self.scratch",
      ["tests/test_keep.py::test_moe_and_qlora_kept_equal_recomputed"],
      "a kept NF4 layer dequantized into the shared scratch buffer, which the next layer overwrites"),
    M("kept-ring-slot", "engine", "horizon_cli/runtime/loader.py",
      "for s in self.kept if load.kept else self.ring:",
      "for s in self.ring:",
      ["tests/test_keep.py::test_kept_slots_are_ordered_on_cuda_streams", "tests/test_keep.py::test_kept_equals_recomputed_bitwise"],
      "a kept layer held in a ring slot (the ring runs dry: the backward's loads find no buffer)"),
    M("kept-aux-dropped", "engine", "horizon_cli/model/generic.py",
      "aux = None if self.moe is None or logits is None else self.moe.objective(logits, ctx.tokens)",
      "aux = None",
      ["tests/test_keep.py::test_moe_and_qlora_kept_equal_recomputed"],
      "a kept MoE layer's backward misses its share of the load-balancing loss"),
    M("kept-loaded-twice", "engine", "horizon_cli/engine/sweep.py",
      "for j in reversed(range(first)):",
      "for j in reversed(range(len(calls))):",
      ["tests/test_keep.py::test_kept_equals_recomputed_bitwise"],
      "kept layers loaded again for the backward"),
    M("kept-auto-all", "engine", "horizon_cli/planning/keep.py",
      "return min(plan.layers, room(plan, where) // per_layer)",
      "return plan.layers",
      ["tests/test_keep.py::test_auto_keeps_what_the_budget_holds"],
      "auto keeps every layer whatever the room"),
    M("kept-graph-no-mlp", "engine", "horizon_cli/planning/memory.py",
      "(5 * q + 4 * kv + 4 * spec.intermediate) * item",
      "(5 * q + 4 * kv) * item",
      ["tests/test_keep.py::test_plan_covers_what_kept_graphs_save"],
      "the plan's kept graph leaves out the MLP's saved tensors"),
    M("kept-forward-only", "engine", "horizon_cli/engine/engine.py",
      "        if forward_only:\n            keep = 0\n        elif keep is None:",
      "        if keep is None:",
      ["tests/test_keep.py::test_forward_only_engines_keep_nothing_and_generation_beside_kept_layers"],
      "a forward-only engine (generation, evaluation) keeps layers as a training run's config says"),
    # ---- optimizer ---------------------------------------------------------------------------------
    M("optim-grad-slice", "optim", "horizon_cli/state/optimizer.py",
      "g, s = st.grad[a:b], st.state",
      "g, s = st.grad[: b - a], st.state",
      ["tests/test_optimizer_slices.py", "tests/test_engine_training.py"],
      "AdamW reads the first slice's gradient for every slice of a large unit"),
    M("optim-lo-slice", "optim", "horizon_cli/state/optimizer.py",
      'self.impl.adamw_split_(st.stream[a:b], s["lo"][q], g, s["m"][q], s["v"][q], h)',
      'self.impl.adamw_split_(st.stream[a:b], s["lo"][: b - a], g, s["m"][q], s["v"][q], h)',
      ["tests/test_optimizer_slices.py", "tests/test_bf16_training.py"],
      "bf16 master's remainder taken from the wrong slice"),
    M("optim-bf16-copy", "optim", "horizon_cli/state/optimizer.py",
      'self.impl.adamw_split_(st.stream[a:b], s["lo"][q], g, s["m"][q], s["v"][q], h)',
      'self.impl.adamw_split_(st.stream[a:b].clone(), s["lo"][q], g, s["m"][q], s["v"][q], h)',
      ["tests/test_bf16_training.py", "tests/test_engine_training.py"],
      "bf16 weight updates written into a copy"),
    M("optim-frozen", "optim", "horizon_cli/state/host.py",
      "n = layout.trainable_numel",
      "n = layout.numel",
      ["tests/test_generic_training.py"],
      "AdamW also updates frozen buffers (a routing bias): the unit's state segments cover all its elements"),
    M("adamw-bias-correction", "optim", "horizon_cli/optim/adamw.py",
      "bc1 = 1.0 - h.beta1**h.step",
      "bc1 = 1.0 - h.beta1",
      ["tests/test_kernel_adamw.py", "tests/test_engine_training.py"],
      "first-moment bias correction without the step"),
    M("adamw-decay", "optim", "horizon_cli/optim/adamw.py",
      "p.mul_(1.0 - h.lr * h.weight_decay)",
      "p.mul_(1.0 - h.weight_decay)",
      ["tests/test_kernel_adamw.py", "tests/test_engine_training.py"],
      "weight decay not scaled by lr"),
    M("adamw-eps", "optim", "horizon_cli/optim/adamw.py",
      "denom = (v.sqrt() / bc2_sqrt).add_(h.eps)",
      "denom = v.sqrt().add_(h.eps) / bc2_sqrt",
      ["tests/test_kernel_adamw.py", "tests/test_engine_training.py"],
      "eps added before the bias correction"),
    M("adamw-clip-scale", "optim", "horizon_cli/optim/adamw.py",
      "g = g * h.grad_scale",
      "g = g / h.grad_scale",
      ["tests/test_kernel_adamw.py", "tests/test_engine_training.py"],
      "clip coefficient divides"),
    M("split-round", "optim", "horizon_cli/optim/split.py",
      "h = (u + 0x8000) >> 16",
      "h = u >> 16",
      ["tests/test_kernel_adamw.py", "tests/test_bf16_training.py"],
      "bf16 streaming copy truncated instead of rounded (the master stays exact)"),
    M("split-join-sign", "optim", "horizon_cli/optim/split.py",
      "u = (hi.view(torch.int16).to(torch.int32) << 16) + lo.to(torch.int32)",
      "u = (hi.view(torch.int16).to(torch.int32) << 16) - lo.to(torch.int32)",
      ["tests/test_kernel_adamw.py", "tests/test_bf16_training.py"],
      "master rebuilt with the remainder's sign flipped"),
    M("split-into-copy", "optim", "horizon_cli/optim/split.py",
      "hi.view(torch.int16).copy_(h.to(torch.int16))",
      "hi.clone().view(torch.int16).copy_(h.to(torch.int16))",
      ["tests/test_bf16_training.py", "tests/test_kernel_adamw.py"],
      "the refreshed bf16 copy written into a temporary (torch path)"),
    M("native-scalars", "optim", "horizon_cli/optim/native.py",
      "return (h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, int(h.step), h.grad_scale)",
      "return (h.lr, h.beta2, h.beta1, h.eps, h.weight_decay, int(h.step), h.grad_scale)",
      ["tests/test_kernel_adamw.py"],
      "betas swapped on the way into the native kernel"),
    M("native-tail", "optim", "kernels/adamw_impl.h",
      "  for (; i < n; ++i) adamw_math<Scalar>(p[i]",
      "  for (; i <= n; ++i) adamw_math<Scalar>(p[i]",
      ["tests/test_kernel_adamw.py::test_a_call_touches_exactly_its_elements"],
      "the kernel's scalar tail writes one element past its buffer"),
    M("native-decay", "optim", "kernels/adamw.cpp",
      "c.decay = static_cast<float>(1.0 - lr * weight_decay);",
      "c.decay = static_cast<float>(1.0 - weight_decay);",
      ["tests/test_kernel_adamw.py"],
      "kernel's weight decay not scaled by lr"),
    M("native-split-lo", "optim", "kernels/adamw.cpp",
      "*lo = static_cast<int16_t>(static_cast<uint16_t>(u));",
      "*lo = static_cast<int16_t>(static_cast<uint16_t>(u >> 1));",
      ["tests/test_kernel_adamw.py"],
      "kernel's scalar split writes a wrong remainder"),
    M("lean-1d-exact", "optim", "horizon_cli/state/host.py",
      "return len(shape) <= 1",
      "return len(shape) < 1",
      ["tests/test_lean.py"],
      "optim.memory lean keeps no tensor exact: norm scales and biases get the 16-bit master, which rounds away updates of about lr"),
    M("lean-segment-at", "optim", "horizon_cli/state/optimizer.py",
      "k = seg.at + (a - seg.start)",
      "k = a - seg.start",
      ["tests/test_lean.py"],
      "a lean unit's segments all read their kind's packed state from its start (segments after the first share the first one's moments and master remainder)"),
    M("lean-w-nonzero", "optim", "horizon_cli/optim/lean.py",
      "qw.copy_(encode(x, W_MANT, keep_nonzero=True)",
      "qw.copy_(encode(x, W_MANT, keep_nonzero=False)",
      ["tests/test_lean.py"],
      "lean's reference quantizer lets a small nonzero sqrt(v) round to code 0 (the next update divides by eps)"),
    M("lr-warmup", "optim", "horizon_cli/optim/schedules.py",
      "return lr * (step + 1) / (warmup + 1)",
      "return lr * step / warmup",
      ["tests/test_schedules.py"],
      "warmup starts at lr 0 (off by one)"),
    M("lr-cosine-sign", "optim", "horizon_cli/optim/schedules.py",
      "scale = 0.5 * (1.0 + math.cos(math.pi * frac))",
      "scale = 0.5 * (1.0 - math.cos(math.pi * frac))",
      ["tests/test_schedules.py"],
      "cosine schedule rises instead of decaying"),
    M("plan-moments", "optim", "horizon_cli/planning/memory.py",
      'host["AdamW moments (fp32)"] = numel * 8',
      'host["AdamW moments (fp32)"] = numel * 4',
      ["tests/test_inspect_store.py"],
      "memory plan counts one moment instead of two (inspect's B/param)"),
    M("plan-embed-grad", "optim", "horizon_cli/planning/memory.py",
      "grads = (numel - embed) * gitem + embed * 4",
      "grads = (numel - embed) * gitem + embed * gitem",
      ["tests/test_inspect_store.py"], "memory plan counts the embedding's gradient in bf16 (it is fp32 on the host)"),
    # ---- data ------------------------------------------------------------------------------------------
    M("pack-boundary-label", "data", "horizon_cli/data/pack.py",
      "labels[0] = IGNORE  # the previous document's last token must not predict this one",
      "labels[0] = labels[0]  # the previous document's last token must not predict this one",
      ["tests/test_data_pipeline.py"],
      "a packed document's first token is predicted from the previous one"),
    M("pack-fit", "data", "horizon_cli/data/pack.py",
      "if self._used + len(ids) > self.max_len:",
      "if self._used + len(ids) >= self.max_len:",
      ["tests/test_data_pipeline.py", "tests/test_data_boundaries.py"],
      "a row that would be exactly full is closed early (off-by-one)"),
    M("sampler-offset", "data", "horizon_cli/data/sampler.py",
      "k = step * batch_size + np.arange(batch_size, dtype=np.int64)",
      "k = (step + 1) * batch_size + np.arange(batch_size, dtype=np.int64)",
      ["tests/test_data_batching.py"],
      "step s takes the rows of step s + 1"),
    M("sampler-epoch-seed", "data", "horizon_cli/data/sampler.py",
      "perm = np.random.default_rng([seed, epoch]).permutation(n)",
      "perm = np.random.default_rng(seed).permutation(n)",
      ["tests/test_data_batching.py"],
      "the same permutation every epoch"),
    M("collate-label-pad", "data", "horizon_cli/data/collate.py",
      "labels = np.full((b, T), IGNORE, dtype=np.int64)  # (b, T)",
      "labels = np.full((b, T), pad_id, dtype=np.int64)  # (b, T)",
      ["tests/test_data_batching.py"],
      "padding positions carry loss"),
    M("collate-pad-doc", "data", "horizon_cli/data/collate.py",
      "n_docs = int(real[-1]) + 1 if L else 0",
      "n_docs = int(real[-1]) if L else 0",
      ["tests/test_data_batching.py"],
      "a packed row's padding joins its last document"),
    M("positions-restart", "data", "horizon_cli/data/tokset.py",
      "return pos - np.repeat(starts, run)",
      "return pos",
      ["tests/test_data_batching.py", "tests/test_data_pipeline.py"],
      "positions do not restart per packed document"),
    M("label-tokens-shift", "data", "horizon_cli/data/tokset.py",
      "return csum[end] - csum[start] - has[start]",
      "return csum[end] - csum[start]",
      ["tests/test_data_batching.py", "tests/test_data_pipeline.py"],
      "a row's first label counted as a loss token"),
    M("span-overlap", "data", "horizon_cli/data/encode.py",
      "hit |= (off[:, 0] < b) & (off[:, 1] > a)",
      "hit |= (off[:, 0] <= b) & (off[:, 1] > a)",
      ["tests/test_data_formats.py"],
      "the token right after an assistant span also gets loss"),
    M("eos-double", "data", "horizon_cli/data/encode.py",
      "if eos is not None and (len(ids) == 0 or ids[-1] != eos):",
      "if eos is not None:",
      ["tests/test_data_formats.py"],
      "EOS appended even when the text already ends with it"),
    M("truncate-boundary", "data", "horizon_cli/data/encode.py",
      "if len(ids) <= max_len:",
      "if len(ids) < max_len:",
      ["tests/test_data_formats.py", "tests/test_data_pipeline.py", "tests/test_data_boundaries.py"],
      "an example of exactly max_seq_len counted as truncated"),
    M("no-label-shift", "data", "horizon_cli/data/build.py",
      "if not (ex[1][1:] != IGNORE).any():  # after the shift, nothing to predict",
      "if not (ex[1] != IGNORE).any():  # after the shift, nothing to predict",
      ["tests/test_data_formats.py", "tests/test_data_pipeline.py", "tests/test_data_boundaries.py"],
      "an example whose only label is its first token is kept (it has nothing to predict)"),
    M("alpaca-span", "data", "horizon_cli/data/templates.py",
      "spans.append((len(text), len(text) + len(ins.output)))",
      "spans.append((len(text) - 1, len(text) + len(ins.output)))",
      ["tests/test_data_formats.py", "tests/test_data_fidelity.py"],
      "Alpaca output span starts one character early"),
    M("chat-span-end", "data", "horizon_cli/data/templates.py",
      "return start, max(start, len(q.rstrip()))",
      "return start, len(q)",
      ["tests/test_data_formats.py"],
      "an assistant span includes the template's trailing whitespace"),
    M("auto-order", "data", "horizon_cli/data/formats.py",
      'DETECT = ("tokens", "preference", "chat", "prompt_completion", "instruction", "text")',
      'DETECT = ("text", "tokens", "preference", "chat", "prompt_completion", "instruction")',
      ["tests/test_data_formats.py"],
      "auto detection tries text first"),
    M("eval-split-swapped", "data", "horizon_cli/data/prepare.py",
      "return ts.select(np.flatnonzero(~is_eval)), ts.select(np.flatnonzero(is_eval))",
      "return ts.select(np.flatnonzero(is_eval)), ts.select(np.flatnonzero(~is_eval))",
      ["tests/test_data_pipeline.py"],
      "train and eval rows swapped"),
    M("meaning-numbers-silent", "data", "horizon_cli/data/fields.py",
      "    return isinstance(value, bool | numbers.Number)",
      "    return False",
      ["tests/test_data_meaning.py"],
      "a number or boolean no format reads (a weight, a score) ignored silently"),
    M("ignore-fields-not-keyed", "data", "horizon_cli/data/prepare.py",
      'reading={**spec.mapping, "ignore_fields": sorted(data_cfg.ignore_fields)},',
      "reading=spec.mapping,",
      ["tests/test_data_meaning.py"],
      "a cache entry built with data.ignore_fields reused without them (the meaning check skipped)"),
    M("long-text-no-overlap", "data", "horizon_cli/data/pack.py",
      "start += room - 1  # the overlap: this piece's last token opens the next",
      "start += room  # the overlap: this piece's last token opens the next",
      ["tests/test_data_long_text.py"],
      "a long document's pieces do not overlap: the token at each boundary is never predicted"),
    M("completion-prefix", "data", "horizon_cli/data/completion.py",
      "labels[: 0 if train_on_prompt else _common_prefix(prompt_ids, ids)] = IGNORE",
      "labels[: 0 if train_on_prompt else _common_prefix(prompt_ids, ids) - 1] = IGNORE",
      ["tests/test_data_prompt_completion.py"],
      "the prompt's last token carries loss in prompt/completion data"),
    M("mixture-weight", "data", "horizon_cli/data/mixture.py",
      "np.tile(np.arange(n, dtype=np.int64), whole)",
      "np.tile(np.arange(n, dtype=np.int64), 1)",
      ["tests/test_data_mixture.py"],
      "a source's whole weight ignored (each row once)"),
    # ---- checkpoints and the run dir -------------------------------------------------------------------
    M("ckpt-no-lo", "checkpoint", "horizon_cli/train/checkpoint.py",
      'STATE_BUFFERS = ("lo", "m", "v", "lo8",',
      'STATE_BUFFERS = ("m", "v", "lo8",',
      ["tests/test_bf16_training.py", "tests/test_train_resume.py::test_killed_run_resumes_bitwise_identical"],
      "the bf16 master's 16-bit remainder not saved in checkpoints"),
    M("ckpt-adam-step", "checkpoint", "horizon_cli/train/checkpoint.py",
      'engine.adam_step = trainer["adam_step"]',
      "engine.adam_step = 0",
      ["tests/test_bf16_training.py"],
      "a resumed run restarts AdamW's bias correction"),
    M("ckpt-load-buffer", "checkpoint", "horizon_cli/train/checkpoint.py",
      "_read_raw(ck / rel, bufs[key], sums[rel][1])",
      '_read_raw(ck / rel, bufs["m"], sums[rel][1])',
      ["tests/test_bf16_training.py"],
      "every state file read into the first moment's buffer"),
    M("ckpt-rng", "checkpoint", "horizon_cli/train/checkpoint.py",
      '_set_rng_state(trainer["rng"])',
      "pass",
      ["tests/test_train_resume.py::test_killed_run_resumes_bitwise_identical"],
      "a resumed run does not restore the RNG state", "equivalent",
      "training draws no random numbers (data order is a function of (seed, step), dropout is off), so nothing depends on the RNG; the soak compares outcomes without it"),
    M("ckpt-load-crc", "checkpoint", "horizon_cli/train/checkpoint.py",
      "if zlib.crc32(buf) != crc:",
      "if False:",
      ["tests/test_run_dir.py", "tests/test_checkpoint_integrity.py"],
      "large state files are not checked against their CRC when loaded"),
    M("ckpt-sums-small", "checkpoint", "horizon_cli/store/checkpoint.py",
      'crc = known.get(rel, None if rel.startswith("units/") else crc_file(p))',
      'crc = known.get(rel, None if rel.startswith(("units/", "state/")) else crc_file(p))',
      ["tests/test_run_dir.py"],
      "trainer.json and config.yaml are not checksummed"),
    M("ckpt-newest-first", "checkpoint", "horizon_cli/store/checkpoint.py",
      "for ck in reversed(listed(run_dir)):",
      "for ck in listed(run_dir):",
      ["tests/test_export_store.py", "tests/test_run_dir.py"],
      "the oldest checkpoint is resumed and exported"),
    M("prune-keep", "checkpoint", "horizon_cli/store/checkpoint.py",
      "for old in listed(run_dir)[:-keep_last]:",
      "for old in listed(run_dir)[: -keep_last - 1]:",
      ["tests/test_run_dir.py", "tests/test_train_cli.py::test_train_writes_the_run_dir"],
      "pruning keeps one checkpoint too many"),
    M("resume-complete", "checkpoint", "horizon_cli/train/rundir.py",
      "return bool(self.candidates) and self.resume_step >= self.cfg.train.steps",
      "return bool(self.candidates) and self.resume_step > self.cfg.train.steps",
      ["tests/test_run_dir.py"],
      "a run whose last checkpoint is at train.steps is not seen as trained"),
    M("compat-free-inverted", "checkpoint", "horizon_cli/train/compat.py",
      "a[k] != b[k] and not _under(k, FREE)]",
      "a[k] != b[k] and _under(k, FREE)]",
      ["tests/test_run_dir.py"],
      "only free settings count as changes to the run"),
    M("compat-steps-free", "checkpoint", "horizon_cli/train/compat.py",
      'if schedule["kind"] == "constant":  # warmup and constant: the total is never read',
      'if schedule["kind"] != "":  # warmup and constant: the total is never read',
      ["tests/test_resume_steps.py"],
      "train.steps may change on resume under any schedule, moving a decaying lr silently"),
    M("compat-steps-below", "checkpoint", "horizon_cli/train/compat.py",
      "    if new < step:\n",
      "    if new < 0:\n",
      ["tests/test_resume_steps.py"],
      "train.steps below the step a checkpoint reached is taken as a finished run"),
    M("export-given-unchecked", "checkpoint", "horizon_cli/export/export.py",
      "            check_given(src)\n",
      "            pass\n",
      ["tests/test_checkpoint_edits.py"],
      "a checkpoint named to `horizon export` is exported without its checksums"),
    M("metrics-resume-cut", "checkpoint", "horizon_cli/train/metrics.py",
      'kept = [r for r in rows if r.get("step", 0) <= resume_step] if resume_step else []',
      'kept = [r for r in rows if r.get("step", 0) < resume_step] if resume_step else []',
      ["tests/test_run_dir.py"],
      "a resumed run drops the metrics line of its checkpoint's step"),
    M("dpo-ref-sign", "engine", "horizon_cli/engine/pairs.py",
      'lc, lr = pc - c["rc"], pr - c["rr"]  # log-ratios against the reference',
      'lc, lr = pc + c["rc"], pr + c["rr"]  # log-ratios against the reference',
      ["tests/test_pref_losses.py"],
      "DPO adds the reference log-prob instead of subtracting it"),
    M("pair-truncate-end", "data", "horizon_cli/data/pairs.py",
      "seqs.append((ids[:max_len], labels[:max_len]))",
      "seqs.append((ids[-max_len:], labels[-max_len:]))",
      ["tests/test_pref_data.py"],
      "over-long pairs keep their end instead of their start (TRL's keep_start)"),
    M("pairs-split-micro", "data", "horizon_cli/data/pairs.py",
      "mbs = collate(rows, 2 * micro_pairs, pad_id)",
      "mbs = collate(rows, micro_pairs + 1, pad_id)",
      ["tests/test_pref_engine.py"],
      "a micro-batch of pairs cut across a pair"),
    M("pairs-mixed-by-rows", "data", "horizon_cli/data/mixture.py",
      "rows = ts.row_ids(items) if pairs else items  # a pair: its chosen and rejected rows",
      "rows = items  # a pair: its chosen and rejected rows",
      ["tests/test_pref_sources.py"],
      "a mixture of preference sources picks rows, not whole pairs"),
    M("pair-fields-unjudged", "data", "horizon_cli/data/pairs.py",
      "ignored = unread_columns(ds, read, judge)  # refuses meaning (kto_tag, score, ...) before any work",
      "ignored = unread_columns(ds, list(ds.column_names), judge)  # refuses meaning (kto_tag, score, ...) before any work",
      ["tests/test_data_meaning.py"],
      "a preference record's kto_tag or score is not judged (trained as a plain pair)"),
    M("soak-phases-unwritten", "run", "horizon_cli/faults.py",
      "    if _PHASES:\n",
      "    if False:\n",
      ["tests/test_train_resume.py::test_crash_soak_short"],
      "the phase log is never written: the soak cannot tell where its kills landed"),
]
# fmt: on


def run_one(m: Mutation, timeout: int, ext_dir: Path, py: str) -> dict:
    path = ROOT / m.file
    text = path.read_text()
    if text.count(m.original) != 1:
        return {**asdict(m), "result": "stale", "detail": f"original found {text.count(m.original)} times"}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if m.file.startswith("kernels/"):
        env["TORCH_EXTENSIONS_DIR"] = str(ext_dir)  # a mutant kernel never lands in the user's cache
    cmd = [py, "-m", "pytest", "-x", "-p", "no:cacheprovider", *m.tests]  # pyproject's markers: fast tests
    t0 = time.time()
    path.write_text(text.replace(m.original, m.mutated))
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
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
        path.write_text(text)
    return {**asdict(m), "result": result, "detail": detail, "seconds": round(time.time() - t0, 1)}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _summary(out: str) -> str:
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated mutation ids")
    ap.add_argument("--area", help="engine | optim | data | checkpoint | run")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
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
    if args.list:
        for m in todo:
            n = (ROOT / m.file).read_text().count(m.original)
            print(f"{m.id:26s} {m.area:10s} {'' if n == 1 else f'STALE ({n}x) '}{m.file}: {m.what}")
        return 0
    files = sorted({m.file for m in todo})
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
            flag = "" if (res["result"] == "caught") == (m.expect == "caught") else "   <-- unexpected"
            print(
                f"[{i:2d}/{len(todo)}] {m.id:26s} {res['result']:8s} {res.get('seconds', 0):6.1f}s  {res['detail']}{flag}",
                flush=True,
            )
            if args.json:  # written as it goes: a long audit keeps what it has
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1))
    counts = {
        k: sum(r["result"] == k for r in results) for k in ("caught", "survived", "timeout", "error", "stale")
    }
    print("; ".join(f"{v} {k}" for k, v in counts.items() if v))
    unexpected = [r["id"] for r in results if (r["result"] == "caught") != (r["expect"] == "caught")]
    if unexpected:
        print(f"unexpected: {', '.join(unexpected)}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
