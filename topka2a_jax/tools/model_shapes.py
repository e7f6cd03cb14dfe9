"""Layer shapes of known models, in the order their layers run.

The backward pass produces their gradients in reverse. ``topka2a-plan``
plans them (``--model``); the benchmarks time exchanges of their gradients.

Example:
  >>> import math
  >>> round(sum(math.prod(shape) for _, shape in gpt2_small()) / 1e6, 1)
  124.4
"""

from __future__ import annotations

Shapes = list[tuple[str, tuple[int, ...]]]


def _norm(name: str, width: int) -> Shapes:
  return [(f"{name}.scale", (width,)), (f"{name}.bias", (width,))]


def resnet50(classes: int = 1000) -> Shapes:
  """ResNet-50 (He et al. 2016): bottleneck blocks [3, 4, 6, 3], batch norm."""
  shapes: Shapes = [("conv1", (7, 7, 3, 64))] + _norm("bn1", 64)
  channels = 64
  for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
    for block in range(blocks):
      prefix = f"layer{stage + 1}.{block}"
      shapes += [(f"{prefix}.conv1", (1, 1, channels, width))]
      shapes += _norm(f"{prefix}.bn1", width)
      shapes += [(f"{prefix}.conv2", (3, 3, width, width))]
      shapes += _norm(f"{prefix}.bn2", width)
      shapes += [(f"{prefix}.conv3", (1, 1, width, 4 * width))]
      shapes += _norm(f"{prefix}.bn3", 4 * width)
      if block == 0:
        shapes += [(f"{prefix}.downsample", (1, 1, channels, 4 * width))]
        shapes += _norm(f"{prefix}.downsample_bn", 4 * width)
      channels = 4 * width
  return shapes + [("fc.kernel", (channels, classes)), ("fc.bias", (classes,))]


def bert_base(vocab: int = 30522, layers: int = 12, hidden: int = 768) -> Shapes:
  """BERT-base (Devlin et al. 2019), with the pooler."""
  shapes: Shapes = [
      ("embeddings.word", (vocab, hidden)),
      ("embeddings.position", (512, hidden)),
      ("embeddings.token_type", (2, hidden)),
  ] + _norm("embeddings.norm", hidden)
  for layer in range(layers):
    prefix = f"layer{layer}"
    for proj in ("query", "key", "value", "output"):
      shapes += [(f"{prefix}.attention.{proj}.kernel", (hidden, hidden)),
                 (f"{prefix}.attention.{proj}.bias", (hidden,))]
    shapes += _norm(f"{prefix}.attention.norm", hidden)
    shapes += [(f"{prefix}.intermediate.kernel", (hidden, 4 * hidden)),
               (f"{prefix}.intermediate.bias", (4 * hidden,)),
               (f"{prefix}.output.kernel", (4 * hidden, hidden)),
               (f"{prefix}.output.bias", (hidden,))]
    shapes += _norm(f"{prefix}.output.norm", hidden)
  return shapes + [("pooler.kernel", (hidden, hidden)), ("pooler.bias", (hidden,))]


def gpt2_small(vocab: int = 50257, layers: int = 12, hidden: int = 768) -> Shapes:
  """GPT-2 small (Radford et al. 2019), output embedding tied to the input."""
  shapes: Shapes = [("wte", (vocab, hidden)), ("wpe", (1024, hidden))]
  for layer in range(layers):
    prefix = f"h{layer}"
    shapes += _norm(f"{prefix}.ln_1", hidden)
    shapes += [(f"{prefix}.attn.c_attn.kernel", (hidden, 3 * hidden)),
               (f"{prefix}.attn.c_attn.bias", (3 * hidden,)),
               (f"{prefix}.attn.c_proj.kernel", (hidden, hidden)),
               (f"{prefix}.attn.c_proj.bias", (hidden,))]
    shapes += _norm(f"{prefix}.ln_2", hidden)
    shapes += [(f"{prefix}.mlp.c_fc.kernel", (hidden, 4 * hidden)),
               (f"{prefix}.mlp.c_fc.bias", (4 * hidden,)),
               (f"{prefix}.mlp.c_proj.kernel", (4 * hidden, hidden)),
               (f"{prefix}.mlp.c_proj.bias", (hidden,))]
  return shapes + _norm("ln_f", hidden)


MODELS = {"resnet50": resnet50, "bert-base": bert_base, "gpt2": gpt2_small}
"""Known models by the name ``--model`` takes."""

FORWARD_FLOPS = {
    "resnet50": (8.2e9, "4.1 G multiply-adds per 224 x 224 image"),
    "bert-base": (2 * 110e6 * 128, "2 FLOP per parameter per token, 128 tokens"),
    "gpt2": (2 * 124e6 * 1024, "2 FLOP per parameter per token, 1024 tokens"),
}
"""Forward FLOPs per sample of each known model, and how they are counted."""
