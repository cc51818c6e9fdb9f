"""Hub ids as sources (convert/hub.py): `horizon convert owner/name DST [--revision R]` and
`model.path: owner/name` in a dry run, offline against a Hugging Face cache built in tmp_path in
huggingface_hub's layout (models--owner--name/{blobs,snapshots/<commit>,refs/<name>}), which
huggingface_hub's own scan_cache_dir must read back. The online choice of files is checked with
the hub's listing and download calls replaced (no network in tests)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from horizon_cli.convert import convert
from horizon_cli.convert import hub as hubmod
from horizon_cli.convert.hub import hub_id
from tests.conftest import chat_rows, horizon, write_jsonl
from tests.support.tiny import make_model, save
from tests.support.tokenizer import make_tokenizer

MAIN, V2 = "a" * 40, "b" * 40  # two commits of owner/tiny: main, and the tag v2
MACHINE = ("--host-gib", "64", "--device-gib", "24")  # one machine for both plans (free RAM varies)


def cache_snapshot(cache: Path, repo: str, commit: str, src: Path, refs: tuple[str, ...] = ()) -> Path:
    """src's files as one cached commit of `repo`, in huggingface_hub's layout: each file a blob
    named by its hash, the snapshot's entries relative links to them, refs/<name> the commit."""
    from huggingface_hub.file_download import repo_folder_name

    base = cache / repo_folder_name(repo_id=repo, repo_type="model")
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "blobs").mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        blob = base / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    for ref in refs:
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two tiny Llamas saved by transformers with the tiny tokenizer (different weights)."""
    root = tmp_path_factory.mktemp("hub-models")
    out = {}
    for name, seed in (("main", 0), ("v2", 1)):
        save(make_model("llama", seed=seed, vocab_size=400, max_position_embeddings=128), root / name)
        make_tokenizer(root / name)
        out[name] = root / name
    return out


@pytest.fixture
def cache(tmp_path, models, monkeypatch) -> Path:
    """HF_HUB_CACHE in tmp_path, offline, holding owner/tiny at main and v2."""
    cache = tmp_path / "hf-cache"
    cache_snapshot(cache, "owner/tiny", MAIN, models["main"], refs=("main",))
    cache_snapshot(cache, "owner/tiny", V2, models["v2"], refs=("v2",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def store_files(store: Path) -> dict[str, object]:
    """Every file of a store (the manifest as JSON, without its source), for comparison."""
    out: dict[str, object] = {}
    for f in sorted(p for p in store.rglob("*") if p.is_file()):
        rel = str(f.relative_to(store))
        if rel == "manifest.json":
            m = json.loads(f.read_text())
            m.pop("source")
            out[rel] = m
        else:
            out[rel] = f.read_bytes()
    return out


def test_the_cache_is_huggingface_hubs_own_layout(cache):
    from huggingface_hub import scan_cache_dir

    repos = {r.repo_id: r for r in scan_cache_dir(cache).repos}
    assert set(repos) == {"owner/tiny"}
    revs = {r.commit_hash: r.refs for r in repos["owner/tiny"].revisions}
    assert revs == {MAIN: frozenset({"main"}), V2: frozenset({"v2"})}


def test_convert_a_hub_id_offline_equals_converting_the_directory(cache, models, tmp_path):
    r = horizon("convert", "owner/tiny", tmp_path / "hub", "--dtype", "float32")
    assert r.exit_code == 0, r.output
    convert(models["main"], tmp_path / "dir", dtype="float32")
    assert store_files(tmp_path / "hub") == store_files(tmp_path / "dir")
    assert json.loads((tmp_path / "hub" / "manifest.json").read_text())["source"] == "owner/tiny"
    assert (tmp_path / "hub" / "hf" / "tokenizer.json").is_file()  # the tokenizer came along


def test_revision_picks_a_snapshot(cache, models, tmp_path):
    convert(models["v2"], tmp_path / "v2-dir", dtype="float32")
    convert(models["main"], tmp_path / "main-dir", dtype="float32")
    for rev in ("v2", V2):
        r = horizon("convert", "owner/tiny", tmp_path / rev, "--dtype", "float32", "--revision", rev)
        assert r.exit_code == 0, r.output
        assert store_files(tmp_path / rev) == store_files(tmp_path / "v2-dir")
    r = horizon("convert", "owner/tiny", tmp_path / "m", "--dtype", "float32", "--revision", "main")
    assert r.exit_code == 0 and store_files(tmp_path / "m") == store_files(tmp_path / "main-dir")
    assert store_files(tmp_path / "m") != store_files(tmp_path / "v2-dir")


def one_error(r) -> str:
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_offline_without_the_files_is_one_line_naming_the_id_and_the_cache(cache, models, tmp_path):
    line = one_error(horizon("convert", "owner/absent", tmp_path / "dst"))
    assert "owner/absent" in line and str(cache) in line and "offline" in line
    line = one_error(horizon("convert", "owner/tiny", tmp_path / "dst", "--revision", "nope"))
    assert "owner/tiny@nope" in line and str(cache) in line
    # a dry run fetched only its config.json: the cache holds part of the model
    only = tmp_path / "only-config"
    only.mkdir()
    shutil.copy(models["main"] / "config.json", only / "config.json")
    cache_snapshot(cache, "owner/half", MAIN, only, refs=("main",))
    line = one_error(horizon("convert", "owner/half", tmp_path / "dst"))
    assert "owner/half" in line and str(cache) in line and "no weights" in line
    sharded = tmp_path / "sharded"
    save(make_model("llama", vocab_size=400, max_position_embeddings=128), sharded, "sharded")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()  # an interrupted download: one shard short
    cache_snapshot(cache, "owner/cut", MAIN, sharded, refs=("main",))
    line = one_error(horizon("convert", "owner/cut", tmp_path / "dst"))
    assert f"the cache holds only part of it ({shards[-1].name} is missing)" in line and str(cache) in line
    assert not (tmp_path / "dst").exists() and [p.name for p in tmp_path.iterdir() if "dst" in p.name] == []


def test_a_directory_wins_and_a_path_is_a_path(cache, models, tmp_path, monkeypatch):
    assert hub_id("owner/tiny") == "owner/tiny"
    for text in ("./owner/tiny", "/owner/tiny", "owner/tiny/x", "~/tiny", "gpt2", "owner/ti ny", "a--b/c"):
        assert hub_id(text) is None, text
    monkeypatch.chdir(tmp_path)
    shutil.copytree(models["v2"], tmp_path / "owner" / "tiny")  # a local dir of that name
    assert hub_id("owner/tiny") is None
    assert horizon("convert", "owner/tiny", "local", "--dtype", "float32").exit_code == 0
    convert(models["v2"], tmp_path / "v2-dir", dtype="float32")
    assert store_files(tmp_path / "local") == store_files(tmp_path / "v2-dir")  # not the cache's main
    line = one_error(horizon("convert", "owner/tiny", "x", "--revision", "v2"))
    assert "--revision v2" in line and "local path" in line
    for missing in ("./nope/x", "no/such/dir"):
        assert one_error(horizon("convert", missing, "x")) == f"error: {Path(missing)}: not found"
    assert "a hub id is owner/name" in one_error(horizon("convert", "gpt2", "x"))


def test_safetensors_preferred_over_bin(cache, models, tmp_path):
    both = tmp_path / "both"
    shutil.copytree(models["main"], both)
    save(make_model("llama", seed=5, vocab_size=400, max_position_embeddings=128), tmp_path / "bin", "bin")
    shutil.copy(tmp_path / "bin" / "pytorch_model.bin", both / "pytorch_model.bin")  # other weights
    names = torch.load(both / "pytorch_model.bin", weights_only=True)  # with its index, which once won
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "pytorch_model.bin")}
    (both / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    cache_snapshot(cache, "owner/both", MAIN, both, refs=("main",))
    assert horizon("convert", "owner/both", tmp_path / "hub", "--dtype", "float32").exit_code == 0
    convert(models["main"], tmp_path / "st", dtype="float32")
    assert store_files(tmp_path / "hub") == store_files(tmp_path / "st")
    convert(both, tmp_path / "local", dtype="float32")  # the same rule for a directory
    assert store_files(tmp_path / "local") == store_files(tmp_path / "st")


def dry_run_config(tmp_path: Path, model: str) -> Path:
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    cfg = {
        "model": {"path": model},
        "data": {"path": str(data), "max_seq_len": 64},
        "train": {"steps": 2, "batch_size": 2, "micro_batch_size": 1},
        "engine": {"device": "cpu", "dtype": "float32"},
        "output": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / f"{model.replace('/', '_')}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dry_run_plans_a_hub_id_from_its_cached_config(cache, models, tmp_path):
    plans = {}
    for model in ("owner/tiny", str(models["main"])):
        out = tmp_path / f"{len(plans)}.json"
        r = horizon("train", dry_run_config(tmp_path, model), "--dry-run", "--json", out, *MACHINE)
        assert r.exit_code == 0, r.output
        plans[model] = json.loads(out.read_text())
    hub, local = plans["owner/tiny"], plans[str(models["main"])]
    assert hub.pop("model") == "owner/tiny" and local.pop("model") == str(models["main"])
    assert hub == local and hub["params"] > 0
    # config.json alone in the cache (what a dry run fetches online) is enough to plan
    only = tmp_path / "only-config"
    only.mkdir()
    shutil.copy(models["main"] / "config.json", only / "config.json")
    cache_snapshot(cache, "owner/half", MAIN, only, refs=("main",))
    r = horizon("train", dry_run_config(tmp_path, "owner/half"), "--dry-run")
    assert r.exit_code == 0, r.output
    assert "not tokenized (owner/half: a dry run fetches its config.json alone" in r.output
    # not in the cache: one line; a real start on a hub id: convert it first (nothing fetched)
    line = one_error(horizon("train", dry_run_config(tmp_path, "owner/absent"), "--dry-run"))
    assert "owner/absent" in line and str(cache) in line
    line = one_error(horizon("train", dry_run_config(tmp_path, "owner/tiny")))
    assert "convert it first (horizon convert owner/tiny STORE)" in line
    assert not (tmp_path / "run").exists()


class FakeHub:
    """The hub's listing (model_info) and downloads replaced: a 'remote' directory's files,
    copied into the cache as snapshot_download would, recording what each call asked for."""

    def __init__(self, remote: Path, cache: Path):
        self.remote, self.cache, self.calls = remote, cache, []

    def model_info(self, repo, revision=None, **kw):
        from types import SimpleNamespace

        names = [str(p.relative_to(self.remote)) for p in self.remote.rglob("*") if p.is_file()]
        return SimpleNamespace(sha=MAIN, siblings=[SimpleNamespace(rfilename=n) for n in names])

    def snapshot_download(
        self, repo, revision=None, cache_dir=None, allow_patterns=(), local_files_only=False
    ):
        import fnmatch

        assert not local_files_only
        self.calls.append((revision, sorted(allow_patterns)))
        snap = Path(cache_dir) / f"models--{repo.replace('/', '--')}" / "snapshots" / MAIN
        for f in self.remote.rglob("*"):
            rel = str(f.relative_to(self.remote))
            if f.is_file() and any(fnmatch.fnmatchcase(rel, p) for p in allow_patterns):
                (snap / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, snap / rel)
        snap.mkdir(parents=True, exist_ok=True)
        return str(snap)


def test_online_fetches_only_what_convert_reads(models, tmp_path, monkeypatch):
    import huggingface_hub

    remote = tmp_path / "remote"
    save(make_model("llama", seed=0, vocab_size=400, max_position_embeddings=128), remote, "sharded")
    make_tokenizer(remote)
    save(make_model("llama", seed=0, vocab_size=400, max_position_embeddings=128), tmp_path / "b", "bin")
    shutil.copy(tmp_path / "b" / "pytorch_model.bin", remote)
    (remote / "README.md").write_text("a model card")
    (remote / "original").mkdir()
    (remote / "original" / "consolidated.safetensors").write_bytes(b"not read")
    (remote / "consolidated.safetensors").write_bytes(b"not listed in the index")
    fake = FakeHub(remote, tmp_path / "cache")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hubmod, "offline", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: fake.model_info(*a, **k))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    snap, commit = hubmod.fetch_checkpoint("owner/remote", show=False)
    shards = sorted(json.loads((remote / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1
    unread = {"README.md", "original", "consolidated.safetensors", "pytorch_model.bin", *shards}
    small = sorted(set(os.listdir(remote)) - unread)  # config, index, tokenizer, generation files
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(small)
    assert fake.calls[0] == (None, small)  # the named revision first: refs/main records its commit
    assert fake.calls[-1] == (MAIN, sorted({*small, *shards}))
    assert commit == MAIN and sorted(p.name for p in snap.iterdir()) == sorted({*small, *shards})
    convert(snap, tmp_path / "store", dtype="float32")  # what was fetched converts
    # a dry run fetches config.json alone
    asked = []

    def hf_hub_download(repo, filename, **kw):
        asked.append(filename)
        return str(snap / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    assert hubmod.fetch_config("owner/remote") == snap and asked == ["config.json"]
