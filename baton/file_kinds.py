"""Which of Baton's files a user's file is (a cluster, a model or a plan), told by its top-level fields.

``baton show FILE`` takes any of them. Telling them apart by one word (a cluster file mentions 'nodes')
sent a cluster file with a typo (``node:``) to the model reader, whose error listed a model's fields:
every field here counts, a misspelt one for the field it is nearest to, so the file's own reader reports
the typo against the right list.
"""
from __future__ import annotations

from typing import Any

from baton.cluster import FIELDS as CLUSTER_FIELDS
from baton.fields import close_fields
from baton.model_spec import FIELDS as MODEL_FIELDS
from baton.plan import FIELDS as PLAN_FIELDS

KINDS = {"cluster": frozenset(CLUSTER_FIELDS), "model": frozenset(MODEL_FIELDS), "plan": frozenset(PLAN_FIELDS)}
"""Each kind of file and its top-level fields."""
ALL_FIELDS = frozenset().union(*KINDS.values())

TYPO_WEIGHT = 0.5
"""What a field that is only near one of a kind's fields counts for, against 1 for one of them exactly."""


def kind_of(data: Any) -> str | None:
    """'cluster', 'model' or 'plan': the kind whose own fields (those no other kind has, such as a
    cluster's 'nodes' or a model's 'num_layers') ``data``'s keys are or are nearest to; None for data that
    is not a mapping, holds none of them, or holds as much of two kinds."""
    if not isinstance(data, dict):
        return None
    scores = {}
    for kind, fields in KINDS.items():
        own = fields.difference(*(other for k, other in KINDS.items() if k != kind))
        scores[kind] = sum(1.0 if key in own else TYPO_WEIGHT if key not in ALL_FIELDS and close_fields(key, own) else 0.0
                           for key in data)
    ranked = sorted(scores.items(), key=lambda kv: -kv[1])
    (best, top), (_, second) = ranked[0], ranked[1]
    return best if top > 0 and top > second else None
