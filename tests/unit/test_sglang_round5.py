"""Issue 52, items 1, 4, 5 and 7 on CPU: the stand-in answers what the pinned release's handlers
answer, the client takes any JSON answer, a tensor push serializes once per (server, TP rank),
and attaching reads the server's TP size and closes a session a killed trainer left open.

The release's answers are derived from its own source (``http_server.py`` of the 0.5.23 wheel,
read as text with ``ast``, never imported): a handler whose success path returns nothing answers
``null``, ``Response(status_code=…)`` an empty body, ``ORJSONResponse({...})`` an object with
those keys. The real server shows the same on CPU in ``tests/sglang_server/test_round5_real.py``.
"""

import ast
import base64
import json
import pickle
import threading
import urllib.error
import urllib.request
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megatron_p3o.rollout.sglang import SGLangConfig, SGLangEngine, SGLangFleet
from megatron_p3o.rollout.sglang.launch import SGLangSetupError
from megatron_p3o.rollout.sglang.protocol import (
    NO_SESSION_OPEN,
    RESUME_AFTER_PUSH,
    RESUME_BEFORE_PUSH,
    EngineResponseError,
    release_payload,
    resume_payload,
)
from megatron_p3o.types import SamplingParams

from ..sglang_standin import ALREADY_OPEN, GET_ROUTES, NONE_OPEN, POST_ROUTES, SGLangStandIn
from .test_sglang_protocol import release_source

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
BUCKET = [("model.norm.weight", torch.arange(4.0)), ("lm_head.weight", torch.ones(3, 4))]
# /generate answers the tokenizer manager's output, not a literal of its handler: its fields are
# compared with the real server's answers (tests/sglang_server/test_engine_real.py)
NOT_DERIVED = {"/generate": "the tokenizer manager's output"}


# -- the release's answers, from its source ----------------------------------------------------
def _name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _returns(node, out):
    """The ``return`` statements of a handler outside its ``except`` clauses (its success
    path; an ``except`` answers the error)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ExceptHandler, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(child, ast.Return):
            out.append(child)
        _returns(child, out)
    return out


def _failure_status(call: ast.Call) -> bool:
    """``status_code=`` a constant 4xx/5xx or ``HTTPStatus.BAD_REQUEST``: an error answer."""
    for kw in call.keywords:
        if kw.arg == "status_code":
            v = kw.value
            if isinstance(v, ast.Constant):
                return int(v.value) >= 400
            return isinstance(v, ast.Attribute) and v.attr == "BAD_REQUEST"
    return False


def _object_shape(node, fn):
    """``("object", keys, open)`` of a dict literal (or a name assigned one in ``fn``);
    ``open``: a ``**spread`` adds keys the literal does not name."""
    while isinstance(node, ast.Call) and _name(node) in ("msgspec_to_builtins",
                                                          "redact_watermark_secrets"):  # fmt: skip
        node = node.args[0]
    if isinstance(node, ast.Name):
        assigned = [
            a.value
            for a in ast.walk(fn)
            if isinstance(a, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == node.id for t in a.targets)
        ]
        node = assigned[0] if len(assigned) == 1 else node
    if not isinstance(node, ast.Dict):
        return ("unknown", ast.unparse(node))
    keys = frozenset(k.value for k in node.keys if k is not None)
    return ("object", keys, None in node.keys)


def _success_shape(fn):
    shapes = set()
    for r in _returns(fn, []):
        v = r.value
        if isinstance(v, ast.Await):
            v = v.value
        if v is None or (isinstance(v, ast.Constant) and v.value is None):
            shapes.add(("null",))
        elif isinstance(v, ast.Call) and _name(v) == "_create_error_response":
            continue
        elif isinstance(v, ast.Call) and _name(v) == "Response" and not _failure_status(v):
            shapes.add(("empty",))
        elif isinstance(v, ast.Call) and _name(v) == "ORJSONResponse":
            if not _failure_status(v):
                kw = {k.arg: k.value for k in v.keywords}
                shapes.add(_object_shape(v.args[0] if v.args else kw["content"], fn))
        elif isinstance(v, ast.Call) and _name(v) == "msgspec_to_builtins":
            shapes.add(_object_shape(v, fn))
        elif not (isinstance(v, ast.Call) and _name(v) == "Response"):
            shapes.add(("unknown", ast.unparse(v)))
    return shapes or {("null",)}  # no return on the success path: FastAPI answers null


@pytest.fixture(scope="module")
def release_handlers():
    """{(method, path): handler function (ast)} of the pinned release's route table."""
    tree = ast.parse(release_source(HTTP_SERVER))
    out = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for d in fn.decorator_list:
            if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args):
                continue
            if d.func.attr not in ("get", "post", "api_route"):
                continue
            if not isinstance(d.args[0], ast.Constant):
                continue
            methods = {d.func.attr.upper()}
            for kw in d.keywords:
                if kw.arg == "methods":
                    methods = {e.value for e in kw.value.elts}
            for m in methods:
                out[(m, d.args[0].value)] = fn
    return out


