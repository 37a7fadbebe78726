"""Tree-packed forward passes against the plain per-leaf forward.

Every reference here runs the model on each leaf's own token sequence (prompt, then its path's turns)
with no packing code involved: `tree.token_ids(leaf)` through `model(input_ids=...)`, or the module's
per-leaf path on an unpacked `collate` batch.
"""

import functools
import logging

import pytest
import torch
from helpers import rollout_data, trace_module

from trace_lightning.advantages import ESTIMATORS, GRPO, node_advantages
from trace_lightning.batching import collate, collate_packed, leaf_sequences
from trace_lightning.losses import LossSettings, SeqMeanTokenMean, TokenMean
from trace_lightning.module import TraceModule
from trace_lightning.packing import budget_groups, pack, packed_tokens
from trace_lightning.predictor import PredictorSettings
from trace_lightning.tree import RolloutTree


def branching_tree(seed: int, prompt_len: int = 9) -> RolloutTree:
    """prompt -> a -> b -> c (leaf 1), b -> d (leaf 0, expand), a -> e (leaf 0, expand), prompt -> f (0).
    Turns carry observations, so a branch starts after its parent's observation tokens."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 600, (n,), generator=g).tolist()

    t = RolloutTree(task_id=seed, prompt_ids=ids(prompt_len))
    a = t.add_turn(0, "bare", ids(4), ids(3))
    b = t.add_turn(a, "bare", ids(3), ids(2))
    t.finish(t.add_turn(b, "bare", ids(5), []), 1.0, "answer")
    t.finish(t.add_turn(b, "expand", ids(2), []), 0.0, "answer")
    t.finish(t.add_turn(a, "expand", ids(6), []), 0.0, "answer")
    t.finish(t.add_turn(0, "bare", ids(4), []), 0.0, "answer")
    return t


HEAD = PredictorSettings.policy_state(width=8, coef=1.0, pooling="last", standardize=False, refit_steps=0)


@pytest.fixture
def module(tiny_model_dir: str) -> TraceModule:
    return trace_module(tiny_model_dir, functools.partial(torch.optim.SGD, lr=0.1), predictor=HEAD)


def plain_forward(model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token_t | tokens_<t) [T] (0 at t = 0) and last hidden states [T, H] of one unpadded
    sequence: the reference."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    # log-softmax in float64: in float32 over a 49k vocabulary it alone is off by up to ~2e-5 on SmolLM2
    # (logits near 40), more than the tolerance the packed path is held to
    logits = out.logits[0].double()  # [T, V]
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp.float()]), out.hidden_states[-1][0]


def plain_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return plain_forward(model, ids)[0]


def batches(trees: list[RolloutTree], estimator: str = "grpo"):
    seqs = leaf_sequences(trees, node_advantages(trees, ESTIMATORS[estimator]()))
    return seqs, collate(seqs, 0), collate_packed(seqs, trees, 0)


def test_packing_lays_out_every_node_once_with_depth_positions():
    t = branching_tree(0, prompt_len=2)
    packed = pack([t], [(0, leaf) for leaf in t.leaves()], pad_id=0)
    # prompt 2 + a 7 + b 5 + c 5 + d 2 + e 6 + f 4 = 31 tokens, against 2+7+5+5 + 2+7+5+2 + 2+7+6 + 2+4 = 56
    assert packed.tokens == packed_tokens(t, t.leaves()) == 31
    assert sum(len(t.token_ids(leaf)) for leaf in t.leaves()) == 56
    pos = packed.position_ids[0].tolist()
    assert pos[:9] == list(range(9))  # prompt, then a (4 actions + 3 observations)
    # columns: prompt 0-1, a 2-8, b 9-13, c 14-18, d 19-20, e 21-26, f 27-30
    assert pos[14:21] == [14, 15, 16, 17, 18, 14, 15]  # d hangs under b (ending at position 13), as c does
    assert pos[21:31] == [9, 10, 11, 12, 13, 14, 2, 3, 4, 5]  # e under a, f under the prompt
    assert packed.prev[0, 19].item() == 13 and packed.prev[0, 27].item() == 1  # scored after their parent
    assert packed.prev[0, 0].item() == -1 and packed.prev[0, 20].item() == 19
    allowed = packed.allowed[0]
    assert allowed[19, :14].all() and not allowed[19, 14:19].any()  # d sees prompt, a, b; never c
    assert allowed[19, 19] and not allowed[19, 20]  # causal inside its own node


def test_packed_logprobs_match_each_leafs_own_forward(module):
    trees = [branching_tree(0), branching_tree(1, prompt_len=5)]
    seqs, _, packed = batches(trees)
    logp, hidden = module._batch_forward(module.policy, packed)
    for row, s in enumerate(seqs):
        want, want_hidden = plain_forward(module.policy, trees[s.tree_index].token_ids(s.leaf))
        trained = torch.tensor(s.loss_mask, dtype=torch.bool)  # log-probs are computed where they train
        assert trained.any() and not trained.all()
        torch.testing.assert_close(logp[row, : len(want)][trained].detach(), want[trained], atol=1e-5, rtol=0)
        assert not logp[row, : len(want)][~trained].any() and not logp[row, len(want) :].any()
        # every real token's state, prompt and observations included, is the leaf's own
        torch.testing.assert_close(hidden[row, : len(want)].detach(), want_hidden, atol=1e-5, rtol=1e-5)


def left_padded_logprobs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-leaf reference again, left-padded: rows rolled right, positions counted from the mask."""
    width, lengths = ids.shape[1], mask.sum(1).tolist()
    left_ids = torch.stack([r.roll(width - n) for r, n in zip(ids, lengths, strict=True)])
    left_mask = torch.stack([m.roll(width - n) for m, n in zip(mask, lengths, strict=True)])
    with torch.no_grad():
        positions = (left_mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=left_ids, attention_mask=left_mask, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, left_ids[:, 1:, None])[..., 0]
    logp = torch.nn.functional.pad(logp, (1, 0))  # [B, T], left-padded
    return torch.stack([r.roll(-(width - n)) for r, n in zip(logp, lengths, strict=True)])  # back to the left


