"""SamplingParams: vLLM defaults, normalisation, and a ValueError naming the parameter for every invalid value."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from inference.sampling.params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.max_tokens == 16
    assert p.stop == () and p.stop_token_ids == ()
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (False, False, True)
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.logprobs_mode == "raw"
    assert MAX_LOGPROBS == 20


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("n", 0),
        ("n", -3),
        ("n", 1.5),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "0.7"),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.0001),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("min_p", math.nan),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 3.0),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", MAX_LOGPROBS + 1),
        ("seed", 1.5),
        ("seed", "42"),
        ("seed", True),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 7),
        ("ignore_eos", "yes"),
        ("logprobs_mode", "processed_logits"),
        ("logprobs_mode", "bogus"),
    ],
)
def test_invalid_value_raises_naming_parameter(name: str, value: object) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**{name: value})
    msg = str(err.value)
    assert name in msg
    assert repr(value) in msg  # the offending value is quoted


@pytest.mark.parametrize(
    ("name", "value", "range_text"),
    [
        ("top_p", 0.0, "(0, 1]"),
        ("min_p", 2.0, "[0, 1]"),
        ("logprobs", 21, "[0, 20]"),
        ("temperature", -1.0, ">= 0"),
        ("n", 0, ">= 1"),
        ("max_tokens", 0, ">= 1"),
        ("seed", 2**70, "[-2**63, 2**64)"),
    ],
)
def test_message_states_allowed_range(name: str, value: object, range_text: str) -> None:
    with pytest.raises(ValueError, match=name) as err:
        SamplingParams(**{name: value})
    assert range_text in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0),
        dict(temperature=0.0, top_p=1.0, min_p=1.0, top_k=-1),
        dict(top_p=1e-9, min_p=0.0, top_k=1),
        dict(logprobs=0, prompt_logprobs=MAX_LOGPROBS),
        dict(seed=-7),
        dict(seed=2**64 - 1),
        dict(seed=-(2**63)),
        dict(seed=np.int64(3)),
        dict(max_tokens=None),
        dict(stop=("a", "b"), stop_token_ids=(1, 2)),
        dict(logprobs_mode="processed"),
    ],
)
def test_boundary_values_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_normalisation() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)
    p = SamplingParams(temperature=1, top_p=1, seed=np.int32(9))
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert type(p.seed) is int and p.seed == 9


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=SAMPLING_EPS / 2).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
    assert not SamplingParams().greedy


def test_uses_filters() -> None:
    assert not SamplingParams().uses_filters
    assert SamplingParams(top_k=5).uses_filters
    assert SamplingParams(top_p=0.9).uses_filters
    assert SamplingParams(min_p=0.1).uses_filters
    assert not SamplingParams(temperature=0, top_k=5, top_p=0.5).uses_filters  # greedy ignores filters


def test_frozen_hashable_and_value_equal() -> None:
    a = SamplingParams(stop=["x"], stop_token_ids=[1], top_k=-1)
    b = SamplingParams(stop=("x",), stop_token_ids=(1,), top_k=0)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, SamplingParams()}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.temperature = 0.5  # type: ignore[misc]


def test_replace_revalidates() -> None:
    p = SamplingParams(temperature=0.7, stop="x")
    q = p.replace(top_p=0.5)
    assert q.top_p == 0.5 and q.temperature == 0.7 and q.stop == ("x",)
    assert p.top_p == 1.0
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=0.0)


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]
