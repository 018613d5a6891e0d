"""The planner: model structure + mesh + overrides → ``ShardingPlan`` (docs/plans.md).

This package imports none of its modules (so importing one never pulls in the rest).
What is where: ``plan`` — :func:`hp_core.plan` itself; ``structure`` — the model's blocks
and roles; ``role_report`` — :func:`hp_core.explain_roles`, what decided each
role; ``lints`` — the checks of a derived plan and the planning errors;
``context`` / ``builtin`` — the templates' context and the built-in templates;
``comms`` — the collectives a plan implies; ``explain`` — the plan in words.
"""
