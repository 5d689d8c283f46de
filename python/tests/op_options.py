"""The options the tests pass to the custom ops (``cut_cross_entropy_rs._ops``), shared by the
test modules that call the ops directly."""

from __future__ import annotations

from cut_cross_entropy_rs.functional import _options


def opts(reduction="mean", **kw):
    """The ops' options: exact gradients unless ``filter_eps`` is given."""
    base = dict(
        ignore_index=-100,
        softcap=None,
        reduction=reduction,
        shift=0,
        filter_eps=None,
        filter_e_grad=False,
        filter_c_grad=False,
        label_smoothing=0.0,
        z_loss=0.0,
        max_dropped_mass=1e-3,
        workspace_budget_bytes=None,
        deterministic=False,
        check_finite=True,
    )
    base.update(kw)
    return _options(**base)
