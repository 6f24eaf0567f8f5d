"""The `exported` fixture of tests/llm: each random-weight model of llm_models.MODELS saved, its
skeleton exported and transformers' greedy tokens computed, once per test run (session scope:
test_decoder.py and test_generate.py share them)."""

import pytest

from llm_models import MODELS, make_exported


@pytest.fixture(scope="session", params=list(MODELS))
def exported(request, tmp_path_factory):
    return make_exported(request.param, tmp_path_factory.mktemp(request.param))
