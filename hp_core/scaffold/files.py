"""The text of every file ``hp plugin new`` writes, with ``{{placeholder}}`` fields.

Plain string constants (no package data to ship): :func:`hp_core.scaffold.skeleton_files`
fills the fields (``{{name}}``, ``{{dist}}``, ``{{package}}``, ``{{architecture}}``,
``{{model_class}}``, ``{{requirement}}``, ``{{plugin_api}}``, ``{{items}}``) and checks
that none is left. The generated plugin registers two architecture-scoped role rules and
tests itself with the conformance suite on a tiny seeded model of its own.
"""

from __future__ import annotations

__all__ = ["FILES", "ITEM_NAMES"]

#: The items the skeleton's hook registers, ``(kind, name suffix)``: the pyproject declares
#: each as ``"<kind>.<name>.<suffix>"`` in ``hp_core.items``.
ITEM_NAMES: tuple[tuple[str, str], ...] = (("template", "mlp_in"), ("template", "mlp_out"))

PYPROJECT = """\
[build-system]
# setuptools>=77: PEP 639 (`license` as an SPDX expression); it builds wheels itself.
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "{{dist}}"
version = "0.1.0"
description = "hp plugin: tensor-parallel role rules for {{architecture}}."
readme = "README.md"
requires-python = ">=3.11"
license = "Apache-2.0"
# hp-core's hook specs (the plugin API) may change in a minor release: stay within the
# minor release this plugin was generated and tested with.
dependencies = ["{{requirement}}"]

# How hp finds the plugin: `hp plugins` lists it, HP_PLUGINS={{name}} selects it.
[project.entry-points.hp_core]
{{name}} = "{{package}}.plugin"

# Every item the plugin registers, read by hp without importing the plugin: a plan that
# needs one of them names this distribution when it is missing. The conformance suite
# checks that this table and the registrations agree.
[project.entry-points."hp_core.items"]
{{items}}

[tool.setuptools.packages.find]
where = ["src"]

[tool.setuptools.package-data]
{{package}} = ["py.typed"]
"""

INIT = '''\
"""{{dist}}: an hp plugin teaching hp how to shard {{architecture}} (see plugin.py)."""

from __future__ import annotations

__all__: list[str] = []
'''

PLUGIN = '''\
"""Role rules for ``{{architecture}}``: which parameters are column- and row-parallel.

hp loads this module through the ``hp_core`` entry point ``{{name}}`` and calls its hooks
(``hp_core.hookspecs``). Each rule names a parameter pattern and its ``Role``; scoping it
to the architecture (``config.architectures``, else the model's class name) makes it win
over the core's own inference for that model and leaves every other model alone.

Replace the patterns with your model's parameter names (``hp plan --model
pkg.mod:factory --explain-roles`` shows what hp infers today), add boundary templates,
inner wrappers or compute factories with the other hooks, and list every item you
register in the pyproject's ``hp_core.items`` table.
"""

from __future__ import annotations

from collections.abc import Callable

from hp_core import Role, RoleRule
from hp_core.hookspecs import hookimpl

__all__ = ["ARCHITECTURE", "HP_PLUGIN_API", "ROLE_RULES", "hp_register_templates"]

#: The hp plugin API (hook specs + injection signatures) this plugin is built for: a
#: literal, so an hp-core speaking another version refuses it instead of misusing it.
HP_PLUGIN_API = {{plugin_api}}

ARCHITECTURE = "{{architecture}}"

ROLE_RULES: tuple[RoleRule, ...] = (
    # The MLP's input projection: each tp rank holds a block of its output features.
    RoleRule(
        "{{name}}.mlp_in",
        r"(^|\\.)mlp\\.fc_in\\.(weight|bias)$",
        Role.COLWISE,
        (ARCHITECTURE,),
    ),
    # Its output projection: a block of input features; the ranks' results are summed.
    RoleRule(
        "{{name}}.mlp_out",
        r"(^|\\.)mlp\\.fc_out\\.weight$",
        Role.ROWWISE,
        (ARCHITECTURE,),
    ),
)


@hookimpl
def hp_register_templates(register: Callable[[RoleRule], None]) -> None:
    """Register the role rules (each one is an item of kind ``template``)."""
    for rule in ROLE_RULES:
        register(rule)
'''

