"""The OpenEnv adapter against a real OpenEnv server (issue 64): the environment is the one the
SDK's own CLI writes (``openenv init echo_env``: an echo environment whose step reward is 0.1 ×
the message's length), served by ``openenv-core``'s own app under uvicorn in its own venv
(``tools/openenv_env.sh``), driven by :class:`megatron_p3o.env.openenv_client.OpenEnvClient`
through the trainer's turn loop on the embedded engine (a tiny random Llama)."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .cli import ROOT


def _venv_bin() -> Path:
    """The OpenEnv venv: built by tools/run_tests.sh in the background (its exit status in
    ``$P3O_OPENENV_ENV_RC``) or, without it, here (up to date: seconds)."""
    venv = ROOT / os.environ.get("OPENENV_VENV", ".venv-openenv")  # relative: to the checkout
    rc_file = os.environ.get("P3O_OPENENV_ENV_RC")
    if rc_file:
        deadline = time.monotonic() + 900
        while not Path(rc_file).exists():
            assert time.monotonic() < deadline, "tools/openenv_env.sh did not finish in 15 min"
            time.sleep(2)
        log = os.environ.get("P3O_OPENENV_ENV_LOG", "")
        assert Path(rc_file).read_text().strip() == "0", f"tools/openenv_env.sh failed: {log}"
    else:
        env = {**os.environ, "OPENENV_VENV": str(venv)}
        r = subprocess.run(["bash", str(ROOT / "tools/openenv_env.sh")], capture_output=True,
                           text=True, timeout=900, env=env)  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return venv / "bin"


def _serve(d: Path, max_envs: int):
    """``openenv init echo_env`` in ``d``, its ``max_concurrent_envs`` set to ``max_envs`` (the
    template's own knob, 1 as written), served by uvicorn: ``(url, process)``."""
    from megatron_p3o.runtime.ports import free_port

    bin_ = _venv_bin()
    r = subprocess.run([str(bin_ / "openenv"), "init", "echo_env"], cwd=d, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    app = d / "echo_env" / "server" / "app.py"
    src = app.read_text()
    assert "max_concurrent_envs=1," in src
    app.write_text(src.replace("max_concurrent_envs=1,", f"max_concurrent_envs={max_envs},"))
    port = free_port()
    log = open(d / "server.log", "w")
    proc = subprocess.Popen(
        [str(bin_ / "python"), "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=d / "echo_env", stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return url, proc
        except OSError:
            pass
        assert proc.poll() is None, (d / "server.log").read_text()[-2000:]
        assert time.monotonic() < deadline, (d / "server.log").read_text()[-2000:]
        time.sleep(0.5)


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    url, proc = _serve(tmp_path_factory.mktemp("openenv"), 64)
    yield url
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron_p3o.data.tasks import tool_calc

    train, _ = tool_calc.splits(2000, 10)
    return tool_calc.make_tokenizer(tmp_path_factory.mktemp("tok"), train)


def _rollout(tok, url, n_prompts=17, n=3, engine=None, **env_args):
    from megatron_p3o.data.prompts import encode_prompt
    from megatron_p3o.data.tasks import tool_calc
    from megatron_p3o.env.config import MultiTurnConfig
    from megatron_p3o.env.types import EnvItem
    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from megatron_p3o.rollout.turns import build_turn_loop
    from megatron_p3o.types import SamplingParams

    from ..turn_recording import record_turns
    from ..unit.test_chat_templates import _model

    if engine is None:
        cfg, ref = _model(tok, positions=512)
        engine = EmbeddedEngine(cfg, "fp32", pad_token_id=tok.pad_token_id)
        engine.update_weights([list(ref.state_dict().items())], 0)
    calls = record_turns(engine)
    args = {"url": url, "action_key": "message", "observation_key": "echoed_message",
            "show_reset": False, **env_args}  # fmt: skip
    mt = MultiTurnConfig(env="megatron_p3o.env.openenv_client:OpenEnvClient", env_args=args,
                         max_turns=3, max_total_tokens=160, tool_timeout_s=30.0)  # fmt: skip
    loop = build_turn_loop(mt, tok, True, (tok.eos_token_id,))
    rows = tool_calc.splits(100, n_prompts)[1]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    prompts = [encode_prompt(tok, r["prompt"], chat=True) for r in rows]
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=(tok.eos_token_id,), seed=5)
    try:
        return loop.run(engine, prompts, items, n, sp), calls
    finally:
        loop.close()


@pytest.mark.e2e
def test_the_sdks_echo_environment_through_the_turn_loop(echo_server, tok):
    """≥ 50 episodes × 3 turns: the prefix invariant holds (the trained tokens are the
    engine's), each turn's reward is the server's 0.1 × the length of the text the engine
    sampled, and each appended (mask-0) span carries that text back as the observation."""
    from ..turn_recording import appended_spans, prefix_violations

    out, calls = _rollout(tok, echo_server)
    inv = prefix_violations(out, calls)
    assert inv["episodes"] >= 50 and inv["turns"] >= 150 and inv["violations"] == 0, inv
    stop, said = tok.eos_token_id, 0
    for s in out:
        assert s.meta["status"] == "truncated" and s.meta["turns"] == 3, s.meta
        texts = []
        for a, b in s.meta["turn_spans"]:
            ids = s.completion_ids[a:b]
            assert all(m == 1 for m in s.policy_mask[a:b])
            ids = ids[:-1] if ids and ids[-1] == stop else ids
            texts.append(tok.decode(ids, skip_special_tokens=False))
        said += sum(len(t) > 0 for t in texts)
        assert s.meta["turn_rewards"] == pytest.approx([0.1 * len(t) for t in texts]), texts
        assert s.reward == pytest.approx(sum(0.1 * len(t) for t in texts))
        spans = appended_spans(s)
        assert len(spans) == 2  # after turns 1 and 2 (the third ends the episode)
        for span, text in zip(spans, texts):
            assert text in tok.decode(span, skip_special_tokens=False), (text, span)
    assert said >= inv["turns"] // 2, said  # most turns said something (a reward to check)


@pytest.mark.e2e
def test_episodes_wait_for_a_session_at_the_servers_capacity(tmp_path, tok):
    """The template as written serves one session at a time: 12 episodes in flight at once
    each wait for it (backoff) and all end as they would with room, none aborted. The engine
    batches by wall clock, as SGLang does (a scripted one: the embedded engine's logical-time
    ticks wait for every admitted episode, so there an episode waiting for a session another
    holds stalls both: docs/agents.md)."""
    from ..turn_recording import prefix_violations
    from ..unit.test_multiturn import ScriptedEngine

    hello = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_id]
    url, proc = _serve(tmp_path, 1)
    try:
        eng = ScriptedEngine(tok, lambda ids, turn: hello)
        out, calls = _rollout(tok, url, n_prompts=4, n=3, engine=eng)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert prefix_violations(out, calls)["violations"] == 0
    assert [s.meta["status"] for s in out] == ["truncated"] * 12, [s.meta for s in out]
    assert all(s.reward == pytest.approx(3 * 0.1 * len("hello")) for s in out)


@pytest.mark.e2e
def test_a_server_that_is_not_there_is_one_line_naming_it(tok):
    from megatron_p3o.rollout.turns import AllAborted
    from megatron_p3o.runtime.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(AllAborted) as e:
        _rollout(tok, url, n_prompts=2, n=2)
    assert time.monotonic() - t0 < 30
    assert url in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.e2e
def test_a_wrong_observation_key_is_one_line_naming_the_key(echo_server, tok):
    from megatron_p3o.rollout.turns import AllAborted

    with pytest.raises(AllAborted) as e:  # reset's observation is read with the wrong key
        _rollout(tok, echo_server, n_prompts=2, n=1, observation_key="echoed", show_reset=True)
    msg = str(e.value)
    assert "observation_key 'echoed'" in msg and "echoed_message" in msg and "\n" not in msg


def test_a_url_that_is_not_http_is_a_config_error():
    from megatron_p3o.env.config import MultiTurnConfig, env_class
    from megatron_p3o.runtime.errors import ConfigError

    mt = MultiTurnConfig(env="megatron_p3o.env.openenv_client:OpenEnvClient",
                         env_args={"url": "localhost:8000"})  # fmt: skip
    with pytest.raises(ConfigError, match="env_args.url"):
        env_class(mt)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
