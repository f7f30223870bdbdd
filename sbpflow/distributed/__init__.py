"""Starting one process per rank.

``python -m sbpflow.distributed.launch --nproc_per_node N script.py`` runs ``script.py`` on
``N`` ranks (see :mod:`sbpflow.distributed.launch`). Plain ``torchrun`` works as well: sbpflow
reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the environment.
"""

from __future__ import annotations

__all__ = ["launch"]