def _answer_shape(raw: bytes):
    if not raw:
        return ("empty",)
    obj = json.loads(raw)
    if obj is None:
        return ("null",)
    return ("object", frozenset(obj)) if isinstance(obj, dict) else (type(obj).__name__,)


def _call(url, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _stand_in_answers():
    """Every route of the stand-in but /generate, driven to success in an order the rules
    allow; {(method, path): (status, raw body)}."""
    srv = SGLangStandIn(lambda b: ([1], [-0.1], "stop"),
                        server_info={"tp_size": 2, "dp_size": 1, "pp_size": 1})  # fmt: skip
    calls = [("GET", p, None) for p in GET_ROUTES] + [
        ("POST", "/init_weights_update_group", {"group_name": "g"}),
        ("POST", "/pause_generation", {"mode": "retract"}),
        ("POST", "/begin_weight_update", {}),
        ("POST", "/update_weights_from_distributed", {"names": []}),
        ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": []}),
        ("POST", "/end_weight_update", {}),
        ("POST", "/continue_generation", {}),
        ("POST", "/update_weights_from_disk", {"model_path": "/m", "weight_version": "1"}),
        ("POST", "/release_memory_occupation", release_payload()),
        ("POST", "/resume_memory_occupation", resume_payload(RESUME_BEFORE_PUSH)),
    ]
    try:
        return {(m, p): _call(srv.url, m, p, b) for m, p, b in calls}
    finally:
        srv.close()


def test_the_stand_in_answers_what_the_release_answers(release_handlers):
    """Issue 52, item 1: every route the stand-in serves answers with the shape the release's
    handler returns on success (the memory routes: ``null``; it answered ``{}``, so no test saw
    the client call ``.get`` on None)."""
    got = _stand_in_answers()
    served = {("GET", p) for p in GET_ROUTES} | {("POST", p) for p in POST_ROUTES}
    assert set(got) | {("POST", p) for p in NOT_DERIVED} == served  # none left unchecked
    memory = release_handlers[("POST", "/release_memory_occupation")]
    assert _success_shape(memory) == {("null",)}
    params = ast.parse(release_source("sglang/srt/arg_groups/fields/parallel.py"))
    server_args = {n.target.id for n in ast.walk(params) if isinstance(n, ast.AnnAssign)
                   and isinstance(n.target, ast.Name)}  # fmt: skip
    for (method, path), (status, raw) in got.items():
        assert status == 200, (path, status, raw)
        handler = release_handlers.get((method, path))
        assert handler is not None, f"{method} {path} is not a route of the pinned release"
        (shape,) = _success_shape(handler)  # one success answer per handler
        assert shape[0] != "unknown", f"{path}: cannot derive the answer of {shape[1]}"
        mine = _answer_shape(raw)
        if shape[0] == "object" and shape[2]:  # **server args + named keys
            assert mine[0] == "object" and shape[1] <= mine[1], (path, mine, shape)
            assert mine[1] - shape[1] <= server_args, (path, mine[1] - shape[1])
        else:
            assert mine == shape[:2], (path, mine, shape)


def test_the_stand_in_speaks_the_release_s_session_rules():
    """Its session messages are the weight updater's own; ``/ready`` is 503 while paused
    (``is_ready``: not paused and healthy), and so is ``/health`` (it generates a token, which
    waits for the pause to end); /health and /ready need no key (``auth.py``); the client's
    "none open" test matches the release's message."""
    updater = ast.parse(release_source(
        "sglang/srt/managers/scheduler_components/weight_updater.py"))  # fmt: skip
    strings = {n.value for n in ast.walk(updater) if isinstance(n, ast.Constant)
               and isinstance(n.value, str)}  # fmt: skip
    assert ALREADY_OPEN in strings and NONE_OPEN in strings
    assert NONE_OPEN.startswith(NO_SESSION_OPEN)
    tm = release_source("sglang/srt/managers/tokenizer_manager.py")
    assert "return not self.is_pause and self.is_healthy()" in tm
    assert "await self.is_pause_cond.wait_for(lambda: not self.is_pause)" in tm  # generate
    http = release_source(HTTP_SERVER)
    assert "status_code = 200 if _global_state.tokenizer_manager.is_ready() else 503" in http
    assert "async for _ in _global_state.tokenizer_manager.generate_request(gri, request)" in http
    auth = release_source("sglang/srt/utils/auth.py")
    assert 'path.startswith("/ready")' in auth and 'path.startswith("/health")' in auth
    srv = SGLangStandIn(lambda b: ([1], [-0.1], "stop"), api_key="k")
    try:
        assert _call(srv.url, "GET", "/ready") == _call(srv.url, "GET", "/health") == (200, b"")
        srv.paused = True
        assert _call(srv.url, "GET", "/ready") == _call(srv.url, "GET", "/health") == (503, b"")
    finally:
        srv.close()


# -- the client takes any JSON answer (item 1) -------------------------------------------------
class _Fixed(BaseHTTPRequestHandler):
    """Answers every request with ``body`` (raw bytes), 200."""

    body = b"null"

    def log_message(self, *a):
        pass

    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_POST = _answer


@pytest.fixture
def fixed():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fixed)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