def test_left_and_right_padding_and_every_row_layout_agree(module):
    trees = [branching_tree(2), branching_tree(3, prompt_len=4)]
    seqs, unpacked, _ = batches(trees)
    real = unpacked.attention_mask.bool()
    real[:, 0] = False  # the first token has no log-prob
    right, _ = module._forward(module.policy, unpacked.input_ids, unpacked.attention_mask)
    left = left_padded_logprobs(module.policy, unpacked.input_ids, unpacked.attention_mask)
    torch.testing.assert_close(left[real], right[real].detach(), atol=1e-5, rtol=0)
    keep = unpacked.loss_mask.bool()  # where packed batches compute log-probs
    keys = [(s.tree_index, s.leaf) for s in seqs]
    layouts = {"both trees in one row": None, "a padded row per tree": [ti for ti, _ in keys]}
    for name, rows in layouts.items():
        unpacked.packed = pack(trees, keys, 0, rows)
        got, _ = module._batch_forward(module.policy, unpacked)
        torch.testing.assert_close(got[keep].detach(), right[keep].detach(), atol=1e-5, rtol=0, msg=name)
    for ti, tree in enumerate(trees):  # each tree packed alone
        alone = leaf_sequences([tree], node_advantages([tree], GRPO()))
        got, _ = module._batch_forward(module.policy, collate_packed(alone, [tree], 0))
        rows = [i for i, k in enumerate(keys) if k[0] == ti]
        sub = keep[rows][:, : got.shape[1]]
        torch.testing.assert_close(
            got[sub].detach(), right[rows][:, : got.shape[1]][sub].detach(), atol=1e-5, rtol=0
        )


