"""The tree's own rules (issue 38), checked so that they stay true: a README a user can read,
docs that exist where the code cites them, no module state where steps run, small modules, and
vLLM's private names only in ``vllm_hooks/``."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "h2o_vllm"
SOURCES = sorted(p for part in ("h2o_vllm", "benchmarks", "h2o_devtools", "packaging")
                 for p in (ROOT / part).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_document_the_code_cites_exists():
    """A cited document is a path (``docs/semantics.md``) or an upper-case name (``README.md``);
    a bare lower-case ``*.md`` is a file a benchmark writes."""
    missing = []
    for path in SOURCES:
        for cited in re.findall(r"[\w./-]*[\w-]+\.md\b", path.read_text()):
            if "/" not in cited and not re.fullmatch(r"[A-Z][A-Z_-]*\.md", cited):
                continue
            here = path.parent / cited
            if not any(p.exists() for p in (ROOT / cited, here, ROOT / "docs" / Path(cited).name)):
                missing.append(f"{_rel(path)}: {cited}")
    assert not missing


def test_no_global_statement_where_steps_run():
    found = [f"{_rel(p)}:{node.lineno}" for part in ("worker", "vllm_hooks", "scheduler")
             for p in (PACKAGE / part).rglob("*.py")
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Global)]
    assert not found


def test_no_package_module_over_300_lines():
    long = [_rel(p) for p in PACKAGE.rglob("*.py") if len(p.read_text().splitlines()) > 300]
    assert not long


def _private_names_of_ours() -> set[str]:
    """Every ``_name`` h2o_vllm, its tools and benchmarks define (functions, classes, methods,
    assigned attributes and variables)."""
    names = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_")}


def test_no_private_vllm_name_outside_the_seam():
    """An attribute ``x._name`` read outside ``vllm_hooks/`` is one of ours, or a dunder, or
    another library's listed here; anything else would be vLLM's."""
    ours = _private_names_of_ours() | {
        "_attn_implementation",  # transformers' config (the oracle)
        "_C",  # torch.ops._C: the op library vLLM registers its kernels in (packaging checks it)
    }
    seam = PACKAGE / "vllm_hooks"
    found = []
    for path in SOURCES:
        if seam in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in ours):
                found.append(f"{_rel(path)}:{node.lineno} .{node.attr}")
    assert not found
