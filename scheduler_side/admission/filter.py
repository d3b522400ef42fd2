"""Admission to the CPU tier: which block contents are dead (not worth storing) and which are live.

`AdmissionFilter` keeps a bounded tree of recently requested block keys (each key's parent is the key
before it in a request; block hashes are chained, so a key has one parent) and marks keys *dead*: the
store policies never store a dead key, and the scheduler drops (or demotes) its CPU copy when it dies.
Keys die three ways:
- **superseded branch** (`branch_filter`): a request extends a known key B with a new child while B had
  exactly one child before. The old child's subtree (the previous turn's tail, an abandoned branch, the
  context before a compaction) dies. A key with two or more children (a shared prefix) is never killed,
  nor is anything below it;
- **session close**: every key that only that session's requests used (`close_session`);
- **store: false**: the new keys of a request that asked not to be stored.
A dead key that a request asks for again is live again (`admit_request` revives its whole prompt).

Invariants:
- every node in `_nodes` is in `_lru` order (oldest first) and at most `capacity` nodes are kept; a node
  dropped from the tree is unlinked from its parent and children (they forget it; nothing else changes);
- `node.children` holds exactly the nodes whose `parent` is that node;
- `node.owner` is the one session that used the key, `SHARED` once a second session (or a request with
  no session) used it; `_sessions[s]` holds exactly the keys whose owner is `s`.
Cost: O(1) amortized per block of a request (a subtree dies once per revival of its blocks; the walk
stops at dead or shared keys). Imports nothing from the scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

SHARED = ""  # owner of a key used by two sessions or by a request without one (never demoted)


class _Node:
    __slots__ = ("key", "parent", "children", "dead", "owner")

    def __init__(self, key: bytes, owner: str) -> None:
        self.key = key
        self.parent: _Node | None = None
        self.children: dict[bytes, _Node] = {}
        self.dead = False
        self.owner = owner


class AdmissionFilter:
    def __init__(self, capacity: int, branch_filter: bool = True) -> None:
        """`capacity`: keys remembered (the oldest is forgotten first); `branch_filter`: kill superseded
        branches (sessions and `store: false` work either way)."""
        if capacity < 1:
            raise ValueError(f"AdmissionFilter capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.branch_filter = branch_filter
        # Whether requests are fed to the tree at all: from the start with `branch_filter`, else from the
        # first request that carries a hint (`activate`). Until then nothing can die and the tree is empty.
        self.active = branch_filter
        self._nodes: OrderedDict[bytes, _Node] = OrderedDict()
        self._sessions: dict[str, dict[bytes, None]] = {}  # insertion-ordered: replays stay deterministic
        self.num_superseded = 0  # keys killed as a superseded branch
        self.num_session_closed = 0  # keys killed by a session close
        self.num_revived = 0  # dead keys requested again

    # --- queries ---------------------------------------------------------------------------------
    def is_dead(self, key: bytes) -> bool:
        node = self._nodes.get(key)
        return node is not None and node.dead

    def __len__(self) -> int:
        return len(self._nodes)

    def children_of(self, key: bytes) -> list[bytes]:
        node = self._nodes.get(key)
        return [] if node is None else list(node.children)

    def session_keys(self, session: str) -> list[bytes]:
        """Keys only `session` used so far (oldest first)."""
        return list(self._sessions.get(session, ()))

    # --- updates ---------------------------------------------------------------------------------
    def admit_request(self, keys: Sequence[bytes], session: str | None = None, store: bool = True,
                      first_new: int = 0, start: int = 0, extends: bool = True) -> list[bytes]:
        """A request uses `keys[start:]` (its block keys, in order; `keys[start - 1]` is the parent of the
        first). Keys become live (dead ones revive), except new keys from index `first_new` on when `store`
        is False (born dead). With `extends`, a new child of a key that had exactly one child supersedes
        that child's subtree. Returns the keys that died now (their CPU copies should be dropped)."""
        owner = SHARED if session is None else session
        nodes, died = self._nodes, []
        parent = nodes.get(keys[start - 1]) if 0 < start <= len(keys) else None
        for i in range(start, len(keys)):
            key = keys[i]
            node = nodes.get(key)
            if node is None:
                node = self._new_node(key, owner)
                node.dead = not store and i >= first_new
                if parent is not None:
                    if extends and self.branch_filter and len(parent.children) == 1:
                        (old,) = parent.children.values()
                        self._kill_subtree(old, died)
                    self._link(parent, node)
            else:
                nodes.move_to_end(key)
                if node.dead and (store or i < first_new):
                    node.dead = False
                    self.num_revived += 1
                if node.owner != owner and node.owner != SHARED:
                    self._share(node)
                if node.parent is None and parent is not None and parent is not node:
                    self._link(parent, node)  # its parent was forgotten and is known again
            parent = node
        self._trim(keys, start)
        return died

    def close_session(self, session: str) -> list[bytes]:
        """The session ended: every key only it used dies. Returns those keys (oldest use first)."""
        keys = self._sessions.pop(session, {})
        out = []
        for key in keys:
            node = self._nodes[key]
            node.owner = SHARED  # the session is gone: a later use by anyone keeps the key live
            if not node.dead:
                node.dead = True
                out.append(key)
        self.num_session_closed += len(out)
        return out

    def _new_node(self, key: bytes, owner: str) -> _Node:
        node = _Node(key, owner)
        self._nodes[key] = node
        if owner != SHARED:
            self._sessions.setdefault(owner, {})[key] = None
        return node

    def _link(self, parent: _Node, child: _Node) -> None:
        child.parent = parent
        parent.children[child.key] = child

    def _share(self, node: _Node) -> None:
        keys = self._sessions.get(node.owner)
        if keys is not None:
            keys.pop(node.key, None)
            if not keys:
                del self._sessions[node.owner]
        node.owner = SHARED

    def _kill_subtree(self, root: _Node, died: list[bytes]) -> None:
        """Kill `root` and its descendants, stopping at dead keys and at keys with 2+ children."""
        stack = [root]
        while stack:
            node = stack.pop()
            if node.dead or len(node.children) >= 2:
                continue
            node.dead = True
            died.append(node.key)
            self.num_superseded += 1
            stack.extend(node.children.values())

    def _trim(self, keys: Sequence[bytes], start: int) -> None:
        """Forget the oldest keys beyond `capacity` (never those of the request just admitted)."""
        nodes = self._nodes
        if len(nodes) <= self.capacity:
            return
        keep = set(keys[start:])
        while len(nodes) > self.capacity:
            key, node = next(iter(nodes.items()))
            if key in keep:
                break  # one request longer than the capacity: keep it whole until the next one
            del nodes[key]
            if node.parent is not None:
                node.parent.children.pop(key, None)
            for child in node.children.values():
                child.parent = None
            if node.owner != SHARED:
                self._share(node)

    def check_integrity(self) -> None:
        """Raise if an invariant of the module docstring is broken (O(keys): tests only)."""
        for key, node in self._nodes.items():
            if node.key != key:
                raise RuntimeError(f"AdmissionFilter node {key.hex()[:8]} holds key {node.key.hex()[:8]} (our bug)")
            for child in node.children.values():
                if child.parent is not node or self._nodes.get(child.key) is not child:
                    raise RuntimeError(f"AdmissionFilter child link of {key.hex()[:8]} is broken (our bug)")
            if node.parent is not None and node.parent.children.get(key) is not node:
                raise RuntimeError(f"AdmissionFilter parent link of {key.hex()[:8]} is broken (our bug)")
            if node.owner != SHARED and key not in self._sessions.get(node.owner, ()):
                raise RuntimeError(f"AdmissionFilter key {key.hex()[:8]} missing from its session (our bug)")
        for session, keys in self._sessions.items():
            for key in keys:
                node = self._nodes.get(key)
                if node is None or node.owner != session:
                    raise RuntimeError(f"AdmissionFilter session {session!r} lists a key it does not own (our bug)")
