"""Sharded runs started wrongly: torchrun's variables half set, a command that runs one process.

Each is refused in one line (exit 2) before anything is written, instead of torch's traceback
or N independent copies of a one-process command.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from rich.console import Console

from horizon_cli.errors import InputError
from horizon_cli.profile import run_profile
from horizon_cli.store import Store
from horizon_cli.train import run_training
from horizon_cli.train.sharded_checkpoint import verify_split
from tests.conftest import chat_rows, write_config, write_jsonl
from tests.parallel.test_dist import torchrun

RENDEZVOUS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def bare_env(monkeypatch):
    for k in RENDEZVOUS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def config(tmp_path, store):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    return write_config(tmp_path / "c.yaml", store, data, tmp_path / "run", engine={"compute_threads": 1})


@pytest.mark.parametrize(
    "env,missing",
    [({"WORLD_SIZE": "2"}, "RANK"), ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR")],
)
def test_world_size_without_torchrun_is_refused(tiny_store, tmp_path, bare_env, env, missing):
    """`export WORLD_SIZE=2` left over, then a plain `horizon train`: torch's env:// rendezvous
    would raise ValueError (a traceback) or, with every variable set, wait for a rank that never
    comes; the run names the missing variable instead, and writes nothing."""
    for k, v in env.items():
        bare_env.setenv(k, v)
    cfg = config(tmp_path, tiny_store)
    with pytest.raises(InputError, match=f"WORLD_SIZE=2 but {missing} is not set.*torchrun"):
        run_training(cfg, [], console=Console(quiet=True))
    assert not (tmp_path / "run").exists()


def test_bad_dist_timeout_is_refused(tiny_store, tmp_path, bare_env):
    bare_env.setenv("HORIZON_DIST_TIMEOUT", "ten")
    for k, v in dict(
        WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    ).items():
        bare_env.setenv(k, v)
    with pytest.raises(InputError, match="HORIZON_DIST_TIMEOUT='ten'"):
        run_training(config(tmp_path, tiny_store), [], console=Console(quiet=True))
    assert not (tmp_path / "run").exists()


def test_profile_refuses_several_ranks(tmp_path, bare_env):
    """Under torchrun every rank would run its own one-process profile, print it and write the
    same --json/--trace/--plot files at once."""
    bare_env.setenv("WORLD_SIZE", "2")
    bare_env.setenv("RANK", "1")
    with pytest.raises(InputError, match="horizon profile measures one process"):
        run_profile(None, json_out=tmp_path / "p.json", console=Console(quiet=True))
    assert not (tmp_path / "p.json").exists()


def test_bad_data_stops_every_rank_with_its_error(tiny_store, tmp_path):
    """Rank 0 tokenizes first; a bad record is its error on every rank (exit 2), not the
    others' "a barrier failed ... resume by launching the run again", which misleads."""
    rows = (tmp_path / "chat.jsonl").open("w")
    rows.write("".join(json.dumps(r) + "\n" for r in chat_rows(8)) + '{"messages": [\n')
    rows.close()
    cfg = write_config(tmp_path / "c.yaml", tiny_store, tmp_path / "chat.jsonl", tmp_path / "run",
                       engine={"compute_threads": 1})  # fmt: skip
    r = torchrun(2, cfg)
    assert r.returncode != 0
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert errors and all("cannot read as json" in x for x in errors), r.stderr[-3000:]
    assert "exitcode  : 2" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_corrupt_store_is_bad_input_on_ranks_too(tiny_store, tmp_path):
    """A store whose checksum fails is bad input (exit 2) in a one-process run; the sharded
    check, split over the ranks, must say the same (it said HorizonError: exit 1)."""
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    unit = store / "units" / "layer_0000.bin"
    data = bytearray(unit.read_bytes())
    data[100] ^= 0xFF
    unit.write_bytes(bytes(data))
    d = SimpleNamespace(rank=0, world=1, gather_objects=lambda err: [err])  # every file on this rank
    with pytest.raises(InputError, match="layer_0000.bin: checksum mismatch"):
        verify_split(d, None, Store.open(store))


@pytest.mark.parametrize("code", [0, 3])
def test_a_rank_ends_with_its_status_after_atexit_and_flushed_streams(code):
    """parallel.launch.exit_rank (how the CLI's ranks end under torchrun): the atexit handlers run,
    unflushed output reaches the pipe, the status is kept, and nothing after it runs."""
    import subprocess
    import sys

    prog = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "from horizon_cli.parallel.launch import exit_rank\n"
        "print('work', end=' '); sys.stderr.write('err')\n"
        f"exit_rank({code})\n"
        "print('not reached')\n"
    )
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (code, "work atexit ran\n", "err")


def test_the_cli_ends_a_rank_through_exit_rank(monkeypatch):
    from horizon_cli import cli
    from horizon_cli.parallel import launch

    ended: list[int] = []

    def fake_exit(code: int):
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(launch, "exit_rank", fake_exit)
    monkeypatch.setattr(cli, "app", lambda: (_ for _ in ()).throw(SystemExit(0)))
    for world, want in (("2", [0]), ("1", [])):
        monkeypatch.setenv("WORLD_SIZE", world)
        ended.clear()
        with pytest.raises(SystemExit):
            cli.main()
        assert ended == want
