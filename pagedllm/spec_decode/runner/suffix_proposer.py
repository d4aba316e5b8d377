"""Suffix-decoding proposer for speculative decoding (vLLM's ``method="suffix"``).

This module owns the frequency tries that suffix decoding (SuffixDecoding, as shipped in
Arctic Inference and called by vLLM) drafts from, and the per-request bookkeeping that feeds
them:

* a **per-request trie** over the request's own prompt and verified output, and
* a **global trie** over the *outputs* of recent requests (prompts are not cached globally,
  as in vLLM), bounded to ``max_cached_requests`` requests with FIFO eviction.

A trie counts every substring of length <= ``max_tree_depth`` of its sequences: the node of
substring ``s`` holds the number of positions where ``s`` occurs (the root holds the number of
tokens). It is updated in O(max_tree_depth) per appended token by extending the nodes of the
suffixes that end at the previous token; evicting a sequence subtracts its counts and prunes
nodes that reach zero.

Drafting (``propose``), following Arctic Inference's ``SuffixTree.speculate`` as used by vLLM:

1. For every match length ``m`` from 1 up to ``max_tree_depth - 1`` whose last-``m``-token
   suffix occurs in a trie, walk down from that suffix's node, each time taking the most
   frequent child (ties: the smaller token id). A draft token's probability is the running
   product of ``child.count / parent.count`` along the walk; the walk stops when it drops
   below ``min_token_prob``, when no child exists, or after
   ``min(num_speculative_tokens, floor(max_spec_factor * m))`` tokens (floor, as vLLM).
2. A draft's score is the sum of its tokens' probabilities (its expected accepted length);
   the best-scoring draft wins, ties going to the longer match.
3. Both tries are searched; the global trie's draft replaces the per-request one only when it
   scores strictly higher.

A node at depth ``max_tree_depth`` has no children, so a match plus its draft spans at most
``max_tree_depth`` tokens. A request's output enters the global trie as it is generated, so
concurrent requests already draft from each other. Its cache slot is taken when the request
is added, so adding a request may evict the oldest cached output (even one still running).
"""

import sys
from array import array
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["SuffixProposer"]

# Token ids must fit the low 32 bits of a packed single-child edge (see _SuffixTrie); node
# ids the 31 bits above them.
MAX_TOKEN_ID = (1 << 32) - 1
_TOKEN_MASK = MAX_TOKEN_ID
_CHILD_SHIFT = 32

_ROOT = 0
# _SuffixTrie._edge values other than a packed single edge (which is >= 0).
_LEAF = -1
_FANOUT = -2
# _SuffixTrie._best sentinels: no child at all, or the best child must be recomputed because
# the previous best lost count (recomputing eagerly would make eviction O(fanout) per step).
_NO_CHILD = -1
_STALE = -2


@dataclass
class _Draft:
    token_ids: list[int] = field(default_factory=list)
    # Sum of the tokens' path probabilities: the expected number of accepted tokens.
    score: float = 0.0
    # Length of the matched suffix the draft continues.
    match_len: int = 0


