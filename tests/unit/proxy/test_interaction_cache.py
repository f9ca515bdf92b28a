"""InteractionCache: parents, rewards, discount, retry orphans, export, tensors."""

from __future__ import annotations

import pytest
import torch

from areal.api.io_struct import ModelResponse
from areal.proxy.interaction import Interaction, InteractionCache


def done(
    iid: str,
    messages: list[dict],
    answer: str,
    prompt: list[int],
    output: list[int],
    template: str = "concat",
    created: float = 0.0,
) -> Interaction:
    interaction = Interaction(
        id=iid, messages=messages, chat_template_type=template, created=created
    )
    interaction.prompt_tokens = prompt
    interaction.response = ModelResponse(
        input_tokens=prompt,
        output_tokens=output,
        output_logprobs=[-0.5] * len(output),
        output_versions=[3] * len(output),
        stop_reason="stop",
    )
    interaction.output_message_list = [{"role": "assistant", "content": answer}]
    return interaction


U1 = {"role": "user", "content": "one"}
U2 = {"role": "user", "content": "two"}
A1 = {"role": "assistant", "content": "a1"}


def test_parent_is_the_longest_prefixing_conversation():
    cache = InteractionCache()
    first = done("i1", [U1], "a1", [1, 2], [3, 4])
    cache.add(first)
    parent, remaining = cache.find_parent([U1, A1, U2])
    assert parent is first and remaining == [U2]
    # a different answer does not prefix: no parent
    assert cache.find_parent([U1, {"role": "assistant", "content": "other"}, U2])[0] is None
    incomplete = Interaction(id="i2", messages=[U1, A1, U2])
    cache.add(incomplete)
    assert cache.find_parent([U1, A1, U2, A1])[0] is first  # incomplete calls are never parents


def test_custom_prefix_matcher():
    def ignore_content(prefix, messages):
        return len(prefix) <= len(messages) and [m["role"] for m in messages[: len(prefix)]] == [
            m["role"] for m in prefix
        ]

    cache = InteractionCache(ignore_content)
    first = done("i1", [U1], "a1", [1], [2])
    cache.add(first)
    assert cache.find_parent([U2, {"role": "assistant", "content": "x"}, U1])[0] is first


def test_concat_tensors_copy_the_parent_positions():
    cache = InteractionCache()
    parent = done("p", [U1], "a1", [10, 11], [12, 2])
    child = done("c", [U1, A1, U2], "a2", [10, 11, 12, 2, 20, 21], [22, 2])
    child.parent = parent
    cache.add(parent)
    cache.add(child)
    child.response.output_versions = [4, 4]
    t = child.to_tensor_dict()
    # sequence = parent prompt (2) + parent output (2) + new prompt (2) + child output (2)
    assert t["input_ids"].tolist() == [[10, 11, 12, 2, 20, 21, 22, 2]]
    assert t["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 1, 1]]
    assert t["logprobs"].tolist() == [[0.0, 0.0, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]]
    assert t["versions"].tolist() == [[-1, -1, 3, 3, -1, -1, 4, 4]]
    assert t["turn_ids"].tolist() == [[-1, -1, 0, 0, -1, -1, 1, 1]]
    assert t["turn_ids"].dtype == torch.int32 and t["input_ids"].dtype == torch.int64
    assert t["rewards"].tolist() == [0.0] and t["original_rewards"].tolist() == [0.0]
    assert list(cache.export("concat")) == ["c"]
    assert list(cache.export("individual")) == ["p", "c"]


def test_hf_mode_child_is_trained_alone():
    parent = done("p", [U1], "a1", [10, 11], [12, 2], template="hf")
    child = done("c", [U1, A1, U2], "a2", [5, 6, 7], [8], template="hf")
    child.parent = parent
    assert child.to_tensor_dict()["loss_mask"].tolist() == [[0, 0, 0, 1]]
    cache = InteractionCache()
    cache.add(parent)
    cache.add(child)
    with pytest.raises(ValueError, match="concat mode"):
        cache.export("concat")


def test_rewards_and_discount():
    cache = InteractionCache()
    for i in range(3):
        cache.add(done(f"i{i}", [U1] * (i + 1), "a", [1], [2]))
    with pytest.raises(KeyError):
        cache.set_reward("missing", 1.0)
    cache.set_reward("i0", 1.0)
    cache.set_reward(None, 4.0)  # the last interaction
    cache.apply_reward_discount(0.5)
    # backwards: i2 = 4; i1 = 0 + 0.5 * 4 = 2; i0 = 1 + 0.5 * 2 = 2
    assert [i.reward for i in cache.values()] == [2.0, 2.0, 4.0]
    cache.apply_reward_discount(0.5)  # only once
    assert [i.reward for i in cache.values()] == [2.0, 2.0, 4.0]
    with pytest.raises(KeyError):
        InteractionCache().set_reward(None, 1.0)


def test_retry_orphans():
    cache = InteractionCache()
    retry_a = done("a", [U1], "x", [1], [2], created=1.0)
    retry_b = done("b", [U1], "y", [1], [3], created=2.0)
    lone_1 = done("c", [U2], "z", [4], [5], created=1.0)
    lone_2 = done("d", [U2], "w", [4], [6], created=3.0)
    child = done(
        "e", [U1, {"role": "assistant", "content": "x"}, U2], "v", [1, 2, 7], [8], created=4.0
    )
    child.parent = retry_a
    for item in (retry_a, retry_b, lone_1, lone_2, child):
        cache.add(item)
    # U1 group: 'a' has a child, so the childless retry 'b' is an orphan;
    # U2 group: nobody has children, so only the latest ('d') is kept
    assert cache.drop_retry_orphans() == 2
    assert [i.id for i in cache.values()] == ["a", "d", "e"]


def test_set_reward_value_patches_built_tensors():
    interaction = done("i", [U1], "a", [1], [2])
    interaction.to_tensor_dict()
    interaction.set_reward_value(0.5, original=2.0)
    t = interaction.to_tensor_dict()
    assert t["rewards"].tolist() == [0.5] and t["original_rewards"].tolist() == [2.0]