TINY_MODEL = '''\
"""A tiny, seeded stand-in for ``{{architecture}}``: the conformance suite's equivalence case.

Real torch, no download: an embedding, two pre-norm MLP blocks whose projections the
plugin's rules shard (``mlp.fc_in`` column-parallel, ``mlp.fc_out`` row-parallel), a final
norm and an LM head. It declares its architecture the way a Hugging Face model does
(``config.architectures``), so the plugin's scoped rules apply to it. Replace it with a
tiny config of the real model (e.g. ``AutoModelForCausalLM.from_config(...)``) once the
plugin targets one.

Both factories are module-level functions: the equivalence check's ranks import them by
name, and every call builds bit-identical weights and batches.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from torch import nn

ARCHITECTURE = "{{architecture}}"
VOCAB, HIDDEN, FFN, LAYERS = 64, 32, 64, 2
BATCH, SEQ = 2, 8


@dataclasses.dataclass
class Output:
    """What the equivalence check reads: the loss it trains on and the logits it compares."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(HIDDEN, FFN)
        self.fc_out = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(nn.functional.gelu(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class {{model_class}}(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(architectures=[ARCHITECTURE])
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return Output(loss=loss, logits=logits)


def build() -> {{model_class}}:
    """The model with seeded weights; every bias and norm weight nudged off its init value,
    so a bias counted twice or a norm weight dropped shows in the comparison."""
    torch.manual_seed(0)
    model = {{model_class}}()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator), alpha=0.02)
    return model


def batch(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s inputs: seeded token ids and their next-token labels."""
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
'''

TEST_CONFORMANCE = '''\
"""{{dist}} passes hp's plugin conformance suite (``docs/conformance.md`` in hp).

The suite checks the entry point, the hp-core requirement, the plugin API version, the
report row and provenance, that the registered items are the declared ones, that
``HP_PLUGINS`` can leave the plugin out, that the source uses only hp's public surface,
and that the tiny model (``tiny_model.py``) sharded over tp=2 matches one device in both
modes. Run: ``python -m pytest tests``.
"""

from __future__ import annotations

import tiny_model

from hp_core.testing.conformance import EquivalenceCase, PluginConformance


class TestConformance(PluginConformance):
    distribution = "{{dist}}"
    entry_point = "{{name}}"
    package = "{{package}}"
    equivalence = [
        EquivalenceCase(
            model_factory=tiny_model.build, batch_factory=tiny_model.batch, mesh="tp=2", steps=2
        )
    ]
'''

TEST_RULES = '''\
"""The plugin's rules claim the tiny model's parameters they are written for, and no others."""

from __future__ import annotations

import tiny_model
import torch

from {{package}}.plugin import ARCHITECTURE, ROLE_RULES


def test_every_rule_claims_parameters_of_the_model_and_only_there():
    with torch.device("meta"):
        model = tiny_model.{{model_class}}()
    names = [name for name, _ in model.named_parameters()]
    for rule in ROLE_RULES:
        claimed = [name for name in names if rule.matches(name, (ARCHITECTURE,))]
        assert claimed, f"rule {rule.name} claims no parameter of the tiny model"
        assert not any(rule.matches(name, ("SomeOtherForCausalLM",)) for name in names)
'''

README = """\
# {{dist}}

An [hp](https://pypi.org/project/hp-core/) plugin: tensor-parallel role rules for
`{{architecture}}`, generated by `hp plugin new {{name}}`.

```
src/{{package}}/plugin.py    HP_PLUGIN_API, the role rules, the hook that registers them
src/{{package}}/py.typed
tests/tiny_model.py          a tiny seeded stand-in model (replace with the real one)
tests/test_conformance.py    hp's conformance suite, with one equivalence case (tp=2)
tests/test_rules.py          each rule claims the parameters it is written for
pyproject.toml               the hp_core entry point, the hp_core.items table, hp-core range
```

Develop:

```
pip install -e .
hp plugins                      # lists "{{name}}" with its items
python -m pytest tests          # conformance + equivalence on 2 CPU ranks (gloo)
```

Every item the plugin registers must be listed in `[project.entry-points."hp_core.items"]`
(`"<kind>.<name>" = "{{package}}.plugin"`); the conformance suite fails otherwise. The
`hp-core` requirement covers one minor release, because a minor release may change the
plugin API; widen it after testing against the next one.
"""

#: Path inside ``hp-plugin-NAME/`` -> template text.
FILES: dict[str, str] = {
    "pyproject.toml": PYPROJECT,
    "README.md": README,
    "src/{{package}}/__init__.py": INIT,
    "src/{{package}}/plugin.py": PLUGIN,
    "src/{{package}}/py.typed": "",
    "tests/tiny_model.py": TINY_MODEL,
    "tests/test_conformance.py": TEST_CONFORMANCE,
    "tests/test_rules.py": TEST_RULES,
}
