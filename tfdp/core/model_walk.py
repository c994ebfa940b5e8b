"""Every layer of a Keras model, nested models' too: what the trainer's BatchNorm and activity
regularization steps look for."""
from __future__ import annotations


def every_layer(model) -> list:
  """`model` and the layers within it (through `.layers`, at any depth), each once."""
  found, stack, seen = [], [model], set()
  while stack:
    layer = stack.pop()
    if id(layer) not in seen:
      seen.add(id(layer))
      found.append(layer)
      stack.extend(getattr(layer, "layers", []))
  return found
