"""The shape of the tree: modules import each other without circles, and functions stay short
enough to read (DEVELOPERS.md: one concern per file; a training step a newcomer can follow)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = {p.stem: p for p in ROOT.glob("*.py")}


def project_imports(path: Path) -> set[str]:
    """The project's modules that ``path`` imports, at the top or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(MODULES)


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as [a, b, ..., a], or [] when there is none (depth-first search)."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target, path + [target])):
                return cycle
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return []


def test_find_cycle_sees_a_circle_and_its_absence():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_module_imports_another_in_a_circle():
    graph = {name: project_imports(path) - {name} for name, path in MODULES.items()}
    assert graph["train_dapo"] >= {"rollout", "learner", "ckpt", "ranks"}  # the reader really sees imports
    assert find_cycle(graph) == []


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in sorted([*ROOT.glob("*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("bench/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long == []


def test_the_package_lists_every_module():
    """pyproject's py-modules is what a wheel (a non-editable install) holds: a module missing
    from it installs a train_dapo.py that cannot import its neighbours."""
    import tomllib

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["py-modules"]
    assert sorted(listed) == sorted(MODULES), (f"py-modules lacks {sorted(set(MODULES) - set(listed))}, "
                                               f"names no file {sorted(set(listed) - set(MODULES))}")
