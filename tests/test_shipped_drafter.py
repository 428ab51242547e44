"""Tier 3: the DFlash drafter adaspec ships for SmolLM2-135M-Instruct loads, fits the target
(vocabulary, hidden size, tap layers, mask token) and keeps the output mlx-lm's at T=0."""

import json

import mlx_lm
import pytest

import adaspec
from adaspec.drafters import dflash
from adaspec.drafters.arms import default_spec
from adaspec.prompting import messages_for, prompt_ids
from adaspec.settings import from_env
from adaspec.targets.base import layer_list, target_info
from adaspec.train.pipeline import choose_mask_token

# Open prompts of the dev suite (story, explain, code-gen, math), where PLD rarely has a match
# and the DFlash drafter does the drafting, plus one grounded prompt for the PLD arm in front of it.
PROMPTS = [
    "Write a short story about a robot learning to bake bread.",
    "Explain why the sky is blue to a beginner.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "A shop sells pencils at 3 for 40 cents. How much do 27 pencils cost? Explain step by step.",
    "Repeat the following text exactly, without changing anything.\n\nThe council met on Monday "
    "and agreed that the old bridge over the river will be closed for repairs until March.",
]


@pytest.fixture(scope="module")
def shipped(smollm2):
    model, tok = smollm2
    info = target_info(model, tok)
    folder = dflash.default_checkpoint(info)
    assert folder is not None, "no DFlash checkpoint ships for smollm2-135m"
    return model, tok, info, folder


def test_shipped_drafter_fits_the_target(shipped):
    model, tok, info, folder = shipped
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["vocab_size"] == info.vocab_size
    assert cfg["hidden_size"] == info.hidden_size
    assert cfg["num_target_layers"] == len(layer_list(model))
    assert cfg["torch_dtype"] == "float16"
    d = cfg["dflash_config"]
    assert all(0 <= i < len(layer_list(model)) for i in d["target_layer_ids"])
    assert d["mask_token_id"] == choose_mask_token(tok, info.vocab_size)[0]
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size < 25 * 2**20, f"{size} bytes ships in the package"
    assert (folder / "README.md").is_file()  # the model card
    drafter = dflash.load(folder, info)
    assert drafter.model.cfg.target_layer_ids == tuple(d["target_layer_ids"])
    # the CLI's default is auto, which takes the shipped drafter only once it is marked as
    # beating PLD alone (in_auto); until then the drafter is one name away
    assert default_spec(info) == "auto"


@pytest.mark.parametrize("drafter", ["auto", "dflash", "auto:suffix=true"])
@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_shipped_drafter_output_is_mlx_lm_greedy(shipped, drafter, i):
    model, tok, _, _ = shipped
    ids = prompt_ids(tok, messages_for(PROMPTS[i]))
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=40)]
    rs = list(
        adaspec.stream_generate(
            model, tok, ids, drafter=drafter, max_tokens=40, settings=from_env({}, gate="off")
        )
    )
    assert [r.token for r in rs] == ref
    assert rs[-1].stats.spec_steps > 0  # it really speculated