class _SuffixTrie:
    """Substring counts (length <= max_depth) over a set of keyed token sequences.

    Nodes are integer ids into flat int64 arrays rather than objects: millions of small
    objects would each be tracked by Python's cyclic garbage collector, and every full
    collection (and the trie's own growth, by triggering them) would pay for all of them.
    A node's edges are ``_LEAF``, one packed ``token | child << 32`` (the common case deep in
    the trie, where a substring has a single continuation), or ``_FANOUT`` with the children
    in a dict token -> child (int-only dicts are not GC-tracked either). A typical node
    costs 24 bytes plus array slack; a substring trie has up to max_depth nodes per token.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._counts = array("q", [0])
        self._edge = array("q", [_LEAF])
        self._fanout: dict[int, dict[int, int]] = {}
        # Token of each node's most frequent child (ties: smaller token), or a sentinel.
        self._best = array("q", [_NO_CHILD])
        self._free_ids = array("q")
        self._tokens: dict[Hashable, array] = {}
        # Nodes of the suffixes of length 1..max_depth ending at each open sequence's last
        # token, shortest first; absent once the sequence is closed.
        self._suffix_nodes: dict[Hashable, list[int]] = {}

    # -- sequences ---------------------------------------------------------------------

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def sequence_keys(self) -> list[Hashable]:
        """Sequence keys in insertion order."""
        return list(self._tokens)

    def open(self, key: Hashable) -> None:
        if key in self._tokens:
            raise ValueError(f"sequence {key!r} is already in the trie")
        self._tokens[key] = array("q")
        self._suffix_nodes[key] = []

    def extend(self, key: Hashable, token_ids: Iterable[int]) -> None:
        """Appends tokens to an open sequence, O(max_depth) per token."""
        tokens = self._tokens[key]
        suffix_nodes = self._suffix_nodes[key]
        keep = self.max_depth - 1
        bump = self._bump_child
        for token in token_ids:
            tokens.append(token)
            self._counts[_ROOT] += 1
            # Each suffix ending at the previous token grows by one; the one that would
            # exceed max_depth falls off, and the new length-1 suffix starts at the root.
            extended = [bump(_ROOT, token)]
            extended.extend([bump(node, token) for node in suffix_nodes[:keep]])
            suffix_nodes = extended
        self._suffix_nodes[key] = suffix_nodes

    def suffix_nodes(self, key: Hashable) -> list[int]:
        """Nodes of the open sequence's suffixes, index i for length i + 1."""
        return self._suffix_nodes[key]

    def close(self, key: Hashable) -> None:
        """Stops extending ``key``; its counts stay until ``remove``."""
        self._suffix_nodes.pop(key, None)

    def remove(self, key: Hashable) -> None:
        """Subtracts every substring occurrence of ``key``'s tokens, pruning zero nodes."""
        tokens = self._tokens.pop(key).tolist()
        self._suffix_nodes.pop(key, None)
        self._counts[_ROOT] -= len(tokens)
        for start in range(len(tokens)):
            node = _ROOT
            for token in tokens[start : start + self.max_depth]:
                node = self._drop_child(node, token)
                if node < 0:
                    break

    # -- queries -----------------------------------------------------------------------

    def count(self, substring: Sequence[int]) -> int:
        """Occurrences of ``substring`` (len <= max_depth); 0 when absent."""
        node = _ROOT
        for token in substring:
            node = self._child(node, int(token))
            if node < 0:
                return 0
        return self._counts[node]

    def num_nodes(self) -> int:
        """Live nodes below the root (a memory gauge)."""
        return len(self._counts) - len(self._free_ids) - 1

    def match(self, pattern: Sequence[int]) -> list[int]:
        """Nodes of ``pattern``'s suffixes that occur in the trie, index i for length i + 1.

        Lengths that occur are contiguous from 1 (a suffix of an occurring string occurs),
        so the first miss ends the search; cost is O(len(pattern)^2) edge lookups."""
        nodes: list[int] = []
        tokens = list(pattern)
        edge_of, fanout = self._edge, self._fanout
        for start in range(len(tokens) - 1, -1, -1):
            node = _ROOT
            # _child inlined: this loop is the per-step hot path of the global trie.
            for token in tokens[start:]:
                edge = edge_of[node]
                if edge >= 0:
                    if edge & _TOKEN_MASK != token:
                        return nodes
                    node = edge >> _CHILD_SHIFT
                elif edge == _LEAF:
                    return nodes
                else:
                    node = fanout[node].get(token, -1)
                    if node < 0:
                        return nodes
            nodes.append(node)
        return nodes

    def greedy_draft(
        self, node: int, budget: int, min_token_prob: float, to_beat: float = -1.0
    ) -> _Draft | None:
        """Follows the most frequent child from ``node`` for up to ``budget`` tokens while
        the path probability (product of child count / parent count) stays at or above
        ``min_token_prob``.

        Returns None once the draft provably cannot score above ``to_beat``: probabilities
        only shrink along a path, so the rest adds at most the current one per token."""
        token_ids: list[int] = []
        score = 0.0
        counts = self._counts
        prob = 1.0
        for remaining in range(budget, 0, -1):
            token, child = self._most_frequent_child(node)
            if child < 0:
                break
            prob *= counts[child] / counts[node]
            if prob < min_token_prob:
                break
            # The slack leaves near-ties to the exact comparison of the finished scores.
            if score + prob * remaining < to_beat - 1e-9:
                return None
            token_ids.append(token)
            score += prob
            node = child
        return _Draft(token_ids, score)

    # -- node primitives ---------------------------------------------------------------

    def _child(self, node: int, token: int) -> int:
        edge = self._edge[node]
        if edge >= 0:
            return edge >> _CHILD_SHIFT if edge & _TOKEN_MASK == token else -1
        if edge == _LEAF:
            return -1
        return self._fanout[node].get(token, -1)

    def _most_frequent_child(self, node: int) -> tuple[int, int]:
        """(token, child) of the most frequent child, or (-1, -1) for a leaf."""
        edge = self._edge[node]
        if edge >= 0:
            return edge & _TOKEN_MASK, edge >> _CHILD_SHIFT
        if edge == _LEAF:
            return -1, -1
        children = self._fanout[node]
        best = self._best[node]
        if best == _STALE:
            counts = self._counts
            best = min(children, key=lambda token: (-counts[children[token]], token))
            self._best[node] = best
        return best, children[best]

    def _new_node(self) -> int:
        if self._free_ids:
            return self._free_ids.pop()
        self._counts.append(0)
        self._edge.append(_LEAF)
        self._best.append(_NO_CHILD)
        return len(self._counts) - 1

    def _bump_child(self, node: int, token: int) -> int:
        """Counts one more occurrence of ``node``'s substring extended by ``token``."""
        edge = self._edge[node]
        if edge == _LEAF:
            child = self._new_node()
            self._edge[node] = token | child << _CHILD_SHIFT
        elif edge >= 0:
            if edge & _TOKEN_MASK == token:
                child = edge >> _CHILD_SHIFT
            else:
                child = self._new_node()
                self._fanout[node] = {edge & _TOKEN_MASK: edge >> _CHILD_SHIFT, token: child}
                self._edge[node] = _FANOUT
        else:
            children = self._fanout[node]
            child = children.get(token, -1)
            if child < 0:
                child = children[token] = self._new_node()
        self._counts[child] += 1
        self._consider_best(node, token, self._counts[child])
        return child

    def _consider_best(self, node: int, token: int, count: int) -> None:
        best = self._best[node]
        if best in (token, _STALE):
            return
        if best == _NO_CHILD:
            self._best[node] = token
            return
        best_count = self._counts[self._child(node, best)]
        if count > best_count or (count == best_count and token < best):
            self._best[node] = token

    def _drop_child(self, node: int, token: int) -> int:
        """Uncounts one occurrence of ``node``'s substring extended by ``token``; returns the
        child, or -1 when it reached zero and was pruned together with its subtree."""
        child = self._child(node, token)
        self._counts[child] -= 1
        if self._best[node] == token:
            self._best[node] = _STALE
        if self._counts[child] > 0:
            return child
        if self._edge[node] >= 0:
            self._edge[node] = _LEAF
            self._best[node] = _NO_CHILD
        else:
            children = self._fanout[node]
            del children[token]
            if len(children) == 1:
                ((last_token, last_child),) = children.items()
                del self._fanout[node]
                self._edge[node] = last_token | last_child << _CHILD_SHIFT
                self._best[node] = last_token
        self._free_chain(child)
        return -1

    def _free_chain(self, node: int) -> None:
        # A node that held one occurrence has at most one child holding that same
        # occurrence, so everything below a pruned node is a single chain of packed edges.
        while node >= 0:
            edge = self._edge[node]
            self._edge[node] = _LEAF
            self._best[node] = _NO_CHILD
            self._counts[node] = 0
            self._free_ids.append(node)
            node = edge >> _CHILD_SHIFT if edge >= 0 else -1


