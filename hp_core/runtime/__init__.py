"""The runtime mechanisms ``hp_core.apply`` installs on a model (docs/plans.md, "Applying").

This package imports none of its modules, so a runtime module importing another never
pulls in the applier. What is where:

* ``preflight`` — every check before the model is touched (``errors``: its refusals);
* ``install`` — the journaled install (``journal``): parameters (``params``, ``experts``),
  boundaries (``boundary``, ``outer``, ``fixes``), inputs (``guard``), random streams
  (``rng``), gradient reductions (``grads``, ``partial``), the vocab-parallel loss
  (``vocab``) and the sequence fallback (``sequence``);
* ``applied`` — what ``apply`` leaves on the model (``hp_core.applied(model)``) and
  ``finalize_grads``; ``clip`` — ``clip_grad_norm_`` over the applied layouts;
* ``verdict`` — the ranks' exchange of verdicts around the install;
* ``layouts`` / ``collectives`` — the layout transitions and their collectives.

``apply`` itself is :mod:`hp_core.apply`: it sits above the verifier, which runs
``install`` and ``preflight`` on meta-device copies.
"""
