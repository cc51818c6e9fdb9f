"""Census child: one model type, every stage, its row rewritten after each stage (so a crash or a
timeout still says how far it got)."""

from __future__ import annotations

import copy
import json
import math
import tempfile
from pathlib import Path

import torch

from scripts.census_calls import call_order
from scripts.census_structure import structure
from tests.support.census_config import FIXUPS, build, choose_depth, text_config, tiny_config
from tests.support.census_horizon import Data, err, perturb, quiet, try_horizon, where


def check_transformers(model, data: Data) -> dict:
    """Can transformers train it: forward with labels + backward, finite loss and gradients.
    Also: does the loss depend on the RNG (stochastic), on train/eval mode, and is it causal."""
    ids, labels = data.step(0)
    model.train()
    try:
        torch.manual_seed(1)
        out = model(input_ids=ids, labels=labels)
        if getattr(out, "loss", None) is None:
            return {"trains": False, "why": "forward with labels gives no loss"}
        out.loss.backward()
    except Exception as e:  # noqa: BLE001 (a census row)
        return {"trains": False, "why": f"train step: {err(e)}", "where": where(e)}
    loss = out.loss.item()
    params = dict(model.named_parameters())
    none = sorted(n for n, p in params.items() if p.requires_grad and p.grad is None)
    bad = sorted(n for n, p in params.items() if p.grad is not None and not torch.isfinite(p.grad).all())
    res = {"loss": loss, "params_without_grad": none[:10], "n_without_grad": len(none)}
    if not math.isfinite(loss) or bad or len(none) == len(params):
        res.update(
            trains=False, why=f"non-finite loss {loss}" if not math.isfinite(loss) else f"bad grads {bad[:4]}"
        )
        return res
    res["trains"] = True
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        torch.manual_seed(2)
        res["stochastic"] = model(input_ids=ids, labels=labels).loss.item() != loss
        model.eval()
        torch.manual_seed(1)
        res["train_eval_differ"] = model(input_ids=ids, labels=labels).loss.item() != loss
        changed = ids.clone()
        changed[:, -1] = (changed[:, -1] + 1) % max(int(ids.max()), 4) + 3
        a = model(input_ids=ids).logits[:, :-1]
        b = model(input_ids=changed).logits[:, :-1]
        res["causal"] = bool((a - b).abs().max() <= 1e-6 * a.abs().max().clamp_min(1e-30))
    model.train()
    return res


def census_one(mt: str, out: Path) -> None:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    quiet()
    row: dict = {"type": mt, "config_class": CONFIG_MAPPING[mt].__name__}
    row["model_class"] = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt]
    if mt in FIXUPS:
        fix = FIXUPS[mt]
        row["fixups"] = fix if isinstance(fix, dict) else f"{fix.__name__}(n_layers)"

    def stage(name: str) -> None:
        row["stage"] = name
        out.write_text(json.dumps(row, indent=1, default=str))

    stage("depth")
    try:
        row["depth"] = choose_depth(mt)
    except Exception as e:  # noqa: BLE001
        row["depth"] = {"error": err(e), "where": where(e), "layers": 2}
    stage("build")
    try:
        cfg = tiny_config(mt, row["depth"]["layers"])
        torch.manual_seed(0)
        model = build(mt, cfg).float()
        perturb(model)
    except Exception as e:  # noqa: BLE001
        row["transformers"] = {"trains": False, "why": f"build: {err(e)}", "where": where(e)}
        return stage("done")
    row["built_class"] = type(model).__name__
    row["params"] = sum(p.numel() for p in model.parameters())
    row["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    vocab = getattr(text_config(cfg), "vocab_size", None) or 128
    emb = model.get_input_embeddings()
    data = Data(min(vocab, emb.num_embeddings) if isinstance(emb, torch.nn.Embedding) else vocab)
    with tempfile.TemporaryDirectory(prefix=f"census-{mt}-") as tmp:
        tmp = Path(tmp)
        model0 = copy.deepcopy(model)
        stage("save")
        try:
            model0.save_pretrained(tmp / "hf")
            hf = tmp / "hf"
        except Exception as e:  # noqa: BLE001
            row["save_error"] = err(e)
            hf = None
        stage("structure")
        try:
            row["structure"] = structure(model, cfg, row["depth"].get("stack"), hf)
        except Exception as e:  # noqa: BLE001
            row["structure"] = {"error": err(e), "where": where(e)}
        stage("calls")
        if row["depth"].get("stack"):
            try:
                model.eval()
                row["calls"] = call_order(model, row["depth"]["stack"], data.probe()[0])
            except Exception as e:  # noqa: BLE001
                row["calls"] = {"error": err(e), "where": where(e)}
        stage("transformers")
        row["transformers"] = check_transformers(model, data)
        stage("horizon")
        if hf is None:
            row["horizon"] = {"result": "failed", "stage": "save_pretrained", "message": row["save_error"]}
        else:
            row["horizon"] = try_horizon(hf, copy.deepcopy(model0), data, row["transformers"]["trains"], tmp)
    stage("done")
