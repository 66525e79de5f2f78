"""Draft trees: several candidates where the head is unsure, verified in one target batch.

A tree's root is the cycle's first row (id_last, the target's newest token); its nodes are draft tokens, each
the child of the node before it in its path; the chain (nodes 1..chain) is its likeliest path. Two drafts make
one:
- EAGLE-2's dynamic tree (`Expansion`, Eagle3Session.draft_tree; the fixed policy's): depth by depth, the head
  runs the topk candidates likeliest to be reached in one batch and their topk likeliest tokens join the
  candidates; the N likeliest candidates are the tree. It costs topk head rows a depth.
- The chain plus runner-ups (`branch_candidates`, the adaptive policy's): the head's draft is the chain and its
  runner-up tokens at each chain depth (`Draft.alt_tokens`) are leaves beside it, so the tree costs no head
  step beyond the chain's, only verify rows: a node whose chain sibling the target rejects may still be the
  target's choice there.

The target verifies all nodes in one batch with no new kernel: a batch row may carry several sequence ids,
and attention keeps a cell for a row when they share a sequence and the cell's position is not past the
row's (llama.cpp's unified KV cache). The chain's rows and the prefix are sequence 0; each branch leaf gets a
sequence of its own, which the prefix's cells are given (`seq_cp`, no copy of data) and every ancestor of the
leaf carries, so each node attends exactly its own path. (The head's dynamic expansion does the same in its
own cache: a sequence per candidate it runs, its parent's copied into it.)

After the walk (`walk`: from the root, the target's token at a row is kept while it is one of the row's
children), the cache keeps the prefix and the accepted part of the chain; every branch sequence is removed.
An accepted branch node's cell goes too, and the node is decoded again at the head of the next cycle's
batch (`Speculator._redo`): its cell would otherwise sit after the freed cells of the rejected chain, later
rows would fill those, and attention (which sums cells in their order) would stop matching plain decoding
bit for bit. The logits its tree row gave are the ones the walk used, so nothing is decided twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .draft import Draft


@dataclass
class DraftTree:
    """Nodes 1..N below the root (node 0); node i is batch row i. The chain's nodes come first."""

    tokens: list[int] = field(default_factory=list)  # [N + 1]: the root's (id_last), then each node's
    parents: list[int] = field(default_factory=list)  # [N + 1]: each node's parent (the root's: -1)
    depths: list[int] = field(default_factory=list)  # [N + 1]: 0 for the root
    chain: int = 0  # nodes 1..chain are the main chain
    probs: list[float] = field(default_factory=list)  # [N + 1]: the head's probability of reaching each node

    @property
    def n_nodes(self) -> int:
        return len(self.tokens) - 1

    @property
    def chain_draft(self) -> Draft:
        """The chain as a Draft: its tokens and the head's probability of each step."""
        chain = range(1, self.chain + 1)
        return Draft([self.tokens[i] for i in chain], [self.probs[i] / self.probs[i - 1] for i in chain])

    def children(self, i: int) -> list[int]:
        return [c for c in range(i + 1, len(self.tokens)) if self.parents[c] == i]

    def path(self, i: int) -> list[int]:
        """The nodes from the root's child down to node i."""
        out = []
        while i > 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def sequences(self) -> tuple[list[list[int]], int]:
        """Each row's sequence ids: 0 for the root and the chain, and a sequence 1.. per leaf off the chain,
        carried by the leaf and all its ancestors. Returns them and the number of branch sequences."""
        seqs = [[0] if i <= self.chain else [] for i in range(len(self.tokens))]
        leaves = [i for i in range(self.chain + 1, len(self.tokens)) if not self.children(i)]
        for s, leaf in enumerate(leaves, start=1):
            i = leaf
            while i >= 0:
                seqs[i].append(s)
                i = self.parents[i]
        return seqs, len(leaves)


def chain_tree(id_last: int, draft: Draft, accept: Callable[[int, float], float] | None = None) -> DraftTree:
    """The draft's chain as a tree (no branches). `accept(step, conf)`: the chance the target keeps a step's
    draft (default: the head's confidence itself), whose running products are the nodes' probs."""
    n = len(draft.tokens)
    reach, p = [1.0], 1.0
    for i, conf in enumerate(draft.confs[:n]):
        p *= accept(i, conf) if accept is not None else conf
        reach.append(p)
    return DraftTree([id_last, *draft.tokens], list(range(-1, n)), list(range(n + 1)), n, reach)


def head_sequences(topk: int) -> int:
    """The sequences the head's context needs to expand a tree of topk tokens a depth: two sets of topk
    (a depth's candidates and their parents') and the prefix's."""
    return 1 + 2 * topk


