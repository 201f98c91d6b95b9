"""Which masked positions a diffusion LM step commits (adapters/masked_diffusion.py): a module of its own,
so the request's field (models/interfaces.py) names the choices without importing torch."""

REMASKING = ("low_confidence", "random")
