"""A token tree of drafts, laid out as one verify batch (docs/design.md §21).

A draft proposes, after the last token the model has not yet decoded (the *root*), a tree of
candidate continuations: the self draft's greedy chain, the draft's runner-up tokens where it is
unsure, prompt lookup's copy of what followed the same n-gram earlier. One ``llama_decode`` of
the pending tokens and every node checks them all:

- each node attends to the context, the pending tokens and its own ancestors only. llama.cpp
  masks a token's attention by the first sequence id it carries, and a KV cell by all the ids its
  token carried: every leaf gets a sequence id, a node carries the ids of the leaves below it and
  is masked by the first of them, and the context is copied into every leaf's sequence first;
- the batch puts the main path (the most likely child of each node, from the root down) first
  and every other node after it, parents before children. After the walk, the accepted nodes on
  the main path sit in the KV cells right after the pending tokens, in position order, as plain
  decoding would have put them; an accepted node off the main path would not (its cell comes
  after rejected ones, and the next token would fill the hole before it, which changes the order
  in which flash attention sums), so it is not kept: it is decoded again with the next pass;
- the walk samples the model's own token at the root's row, moves to the child with that token
  if there is one and samples again at its row, and stops at the first token no child has: every
  emitted token is the one plain decoding samples at that position (exact at any temperature,
  as the sampler's random draws are the same in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Node:
    token: int
    parent: int          # node index, -1: the root
    depth: int           # 1 for a child of the root
    p: float             # estimated chance that the model's token here is this one, given the parent
    source: str          # "self" or "ngram"
    rank: int = 0        # the self draft's rank of this token at its step (0: its top-1)
    qbin: int = -1       # the self draft's confidence bin at its step (its top-1 probability)


@dataclass
class Tree:
    """Candidate continuations of the root; node i's parent is an index < i or -1."""

    nodes: list[Node] = field(default_factory=list)
    # per depth d (index d - 1): the self draft's top tokens at that step and its confidence bin
    # (what the controller learns rank acceptance from, whether or not a node was made of them)
    steps: list[tuple[list[int], int]] = field(default_factory=list)
    arm: int = 0         # the draft size that drafted it (speculative.Drafter)
    ngram: int = 0       # the n-gram size prompt lookup matched for it (0: none)

    def __len__(self) -> int:
        return len(self.nodes)

    def child(self, parent: int, token: int) -> int:
        """The child of ``parent`` with ``token``, or -1."""
        for i, n in enumerate(self.nodes):
            if n.parent == parent and n.token == token:
                return i
        return -1

    def add(self, parent: int, token: int, p: float, source: str, rank: int = 0, qbin: int = -1) -> int:
        """A child of ``parent`` (the existing one if it has this token: its chance is the larger)."""
        i = self.child(parent, token)
        if i >= 0:
            self.nodes[i].p = max(self.nodes[i].p, p)
            return i
        depth = 1 if parent < 0 else self.nodes[parent].depth + 1
        self.nodes.append(Node(token, parent, depth, p, source, rank, qbin))
        return len(self.nodes) - 1

    def reach(self) -> list[float]:
        """Per node: the estimated chance that the walk accepts it (the product of p down its path)."""
        out: list[float] = []
        for n in self.nodes:
            out.append(n.p * (1.0 if n.parent < 0 else out[n.parent]))
        return out

    def subtree(self, keep: list[int]) -> "Tree":
        """The tree of the nodes ``keep`` (each one's parent kept too), indices renumbered."""
        new = Tree(steps=self.steps, arm=self.arm, ngram=self.ngram)
        index = {-1: -1}
        for i in sorted(keep):
            n = self.nodes[i]
            index[i] = len(new.nodes)
            new.nodes.append(Node(n.token, index[n.parent], n.depth, n.p, n.source, n.rank, n.qbin))
        return new


@dataclass
class Layout:
    """A tree as the rows of one batch after the pending tokens."""

    order: list[int]           # node index of each row after the pending tokens
    main: list[int]            # the main path, node indices from depth 1 down (a prefix of order)
    seqs: list[list[int]]      # per row after the pending tokens: its sequence ids, the masking one first
    n_seq: int                 # sequence ids in use (0 .. n_seq - 1; 0 is the main path's leaf)
    row_of: dict[int, int]     # node index -> row after the pending tokens


def layout(tree: Tree) -> Layout:
    kids: dict[int, list[int]] = {}
    for i, n in enumerate(tree.nodes):
        kids.setdefault(n.parent, []).append(i)
    reach = tree.reach()
    best = lambda i: max(kids.get(i, []), key=lambda c: (reach[c], -c), default=None)   # noqa: E731
    main, cur = [], best(-1)
    while cur is not None:
        main.append(cur)
        cur = best(cur)
    on_main = set(main)
    rest = [i for i in range(len(tree.nodes)) if i not in on_main]   # index order: parents first
    order = main + rest
    # leaves, the main path's first (sequence 0)
    leaves = [i for i in order if not kids.get(i)]
    seq_of = {leaf: s for s, leaf in enumerate(leaves)}
    below: dict[int, list[int]] = {i: [] for i in range(len(tree.nodes))}
    for leaf in leaves:
        i = leaf
        while i >= 0:
            below[i].append(seq_of[leaf])
            i = tree.nodes[i].parent
    seqs = [sorted(below[i]) for i in order]   # the smallest id (the earliest leaf in row order) masks
    return Layout(order=order, main=main, seqs=seqs, n_seq=len(leaves), row_of={i: r for r, i in enumerate(order)})


def walk(tree: Tree, lay: Layout, sample) -> tuple[list[int], list[int]]:
    """The exact verification: ``sample(row)`` is the model's token at a row after the pending
    tokens (-1: the root's row). Returns (the accepted nodes from depth 1 down, the emitted
    tokens: one per accepted node, then the model's token after the last one)."""
    accepted, emitted, cur = [], [], -1
    while True:
        tok = sample(-1 if cur < 0 else lay.row_of[cur])
        emitted.append(tok)
        nxt = tree.child(cur, tok)
        if nxt < 0:
            return accepted, emitted
        accepted.append(nxt)
        cur = nxt


def kept_prefix(lay: Layout, accepted: list[int]) -> int:
    """How many accepted nodes stay in the KV cache: those on the main path, in row order right
    after the pending tokens (module doc); the rest are decoded again."""
    n = 0
    while n < len(accepted) and n < len(lay.main) and accepted[n] == lay.main[n]:
        n += 1
    return n