class Expansion:
    """The candidates of EAGLE-2's dynamic expansion (Eagle3Session.draft_tree): node 0 is the root (id_last);
    every other candidate is a head token under its parent, scored by the head's probability of its whole
    path (the product of its steps' probabilities). A parent is added before its children."""

    def __init__(self, id_last: int):
        self.tokens = [id_last]  # [n_cands]
        self.parents = [-1]  # [n_cands]
        self.depths = [0]  # [n_cands]
        self.scores = [1.0]  # [n_cands]: the head's probability of the whole path

    def add_children(self, parent: int, tokens: list[int], probs: list[float]) -> None:
        """The head's likeliest tokens after `parent`, with their probabilities there."""
        for tok, p in zip(tokens, probs):
            self.tokens.append(tok)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.scores.append(self.scores[parent] * p)

    def likeliest(self, depth: int, n: int) -> list[int]:
        """The n candidates at `depth` likeliest to be reached (the first added on a tie)."""
        level = [i for i, d in enumerate(self.depths) if d == depth]
        return sorted(level, key=lambda i: -self.scores[i])[:n]

    def best(self, n: int) -> DraftTree:
        """The n likeliest candidates as a tree (an ancestor is at least as likely and was added first, so
        each one's path comes along): the chain is the likeliest path (from the root, the likeliest child at
        each step), then the other nodes by depth."""
        chosen = set(sorted(range(1, len(self.tokens)), key=lambda i: -self.scores[i])[:n])
        children: dict[int, list[int]] = {}
        for i in sorted(chosen):
            children.setdefault(self.parents[i], []).append(i)
        chain, node = [], 0
        while node in children:
            node = max(children[node], key=lambda i: self.scores[i])  # the first added on a tie
            chain.append(node)
        rest = sorted(chosen.difference(chain), key=lambda i: (self.depths[i], i))
        order = [0, *chain, *rest]
        row = {i: r for r, i in enumerate(order)}
        return DraftTree([self.tokens[i] for i in order], [row[self.parents[i]] if i else -1 for i in order],
                         [self.depths[i] for i in order], len(chain), [self.scores[i] for i in order])


@dataclass
class Branch:
    """A runner-up token beside chain node `depth`, a child of the chain node before it."""

    depth: int
    token: int
    prob: float  # the head's probability of it
    weight: float  # how much it is worth verifying (branch_candidates)


def branch_candidates(tree: DraftTree, draft: Draft,
                      weight: Callable[[int, float, float], float] | None = None) -> list[Branch]:
    """Every runner-up of the chain's steps, the most worth first by weight(depth, probability of reaching
    the parent, runner-up probability) (default: their product, how likely the head thinks the node is
    reached); zero weights left out."""
    weight = weight or (lambda _d, reach, p: reach * p)
    out = []
    for d in range(1, tree.chain + 1):
        for tok, p in zip(draft.alt_tokens[d - 1], draft.alt_probs[d - 1]):
            w = weight(d, tree.probs[d - 1], p)
            if w > 0.0:
                out.append(Branch(d, tok, p, w))
    out.sort(key=lambda b: -b.weight)
    return out


def with_branches(tree: DraftTree, branches: list[Branch]) -> DraftTree:
    """The chain tree plus these branches as leaves (their rows by depth: a parent precedes its children)."""
    out = DraftTree(list(tree.tokens), list(tree.parents), list(tree.depths), tree.chain, list(tree.probs))
    for b in sorted(branches, key=lambda b: b.depth):
        out.tokens.append(b.token)
        out.parents.append(b.depth - 1)
        out.depths.append(b.depth)
        out.probs.append(tree.probs[b.depth - 1] * b.prob)
    return out


@dataclass
class TreeWalk:
    """What the target kept of a tree: the emitted tokens (the accepted nodes' and the target's own token
    after the last), and the accepted nodes."""

    out: list[int]
    path: list[int]  # accepted nodes, root's child first
    on_chain: int  # how many of them lie on the chain (the path leaves it after them, or never)

    @property
    def n_acc(self) -> int:
        return len(self.path)


def walk(tree: DraftTree, pick: Callable[[int], int], stop: Callable[[int], bool] | None = None) -> TreeWalk:
    """From the root: `pick(row)` is the target's own token at a node's row (its sampler, called once per
    emitted token, in order); it is kept while it is one of the node's children. An end-of-generation token
    ends the walk as its own token."""
    out, path, node = [], [], 0
    while True:
        choice = pick(node)
        out.append(choice)
        if stop is not None and stop(choice):
            break
        child = next((c for c in tree.children(node) if tree.tokens[c] == choice), None)
        if child is None:
            break
        path.append(child)
        node = child
    return TreeWalk(out, path, next((j for j, node in enumerate(path) if node > tree.chain), len(path)))
