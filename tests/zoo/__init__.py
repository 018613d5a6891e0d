"""A zoo of hand-written PyTorch language models in the style of five widely used projects.

Each module reproduces one project's *design* (module and attribute names, call conventions,
config objects, caches) in hp's own code, at tiny seeded sizes, so hp can be tried on the
forwards users actually write rather than on Hugging Face classes only:

* :mod:`tests.zoo.nanogpt` — nanoGPT's GPT (fused ``c_attn``, ``(logits, loss)``);
* :mod:`tests.zoo.gpt_fast` — gpt-fast's Llama (fused ``wqkv``, kv caches, ``input_pos``);
* :mod:`tests.zoo.torchtitan_llama` — torchtitan's Llama 3 (``layers`` as a ``ModuleDict``);
* :mod:`tests.zoo.litgpt` — litgpt's GPT (``self.config`` read in the forward) in three
  configs: Llama-, Pythia- and Phi-like;
* :mod:`tests.zoo.mingpt` — minGPT's GPT (explicit softmax attention, ``mlpf`` lambda).

Every module has ``tiny()`` (or ``tiny_<variant>()``), ``batch(seed)`` (the training call's
keyword arguments), ``output_loss(output, batch)`` and ``loss(model, batch)``.
:mod:`tests.zoo.survey` runs hp's zero-config plan and equivalence check on each of them.
"""
