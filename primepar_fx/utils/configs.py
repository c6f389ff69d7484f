"""Reading a model's configuration where it explains an error."""

from __future__ import annotations

from typing import Any

#: Hugging Face config fields that are ``None`` in most checkpoints' files as well (nothing to point a user at)
OFTEN_NULL = frozenset(
    {"architectures", "dtype", "torch_dtype", "problem_type", "pad_token_id", "bos_token_id", "eos_token_id"}
)


def unset_fields(config: Any) -> list[str]:
    """The fields a Hugging Face config (anything with ``to_dict()``) leaves ``None``, less :data:`OFTEN_NULL`, in
    its order; ``[]`` for anything else. A model built from a default config fails on these where a checkpoint's
    config would have set them (a ``TypeError`` about ``NoneType`` deep in its forward)."""
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return []
    try:
        fields = to_dict()
    except Exception:  # a config that cannot say: no hint
        return []
    if not isinstance(fields, dict):
        return []
    return [k for k, v in fields.items() if v is None and k not in OFTEN_NULL]


def unset_note(config: Any, whose: str = "the config") -> str:
    """``"; <whose> leaves a, b unset, which a checkpoint's config sets"`` for :func:`unset_fields`, or ``""``: the
    end of an error message where a model built from ``config`` failed."""
    unset = unset_fields(config)
    return f"; {whose} leaves {', '.join(unset)} unset, which a checkpoint's config sets" if unset else ""
