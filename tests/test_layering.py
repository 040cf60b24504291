"""Dependencies point one way: pipeline/, data_prep/, checkpoints/ and slurm/ never import megaloop (ARCHITECTURE.md);
megaloop/model holds no parallel code (no torch.distributed, no pipeline import)."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def python_files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", ["pipeline", "data_prep", "checkpoints", "slurm"])
def test_lower_layers_never_import_megaloop(package):
    files = python_files(package)
    assert files, f"{package} has no Python files"
    offenders = {str(f.relative_to(REPO)): sorted(m for m in imported_modules(f) if m.split(".")[0] == "megaloop")
                 for f in files}
    assert not {k: v for k, v in offenders.items() if v}


def test_model_is_free_of_parallelism():
    for f in python_files("megaloop/model"):
        bad = [m for m in imported_modules(f) if m.startswith(("torch.distributed", "pipeline", "deepspeed"))]
        assert not bad, f"{f.relative_to(REPO)} imports {bad}"


def test_checker_sees_imports(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("import megaloop.model\nfrom megaloop.config import load_config\nfrom . import y\n")
    assert imported_modules(sample) == {"megaloop.model", "megaloop.config"}
