"""The package's import graph: no cycles, and the two sides never import each other (SPEC §1).

Every import counts, at module level, under TYPE_CHECKING or inside a function: a cycle that only
type checkers or a lazy import follow is still two modules that cannot be read one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("offload_connector", "scheduler_side", "worker_side")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
                break  # the deepest project module named is the one imported
    return out


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


FACES = ("offload_connector.vllm", "offload_connector.cli", "offload_connector.fake_engine",
         "offload_connector.vllm_connector")  # the alias module users name in vLLM's config
SIDES = ("scheduler_side", "worker_side")


def layer_of(module: str) -> str:
    """"face", "scheduler_side", "worker_side" or "shared" (offload_connector's own modules and remote/)."""
    if any(module == f or module.startswith(f + ".") for f in FACES):
        return "face"
    return module.split(".")[0] if module.split(".")[0] in SIDES else "shared"


def test_no_import_cycle() -> None:
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()) or [])


def test_the_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_sides_never_import_each_other() -> None:
    for name, deps in graph().items():
        for side, other in (("scheduler_side", "worker_side"), ("worker_side", "scheduler_side")):
            if name.startswith(side):
                assert not any(d.startswith(other) for d in deps), f"{name} imports {other}"


def test_store_policies_see_the_scheduler_only_through_their_view() -> None:
    g = graph()
    for policy in ("scheduler_side.policies.store_policy", "scheduler_side.policies.lazy"):
        assert "scheduler_side.scheduler" not in g[policy]


def test_each_layer_imports_only_the_layers_below_it() -> None:
    """shared -> nothing of ours; a side -> shared and itself, never the other side, never a face;
    a face -> anything."""
    allowed = {"shared": {"shared"}, "scheduler_side": {"shared", "scheduler_side"},
               "worker_side": {"shared", "worker_side"}, "face": {"shared", "scheduler_side", "worker_side", "face"}}
    bad = [f"{name} ({layer_of(name)}) imports {dep} ({layer_of(dep)})" for name, deps in graph().items()
           for dep in deps if layer_of(dep) not in allowed[layer_of(name)]]
    assert bad == [], "\n".join(bad)


def test_the_layer_rule_sees_a_side_importing_a_face() -> None:
    assert layer_of("offload_connector.vllm.plugin") == "face"
    assert layer_of("offload_connector.vllm_connector") == "face"
    assert layer_of("offload_connector.remote.client") == "shared"
    assert layer_of("worker_side.backends.cuda.runtime") == "worker_side"
