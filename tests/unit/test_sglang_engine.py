"""SGLang engine on CPU: request building, response parsing, concurrency, retries and the
dead-server error, against a loopback stand-in server (the real server needs a GPU: see the tests
marked ``sglang`` and tools/gpu_check.sh)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megatron_p3o.rollout.sglang import SGLangConfig, SGLangEngine
from megatron_p3o.rollout.sglang.launch import launch_command
from megatron_p3o.rollout.sglang.protocol import (
    EngineResponseError,
    EngineUnavailableError,
    generate_payload,
    parse_generate_response,
)
from megatron_p3o.types import SamplingParams

FIXTURE = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "sglang_generate_response.json").read_text()
)


def test_generate_payload_fields():
    p = generate_payload(
        [1, 2, 3], SamplingParams(temperature=0.7, max_new_tokens=9, stop_token_ids=(2,)), seed=5
    )
    assert (
        p["input_ids"] == [1, 2, 3] and p["return_logprob"] is True and p["logprob_start_len"] == -1
    )
    assert p["sampling_params"] == {
        "temperature": 0.7,
        "top_p": 1.0,
        "max_new_tokens": 9,
        "stop_token_ids": [2],
        "sampling_seed": 5,
    }
    assert "top_k" not in p["sampling_params"]  # 0 = off: let SGLang keep its "all tokens"
    assert generate_payload([1], SamplingParams(top_k=20), None)["sampling_params"]["top_k"] == 20


def test_parse_response_fixture():
    s = parse_generate_response(FIXTURE, [5, 6, 7, 8, 9], group_id=2)
    assert s.completion_ids == [319, 4, 87, 2] and s.logprobs == [-1.2345, -0.0213, -3.5, -0.5]
    assert s.finish_reason == "stop" and s.weight_version == 3 and s.group_id == 2


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (
            lambda r: r["meta_info"].update(finish_reason={"type": "abort", "message": "oom"}),
            "abort",
        ),
        (
            lambda r: r["meta_info"]["output_token_logprobs"][2].__setitem__(0, float("nan")),
            "token 2",
        ),
        (lambda r: r.update(output_ids=[1, 2]), "disagree"),
        (lambda r: r["meta_info"].pop("output_token_logprobs"), "return_logprob"),
    ],
)
def test_parse_response_refuses_bad_samples(mutate, needle):
    r = json.loads(json.dumps(FIXTURE))
    mutate(r)
    with pytest.raises(EngineResponseError, match=needle):
        parse_generate_response(r, [1], 0)


def test_launch_command(tmp_path):
    import json

    from megatron_p3o.weight_sync.fp8 import quantization_config

    m = tmp_path / "m"  # an FP8 block checkpoint (fp8 serving refuses any other)
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"quantization_config": quantization_config()}))
    cmd = launch_command(
        SGLangConfig(
            model_path=str(m), quantization="fp8", kv_cache_dtype="fp8_e4m3", tp_size=2,
            port=31000, python="/bin/sh", device="cuda",  # stands for the SGLang env's python
        )
    )  # fmt: skip
    joined = " ".join(cmd)
    assert cmd[0] == "/bin/sh"  # the configured interpreter, never sys.executable
    for part in (
        "-m sglang.launch_server",
        f"--model-path {m}",
        "--quantization fp8",
        "--kv-cache-dtype fp8_e4m3",
        "--tp-size 2",
        "--port 31000",
    ):
        assert part in joined
    with pytest.raises(ValueError, match="model_path"):
        launch_command(SGLangConfig())
    cpu = " ".join(launch_command(SGLangConfig(model_path="/m", device="cpu"), python="py"))
    assert "--device cpu --max-total-tokens 65536" in cpu and "mem-fraction" not in cpu


def test_launching_needs_the_sglang_interpreter(monkeypatch):
    from megatron_p3o.rollout.sglang.launch import SGLangSetupError

    monkeypatch.delenv("SGLANG_PYTHON", raising=False)
    with pytest.raises(SGLangSetupError, match=r"rollout.sglang.python or \$SGLANG_PYTHON"):
        launch_command(SGLangConfig(model_path="/m"))
    monkeypatch.setenv("SGLANG_PYTHON", "/no/such/python")
    with pytest.raises(SGLangSetupError, match="/no/such/python is not executable"):
        launch_command(SGLangConfig(model_path="/m"))


class _StandIn(BaseHTTPRequestHandler):
    """Answers like SGLang: completion = the prompt reversed, log-prob −0.1·(i+1)."""

    in_flight = 0
    max_in_flight = 0
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with _StandIn.lock:
            _StandIn.in_flight += 1
            _StandIn.max_in_flight = max(_StandIn.max_in_flight, _StandIn.in_flight)
        time.sleep(0.05)
        ids = list(reversed(body["input_ids"]))[: body["sampling_params"]["max_new_tokens"]]
        resp = {
            "output_ids": ids,
            "meta_info": {
                "id": "r",
                "finish_reason": {"type": "length", "length": len(ids)},
                "weight_version": "9",
                "output_token_logprobs": [[-0.1 * (i + 1), t, None] for i, t in enumerate(ids)],
            },
        }
        data = json.dumps(resp).encode()
        with _StandIn.lock:
            _StandIn.in_flight -= 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def stand_in():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    if not getattr(srv, "closed_by_test", False):
        srv.shutdown()
        srv.server_close()


def test_generate_against_stand_in_server(stand_in):
    url = f"http://127.0.0.1:{stand_in.server_address[1]}"
    _StandIn.max_in_flight = 0
    with SGLangEngine(SGLangConfig(url=url, max_concurrency=4, startup_timeout_s=10)) as eng:
        assert eng.health()["ok"]
        samples = eng.generate(
            [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
            n=3,
            sampling=SamplingParams(max_new_tokens=2, seed=1),
        )
    assert [s.group_id for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert samples[0].completion_ids == [3, 2] and samples[0].logprobs == [-0.1, -0.2]
    assert all(s.weight_version == 9 for s in samples)
    assert 1 < _StandIn.max_in_flight <= 4  # concurrent, bounded


def test_dead_server_gives_one_clear_error(stand_in):
    port = stand_in.server_address[1]
    eng = SGLangEngine(
        SGLangConfig(url=f"http://127.0.0.1:{port}", max_retries=1, request_timeout_s=2)
    )
    stand_in.shutdown()
    stand_in.server_close()
    stand_in.closed_by_test = True
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=f"127.0.0.1:{port}.*after 2 attempts"):
        eng.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
    assert time.monotonic() - t0 < 20
