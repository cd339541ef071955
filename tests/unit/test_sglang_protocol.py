"""The SGLang client against the pinned release's own source, and against its rules.

The release's wheel (``sglang==0.5.23``, fetched ``--no-deps`` by ``tools/run_tests.sh`` into
``.cache/sglang/``, or named by ``P3O_SGLANG_WHEEL``) is read as text, never imported: its route
table (``http_server.py``) and its request classes (``io_struct.py``, ``sampling_params.py``)
are parsed with ``ast``, and every route and field the client sends must exist there. The
session order and the restart rule are checked against ``tests/sglang_standin.py``.
"""

import ast
import os
import zipfile
from pathlib import Path

import pytest
import torch

from megatron_p3o.rollout.sglang import SGLangConfig, SGLangEngine, SGLangFleet
from megatron_p3o.rollout.sglang.launch import server_env
from megatron_p3o.rollout.sglang.protocol import (
    MEMORY_TAGS,
    RESUME_AFTER_PUSH,
    RESUME_BEFORE_PUSH,
    EngineResponseError,
    batch_payload,
    disk_payload,
    distributed_payload,
    generate_payload,
    init_group_payload,
    release_payload,
    resume_payload,
)
from megatron_p3o.types import SamplingParams
from tests.sglang_env import interpreter_path, sglang_python, wait_for_the_environment

from ..sglang_standin import SGLangStandIn

ROOT = Path(__file__).resolve().parents[2]
PINNED = "0.5.23"


def _wheel() -> Path:
    env = os.environ.get("P3O_SGLANG_WHEEL")
    found = [Path(env)] if env else sorted((ROOT / ".cache/sglang").glob(f"sglang-{PINNED}-*.whl"))
    if not found or not found[0].is_file():
        pytest.skip(f"no sglang {PINNED} wheel (tools/run_tests.sh fetches it into .cache/sglang)")
    return found[0]


@pytest.fixture(scope="module")
def release():
    """(routes: {path: (methods, request class)}, classes: {name: field names})."""
    with zipfile.ZipFile(_wheel()) as z:
        http = ast.parse(z.read("sglang/srt/entrypoints/http_server.py"))
        structs = ast.parse(z.read("sglang/srt/managers/io_struct.py"))
        sampling = ast.parse(z.read("sglang/srt/sampling/sampling_params.py"))
    classes = {}
    for tree in (structs, sampling):
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = {
                    s.target.id
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
                literals = {}
                for s in node.body:
                    if isinstance(s, ast.AnnAssign) and "Literal[" in ast.unparse(s.annotation):
                        literals[s.target.id] = ast.unparse(s.annotation)
                classes[node.name + ".literals"] = literals
    routes = {}
    for node in http.body:
        if not isinstance(node, (ast.AsyncFunctionDef, ast.FunctionDef)):
            continue
        req = None
        for a in node.args.args:
            if a.annotation is not None:
                ann = ast.unparse(a.annotation)
                for name in classes:
                    if name.endswith("ReqInput") and name in ann:
                        req = name
        for d in node.decorator_list:
            if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args:
                kind = d.func.attr
                if kind in ("post", "get", "api_route") and isinstance(d.args[0], ast.Constant):
                    methods = {kind.upper()} if kind != "api_route" else set()
                    for kw in d.keywords:
                        if kw.arg == "methods":
                            methods = {e.value for e in kw.value.elts}
                    routes[d.args[0].value] = (methods, req)
    return routes, classes


BUCKET = [("model.norm.weight", torch.zeros(4)), ("lm_head.weight", torch.zeros(3, 4))]


def _client_requests():
    """(route, body) of every request the client builds."""
    sp = SamplingParams(temperature=0.9, top_k=5, max_new_tokens=7, stop_token_ids=(2,), seed=3)
    return [
        ("/generate", generate_payload([1, 2, 3], sp, seed=11)),
        ("/generate", generate_payload([1, 2, 3], sp, seed=11, routed_experts=True)),
        ("/generate", batch_payload([generate_payload([1, 2], sp, seed=s) for s in (1, 2)])),
        ("/init_weights_update_group", init_group_payload("h", 29650, 3, "g", "gloo")),
        ("/update_weights_from_distributed", distributed_payload(BUCKET, "g", 4, last=False)),
        ("/update_weights_from_distributed", distributed_payload(BUCKET, "g", 4, last=True)),
        ("/update_weights_from_disk", disk_payload("/m", 4)),
        ("/pause_generation", {"mode": "retract"}),
        ("/begin_weight_update", {}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "flush_cache": True,
                                         "weight_version": "4"}),
        ("/release_memory_occupation", release_payload()),
        ("/resume_memory_occupation", resume_payload(RESUME_BEFORE_PUSH)),
        ("/resume_memory_occupation", resume_payload(RESUME_AFTER_PUSH)),
        ("/end_weight_update", {}),
        ("/continue_generation", {}),
    ]  # fmt: skip