ANSWERS = [b"null", b"[]", b"[1, 2]", b'"ok"', b"7", b"true", b"", b"{}", b"plain text",
           b'{"success": true, "message": "Success"}']  # fmt: skip


@pytest.mark.parametrize("raw", ANSWERS)
def test_the_client_takes_any_json_answer(fixed, raw, monkeypatch):
    """Issue 52, item 1: ``null`` (SGLang's memory routes), a list, a string, plain text: the
    colocated calls and a session go through; no AttributeError."""
    monkeypatch.setattr(_Fixed, "body", raw)
    eng = SGLangEngine(SGLangConfig(url=fixed, max_retries=0))
    eng.release_memory()
    eng.resume_memory(RESUME_BEFORE_PUSH)
    with eng.weight_update_session():
        eng.push_tensors(["x"], 1, last=True)
    eng.resume_memory(RESUME_AFTER_PUSH)
    assert eng.leave_weight_group("g") is True


def test_success_false_still_fails_and_odd_answers_fail_in_one_line(fixed, monkeypatch):
    eng = SGLangEngine(SGLangConfig(url=fixed, max_retries=0))
    monkeypatch.setattr(_Fixed, "body", b'{"success": false, "message": "out of memory"}')
    with pytest.raises(EngineResponseError, match="release_memory_occupation failed: out of"):
        eng.release_memory()
    monkeypatch.setattr(_Fixed, "body", b"null")
    with pytest.raises(EngineResponseError, match="answered NoneType") as e:
        eng.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
    assert "\n" not in str(e.value)
    with pytest.raises(EngineResponseError, match="/model_info has no weight_version"):
        eng.served_version()


# -- one serialization per (server, TP rank) (item 4) -------------------------------------------
class _NoGroup:
    def broadcast(self, tensors, opts):
        raise AssertionError("a tensor push broadcast over the group")


def test_a_tensor_push_serializes_once_per_server_rank(monkeypatch):
    """Issue 52, item 4: two servers of TP size 2: every bucket is serialized four times, one
    payload for each (server, rank), never one payload shared (torch counts one CUDA-IPC
    reference per serialization; each rank that opens it gives one back). Each payload still
    decodes to the bucket."""
    from megatron_p3o.rollout.sglang import fleet as fleet_mod

    real = fleet_mod.serialize_named_tensors
    made = []

    def counted(named):
        made.append(real(named))
        return made[-1]

    monkeypatch.setattr(fleet_mod, "serialize_named_tensors", counted)
    srvs = [SGLangStandIn(lambda b: ([1], [-0.1], "stop")) for _ in range(2)]
    try:
        workers = [SGLangEngine(SGLangConfig(url=s.url, tp_size=2, max_retries=0),
                                label=f"worker{i}") for i, s in enumerate(srvs)]  # fmt: skip
        fleet = SGLangFleet(workers[0], workers, transport="tensor")
        fleet._group = (_NoGroup(), "g", "gloo")
        fleet.update_weights(iter([BUCKET, BUCKET, BUCKET]), version=5)
        sent = [b["serialized_named_tensors"] for s in srvs for p, b in s.routes
                if p == "/update_weights_from_tensor"]  # fmt: skip
    finally:
        for s in srvs:
            s.close()
    assert len(made) == 3 * 2 * 2, len(made)
    assert len(sent) == 3 * 2 and all(len(p) == 2 for p in sent)
    for payloads in sent:
        for p in payloads:
            got = pickle.loads(base64.b64decode(p))
            assert [n for n, _ in got] == [n for n, _ in BUCKET]
            assert all(torch.equal(t, ref) for (_, t), (_, ref) in zip(got, BUCKET))


