"""The model's Python binding: forward, backward and logits against their definitions on fresh random
weights, save/load, and errors that name the argument."""

import numpy as np
import pytest

from deltatrain import _deltatrain

model_module = getattr(_deltatrain, "model", None)
pytestmark = pytest.mark.skipif(model_module is None, reason="this build has no model (the light build)")


def small_config(tmp_path, vocab=37):
    """A tiny hybrid written as an HF config.json, so the test also goes through the config reader."""
    import json

    config = {"model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 1,
              "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
              "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.5}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy
    print("seed", seed)
    return np.random.default_rng(seed)


def random_batch(rng, vocab, lengths):
    tokens = rng.integers(0, vocab, sum(lengths)).tolist()
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(int).tolist()
    return tokens, cu


def test_loss_is_the_mean_next_token_cross_entropy_of_the_logits(tmp_path, rng):
    model = model_module.Model(small_config(tmp_path), dtype="float64", seed=int(rng.integers(1 << 31)))
    tokens, cu = random_batch(rng, 37, [5, 1, 9])
    logits = model.logits(tokens, cu)
    assert logits.shape == (15, 37) and logits.dtype == np.float64
    # The mean over next-token targets that stay inside a sequence, from the logits by hand.
    log_softmax = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    terms = [-log_softmax[t, tokens[t + 1]] for n in range(3) for t in range(cu[n], cu[n + 1] - 1)]
    loss = model.forward(tokens, cu, training=False)
    assert loss == pytest.approx(np.mean(terms), rel=1e-12)
    logprobs = model.token_logprobs()
    assert logprobs[cu[1] - 1] == 0.0  # the last token of a sequence has no target


def test_backward_matches_a_finite_difference(tmp_path, rng):
    model = model_module.Model(small_config(tmp_path), dtype="float64", seed=int(rng.integers(1 << 31)))
    tokens, cu = random_batch(rng, 37, [6, 3])
    model.zero_grads()
    model.forward(tokens, cu)
    model.backward()
    for name in ["model.embed_tokens.weight", "model.layers.0.linear_attn.A_log",
                 "model.layers.1.self_attn.q_proj.weight"]:
        param, grad = model.param(name), model.grad(name)
        index = tuple(rng.integers(0, n) for n in param.shape)
        saved, step = param[index], 1e-5
        param[index] = saved + step  # the array views the model's memory
        up = model.forward(tokens, cu, training=False)
        param[index] = saved - step
        down = model.forward(tokens, cu, training=False)
        param[index] = saved
        assert grad[index] == pytest.approx((up - down) / (2 * step), rel=1e-5, abs=1e-9), name


def test_save_and_load_round_trip(tmp_path, rng):
    config = small_config(tmp_path)
    first = model_module.Model(config, seed=1)
    second = model_module.Model(config, seed=2)
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert not np.array_equal(first.param(name), second.param(name))
    first.save(str(tmp_path / "saved"))
    second.load(str(tmp_path / "saved"))
    for n in first.param_names():
        np.testing.assert_array_equal(first.param(n), second.param(n))


def test_bad_input_names_the_argument(tmp_path):
    model = model_module.Model(small_config(tmp_path))
    with pytest.raises(ValueError, match="tokens"):
        model.forward([0, 1, 37], [0, 3])
    with pytest.raises(ValueError, match="cu_seqlens"):
        model.forward([0, 1, 2], [0, 2])
    with pytest.raises(ValueError, match="dtype"):
        model_module.Model(small_config(tmp_path), dtype="float16")
    with pytest.raises(ValueError):
        model_module.Model("no-such-preset")
    with pytest.raises(RuntimeError, match="backward"):
        model.backward()
