"""The texts the reward sees: each distinct completion decoded once; the prompts of a step
encoded in one tokenizer call, the same ids as one call per prompt (the shipped tiny
tokenizer)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_decode_completions_decodes_each_distinct_completion_once():
    from megatron_p3o.reward import decode_completions

    calls = []

    def decode(ids):
        calls.append(tuple(ids))
        return "-".join(map(str, ids))

    comps = [[1, 2], [3], [1, 2], [], [3], [1, 2, 2]]
    assert decode_completions(decode, comps) == ["1-2", "3", "1-2", "", "3", "1-2-2"]
    assert sorted(calls) == sorted({(1, 2), (3,), (), (1, 2, 2)})


@pytest.mark.parametrize("add_bos", [True, False])
def test_prompts_encoded_in_one_call_equal_one_call_each(tmp_path, add_bos):
    import json

    from megatron_p3o.data.prompts import PromptData, encode_prompt
    from megatron_p3o.model.hf.safetensors_io import load_tokenizer

    tok = load_tokenizer(ROOT / "bases" / "tiny_addition" / "hf")
    texts = ["12+34=", "7+8=", "99+1=", "", "5+5= 3"]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": t, "answer": "0"}) + "\n" for t in texts))
    data = PromptData(str(f), tok, shuffle=False, add_bos=add_bos)
    got = [it.prompt_ids for it in data.next_local(len(texts))]
    assert got == [encode_prompt(tok, t, False, add_bos) for t in texts]
    assert (got[0][0] == tok.bos_token_id) == add_bos
