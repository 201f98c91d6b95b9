"""The pieces of ``scripts/gpu_checks.py`` (its entry point, argument parsing and ``main``), by concern:

    budget       what a denoising step costs on one H100 (each figure with its source), a part's work
                 (``Work``) and its estimate, and the plan: which parts fit in one call's budget
    parts        the parts' sizes on a GPU, their work, their commands (GPU and smoke) and the registry
                 ``PARTS``, in running order
    environment  the device machine's Python: the wheels it is carried (scripts/gpu_wheels.txt), the
                 import probe run before any part, the parts' environment and the machine's description
    runner       running the parts: each a subprocess with its budget as a timeout, the rows a cut part
                 kept, and the summary (summary.md, summary.json, $OUT's bundle) rewritten as it goes

``scripts/gpu_figures.py`` reads each part's key figures back from its files.
"""
