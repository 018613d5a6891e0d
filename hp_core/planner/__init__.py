"""The planner: model structure + mesh + overrides → ``ShardingPlan`` (docs/plans.md).

This package imports none of its modules (so importing one never pulls in the rest).
What is where: ``plan`` — the planning behind :func:`hp_core.plan` (which also checks a
refusal's fix: :mod:`hp_core.verifier.advice`); ``structure`` — the model's blocks and
roles (what decided each: :mod:`hp_core.role_report`); ``unclaimed`` — parameters no
template claimed; ``lints`` — the checks of a derived plan and the planning errors;
``context`` / ``builtin`` — the templates' context and the built-in templates; ``comms`` —
the collectives a plan implies; ``explain`` — the plan in words.
"""