def test_every_route_and_field_exists_in_the_pinned_release(release):
    routes, classes = release
    assert "/health" in routes and "GET" in routes["/health"][0]
    for path, body in _client_requests():
        assert path in routes, f"{path} is not a route of sglang {PINNED}"
        methods, req = routes[path]
        assert "POST" in methods, (path, methods)
        if path == "/generate":
            req = "GenerateReqInput"
            sps = body["sampling_params"]
            extra = set().union(*(sps if isinstance(sps, list) else [sps]))
            extra -= classes["SamplingParams"]
            assert not extra, f"sampling_params fields unknown to sglang {PINNED}: {extra}"
        assert req is not None, f"{path}: no request class found"
        unknown = set(body) - classes[req]
        assert not unknown, f"{path}: fields {unknown} are not in {req} of sglang {PINNED}"
    pause = classes["PauseGenerationReqInput.literals"]["mode"]
    assert "'retract'" in pause, pause  # in-flight requests wait; 'abort' would drop them


def test_a_batched_generate_body_lists_prompts_and_sampling_in_order():
    sp = SamplingParams(temperature=0.9, max_new_tokens=7, seed=3)
    bodies = [generate_payload([1, 2 + i], sp, seed=10 + i) for i in range(3)]
    b = batch_payload(bodies)
    assert b["input_ids"] == [[1, 2], [1, 3], [1, 4]]
    assert [x["sampling_seed"] for x in b["sampling_params"]] == [10, 11, 12]
    assert b["return_logprob"] is True and b["logprob_start_len"] == -1
    with pytest.raises(ValueError, match="differ"):
        batch_payload([bodies[0], generate_payload([1], sp, seed=1, routed_experts=True)])
    with pytest.raises(ValueError, match="no requests"):
        batch_payload([])


def test_launch_environment_has_no_torchrun_variables():
    worker = {
        "PATH": "/bin", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "x", "HF_HOME": "/h",
    }  # fmt: skip
    env = server_env(worker, gpus="4,5")
    assert env == {
        "PATH": "/bin",
        "HF_HOME": "/h",
        "SGLANG_RETURN_ORIGINAL_LOGPROB": "false",
        "CUDA_VISIBLE_DEVICES": "4,5",
    }


def _trivial(body):
    return [5, 6], [-0.5, -0.25], "length"


