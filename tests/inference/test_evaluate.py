"""Perplexity (inference/tools/evaluate.py) on cases computed by hand, the window bookkeeping, and the shipped texts."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from inference.loading.shipped_text import CALIBRATION_TEXT, shipped_text
from inference.tools.evaluate import engine_perplexity, perplexity, window_spans
from tests.llm_configs import merged_model

# A bigram "model" over 4 tokens: row = current token, column = next token. The text 0 1 2 3 0 1 uses the
# transitions 0->1 (1/2), 1->2 (1/4), 2->3 (1/2), 3->0 (1/8), 0->1 (1/2).
BIGRAM = np.array([[1 / 4, 1 / 2, 1 / 8, 1 / 8],
                   [1 / 4, 1 / 4, 1 / 4, 1 / 4],
                   [1 / 8, 1 / 8, 1 / 4, 1 / 2],
                   [1 / 8, 3 / 8, 1 / 4, 1 / 4]])
TEXT = [0, 1, 2, 3, 0, 1]


def bigram(tokens):
    return jnp.log(jnp.asarray(BIGRAM, jnp.float32))[tokens]  # [1, W] -> [1, W, 4]


def test_uniform_model_has_perplexity_equal_to_the_vocabulary():
    result = perplexity(lambda t: jnp.zeros((*t.shape, 7)), [1, 2, 3, 4, 5, 6, 0, 1], window=4, stride=2)
    assert result.perplexity == pytest.approx(7.0, rel=1e-6)
    assert result.num_tokens == 7


@pytest.mark.parametrize("window,stride", [(6, 5), (3, 1), (4, 2), (2, 1), (8, 3)])
def test_bigram_perplexity_by_hand(window, stride):
    # NLL = -(ln 1/2 + ln 1/4 + ln 1/2 + ln 1/8 + ln 1/2) = (1 + 2 + 1 + 3 + 1) ln 2 = 8 ln 2 over 5 tokens.
    result = perplexity(bigram, TEXT, window=window, stride=stride)
    assert result.num_tokens == 5
    assert result.nll == pytest.approx(8 * math.log(2), rel=1e-6)
    assert result.perplexity == pytest.approx(2 ** (8 / 5), rel=1e-6)


def test_windows_score_each_token_once_with_enough_context():
    for n, window, stride in [(100, 16, 8), (17, 16, 15), (50, 7, 3), (2, 512, 256)]:
        spans = window_spans(n, window, stride)
        scored = [t for begin, end, first in spans for t in range(first, end)]
        assert scored == list(range(1, n))
        for begin, end, first in spans[1:]:
            assert first - begin >= window - stride  # every scored token sees at least window - stride tokens
            assert end - begin <= window


def test_bad_windows_raise():
    for stride in (0, 4, 5):
        with pytest.raises(ValueError, match="stride"):
            perplexity(bigram, TEXT, window=4, stride=stride)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(bigram, [1], window=4, stride=2)


def test_shipped_texts_are_packaged_and_differ():
    text, calibration = shipped_text(), shipped_text(CALIBRATION_TEXT)
    assert len(text.split()) > 2000 and len(calibration.split()) > 400
    assert calibration[:200] not in text
    with pytest.raises(ValueError, match="missing"):
        shipped_text("nope.txt")


def test_engine_perplexity_equals_the_cache_free_forward(tiny_llama):
    llm = tiny_llama  # prompt logprobs: the shared engine's prefix cache is not read
    ids = np.random.default_rng(0).integers(0, llm.config.vocab_size, 40)
    want = perplexity(merged_model(llm), ids, window=16, stride=8)
    got = engine_perplexity(llm, ids, window=16, stride=8)
    assert got.num_tokens == want.num_tokens == 39
    assert got.nll == pytest.approx(want.nll, rel=1e-4)
