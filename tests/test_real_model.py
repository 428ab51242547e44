"""Tier 3: the real default model (SmolLM2-135M-Instruct). Speculative output is mlx-lm's."""

import mlx_lm
import pytest

import adaspec
from adaspec.prompting import messages_for, prompt_ids
from adaspec.settings import from_env

# Grounded prompts (copyable text in the prompt), where PLD has something to propose.
PROMPTS = [
    "Repeat this sentence twice, word for word: The river carried the old boat past the mill "
    "and under the stone bridge before sunset.",
    "Fix the bug and return the whole function:\n\ndef mean(xs):\n    total = 0\n    for x in "
    "xs:\n        total += x\n    return total / len(x)\n",
    "List the three names in this text, one per line: Maria met Tomas at the station, and "
    "later both of them visited Aunt Leila in the hospital.",
]


@pytest.mark.parametrize("i", range(len(PROMPTS)))
@pytest.mark.parametrize("gate", ["off", "both"])
def test_pld_output_is_identical_to_mlx_lm_greedy(smollm2, i, gate):
    model, tok = smollm2
    ids = prompt_ids(tok, messages_for(PROMPTS[i]))
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=48)]
    rs = list(
        adaspec.stream_generate(
            model, tok, ids, drafter="pld", max_tokens=48, settings=from_env({}, gate=gate)
        )
    )
    assert [r.token for r in rs] == ref
    if gate == "off":
        assert rs[-1].stats.spec_steps > 0  # it really speculated


def test_sampling_with_a_seed_is_reproducible(smollm2):
    model, tok = smollm2
    ids = prompt_ids(tok, messages_for(PROMPTS[0]))

    def run(seed=3):
        return adaspec.generate(
            model,
            tok,
            ids,
            drafter="pld",
            max_tokens=24,
            temp=0.8,
            top_p=0.95,
            seed=seed,
        )

    assert run() == run()
    assert run() != run(4)  # the seed decides: another one samples otherwise
