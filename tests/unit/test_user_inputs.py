"""Files and servers a user names, read in-process (issue 41, items 3c and 4): each bad one is a
:class:`UserError` naming the file (and line) or URL, never a traceback from deep inside a
library, and a dead attached SGLang URL fails in seconds instead of waiting silently."""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_p3o.data.prompts import check_json_rows
from megatron_p3o.rollout.sglang import SGLangConfig, SGLangEngine
from megatron_p3o.rollout.sglang import client as sglang_client
from megatron_p3o.rollout.sglang.protocol import EngineUnavailableError
from megatron_p3o.runtime.errors import (
    DataError,
    InputFileError,
    UserError,
    count_arg,
    read_user_text,
)
from megatron_p3o.runtime.ports import free_port


def test_read_user_text(tmp_path):
    with pytest.raises(InputFileError, match="recipe .*nope.yaml does not exist"):
        read_user_text(tmp_path / "nope.yaml", "recipe")
    with pytest.raises(InputFileError, match="is a directory, not a file"):
        read_user_text(tmp_path, "recipe")
    p = tmp_path / "r.yaml"
    p.write_bytes(b"a: 1\nb: \xff\n")
    with pytest.raises(InputFileError, match=r"not UTF-8 text \(byte 0xff on line 2\)"):
        read_user_text(p, "recipe")
    p.write_text("a: é\n")
    assert read_user_text(p, "recipe") == "a: é\n"


