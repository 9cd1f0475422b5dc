"""The state-layer plumbing of ModelConfig (issue 37): layer kinds, the cache list's numbering, the state cache's
specs and bytes, and the slot copy."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.recurrent.layout import RecurrentState, copy_state_slots, zero_state
from models.config import ModelConfig

GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
           linear_conv_kernel_dim=4)
HYBRID = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4, num_kv_heads=2,
                     head_dim=8, layer_types=("linear_attention", "linear_attention", "full_attention",
                                              "linear_attention", "linear_attention", "full_attention"), **GDN)


def test_cache_list_puts_kv_caches_first_then_state_layers_in_order():
    assert [HYBRID.is_state_layer(i) for i in range(6)] == [True, True, False, True, True, False]
    assert HYBRID.num_kv_layers == 2 and HYBRID.attention_layers == (2, 5) and HYBRID.state_layers == (0, 1, 3, 4)
    assert [HYBRID.cache_index(i) for i in range(6)] == [2, 3, 0, 4, 5, 1]
    assert HYBRID.kv_layer(5) == 1 and HYBRID.kv_group_windows == (None,)
    with pytest.raises(ValueError, match="state cache"):
        HYBRID.kv_layer(0)
    plain = HYBRID.replace(layer_types=None)
    assert not plain.has_state_layers and [plain.cache_index(i) for i in range(6)] == list(range(6))


def test_state_cache_spec_and_bytes_per_sequence():
    spec = HYBRID.state_cache_spec(0, num_slots=5, dtype="bfloat16")
    conv_dim = 2 * 2 * 8 + 4 * 6
    assert spec.conv.shape == (5, conv_dim, 3) and spec.conv.dtype == jnp.bfloat16
    assert spec.ssm.shape == (5, 4, 8, 6) and spec.ssm.dtype == jnp.float32  # float32 whatever the model dtype
    per_layer = conv_dim * 3 * 2 + 4 * 8 * 6 * 4
    assert HYBRID.state_bytes_per_sequence("bfloat16") == 4 * per_layer
    with pytest.raises(ValueError, match="no state cache layout"):
        HYBRID.state_cache_spec(2, 5)


def test_hybrid_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="linear_num_key_heads must be positive"):
        HYBRID.replace(linear_num_key_heads=0)
    with pytest.raises(ValueError, match="not a multiple of linear_num_key_heads"):
        HYBRID.replace(linear_num_value_heads=3)
    with pytest.raises(ValueError, match="cla_factor=1"):
        HYBRID.replace(cla_factor=2)
    with pytest.raises(ValueError, match="unsupported layer type 'ssm'"):
        HYBRID.replace(layer_types=("ssm",) * 6)


def test_copy_state_slots_copies_both_leaves():
    cache = zero_state(HYBRID.state_cache_spec(0, 4))
    cache = RecurrentState(conv=cache.conv.at[1].set(1.0), ssm=cache.ssm.at[1].set(2.0))
    out = copy_state_slots(cache, jnp.array([1]), jnp.array([3]))
    np.testing.assert_array_equal(out.conv[3], cache.conv[1])
    np.testing.assert_array_equal(out.ssm[3], cache.ssm[1])
    assert not np.asarray(out.ssm[2]).any()
