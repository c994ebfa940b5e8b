"""Every layer of a Keras model, nested models' too: what the trainer's BatchNorm and activity
regularization steps look for; its random layers' seed states."""
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


def seed_states(model) -> list:
  """The variables Keras's SeedGenerators keep their state in (Dropout's), in model order:
  get_weights and a checkpoint of the model leave them out."""
  return [v for v in model.variables if v.name == "seed_generator_state"]
