"""mpgen.runtime.generate: the cache's masks and keys, the layers without a
cache, sampling, and the flags' one-line refusals."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from mpgen.runtime import generate


def test_the_prefill_mask_is_causal_and_never_sees_padding():
    padding = torch.tensor([[False, True, True], [True, True, True]])
    cache = generate.Cache(padding)
    mask = cache.mask(3, torch.device("cpu"))
    assert mask.shape == (2, 1, 3, 3)
    assert torch.equal(mask[1, 0], torch.ones(3, 3, dtype=torch.bool).tril())
    # row 0 starts with a pad: real queries skip it; the pad sees only itself
    assert mask[0, 0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]


def test_a_decoding_step_sees_every_real_key_before_it():
    cache = generate.Cache(torch.tensor([[False, True], [True, True]]))
    cache.step(2)
    mask = cache.mask(1, torch.device("cpu"))
    assert mask.shape == (2, 1, 1, 3)
    assert mask[:, 0, 0].tolist() == [[False, True, True], [True, True, True]]


@pytest.mark.parametrize("capacity", [None, 5, 9])
def test_attention_with_the_cache_equals_attention_over_the_whole_window(capacity):
    """Buffers made at the first forward (capacity), or grown past it."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    layer = generate.KVAttention()
    layer.cache = cache = generate.Cache(torch.ones(2, 4, dtype=torch.bool), capacity)
    first = layer(q[:, :, :4], k[:, :, :4], v[:, :, :4], is_causal=True)
    cache.step(4)
    last = layer(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], is_causal=True)
    torch.testing.assert_close(torch.cat([first, last], dim=2), whole)
    assert cache.bytes_by_device() == {"cpu": 2 * 2 * 3 * max(capacity or 0, 5) * 4 * 4}


def test_without_a_cache_the_layers_are_the_plain_functions():
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    layer = generate.KVAttention()
    assert torch.equal(layer(q, k, v, is_causal=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True))
    positions = generate.Positions()
    assert torch.equal(positions(4), torch.arange(4))
    positions.cache = generate.Cache(torch.ones(1, 3, dtype=torch.bool))
    positions.cache.step(3)
    assert torch.equal(positions(1), torch.tensor([3]))


def _how(**given):
    return types.SimpleNamespace(**{"temperature": 0.0, "top_k": 0, "top_p": 1.0, **given})


def test_greedy_is_the_most_likely_token_and_top_k_one_is_greedy():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    generator = torch.Generator().manual_seed(0)
    assert generate.next_tokens(logits, _how(), generator).tolist() == [1, 0]
    sampled = generate.next_tokens(logits, _how(temperature=1.0, top_k=1), generator)
    assert sampled.tolist() == [1, 0]


def test_top_p_keeps_the_smallest_set_over_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    seen = {generate.next_tokens(logits, _how(temperature=1.0, top_p=0.7), generator).item()
            for _ in range(200)}
    assert seen == {0, 1}


def test_prompts_that_are_not_ids_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        generate.ids("5,x", "--prompt")
    assert "--prompt: expected comma-separated token ids, got '5,x'" in str(stopped.value)
    assert generate.ids("5, 17,42", "--prompt") == [5, 17, 42]


def test_the_stop_ids_default_to_the_eos_beside_the_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"eos_token_id": 7}')
    args = types.SimpleNamespace(stop=None, init=str(tmp_path / "model.safetensors"),
                                 checkpoint=None)
    assert generate.stops(args, None) == {7}
    assert generate.stops(types.SimpleNamespace(**{**vars(args), "stop": "1,2"}), None) == {1, 2}


def test_without_padding_the_fast_forms_are_used():
    cache = generate.Cache(torch.ones(2, 3, dtype=torch.bool))
    assert cache.attend(3, torch.device("cpu")) == {"is_causal": True}
    cache.step(3)
    assert cache.attend(1, torch.device("cpu")) == {}
    padded = generate.Cache(torch.tensor([[False, True], [True, True]]))
    assert set(padded.attend(2, torch.device("cpu"))) == {"attn_mask"}
