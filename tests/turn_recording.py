"""What the multi-turn tests observe of an engine: every turn each trajectory asked for (its
input ids, the engine's output ids and log-probs), recorded at the engine's turn server, and the
prefix invariant checked against the trajectories the loop returned."""

import threading
from typing import Dict, List


class RecordingServer:
    """Wraps a turn server: ``calls[k]`` = [(input ids, output ids, log-probs, finish)] of
    trajectory ``k``, in its turn order."""

    def __init__(self, inner, calls: Dict[int, list], lock):
        self.inner, self.calls, self.lock = inner, calls, lock

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, k, ids, sampling, key=None):
        s = await self.inner.generate(k, ids, sampling, key)
        with self.lock:
            self.calls.setdefault(k, []).append(
                (list(ids), list(s.completion_ids), list(s.logprobs), s.finish_reason)
            )
        return s


def record_turns(engine) -> Dict[int, list]:
    """Record every turn the loop asks ``engine`` for (per rollout: cleared at each new server)."""
    calls: Dict[int, list] = {}
    lock = threading.Lock()
    real = engine.turn_server

    def turn_server(slots, max_len):
        calls.clear()
        return RecordingServer(real(slots, max_len), calls, lock)

    engine.turn_server = turn_server
    return calls


def prefix_violations(samples, calls: Dict[int, list]) -> dict:
    """Over every turn of every trajectory: its input is everything kept so far (the previous
    input, the engine's output, the appended ids) and its output and log-probs are kept as the
    engine gave them (``violations``: turns where any of that fails)."""
    violations = turns = 0
    for k, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        mine = calls.get(k, [])
        starts = s.meta["turn_inputs"]
        if len(mine) != len(starts):
            violations += 1
            continue
        for t, (inp, out, lps, _) in enumerate(mine):
            turns += 1
            a = starts[t]
            c = a - len(s.prompt_ids)
            bad = inp != seq[:a] or seq[a : a + len(out)] != out
            bad = bad or s.logprobs[c : c + len(out)] != lps
            if t + 1 < len(mine):
                bad = bad or mine[t + 1][0][: len(inp) + len(out)] != inp + out
            violations += bool(bad)
    return {"violations": violations, "turns": turns, "episodes": len(samples)}


def appended_spans(s) -> List[List[int]]:
    """The ids the loop appended after each model turn (mask-0 runs), in order."""
    out, cur = [], []
    for t, m in zip(s.completion_ids, s.policy_mask):
        if m == 0:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out