def test_count_arg():
    assert count_arg("3") == 3
    for bad, msg in (("0", "0 must be >= 1"), ("-2", "-2 must be >= 1"), ("x", "not an integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            count_arg(bad)


@pytest.mark.parametrize(
    "content,needle",
    [
        (b'{"prompt": "a", "answer": "b"}\n{"prompt": "a", \n', "line 2 is not valid JSON"),
        (b'{"prompt": "a", "answer": "b"}\n\n{"prompt": "\xe9"}\n', "line 3 is not UTF-8"),
        (b'{"prompt": "a", "answer": "b"}\n[1, 2]\n', "line 2 is a JSON list, not an object"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, content, needle):
    p = tmp_path / "d.jsonl"
    p.write_bytes(content)
    with pytest.raises(DataError) as e:
        check_json_rows(p, "data.path")
    assert needle in str(e.value) and str(p) in str(e.value) and "data.path" in str(e.value)


def test_json_documents_and_blank_lines_pass(tmp_path):
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "a", "answer": "b"}\n\n{"prompt": "c", "answer": "d"}\n')
    check_json_rows(ok)
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"prompt": "a", "answer": "b"}], indent=1))
    check_json_rows(arr)
    arr.write_text('[{"prompt": "a", "answer": "b"},\n {"prompt": "a" "answer": "b"}]\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        check_json_rows(arr)


def test_read_dataset_names_a_directory_and_a_corrupt_parquet(tmp_path):
    from megatron_p3o.data.prompts import read_dataset

    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(InputFileError, match="is a directory"):
        read_dataset(str(tmp_path / "d.jsonl"))
    (tmp_path / "p.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"p.parquet'\: cannot read it as parquet"):
        read_dataset(str(tmp_path / "p.parquet"))


def test_read_meta_says_a_missing_directory_does_not_exist(tmp_path):
    from megatron_p3o.model.hf.dist_stream import P3O_META_FILE, read_meta
    from megatron_p3o.runtime.errors import CheckpointError

    with pytest.raises(InputFileError, match=r"checkpoint directory .*nope does not exist"):
        read_meta(tmp_path / "nope")
    (tmp_path / "f").write_text("")
    with pytest.raises(InputFileError, match="is a file, not a directory"):
        read_meta(tmp_path / "f")
    (tmp_path / P3O_META_FILE).write_text("{torn")
    with pytest.raises(CheckpointError, match=f"{P3O_META_FILE}: unreadable"):
        read_meta(tmp_path)


def _tiny_hf_dir(path):
    from transformers import LlamaConfig

    path.mkdir()
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    (path / "config.json").write_text(cfg.to_json_string())
    return path


def test_truncated_safetensors_names_the_file(tmp_path):
    from megatron_p3o.model.hf.safetensors_io import HFCheckpointReader

    hf = _tiny_hf_dir(tmp_path / "hf")
    (hf / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(InputFileError, match="model.safetensors: not a readable safetensors"):
        HFCheckpointReader(hf)
    (hf / "model.safetensors").unlink()
    (hf / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(InputFileError, match="not a safetensors index with a weight_map"):
        HFCheckpointReader(hf)
    (hf / "config.json").write_text("{")
    with pytest.raises(InputFileError, match="config.json: not a usable HF config"):
        HFCheckpointReader(hf)


def test_load_tokenizer_names_the_directory(tmp_path):
    from megatron_p3o.model.hf.safetensors_io import load_tokenizer

    with pytest.raises(InputFileError, match="tokenizer directory .*none does not exist"):
        load_tokenizer(tmp_path / "none")
    hf = _tiny_hf_dir(tmp_path / "hf")
    with pytest.raises(InputFileError, match="no usable tokenizer in"):
        load_tokenizer(hf)


# -- W&B ---------------------------------------------------------------------------------------


def _wandb_env(monkeypatch, tmp_path):
    for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin.isatty", lambda: False, raising=False)


def test_wandb_online_without_any_login_is_refused_at_config_time(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    from megatron_p3o.observability.run_log import WandbConfig, check_wandb

    _wandb_env(monkeypatch, tmp_path)
    with pytest.raises(UserError, match="set WANDB_API_KEY .* WANDB_MODE=offline"):
        check_wandb(WandbConfig(enabled=True))
    check_wandb(WandbConfig(enabled=False))
    check_wandb(WandbConfig(enabled=True, mode="offline"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # W&B's own switch is honoured
    check_wandb(WandbConfig(enabled=True))
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    check_wandb(WandbConfig(enabled=True))


# -- SGLang: dead URLs fail fast, a starting server is reported --------------------------------


class _Fake503(BaseHTTPRequestHandler):
    def do_GET(self):  # a server still loading its model
        self.send_response(503)
        self.end_headers()

    def log_message(self, *a):
        pass


class _AliveProcess:
    """A launched server that is still starting (never healthy, never exits)."""

    log_path = "server0.log"

    def alive(self):
        return True

    def tail(self):
        return "loading weights"

    def forget_config(self):
        pass


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(sglang_client, "REFUSED_GRACE_S", 0.5)
    monkeypatch.setattr(sglang_client, "NOTE_EVERY_S", 0.6)
    monkeypatch.delenv("RANK", raising=False)


def test_attached_url_refusing_connections_fails_in_seconds(quick):
    url = f"http://127.0.0.1:{free_port()}"
    eng = SGLangEngine(SGLangConfig(url=url))
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError) as e:
        eng.wait_healthy(600)
    assert time.monotonic() - t0 < 5
    assert url in str(e.value) and "connection refused" in str(e.value)
    assert "rollout.sglang.url" in str(e.value)


def test_attached_unknown_host_fails_in_seconds(quick):
    eng = SGLangEngine(SGLangConfig(url="http://no-such-host.invalid:30000"))
    with pytest.raises(EngineUnavailableError, match="unknown host"):
        eng.wait_healthy(600)


def test_attached_server_answering_503_is_waited_for_with_notes(quick, capsys):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake503)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        with pytest.raises(EngineUnavailableError, match=r"not healthy \(/health\) after 2s"):
            SGLangEngine(SGLangConfig(url=url)).wait_healthy(2.0)
    finally:
        srv.shutdown()
        srv.server_close()
    out = capsys.readouterr().out
    assert f"waiting for SGLang server0 at {url}/health" in out and "HTTP 503" in out


def test_launched_server_still_starting_prints_what_it_waits_for(quick, capsys):
    eng = SGLangEngine(SGLangConfig(port=free_port()))
    eng.process = _AliveProcess()  # refused connections are normal while it starts
    with pytest.raises(EngineUnavailableError, match="not healthy .* loading weights"):
        eng.wait_healthy(2.0)
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("waiting for")]
    assert len(notes) >= 2, notes
    assert "rollout.sglang.startup_timeout_s" in notes[0] and "server0.log" in notes[0]
    assert "s of 2s" in notes[0]
