"""The single controller: the recipe base class and its experience assembly (``recipe``), the run's lifecycle
(``run``: fit, save, load, resume), the asynchronous rollout pipeline, dynamic sampling, the typed role handles, the
dry run and the command-line entry of a recipe (``entry``).

A recipe (``recipes/grpo.py``) subclasses ``RLRecipe``, writes ``step`` and calls ``main`` under torchrun."""

from spmd_rlhf.controller.entry import main
from spmd_rlhf.controller.recipe import Experience, RLRecipe