@dataclass
class _RequestState:
    trie: _SuffixTrie
    # The last max_tree_depth - 1 tokens: the longest pattern worth matching globally.
    recent_tokens: deque[int]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")


def _checked_tokens(token_ids: Iterable[int]) -> list[int]:
    tokens = [int(token) for token in token_ids]
    if tokens and not 0 <= min(tokens) <= max(tokens) <= MAX_TOKEN_ID:
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}], got {tokens}")
    return tokens


class SuffixProposer:
    """Drafts tokens for running requests from per-request and global suffix tries.

    Args (vLLM's ``suffix_decoding_*`` speculative-config fields, same defaults):
        num_speculative_tokens: most tokens one proposal may hold.
        max_tree_depth: longest substring the tries count; bounds match plus draft length.
        max_cached_requests: outputs kept in the global trie (FIFO); 0 disables it.
        max_spec_factor: a match of m tokens may draft at most floor(factor * m) tokens.
        min_token_prob: drafting stops when the path probability falls below this.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        _check_int("num_speculative_tokens", num_speculative_tokens, 1)
        _check_int("max_tree_depth", max_tree_depth, 1)
        _check_int("max_cached_requests", max_cached_requests, 0)
        _check_float("max_spec_factor", max_spec_factor, 0.0, sys.float_info.max)
        _check_float("min_token_prob", min_token_prob, 0.0, 1.0)
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self._requests: dict[str, _RequestState] = {}
        # Outputs of cached requests; the trie's key order is insertion (FIFO) order.
        self._global_trie: _SuffixTrie | None = (
            _SuffixTrie(max_tree_depth) if max_cached_requests > 0 else None
        )

    # -- request lifecycle -------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Starts tracking a request: builds its trie over the prompt and takes a global
        cache slot for its output (evicting the oldest cached output when full). Re-adding a
        finished id first drops its previously cached output."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already active")
        prompt = _checked_tokens(prompt_token_ids)
        trie = _SuffixTrie(self.max_tree_depth)
        trie.open(request_id)
        trie.extend(request_id, prompt)
        recent_tokens = deque(prompt, maxlen=max(self.max_tree_depth - 1, 1))
        self._requests[request_id] = _RequestState(trie, recent_tokens)
        if self._global_trie is not None:
            if request_id in self._global_trie:
                self._global_trie.remove(request_id)
            self._global_trie.open(request_id)
            self._evict_oldest_cached(keep=request_id)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Appends verified output tokens (any number) to the request's trie and, while its
        output is still cached, to the global trie."""
        state = self._state(request_id)
        tokens = _checked_tokens(token_ids)
        state.trie.extend(request_id, tokens)
        state.recent_tokens.extend(tokens)
        if self._global_trie is not None and request_id in self._global_trie:
            self._global_trie.extend(request_id, tokens)

    def finish_request(self, request_id: str) -> None:
        """Drops the request's own trie; its output stays in the global cache until evicted."""
        self._state(request_id)
        del self._requests[request_id]
        if self._global_trie is not None and request_id in self._global_trie:
            self._global_trie.close(request_id)

    def abort_request(self, request_id: str) -> None:
        """Like ``finish_request`` but also removes the request's output from the global
        cache: an aborted output is cut short and was not necessarily wanted."""
        self._state(request_id)
        del self._requests[request_id]
        if self._global_trie is not None and request_id in self._global_trie:
            self._global_trie.remove(request_id)

    @property
    def active_requests(self) -> list[str]:
        return list(self._requests)

    @property
    def cached_requests(self) -> list[str]:
        """Ids whose outputs are in the global cache, oldest first."""
        if self._global_trie is None:
            return []
        return self._global_trie.sequence_keys()  # type: ignore[return-value]

    def cached_count(self, token_ids: Sequence[int]) -> int:
        """Occurrences of ``token_ids`` (at most max_tree_depth long) in the cached outputs."""
        return 0 if self._global_trie is None else self._global_trie.count(token_ids)

    def num_cached_nodes(self) -> int:
        """Trie nodes held by the global cache (a memory gauge)."""
        return 0 if self._global_trie is None else self._global_trie.num_nodes()

    # -- drafting ----------------------------------------------------------------------

    def propose(self, request_id: str, max_spec_tokens: int | None = None) -> list[int]:
        """Draft tokens continuing the request's verified tokens; [] when nothing matches.

        ``max_spec_tokens`` lowers the cap below ``num_speculative_tokens`` for this call
        (vLLM passes ``max_model_len - num_tokens - 1`` so drafts fit the context)."""
        state = self._state(request_id)
        cap = self.num_speculative_tokens
        if max_spec_tokens is not None:
            cap = min(cap, max_spec_tokens)
        if cap <= 0:
            return []
        local_nodes = state.trie.suffix_nodes(request_id)[: self.max_tree_depth - 1]
        best = self._best_draft(state.trie, local_nodes, cap, floor_score=0.0)
        if self._global_trie is not None:
            global_nodes = self._global_trie.match(state.recent_tokens)
            floor_score = 0.0 if best is None else best.score
            best = self._best_draft(self._global_trie, global_nodes, cap, floor_score) or best
        return [] if best is None else best.token_ids

    def _best_draft(
        self, trie: _SuffixTrie, suffix_nodes: list[int], cap: int, floor_score: float
    ) -> _Draft | None:
        """The best-scoring draft from the matched suffixes (index i matches length i + 1),
        ties going to the longer match, if it scores strictly above ``floor_score``.

        Match lengths are tried in order of their token budget, the most promising first,
        so the first good draft lets ``greedy_draft`` abandon most others after a step."""
        budgets = []
        for match_len in range(1, len(suffix_nodes) + 1):
            # The epsilon keeps e.g. 100 * 0.29 (28.999...) from flooring to 28. A match
            # at depth d can only be followed by max_tree_depth - d tokens.
            budget = min(
                cap,
                int(match_len * self.max_spec_factor + 1e-6),
                self.max_tree_depth - match_len,
            )
            if budget > 0:
                budgets.append((budget, match_len))
        budgets.sort(reverse=True)
        best: _Draft | None = None
        best_score = floor_score
        for budget, match_len in budgets:
            if budget < best_score - 1e-9:
                break  # probabilities are <= 1, and the budgets left are no larger
            node = suffix_nodes[match_len - 1]
            draft = trie.greedy_draft(node, budget, self.min_token_prob, to_beat=best_score)
            if draft is None or not draft.token_ids:
                continue
            draft.match_len = match_len
            if draft.score > best_score or (
                best is not None and draft.score == best_score and match_len > best.match_len
            ):
                best, best_score = draft, draft.score
        return best

    # -- helpers -----------------------------------------------------------------------

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(f"unknown request {request_id!r}")
        return state

    def _evict_oldest_cached(self, keep: str) -> None:
        trie = self._global_trie
        assert trie is not None
        while len(trie) > self.max_cached_requests:
            oldest = next(key for key in trie.sequence_keys() if key != keep)
            trie.remove(oldest)
