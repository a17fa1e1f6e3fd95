"""The rollout engine's binding: greedy generation equals the argmax of the model's full forward, logprobs
equal its log-softmax, the engine sees a Model's parameters in place, seeds reproduce, bad input raises
ValueError naming the argument."""

import json

import numpy as np
import pytest

from deltatrain import _deltatrain

rollout = getattr(_deltatrain, "rollout", None)
pytestmark = pytest.mark.skipif(rollout is None, reason="this build has no model (the light build)")


def small_config(tmp_path, vocab=37):
    config = {"model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 1,
              "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
              "tie_word_embeddings": True, "initializer_range": 0.3,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def test_greedy_equals_the_full_forward_and_logprobs_its_log_softmax(tmp_path, rng):
    model = _deltatrain.model.Model(small_config(tmp_path), dtype="float64", seed=int(rng.integers(1 << 31)), cpu_threads=1)
    engine = rollout.Engine(model, max_batch=2, max_length=40, cpu_threads=1)
    prompts = [rng.integers(0, 37, n).tolist() for n in (1, 7, 19)]
    out = engine.generate(prompts, max_new_tokens=8, temperature=0.0, untempered_logprobs=True)
    assert len(out) == 3
    for prompt, c in zip(prompts, out):
        assert c["finish"] == "length" and len(c["tokens"]) == 8
        seq = list(prompt)
        for token, lp, ulp in zip(c["tokens"], c["logprobs"], c["untempered_logprobs"]):
            logits = model.logits(seq, [0, len(seq)])[-1]
            assert token == int(np.argmax(logits))
            assert lp == 0.0
            assert abs(ulp - log_softmax(logits)[token]) < 1e-10
            seq.append(token)


def test_sampling_reproduces_and_sees_parameter_updates_in_place(tmp_path, rng):
    model = _deltatrain.model.Model(small_config(tmp_path), dtype="float32", seed=3, cpu_threads=1)
    engine = rollout.Engine(model, max_batch=2, max_length=40, cpu_threads=1)
    prompts = [rng.integers(0, 37, 5).tolist() for _ in range(3)]
    first = engine.generate(prompts, max_new_tokens=12, temperature=1.2, top_p=0.9, seed=11)
    assert first == engine.generate(prompts, max_new_tokens=12, temperature=1.2, top_p=0.9, seed=11)
    # The engine reads the model's memory: changing a weight in place changes what it generates.
    model.param("model.embed_tokens.weight")[:] *= 3
    changed = engine.generate(prompts, max_new_tokens=12, temperature=1.2, top_p=0.9, seed=11)
    assert [c["logprobs"] for c in changed] != [c["logprobs"] for c in first]


def test_engine_from_a_config_and_weights_directory(tmp_path, rng):
    config = small_config(tmp_path)
    model = _deltatrain.model.Model(config, dtype="float32", seed=5, cpu_threads=1)
    model.save(str(tmp_path / "saved"))
    from_dir = rollout.Engine(config, str(tmp_path / "saved"), max_batch=1, max_length=30, cpu_threads=1)
    in_place = rollout.Engine(model, max_batch=3, max_length=30, cpu_threads=1)
    prompts = [rng.integers(0, 37, 4).tolist(), rng.integers(0, 37, 9).tolist()]
    a = from_dir.generate(prompts, max_new_tokens=6, temperature=0.0)
    b = in_place.generate(prompts, max_new_tokens=6, temperature=0.0)
    assert [c["tokens"] for c in a] == [c["tokens"] for c in b]


def largest_logprob_gap(config, seed, prompts, batch_invariant):
    """Generate from prompts with an engine on a Model's parameters, then score the completions with the Model's
    forward over all of them packed together: the largest |trainer - rollout| untempered log-probability gap."""
    model = _deltatrain.model.Model(config, dtype="float32", seed=seed, cpu_threads=1, batch_invariant=batch_invariant)
    engine = rollout.Engine(model, max_batch=2, max_length=64, max_prefill_tokens=16, cpu_threads=1,
                            batch_invariant=batch_invariant)
    out = engine.generate(prompts, max_new_tokens=10, temperature=1.0, seed=seed, untempered_logprobs=True)
    tokens, cu, targets, rollout_logprobs = [], [0], [], []
    for prompt, c in zip(prompts, out):
        sequence = prompt + c["tokens"]
        tokens += sequence
        cu.append(len(tokens))
        for t in range(len(sequence)):
            completion_index = t + 1 - len(prompt)  # token t predicts t + 1
            scored = completion_index >= 0 and t + 1 < len(sequence)
            targets.append(sequence[t + 1] if scored else -1)
            rollout_logprobs.append(c["untempered_logprobs"][completion_index] if scored else 0.0)
    model.forward(tokens, cu, targets=targets, training=False)
    return float(np.max(np.abs(np.asarray(model.token_logprobs()) - np.asarray(rollout_logprobs))))


def test_batch_invariant_engine_and_model_agree_bit_for_bit(tmp_path, rng):
    # More prompts than slots, prompts longer than a prefill batch: the rollout's batches change as it goes,
    # while the Model scores everything in one packed forward. Without the mode the two differ (the control).
    config, seed = small_config(tmp_path), int(rng.integers(1 << 31))
    prompts = [rng.integers(0, 37, n).tolist() for n in (1, 9, 4, 17, 6)]
    assert largest_logprob_gap(config, seed, prompts, batch_invariant=True) == 0.0
    assert largest_logprob_gap(config, seed, prompts, batch_invariant=False) > 0.0


def test_bad_input_raises_value_error_naming_it(tmp_path):
    model = _deltatrain.model.Model(small_config(tmp_path), cpu_threads=1)
    engine = rollout.Engine(model, max_batch=2, max_length=10, cpu_threads=1)
    with pytest.raises(ValueError, match="request 0: prompt"):
        engine.generate([[1, 99]])
    with pytest.raises(ValueError, match="request 0: prompt"):
        engine.generate([list(range(11))])
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([[1]], max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1]], max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="max_batch"):
        rollout.Engine(model, max_batch=0)
    with pytest.raises(ValueError, match="max_batch"):
        rollout.Engine(model, max_batch=4, max_length=100, cache_budget=1000)
    with pytest.raises(ValueError, match="model.*got an object of type object"):
        rollout.Engine(object())