@pytest.fixture
def servers():
    made = []

    def make(**kw):
        s = SGLangStandIn(_trivial, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _engine(srv, **kw):
    eng = SGLangEngine(SGLangConfig(url=srv.url, startup_timeout_s=10, max_retries=0, **kw))
    eng._group = "p3o_weight_sync"  # joined ...
    return eng


def _solo(eng):
    fleet = SGLangFleet.solo(eng)
    fleet._group = (_NoGroup(), "p3o_weight_sync", "gloo")  # ... and broadcasts go nowhere
    return fleet


class _NoGroup:
    """A weight-update group whose broadcasts complete at once (the stand-in receives none)."""

    def broadcast(self, tensors, opts):
        class Done:
            def wait(self):
                return True

        return Done()


def test_pushes_are_bracketed_per_worker(servers):
    a, b = servers(), servers()
    fleet = SGLangFleet(_engine(a), [_engine(a), _engine(b)])
    fleet._group = (_NoGroup(), "p3o_weight_sync", "gloo")  # one group spanning both
    fleet.update_weights(iter([BUCKET, BUCKET, BUCKET]), version=7)
    for srv in (a, b):
        assert srv.paths() == [
            "/pause_generation", "/begin_weight_update",
            "/update_weights_from_distributed", "/update_weights_from_distributed",
            "/update_weights_from_distributed", "/end_weight_update", "/continue_generation",
        ]  # fmt: skip
        pushes = [body for p, body in srv.routes if p == "/update_weights_from_distributed"]
        assert [p["flush_cache"] for p in pushes] == [False, False, True]
        assert [p.get("weight_version") for p in pushes] == [None, None, "7"]
        assert srv.version == "7" and not srv.in_session and not srv.paused


def test_the_stand_in_refuses_a_push_outside_a_session(servers):
    srv = servers()
    with pytest.raises(EngineResponseError, match="outside a weight-update session"):
        _solo(_engine(srv))._broadcast_bucket(BUCKET, 1, last=True)


def test_samples_never_carry_a_version_the_server_does_not_hold(servers):
    srv = servers()
    eng = _engine(srv)
    with pytest.raises(EngineResponseError, match="weight_version 'default'"):
        eng.generate([[1]], 1, SamplingParams(max_new_tokens=2))  # nothing pushed yet
    _solo(eng).update_weights([BUCKET], version=3)
    assert {s.weight_version for s in eng.generate([[1]], 2, SamplingParams())} == {3}
    srv.restart()  # the server died mid-run and came back with the base weights
    with pytest.raises(EngineResponseError, match="weight_version 'default'"):
        eng.generate([[1]], 1, SamplingParams(max_new_tokens=2))


def test_every_request_carries_the_api_key(servers, monkeypatch):
    srv = servers(api_key="s3cret")
    monkeypatch.delenv("P3O_SGLANG_API_KEY", raising=False)
    with pytest.raises(EngineResponseError, match="HTTP 401"):
        _engine(srv).update_weights_from_disk("/m", 1)
    monkeypatch.setenv("P3O_SGLANG_API_KEY", "s3cret")
    eng = _engine(srv)
    eng.update_weights_from_disk("/m", 1)
    assert eng.generate([[1]], 1, SamplingParams())[0].weight_version == 1
    assert srv.refused == 1


def _sglang_function(name: str):
    """A function's source from the pinned wheel, compiled here (sglang itself is not
    installed: its imports would pull CUDA torch)."""
    with zipfile.ZipFile(_wheel()) as z:
        tree = ast.parse(z.read("sglang/srt/utils/common.py"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns = {"torch": torch, "torch_release": tuple(int(x) for x in torch.__version__.split(".")[:2])}
    exec(compile(ast.Module([fn], []), "sglang/srt/utils/common.py", "exec"), ns)  # noqa: S102
    return ns[name]


def _group_member(rank: int, port: int, queue):
    """Rank 0: the trainer's ``weight_sync_group``; rank 1: SGLang's own
    ``init_custom_process_group``, called as its weight updater calls it (gloo on CPU)."""
    from megatron_p3o.rollout.sglang.weights import weight_sync_group

    try:
        if rank == 0:
            pg = weight_sync_group("127.0.0.1", port, 2, "p3o_weight_sync", backend="gloo")
            t = torch.arange(4.0)
        else:
            init = _sglang_function("init_custom_process_group")
            pg = init(
                backend="gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                world_size=2,
                rank=1,
                group_name="p3o_weight_sync",
            )
            t = torch.zeros(4)
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        pg.broadcast([t], opts).wait()
        queue.put((rank, t.tolist()))
    except Exception as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, repr(e)))


def test_weight_sync_group_forms_with_sglangs_own_code():
    """The NCCL unique id (here: gloo's rendezvous keys) must land where SGLang's end reads it;
    a different PrefixStore wrapping hangs the rendezvous until the timeout."""
    import multiprocessing as mp

    from megatron_p3o.runtime.ports import free_port

    _wheel()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_group_member, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert got == {0: [0.0, 1.0, 2.0, 3.0], 1: [0.0, 1.0, 2.0, 3.0]}, got


def test_tensor_payload_is_read_by_sglangs_own_deserializer():
    """Our payload (built without sglang) decodes with SGLang 0.5.23's own
    ``MultiprocessingSerializer.deserialize`` (base64, then its ``SafeUnpickler``), run in the
    SGLang environment, to the same named tensors: CPU tensors travel as data (a CPU server cannot
    take torch's shared-memory file descriptors); CUDA ones by IPC handle, which needs a GPU."""
    import json
    import subprocess

    from megatron_p3o.weight_sync.ipc import serialize_named_tensors

    py = sglang_python()
    named = [("model.norm.weight", torch.arange(4.0)), ("lm_head.weight", torch.ones(2, 3))]
    code = (
        "import json, sys\n"
        "from sglang.srt.utils.common import MultiprocessingSerializer\n"
        "named = MultiprocessingSerializer.deserialize(sys.stdin.read())\n"
        "print(json.dumps([(n, t.tolist()) for n, t in named]))\n"
    )
    r = subprocess.run([py, "-c", code], input=serialize_named_tensors(named), text=True,
                       capture_output=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == [[n, t.tolist()] for n, t in named], got


def test_a_restart_mid_rollout_never_mislabels_samples():
    """The server dies and comes back (base weights, version "default") after the third of
    eight concurrent requests: the rollout fails with the reason instead of tagging the later
    samples with the version the client pushed before."""
    calls = {"n": 0}

    def generate(body):
        calls["n"] += 1
        if calls["n"] == 3:
            srv.restart()
        return [5, 6], [-0.5, -0.25], "length"

    srv = SGLangStandIn(generate)
    try:
        eng = _engine(srv)
        _solo(eng).update_weights([BUCKET], version=2)
        with pytest.raises(EngineResponseError, match="weight_version 'default'"):
            eng.generate([[1]] * 8, 1, SamplingParams(max_new_tokens=2))
    finally:
        srv.close()


def test_every_launch_flag_is_a_server_argument_of_the_pinned_release():
    """Each flag ``server_args`` can emit (everything switched on, ``rollout.deterministic``
    included) is an annotated server-argument field of the pinned release."""
    import re

    from megatron_p3o.rollout.sglang.launch import server_args

    gpu = SGLangConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3", deterministic=True,
                       routed_experts=(2, 2), device="cuda", max_total_tokens=4096,
                       memory_saver=True)  # fmt: skip
    cpu = SGLangConfig(device="cpu")
    flags = [a[2:].replace("-", "_") for c in (gpu, cpu) for a in server_args(c) if a[:2] == "--"]
    assert "enable_deterministic_inference" in flags
    assert "enable_return_routed_experts" in flags and "enable_memory_saver" in flags
    with zipfile.ZipFile(_wheel()) as z:
        text = "\n".join(
            z.read(n).decode()
            for n in z.namelist()
            if n.startswith("sglang/srt/") and ("arg" in n) and n.endswith(".py")
        )
    fields = set(re.findall(r"^\s+(\w+)\s*:", text, re.M))
    missing = [f for f in flags if f not in fields]
    assert not missing, f"not server arguments of sglang {PINNED}: {missing}"


def test_routed_experts_response_is_decoded_as_the_release_encodes_it():
    """``meta_info.routed_experts``: base64 of int32 ``[P + C − 1, layers, k]`` (the release's
    detokenizer encodes ``numpy().tobytes()``); a wrong size is refused naming the request."""
    import base64

    import numpy as np

    from megatron_p3o.rollout.sglang.protocol import parse_generate_response

    routes = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 4
    resp = {
        "output_ids": [5, 6],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
            "weight_version": "3",
            "routed_experts": base64.b64encode(routes.tobytes()).decode(),
        },
    }
    s = parse_generate_response(resp, [1, 2, 3], 0, routed_experts=(2, 2))
    assert s.routed_experts.tolist() == routes.tolist()
    with pytest.raises(EngineResponseError, match="r1: routed_experts holds 16 values"):
        parse_generate_response(resp, [1, 2, 3, 4], 0, routed_experts=(2, 2))


