"""What degrading a request costs on a real checkpoint, from a published table: rows copied verbatim.

The tiny models serve no quality a person would judge (their PSNR says how far an image moved, not how good
it looks), so the degradation page quotes what fewer steps and step caches cost FLUX.1-dev in a published
benchmark: cache-dit's ``bench/cache/README.md`` (FLUX.1-dev, 50 steps, DrawBench prompts, an NVIDIA
L20 for its own runs; the other methods' rows quoted from the FoCa paper, arXiv 2508.16211). This script
takes the rows named in :data:`TABLES` out of a copy of that file, character for character, and writes
them with the file's SHA-256 into ``docs/published/flux_quality.json`` (rendered by scripts/figures.py,
block ``published-flux-quality``). Nothing is read from the network: fetch the file first, for example

    git -C <a clone of vipshop/cache-dit> \\
        show f86744af7daa0f569fe4324e73e3e50cebf70f4c:bench/cache/README.md > /tmp/cache-dit-bench.md
    .venv/bin/python scripts/published_quality.py /tmp/cache-dit-bench.md
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from artefacts import provenance, write  # noqa: E402

REPO, PATH = "vipshop/cache-dit", "bench/cache/README.md"
COMMIT = "f86744af7daa0f569fe4324e73e3e50cebf70f4c"
OUT = Path(__file__).resolve().parents[1] / "docs" / "published" / "flux_quality.json"

# Each table: the section heading it sits under, which table of that section (0: the first), what it
# shows, and the rows kept, by their first cell as the source writes it.
TABLES = (
    {
        "heading": "## 📚Text2Image DrawBench: FLUX.1-dev",
        "index": 1,
        "caption": "ImageReward and CLIP score (higher is better) of FLUX.1-dev with fewer steps and with "
        "TaylorSeer, against its 50 steps, as the source quotes them from the FoCa paper (arXiv 2508.16211; "
        "the hardware is not stated there); speedup as the source gives it",
        "rows": (
            "[**FLUX.1**-dev]: 50 steps",
            "[**FLUX.1**-dev]: 60% steps",
            "[**FLUX.1**-dev]: 34% steps",
            "[**FLUX.1**-dev]: 22% steps",
            "TaylorSeer(N=4,O=2)",
        ),
    },
    {
        "heading": "### 📖PSNR: DBCache(Slow) FnBn",
        "index": 0,
        "caption": "PSNR of FLUX.1-dev's image with cache-dit's DBCache on the first block only (F1B0: a "
        "threshold R on the first block's residual, as FBC decides, plus two rules FBC has not: W4, the "
        "first 4 steps never cached, and MC, at most that many cached steps in a row) against the same "
        "image at 50 steps uncached, measured by cache-dit on an NVIDIA L20",
        "rows": (
            "Baseline: [FLUX.1.dev, 50 steps]",
            "F1B0_W4M0MC0_R0.08_T0O0",
            "F1B0_W4M0MC4_R0.2_T0O0",
            "F1B0_W4M0MC6_R0.32_T0O0",
        ),
    },
)


def first_cell(line: str) -> str:
    return line.strip().strip("|").split("|")[0].strip()


def tables_under(lines: list[str], heading: str) -> list[list[str]]:
    """The markdown tables of the section that ``heading`` opens (to the next heading of any level)."""
    start = lines.index(heading) + 1
    tables: list[list[str]] = []
    current: list[str] = []
    for line in lines[start:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables + ([current] if current else [])


def quote(text: str) -> list[dict]:
    """Each table of :data:`TABLES` as the source writes it: its header line and the rows kept."""
    lines = text.splitlines()
    out = []
    for spec in TABLES:
        table = tables_under(lines, str(spec["heading"]))[int(spec["index"])]  # type: ignore[call-overload]
        by_label = {first_cell(line): line for line in table[2:]}
        missing = [label for label in spec["rows"] if label not in by_label]
        if missing:
            raise SystemExit(f"published_quality: rows not in the source's table: {missing}")
        out.append(
            {
                "heading": spec["heading"],
                "caption": spec["caption"],
                "header": table[0],
                "rows": [by_label[label] for label in spec["rows"]],
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help=f"a copy of {REPO}'s {PATH} at {COMMIT[:7]}")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = args.source.read_text(encoding="utf-8")
    artefact = {
        "benchmark": "published_quality",
        # The figures were measured by the source's authors, not here: that is the machine the line names.
        "provenance": {
            **provenance(["scripts/published_quality.py", str(args.source)]),
            "machine": {
                "cpu": f"not measured here: published by {REPO}",
                "cores": None,
                "gpu": f"published ({REPO} at {COMMIT[:7]}: its own runs on an NVIDIA L20, others quoted "
                "from the FoCa paper)",
            },
        },
        "source": {
            "repo": REPO,
            "path": PATH,
            "commit": COMMIT,
            "url": f"https://github.com/{REPO}/blob/{COMMIT}/{PATH}",
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "setup": "as the source states: FLUX.1-dev, 50 steps, DrawBench prompts; cache-dit's own runs on "
            "an NVIDIA L20, the other methods' figures quoted from the FoCa paper",
        },
        "tables": quote(text),
    }
    write(args.out, artefact)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
