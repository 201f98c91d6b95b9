import importlib.util
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "update_readme_fields.py"


def test_readme_field_tables_are_the_generated_ones():
    spec = importlib.util.spec_from_file_location("update_readme_fields", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = README.read_text()
    for name, fields in module.TABLES.items():
        start = text.index(f"<!-- fields:{name} -->") + len(f"<!-- fields:{name} -->")
        end = text.index(f"<!-- /fields:{name} -->")
        assert text[start:end].strip() == fields.markdown_table(), name


def test_readme_config_table_is_the_generated_one():
    from triton_diffusion.settings import parameters_markdown

    text = README.read_text()
    start = text.index("<!-- config -->") + len("<!-- config -->")
    end = text.index("<!-- /config -->")
    assert text[start:end].strip() == parameters_markdown()
