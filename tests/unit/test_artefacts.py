"""An artefact's provenance (scripts/artefacts.py): the commit, and where the working tree differed from it
outside docs/, which files."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import artefacts  # noqa: E402


def test_a_dirty_tree_is_named_file_by_file_and_docs_do_not_count(tmp_path, monkeypatch):
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (tmp_path / "docs").mkdir()
    (tmp_path / "src.py").write_text("a\n")
    (tmp_path / "docs" / "page.md").write_text("a\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD").strip()
    monkeypatch.setattr(artefacts, "REPO_ROOT", tmp_path)
    monkeypatch.delenv("ARTEFACTS_COMMIT", raising=False)
    (tmp_path / "docs" / "page.md").write_text("b\n")  # an artefact being written: not dirt
    clean = artefacts.provenance(["x"])
    assert clean["commit"] == head and "dirty" not in clean
    (tmp_path / "src.py").write_text("b\n")
    dirty = artefacts.provenance(["x"])
    assert dirty["commit"] == f"{head}+dirty" and dirty["dirty"] == ["src.py"]
