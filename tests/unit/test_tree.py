"""The token tree of a verify pass (leanstream_ggml/speculation/tree.py) and the controller's node selection
(draft_control.select): the batch layout's attention sets against a direct computation of each
node's ancestors, the walk against plain decoding's sampling, what stays in the KV cache, and
the selection against brute force over every subtree."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from leanstream_ggml.speculation.draft_control import select
from leanstream_ggml.speculation.tree import Tree, kept_prefix, layout, walk


def random_tree(seed: int, n: int = 12) -> Tree:
    rng = np.random.default_rng(seed)
    t = Tree()
    for _ in range(n):
        parent = int(rng.integers(-1, len(t))) if len(t) else -1
        t.add(parent, int(rng.integers(0, 6)), float(rng.uniform(0.05, 0.9)), "self")
    return t


def ancestors(t: Tree, i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = t.nodes[i].parent
    return out


@pytest.mark.parametrize("seed", range(20))
def test_layout_masks_each_node_to_its_ancestors(seed):
    """A row attends to the KV cells whose sequence sets hold its first sequence id, at positions
    up to its own (llama.cpp's mask): exactly the node's ancestors and itself, never a sibling."""
    t = random_tree(seed)
    lay = layout(t)
    assert sorted(lay.order) == list(range(len(t)))
    assert lay.order[:len(lay.main)] == lay.main
    rows = {i: r for r, i in enumerate(lay.order)}
    for i in range(len(t)):
        assert t.nodes[i].parent < 0 or rows[t.nodes[i].parent] < rows[i]   # parents first
    for r, i in enumerate(lay.order):
        mask_seq = lay.seqs[r][0]
        depth = t.nodes[i].depth
        seen = {lay.order[q] for q in range(len(lay.order))
                if mask_seq in lay.seqs[q] and t.nodes[lay.order[q]].depth <= depth}
        assert seen == set(ancestors(t, i))
    # the main path is sequence 0 all the way down
    assert all(0 in lay.seqs[r] for r in range(len(lay.main)))
    # every sequence's positions are consecutive along its rows (llama.cpp's batch check)
    for s in range(lay.n_seq):
        depths = [t.nodes[lay.order[r]].depth for r in range(len(lay.order)) if s in lay.seqs[r]]
        assert depths == list(range(1, len(depths) + 1))


@pytest.mark.parametrize("seed", range(20))
def test_walk_is_plain_sampling_and_keeps_the_main_path(seed):
    """The walk emits what sampling position by position gives (the model's token after each
    accepted node) and keeps in the KV cache only the accepted prefix of the main path."""
    t = random_tree(seed)
    lay = layout(t)
    rng = np.random.default_rng(100 + seed)
    truth = [int(x) for x in rng.integers(0, 6, 20)]   # what the model samples, position by position

    def sample(row):
        depth = 0 if row < 0 else t.nodes[lay.order[row]].depth
        return truth[depth]

    accepted, emitted = walk(t, lay, sample)
    # plain decoding's tokens, as far as the tree guessed them, then the first miss
    assert emitted == truth[:len(emitted)]
    cur = -1
    for d, tok in enumerate(emitted[:-1]):
        cur = t.child(cur, tok)
        assert accepted[d] == cur
    assert t.child(accepted[-1] if accepted else -1, emitted[-1]) < 0
    n = kept_prefix(lay, accepted)
    assert accepted[:n] == lay.main[:n]
    assert n == len(accepted) or n == len(lay.main) or accepted[n] != lay.main[n]


def test_a_duplicate_token_is_one_node():
    t = Tree()
    a = t.add(-1, 5, 0.5, "self")
    b = t.add(-1, 5, 0.7, "ngram")
    assert a == b and len(t) == 1 and t.nodes[0].p == 0.7


@pytest.mark.parametrize("seed", range(8))
def test_select_against_brute_force(seed):
    """The greedy selection (by decreasing chance, each with its parent, while a row pays) is
    within 3 % of the best tokens per second over every subtree closed under parents."""
    rng = np.random.default_rng(seed)
    t = random_tree(seed, n=9)
    reach = t.reach()
    parent = [n.parent for n in t.nodes]
    t_pass = 0.2 + np.concatenate([[0.0], np.cumsum(rng.uniform(0.0, 0.05, 20))])
    t_pass = np.concatenate([[np.nan], t_pass])        # index = rows
    spent = float(rng.uniform(0.0, 0.1))

    def rate(nodes):
        return (1 + sum(reach[i] for i in nodes)) / (spent + t_pass[1 + len(nodes)])

    best = 0.0
    for mask in itertools.product((0, 1), repeat=len(t)):
        nodes = [i for i in range(len(t)) if mask[i]]
        if all(parent[i] < 0 or mask[parent[i]] for i in nodes):
            best = max(best, rate(nodes))
    got = select(reach, parent, spent, t_pass, 1)
    assert all(parent[i] < 0 or parent[i] in got for i in got)
    assert rate(got) >= 0.97 * best