# -- attaching: the server's TP size, a stale session (items 5 and 7) ------------------------------
def _attached(srv, transport="distributed", **kw):
    eng = SGLangEngine(SGLangConfig(url=srv.url, startup_timeout_s=10, max_retries=0, **kw))
    return SGLangFleet(eng, [eng], transport)


@pytest.fixture
def stand_ins():
    made = []

    def make(**kw):
        made.append(SGLangStandIn(lambda b: ([1], [-0.1], "stop"), **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_attaching_takes_the_server_s_tp_size(stand_ins, capsys):
    """Issue 52, item 7: the recipe says 1, the server serves 2: its value is used (the group's
    world and the tensor payloads per server follow it), in one line naming the key."""
    srv = stand_ins(server_info={"tp_size": 2, "dp_size": 1, "pp_size": 1})
    fleet = _attached(srv, transport="tensor").start()
    assert fleet.workers[0].cfg.tp_size == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "serves tp_size=2" in err[0] and "rollout.sglang.tp_size=1" in err[0]
    with fleet.sessions():
        fleet.push_ipc(["a", "b"], 1, last=True)  # two payloads: accepted
    with pytest.raises(SGLangSetupError, match=r"rollout.sglang.tp_size=1, but .* tp_size=2"):
        _attached(srv, transport="colocated").start()  # its payload ranks are trainer ranks
    same = _attached(srv, transport="tensor", tp_size=2).start()
    assert same.workers[0].cfg.tp_size == 2 and not capsys.readouterr().err


@pytest.mark.parametrize("sizes", [(1, 2, 1), (1, 1, 2)], ids=["dp2", "pp2"])
def test_data_or_pipeline_parallel_servers_are_refused_for_pushes(stand_ins, sizes):
    tp, dp, pp = sizes
    srv = stand_ins(server_info={"tp_size": tp, "dp_size": dp, "pp_size": pp})
    with pytest.raises(SGLangSetupError, match=rf"dp_size={dp}, pp_size={pp}") as e:
        _attached(srv).start()
    assert srv.url in str(e.value) and "\n" not in str(e.value)
    assert _attached(srv, transport="disk").start()  # no group, no per-rank payloads


def test_without_server_info_the_recipe_stands(stand_ins, capsys):
    srv = stand_ins()  # no /server_info (a router)
    fleet = _attached(srv, tp_size=2).start()
    assert fleet.workers[0].cfg.tp_size == 2
    assert "rollout.sglang.tp_size=2 stands" in capsys.readouterr().err


def test_attaching_closes_a_session_a_killed_trainer_left_open(stand_ins, capsys):
    """Issue 52, item 5: a trainer killed inside a push leaves the server paused with a
    session open; the next one to attach ends it and continues generation, then pushes. A
    server that is ready gets no request at all; one paused without a session just continues
    (the "none open" answer is no error)."""
    srv = stand_ins()
    for path in ("/pause_generation", "/begin_weight_update"):
        srv.handle(path, {"mode": "retract"} if "pause" in path else {})
    fleet = _attached(srv).start()
    assert srv.paths()[2:] == ["/end_weight_update", "/continue_generation"]
    assert not srv.in_session and not srv.paused
    assert "a weight-update session it left open closed" in capsys.readouterr().err
    fleet._group = (_NoGroup(), "g", "gloo")
    fleet.transport = "disk"
    fleet.update_weights_from_disk("/m", 1)
    assert srv.version == "1"

    ready = stand_ins()
    _attached(ready).start()
    assert ready.paths() == []
    paused = stand_ins()
    paused.handle("/pause_generation", {"mode": "retract"})
    _attached(paused).start()
    assert paused.paths()[1:] == ["/end_weight_update", "/continue_generation"]
    assert not paused.paused


def test_a_failing_close_is_one_line(stand_ins, monkeypatch):
    srv = stand_ins()
    srv.paused = True

    def refuse(path, body):
        return srv._fail("scheduler busy") if path == "/end_weight_update" else (None, 200)

    monkeypatch.setattr(srv, "handle", refuse)
    with pytest.raises(EngineResponseError, match="/end_weight_update returned HTTP 400") as e:
        _attached(srv).start()
    assert "scheduler busy" in str(e.value) and "\n" not in str(e.value)


def test_attaching_resumes_what_a_killed_colocated_trainer_released(stand_ins, tmp_path, capsys):
    """Issue 63, item 4a: a colocated trainer releases the server's memory before its update
    and is killed there; SGLang 0.5.23 reports no released region (and fails resuming one that
    is not), so the trainer records what it released in the run's SGLang log dir. The next one
    to attach resumes exactly those regions before continuing generation (a forward on released
    memory touches unmapped pages); with nothing recorded, nothing is resumed."""
    from megatron_p3o.rollout.sglang import build_fleet

    srv = stand_ins()
    sg = SGLangConfig(url=srv.url, startup_timeout_s=10, max_retries=0)
    killed = build_fleet(sg, [], tmp_path, "colocated")
    killed.pause_generation()
    killed.release_memory()  # ... and the trainer dies here
    assert srv.released and (tmp_path / "released_memory.json").is_file()
    n = len(srv.paths())
    build_fleet(sg, [], tmp_path, "colocated").start()
    assert srv.paths()[n:] == ["/end_weight_update", "/resume_memory_occupation",
                               "/continue_generation"]  # fmt: skip
    assert not srv.released and not srv.paused
    assert not (tmp_path / "released_memory.json").exists()
    assert "released memory (kv_cache, weights, cuda_graph) resumed" in capsys.readouterr().err
    fresh = stand_ins()
    fresh.handle("/pause_generation", {"mode": "retract"})
    build_fleet(replace(sg, url=fresh.url), [], tmp_path, "colocated").start()
    assert "/resume_memory_occupation" not in fresh.paths()


def test_a_scheduler_blocked_in_a_broadcast_is_one_line_in_seconds(stand_ins, monkeypatch):
    """Issue 63, item 4b: a trainer killed inside /update_weights_from_distributed leaves the
    scheduler blocked in the broadcast until NCCL's timeout: it accepts connections and answers
    nothing. Attaching says so in one line within the stale-call bound, not after the request
    timeout (600 s by default)."""
    import time

    from megatron_p3o.rollout.sglang import attach
    from megatron_p3o.rollout.sglang.protocol import EngineUnavailableError

    monkeypatch.setattr(attach, "STALE_CALL_S", 1.0)
    srv = stand_ins()
    srv.handle("/pause_generation", {"mode": "retract"})
    srv.handle("/begin_weight_update", {})
    srv.blocked.set()
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineUnavailableError, match="scheduler is blocked") as e:
            _attached(srv).start()
    finally:
        srv.blocked.clear()
    assert time.monotonic() - t0 < 5.0 and "\n" not in str(e.value) and srv.url in str(e.value)


def test_a_launch_stops_the_server_a_dead_trainer_left_running(tmp_path, capfd):
    """Issue 63, item 4b (a launched server): the server a killed trainer launched outlives it
    (blocked in a broadcast, holding its port); the next launch of the run stops its process
    group first (one line). A pid that is not an SGLang process is left alone."""
    import subprocess
    import sys
    import time

    from megatron_p3o.rollout.sglang.launch import ServerProcess

    log = tmp_path / "server0.log"
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                            "sglang.launch_server"], start_new_session=True)  # fmt: skip
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)  # fmt: skip
    try:
        log.with_suffix(".pid").write_text(f"{other.pid}\n")
        ServerProcess([sys.executable, "-c", "pass"], {}, log).start().proc.wait(10)
        assert other.poll() is None  # not an SGLang process: untouched
        log.with_suffix(".pid").write_text(f"{old.pid}\n")
        ServerProcess([sys.executable, "-c", "pass"], {}, log).start().proc.wait(10)
        deadline = time.monotonic() + 5
        while old.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert old.poll() is not None
        assert "was still running, its trainer gone: stopped" in capfd.readouterr().err
    finally:
        for p in (old, other):
            p.kill()
            p.wait()