def test_a_sibling_branch_cannot_leak_into_another(module):
    tree = branching_tree(4)
    seqs, _, packed = batches([tree])
    before, h_before = module._batch_forward(module.policy, packed)
    tree.nodes[4].action_ids = [(x + 37) % 600 for x in tree.nodes[4].action_ids]  # d, sibling of c
    _, _, packed2 = batches([tree])
    after, h_after = module._batch_forward(module.policy, packed2)
    rows = {s.leaf: i for i, s in enumerate(seqs)}
    for leaf in (3, 5, 6):  # c (d's sibling), e and f: none of them passes through d
        torch.testing.assert_close(after[rows[leaf]], before[rows[leaf]], atol=0, rtol=0)
        torch.testing.assert_close(h_after[rows[leaf]], h_before[rows[leaf]], atol=0, rtol=0)
    assert not torch.equal(after[rows[4]], before[rows[4]])  # d's own tokens did change


def grads(module: TraceModule, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss = module.training_step(batch, 0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("aggregation", [TokenMean(), SeqMeanTokenMean()], ids=["token_mean", "seq_mean"])
def test_same_loss_and_gradients_as_per_leaf_training(tiny_model_dir, aggregation):
    module = trace_module(
        tiny_model_dir,
        functools.partial(torch.optim.SGD, lr=0.1),
        predictor=HEAD,
        loss=LossSettings(kl_coef=0.1),  # the reference log-probs are packed too
        aggregation=aggregation,
    )
    trees = [branching_tree(5), branching_tree(6, prompt_len=3)]
    _, unpacked, packed = batches(trees, "tree_segment")
    module.fill_old_logprobs(unpacked)
    packed.old_logprobs = unpacked.old_logprobs * 1.01  # ratios away from 1, the same for both
    unpacked.old_logprobs = packed.old_logprobs
    with torch.no_grad():  # move the policy away from the reference so the KL term has a gradient
        for p in module.policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    loss_ref, g_ref = grads(module, unpacked)
    loss_packed, g_packed = grads(module, packed)
    torch.testing.assert_close(loss_packed, loss_ref, rtol=1e-5, atol=1e-6)
    assert g_ref.keys() == g_packed.keys() and any(k.startswith("head.") for k in g_ref)
    worst = max(float((g_packed[k] - g_ref[k]).abs().max() / g_ref[k].abs().max()) for k in g_ref)
    assert worst <= 1e-4


def test_a_model_that_ignores_the_tree_mask_trains_per_leaf_and_says_so(module, caplog):
    class DropsMask(torch.nn.Module):  # a model whose attention ignores any mask it is given
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

    model = DropsMask(module.policy)
    trees = [branching_tree(7)]
    _, unpacked, packed = batches(trees)
    with caplog.at_level(logging.WARNING, logger="trace_lightning.packing"):
        got, _ = module._batch_forward(model, packed)
        module._batch_forward(model, packed)
    assert sum("does not take a 4D tree attention mask" in r.message for r in caplog.records) == 1
    want, _ = module._forward(module.policy, unpacked.input_ids, unpacked.attention_mask)
    keep = unpacked.attention_mask.bool()
    torch.testing.assert_close(got[keep], want[keep])  # the per-leaf rows ran


def test_token_budget_keeps_trees_whole_where_they_fit():
    trees = [
        branching_tree(0, prompt_len=2),
        branching_tree(1, prompt_len=2),
        branching_tree(2, prompt_len=40),
    ]
    keys = [(ti, leaf) for ti, t in enumerate(trees) for leaf in t.leaves()]  # 4 leaves each
    # packed tokens: 31, 31 and 31 + 38 = 69
    assert [packed_tokens(t, t.leaves()) for t in trees] == [31, 31, 69]
    assert budget_groups(trees, keys, 69) == [list(range(8)), list(range(8, 12))]  # 31 + 31, then 69
    # at 61 the first two trees no longer share a batch, and tree 2 splits: c + d cost 40 + 7 + 5 + 5 + 2
    # = 59, e + f 40 + 7 + 6 + 4 = 57
    assert budget_groups(trees, keys, 61) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11]]
    # a tree over the budget is split by leaves: tree 0's leaves c, d, e, f cost 19, 16, 15 and 6 alone;
    # c + d share prompt, a and b (2 + 7 + 5 + 5 + 2 = 21), + e adds 6 more (27), + f 4 (31)
    assert budget_groups(trees[:1], keys[:4], 27) == [[0, 1, 2], [3]]
    assert budget_groups(trees[:1], keys[:4], 21) == [[0, 1], [2, 3]]  # e + f = 2 + 7 + 6 + 4 = 19
    assert budget_groups(trees[:1], keys[:4], 10) == [[0], [1], [2], [3]]  # single leaves over budget


