"""Generation with the KV cache is exact, batched rows are independent, routing follows the rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaas.runtime.model import (
    FAMILIES,
    ByteTokenizer,
    CheckpointReader,
    ExpertStack,
    KVCacheFull,
    load_reference,
)

PROMPTS = [[5, 17, 200, 3], [42], [7, 7, 7, 7, 7, 7, 7, 9, 11]]


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_generation_equals_full_recompute(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    decoder = load_reference(tiny_checkpoints[family])
    generated, step_logits = decoder.generate(PROMPTS, max_new_tokens=6)
    assert step_logits.shape == (6, len(PROMPTS), decoder.config.vocab_size)
    for row, prompt in enumerate(PROMPTS):
        sequence = prompt + generated[row][:-1]
        tokens = torch.tensor([sequence])
        logits = decoder.forward(
            tokens, torch.tensor([len(sequence)]), decoder.new_cache(1, 32), all_logits=True
        )
        # Logits predicting each generated token, recomputed without a cache and without batching.
        recomputed = logits[0, len(prompt) - 1 :]
        torch.testing.assert_close(step_logits[:, row], recomputed, rtol=1e-4, atol=1e-4)
        assert recomputed.argmax(-1).tolist() == generated[row]


def test_generation_is_deterministic(tiny_checkpoints: dict[str, Path]) -> None:
    a = load_reference(tiny_checkpoints["qwen3_moe"]).generate(PROMPTS, 5)
    b = load_reference(tiny_checkpoints["qwen3_moe"]).generate(PROMPTS, 5)
    assert a[0] == b[0]
    assert torch.equal(a[1], b[1])


def test_expert_subsets_sum_to_the_full_layer(tiny_checkpoints: dict[str, Path]) -> None:
    """Splitting a layer's experts over two stacks (two servers) and summing equals one stack."""
    reader = CheckpointReader(tiny_checkpoints["mixtral"])
    config = reader.config
    layer = 1
    x = torch.randn(10, config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, config.num_experts, (10, config.top_k), generator=torch.Generator().manual_seed(1))
    weights = torch.rand(10, config.top_k)
    full = ExpertStack.load(reader, [(layer, e) for e in range(config.num_experts)])
    even = ExpertStack.load(reader, [(layer, e) for e in range(0, config.num_experts, 2)])
    odd = ExpertStack.load(reader, [(layer, e) for e in range(1, config.num_experts, 2)])
    expected = full.forward(x, full.groups_for(layer, ids), weights)
    split = even.forward(x, even.groups_for(layer, ids), weights) + odd.forward(
        x, odd.groups_for(layer, ids), weights
    )
    torch.testing.assert_close(split, expected, rtol=1e-5, atol=1e-5)


def test_grouped_router_picks_from_top_groups_only(tiny_checkpoints: dict[str, Path]) -> None:
    decoder = load_reference(tiny_checkpoints["deepseek_v3"])
    config = decoder.config
    x = torch.randn(200, config.hidden_size, generator=torch.Generator().manual_seed(3))
    ids, weights = decoder.side.route(config.moe_layers[0], x)
    per_group = config.num_experts // config.n_group
    groups_used = [len(set((row // per_group).tolist())) for row in ids]
    assert max(groups_used) <= config.topk_group
    torch.testing.assert_close(weights.sum(-1), torch.full((200,), config.routed_scaling_factor))
    assert all(len(set(row.tolist())) == config.top_k for row in ids)


def test_bad_inputs_are_rejected(tiny_checkpoints: dict[str, Path]) -> None:
    decoder = load_reference(tiny_checkpoints["mixtral"])
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        decoder.generate([[]], 3)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=320\)"):
        decoder.generate([[320]], 3)
    with pytest.raises(KVCacheFull, match="exceeds the KV cache capacity max_len=4"):
        decoder.forward(torch.zeros(1, 5, dtype=torch.int64), torch.tensor([5]), decoder.new_cache(1, 4))


def test_byte_tokenizer_round_trips_utf8() -> None:
    tokenizer = ByteTokenizer(320)
    text = "experts — as a service"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([*tokenizer.encode("ab"), 300]) == "ab"
    with pytest.raises(ValueError, match="needs >= 256"):
        ByteTokenizer(100)


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_attention_equals_the_reference_path(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    """Attention read in place (``paged``) and the gathered oracle (``reference``) give the same
    logits for the prefill and every decode step (sinks, windows, MLA: whatever the family has)."""
    paged = load_reference(tiny_checkpoints[family], attention="paged")
    reference = load_reference(tiny_checkpoints[family], attention="reference")
    paged_tokens, paged_logits = paged.generate(PROMPTS, max_new_tokens=5)
    reference_tokens, reference_logits = reference.generate(PROMPTS, max_new_tokens=5)
    torch.testing.assert_close(paged_logits, reference_logits, rtol=1e-5, atol=1e-5)
    assert paged_tokens == reference_tokens


def test_unknown_attention_path_names_the_choices(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="attention: unknown path 'flash'; choose one of paged, reference"):
        load_reference(tiny_checkpoints["mixtral"], attention="flash")


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])  # sinks and windows; MLA
def test_paged_attention_reads_no_number_back_to_the_host(
    family: str, tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step's attention over the paged cache turns no tensor into a Python number (on a
    GPU each would wait for the device): loop bounds come from shapes, masks from positions."""
    from eaas.runtime.serving.paged_cache import KVPool, PagedView

    decoder = load_reference(tiny_checkpoints[family], attention="paged")
    pool = KVPool(decoder.config, 8, 4, dtype=decoder.side.dtype)
    view = PagedView(pool, [[0, 1, 2], [3, 4]], [9, 5], 1)
    h = decoder.side.embed(torch.tensor([[5], [7]]))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor was read back to the host")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    with torch.inference_mode():
        for layer in range(decoder.config.num_layers):
            h = decoder.side.attention(layer, h, view)
    monkeypatch.undo()
    assert torch.isfinite(h).all()