def release_source(relpath: str) -> str:
    """A file of the pinned release's source: from the wheel (as above), else from the SGLang
    environment's installed copy (``$SGLANG_PYTHON``'s venv, or ``.venv-sglang``)."""
    env = os.environ.get("P3O_SGLANG_WHEEL")
    found = [Path(env)] if env else sorted((ROOT / ".cache/sglang").glob(f"sglang-{PINNED}-*.whl"))
    if found and found[0].is_file():
        with zipfile.ZipFile(found[0]) as z:
            return z.read(relpath).decode()
    wait_for_the_environment()
    py = interpreter_path()
    for site in sorted(Path(py).parent.parent.glob("lib/python3*/site-packages")):
        meta = list(site.glob(f"sglang-{PINNED}.dist-info"))
        if meta and (site / relpath).is_file():
            return (site / relpath).read_text()
    pytest.skip(f"no sglang {PINNED} source (wheel or SGLang environment)")


def wheel_memory_tags() -> list:
    """``GPU_MEMORY_ALL_TYPES`` of the pinned release (``sglang/srt/constants.py``), by ast."""
    tree = ast.parse(release_source("sglang/srt/constants.py"))
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            consts[node.targets[0].id] = node.value
    return [
        consts[e.id].value if isinstance(e, ast.Name) else e.value
        for e in consts["GPU_MEMORY_ALL_TYPES"].elts
    ]


def released_tags(body: dict) -> set:
    """What a ``/release_memory_occupation`` or ``/resume_memory_occupation`` body covers in
    the pinned release: no tags means all of them (``weight_updater.py``)."""
    return set(body.get("tags") or wheel_memory_tags())


def test_a_colocated_push_resumes_every_memory_region_it_releases():
    """Issue 42, item 1: the empty release body freed the CUDA graphs too, and they were never
    resumed. The release names every region of the pinned release, and the two resumes of a
    push cover exactly what was released."""
    tags = wheel_memory_tags()
    assert "cuda_graph" in tags and set(tags) == set(MEMORY_TAGS), tags
    released = released_tags(release_payload())
    resumed = [released_tags(resume_payload(t)) for t in (RESUME_BEFORE_PUSH, RESUME_AFTER_PUSH)]
    assert released == set(tags)
    assert resumed[0] | resumed[1] == released and not resumed[0] & resumed[1]
    assert "weights" in resumed[0]  # loaded into before the push
    src = release_source("sglang/srt/managers/scheduler_components/weight_updater.py")
    assert "tags = GPU_MEMORY_ALL_TYPES" in src and "offload_tags.remove(tag)" in src