def test_micro_batch_tokens_must_be_positive():
    from trace_lightning import allocation as alloc
    from trace_lightning.envs.chain import ChainEnv

    with pytest.raises(ValueError, match="data.micro_batch_tokens=0"):
        rollout_data(ChainEnv(n_tasks=8), alloc.uniform(), None, pool_size=8, micro_batch_tokens=0)


def text_tree(tokenizer) -> RolloutTree:
    """The shape of `branching_tree` with real English turns, so a real model sees likely tokens."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    t = RolloutTree(task_id=0, prompt_ids=ids("You are a helpful assistant. What is the capital of France?"))
    a = t.add_turn(0, "bare", ids("<search>capital of France</search>"), ids(" Paris is the capital."))
    b = t.add_turn(a, "bare", ids(" Let me check the river."), ids(" The Seine flows through it."))
    t.finish(t.add_turn(b, "bare", ids("<answer>Paris</answer>"), []), 1.0, "answer")
    t.finish(t.add_turn(b, "expand", ids("<answer>Lyon</answer>"), []), 0.0, "answer")
    t.finish(t.add_turn(a, "expand", ids(" I think it is Marseille."), []), 0.0, "answer")
    t.finish(t.add_turn(0, "bare", ids("<answer>Berlin</answer>"), []), 0.0, "answer")
    return t


@pytest.mark.slow
def test_smollm2_packed_logprobs_and_gradients_match_per_leaf():
    from trace_lightning.models import prepare_smollm2

    module = trace_module(prepare_smollm2(), functools.partial(torch.optim.SGD, lr=0.1), predictor=HEAD)
    trees = [text_tree(module.tokenizer)]
    seqs, unpacked, packed = batches(trees, "tree_segment")
    logp, _ = module._batch_forward(module.policy, packed)
    for row, s in enumerate(seqs):
        want = plain_logprobs(module.policy, trees[0].token_ids(s.leaf))
        trained = torch.tensor(s.loss_mask, dtype=torch.bool)
        # 30 float32 layers over other attention shapes: measured up to 1.0e-5 at log-probs near -6 (1.6e-6
        # relative), and 0.0 difference in hidden states with the model in float64
        got = logp[row, : len(want)][trained].detach()
        torch.testing.assert_close(got, want[trained], atol=1e-5, rtol=1e-6)
    module.fill_old_logprobs(unpacked)
    packed.old_logprobs = unpacked.old_logprobs
    _, g_ref = grads(module, unpacked)
    _, g_packed = grads(module, packed)
    diff = torch.sqrt(sum(((g_packed[k] - g_ref[k]) ** 2).sum() for k in g_ref))
    assert diff / torch.sqrt(sum((g**2).sum() for g in g_ref.values())) <= 1e-4  # measured 2.1e-5
    # Per tensor, the worst is an RMSNorm weight at 1.1e-4 (measured): a shared prompt token's gradient
    # is summed over its leaves before, not after, the float32 rounding of the backward. Measured with
    # the model in float64 (sum of trained log-probs as the loss): 5.5e-7, since LlamaRMSNorm still
    # computes in float32, and 5.2e-14 once RMSNorm runs in float64 too: rounding, not a wrong term.
    worst = max(float((g_packed[k] - g_ref[k]).abs().max() / g_ref[k].abs().max()) for k in g_ref)
    assert worst <= 2e-4
