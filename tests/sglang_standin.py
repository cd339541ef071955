"""A loopback server that speaks SGLang 0.5.23's HTTP protocol and enforces its rules — kept only
for faults the real server cannot be made to produce.

The SGLang-facing features themselves are tested against the real SGLang 0.5.23 server on CPU
(``tests/sglang_server/``). This stand-in remains where the real server cannot show the case:
non-finite behaviour log-probs (``EmbeddedStandIn(nan_logprobs=True)``, the CLI error test), a
server that comes back with its base weights *between* two requests of one rollout (the
"default" version refusal), the exact route order of a fleet's bracketed sessions, and colocated
CUDA-IPC pushes with memory release (``/release_memory_occupation`` needs a GPU: on CPU the real
server crashes in ``torch.cuda.synchronize``).

What it enforces, as that release does (``tests/unit/test_sglang_protocol.py`` reads the rules
from the release's own source): weight pushes over a process group or as tensors only inside a
weight-update session (``/begin_weight_update`` … ``/end_weight_update``), ``weight_version``
reported as the string ``"default"`` until a push sets it, and, when started with an API key,
``401`` for any request without ``Authorization: Bearer <key>``; a push while the weights' memory
is released (colocated servers) is refused. It records every POST it was asked for, in order.
Generation is delegated to ``generate(body) -> (output_ids, logprobs, finish_type)``.

Its answers have the shape of the release's own handlers (``tests/unit/test_sglang_round5.py``
derives each route's success body from ``http_server.py``): ``null`` from the memory routes
(their handlers return nothing), an empty body from ``/health`` and ``/ready`` (503 while
paused: the release's ``/health`` generates a token, which a pause holds until it gives up
after 20 s), objects with the handlers' keys elsewhere, and the weight updater's own messages.
``GET /server_info`` answers only when started with ``server_info`` (the server arguments an
attaching client reads, e.g. ``{"tp_size": 2, "dp_size": 1, "pp_size": 1}``); without it the
route is missing, as behind a router, and the client keeps its recipe's ``tp_size``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, List, Optional, Tuple

SESSION_ROUTES = ("/update_weights_from_distributed", "/update_weights_from_tensor")
GET_ROUTES = ("/health", "/ready", "/server_info")
POST_ROUTES = (
    "/generate", "/pause_generation", "/continue_generation", "/begin_weight_update",
    "/end_weight_update", "/release_memory_occupation", "/resume_memory_occupation",
    *SESSION_ROUTES, "/update_weights_from_disk", "/init_weights_update_group",
)  # fmt: skip
# the weight updater's messages (sglang/srt/managers/scheduler_components/weight_updater.py)
ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NONE_OPEN = "no weight-update session is open; call begin_weight_update() first"


class SGLangStandIn:
    def __init__(
        self,
        generate: Callable[[dict], Tuple[List[int], List[float], str]],
        api_key: Optional[str] = None,
        load_from_disk: Optional[Callable[[str], None]] = None,
        server_info: Optional[dict] = None,
    ):
        self.generate, self.api_key, self.load_from_disk = generate, api_key, load_from_disk
        self.server_info = server_info
        self.lock = threading.Lock()
        self.routes: List[Tuple[str, dict]] = []  # (path, body) in arrival order
        self.version = "default"
        self.in_session = self.paused = False
        self.released: set = set()  # memory tags given back (colocated servers)
        # set: every POST waits (a scheduler blocked in a weight broadcast whose trainer died)
        self.blocked = threading.Event()
        self.generated, self.loads, self.refused = 0, [], 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, obj, code=200, empty=False):
                raw = b"" if empty else json.dumps(obj).encode()
                self.send_response(code)
                if not empty:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _authorized(self) -> bool:
                if outer.api_key is None:
                    return True
                if self.headers.get("Authorization") == f"Bearer {outer.api_key}":
                    return True
                with outer.lock:
                    outer.refused += 1
                self._send({"error": "Unauthorized"}, 401)
                return False

            def do_GET(self):
                if self.path not in ("/health", "/ready") and not self._authorized():
                    return  # /health and /ready stay open under a key (srt/utils/auth.py)
                if self.path == "/health":  # its generation is held while paused: 503
                    self._send(None, 503 if outer.paused else 200, empty=True)
                elif self.path == "/ready":
                    self._send(None, 503 if outer.paused else 200, empty=True)
                elif self.path == "/server_info" and outer.server_info is not None:
                    info = {"version": "0.5.23", "frontend": "python", "internal_states": [{}],
                            "startup_time": 0.0, **outer.server_info}  # fmt: skip
                    self._send(info)
                else:
                    self._send({"detail": "Not Found"}, 404)

            def do_POST(self):
                if not self._authorized():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                obj, code = outer.handle(self.path, body)
                self._send(obj, code)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def restart(self) -> None:
        """As if the server process were relaunched: base weights, no session, no version."""
        with self.lock:
            self.version, self.in_session, self.paused = "default", False, False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def paths(self) -> List[str]:
        with self.lock:
            return [p for p, _ in self.routes]

    def _fail(self, message: str):
        return {"success": False, "message": message}, 400

    def handle(self, path: str, body: dict):
        with self.lock:
            self.routes.append((path, body))
        while self.blocked.is_set():  # no answer until it is cleared
            threading.Event().wait(0.05)
        if path == "/generate":
            ids, lps, kind = self.generate(body)
            with self.lock:
                self.generated += 1
                rid, version = f"r{self.generated}", self.version
            triples = [[lp, t, None] for lp, t in zip(lps, ids)]
            meta = {"id": rid, "finish_reason": {"type": kind}, "weight_version": version}
            return {"output_ids": ids, "meta_info": {**meta, "output_token_logprobs": triples}}, 200
        if path == "/pause_generation":
            self.paused = True
            return {"message": "Generation paused successfully.", "status": "ok"}, 200
        if path == "/continue_generation":
            self.paused = False
            return {"message": "Generation continued successfully.", "status": "ok"}, 200
        if path == "/begin_weight_update":
            if self.in_session:
                return self._fail(ALREADY_OPEN)
            self.in_session = True
            return {"success": True, "message": "Success"}, 200
        if path == "/end_weight_update":
            if not self.in_session:
                return self._fail(NONE_OPEN)
            self.in_session = False
            return {"success": True, "message": "Success"}, 200
        if path == "/release_memory_occupation":  # the handlers return nothing: null
            self.released = set(body.get("tags") or ("weights", "kv_cache"))
            return None, 200
        if path == "/resume_memory_occupation":  # a tag not released: the scheduler's KeyError
            tags = set(body.get("tags") or ("weights", "kv_cache"))
            if not tags <= self.released:
                return {"error": f"KeyError: {sorted(tags - self.released)}"}, 500
            self.released -= tags
            return None, 200
        if path in SESSION_ROUTES:
            if "weights" in self.released:
                return self._fail(f"{path}: the weights' memory is released (resume it first)")
            if not self.in_session:
                return self._fail(f"{path} outside a weight-update session (begin_weight_update)")
            if body.get("weight_version") is not None:
                self.version = str(body["weight_version"])
            return {"success": True, "message": ""}, 200
        if path == "/update_weights_from_disk":
            if self.load_from_disk is not None:
                self.load_from_disk(body["model_path"])
            with self.lock:
                if body.get("weight_version") is not None:
                    self.version = str(body["weight_version"])
                self.loads.append(int(self.version))
            return {"success": True, "message": "", "num_paused_requests": 0}, 200
        if path == "/init_weights_update_group":
            return {"success": True, "message": ""}, 200
        return self._fail(f"no route {path}")


class EmbeddedStandIn(SGLangStandIn):
    """SGLang's protocol and rules (``tests/sglang_standin.py``) over the embedded engine."""

    def __init__(self, hf_dir: Path, nan_logprobs: bool = False, api_key: Optional[str] = None):
        from megatron_p3o.rollout.embedded import EmbeddedEngine

        self.nan_logprobs = nan_logprobs  # report NaN behaviour log-probs (a broken server)
        cfg = json.loads((hf_dir / "config.json").read_text())
        self.engine = EmbeddedEngine(cfg, "bf16", pad_token_id=cfg.get("pad_token_id") or 0)
        self.engine_lock = threading.Lock()
        super().__init__(self._generate, api_key=api_key, load_from_disk=self._load)

    def _load(self, model_path: str) -> None:
        from safetensors.torch import load_file

        tensors = {}
        for f in sorted(Path(model_path).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        with self.engine_lock:
            self.engine.update_weights([list(tensors.items())], len(self.loads))

    def _generate(self, body: dict):
        from megatron_p3o.types import SamplingParams

        sp = body["sampling_params"]
        params = SamplingParams(
            temperature=sp["temperature"],
            top_p=sp["top_p"],
            top_k=sp.get("top_k", 0),
            max_new_tokens=sp["max_new_tokens"],
            stop_token_ids=tuple(sp.get("stop_token_ids", ())),
            seed=sp.get("sampling_seed"),
        )
        with self.engine_lock:
            s = self.engine.generate([body["input_ids"]], 1, params)[0]
        lps = [float("nan")] * len(s.logprobs) if self.nan_logprobs else s.logprobs
        return s.completion_ids, lps, s.finish_reason
